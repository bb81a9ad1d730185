"""BF16 vs FP8 parity of the same weights: teacher-forced agreement, KL, perplexity, greedy
generation agreement and speculative acceptance (used by scripts/eval_fp8.py).

The FP8 model's teacher-forced pass runs through its own KV cache format: with an FP8 cache every
position attends to e4m3 keys/values (the tokens are written into an empty cache, then attended), so
the numbers include the KV quantization error, not only the weights'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from maverick import generation as gen
from maverick import kv_cache as kvc


@dataclasses.dataclass
class TeacherForced:
  tokens: int
  top1_agreement: float
  mean_kl: float  # nats/token, KL(p_bf16 || p_fp8)
  ppl_bf16: float
  ppl_fp8: float

  @property
  def ppl_increase(self) -> float:
    return self.ppl_fp8 / self.ppl_bf16 - 1.0


def _logprobs(model, inputs):
  cfg = model.config
  if cfg.quant is not None and cfg.quant.kv_cache is not None:
    B, T = inputs.shape
    out = model(inputs, cache=kvc.KVCache.init(cfg, B, T))  # attends to the quantized cache
  else:
    out = model(inputs)
  return jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)


@functools.partial(jax.jit, static_argnames=("gd_ref", "gd_test"))
def _window_stats(gd_ref, st_ref, gd_test, st_test, inputs, targets):
  lp_ref = _logprobs(nnx.merge(gd_ref, st_ref), inputs)
  lp_test = _logprobs(nnx.merge(gd_test, st_test), inputs)
  valid = targets >= 0
  tgt = jnp.maximum(targets, 0)[..., None]
  nll = lambda lp: -jnp.take_along_axis(lp, tgt, axis=-1)[..., 0]
  kl = jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp_test), axis=-1)
  agree = jnp.argmax(lp_ref, -1) == jnp.argmax(lp_test, -1)
  s = lambda x: jnp.sum(jnp.where(valid, x, 0.0))
  return jnp.stack([s(agree.astype(jnp.float32)), s(kl), s(nll(lp_ref)), s(nll(lp_test)),
                    s(jnp.ones_like(kl))])


def teacher_forced(ref, test, inputs: np.ndarray, targets: np.ndarray, *, batch_size: int = 8,
                   progress: bool = False) -> TeacherForced:
  """Windows (inputs, targets) [n, T] as made by maverick.evaluation.windows (target -1: none)."""
  pad = (-len(inputs)) % batch_size
  inputs = np.concatenate([inputs, np.zeros((pad, inputs.shape[1]), np.int32)])
  targets = np.concatenate([targets, np.full((pad, targets.shape[1]), -1, np.int32)])
  gd_r, st_r = nnx.split(ref)
  gd_t, st_t = nnx.split(test)
  total = np.zeros(5)
  for i in tqdm(range(0, len(inputs), batch_size), desc="teacher-forced", disable=not progress):
    total += np.asarray(_window_stats(gd_r, st_r, gd_t, st_t,
                                      jax.device_put(inputs[i:i + batch_size]),
                                      jax.device_put(targets[i:i + batch_size])), np.float64)
  agree, kl, nll_r, nll_t, n = total
  return TeacherForced(int(n), agree / n, kl / n, math.exp(nll_r / n), math.exp(nll_t / n))


@dataclasses.dataclass
class GreedyAgreement:
  prompts: int
  tokens: int
  token_agreement: float  # position-wise equal tokens / generated tokens
  prefix_agreement: float  # mean over prompts of (common prefix length / generated length)
  exact: int  # prompts whose whole continuation is identical


def greedy_agreement(ref_tokens: Sequence[Sequence[int]], test_tokens: Sequence[Sequence[int]]
                     ) -> GreedyAgreement:
  same, total, prefix, exact = 0, 0, 0.0, 0
  for a, b in zip(ref_tokens, test_tokens):
    n = max(len(a), len(b))
    eq = [x == y for x, y in zip(a, b)]
    same += sum(eq)
    total += n
    common = next((i for i, e in enumerate(eq) if not e), len(eq))
    prefix += common / max(n, 1)
    exact += int(len(a) == len(b) and all(eq))
  return GreedyAgreement(len(ref_tokens), total, same / max(total, 1),
                         prefix / max(len(ref_tokens), 1), exact)


def prompts_from(documents: Sequence[np.ndarray], n: int, length: int) -> list[list[int]]:
  """The first `length` tokens of the first n documents long enough to hold them."""
  out = [d[:length].tolist() for d in documents if len(d) > length]
  return out[:n]


def generate_greedy(model, prompts, max_new_tokens: int):
  return gen.generate(model, prompts, max_new_tokens=max_new_tokens, stop_tokens=[])
