"""EAGLE-3 draft training with training-time test (TTT), against a frozen target.

Per batch: one target forward (no gradient) gives the aux features at every position and the target's
next-token distributions. The draft then runs `ttt_length` unrolled steps over all base positions i:
step 0 reads fc(features_i) with token i+1 and learns the target's distribution at i+1; step j reads
its own step j-1 output with token i+1+j (teacher forced) at RoPE position i+j and learns the
target's distribution at i+1+j. A query at step j sees step-0 keys at positions <= i and its own keys
from steps 1..j at base i, exactly the keys a chain step sees at inference. Loss: soft cross-entropy
to the target distribution (restricted to the draft vocabulary), step j weighted by decay**j.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from maverick import generation as plain
from maverick import model as model_lib
from maverick import train as train_lib
from spec_decode.draft import Buffer, Eagle3Config, Eagle3Draft, init_draft


@dataclasses.dataclass(frozen=True)
class TTTConfig:
  length: int = 5  # unrolled draft steps per position (>= the largest K used at inference)
  decay: float = 0.8  # step j weighs decay**j

  def __post_init__(self):
    if self.length < 1:
      raise train_lib.TrainError(f"ttt length must be >= 1, got {self.length}")


def _step_attention(j: int, memory: dict) -> Callable:
  """Attention for TTT step j: causal over step-0 keys, plus this position's keys of steps 1..j."""
  def attend(q, k, v):
    B, T, H, Dh = q.shape
    K = k.shape[2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if j == 0:
      memory["k0"], memory["v0"] = k, v
      return model_lib.attention(q, k, v, model_lib.attention_mask(pos, pos, None))
    memory["diag"].append((k, v))
    qg = q.reshape(B, T, K, H // K, Dh)
    scale = Dh ** -0.5
    s_causal = jnp.einsum("btkgd,bskd->bkgts", qg, memory["k0"],
                          preferred_element_type=jnp.float32) * scale
    s_causal = jnp.where((pos[0][None, :] <= pos[0][:, None])[None, None, None], s_causal,
                         -1e30)
    s_diag = jnp.stack([jnp.einsum("btkgd,btkd->bkgt", qg, kd, preferred_element_type=jnp.float32)
                        for kd, _ in memory["diag"]], axis=-1) * scale
    p = jax.nn.softmax(jnp.concatenate([s_causal, s_diag], axis=-1), axis=-1)
    v_diag = jnp.stack([vd for _, vd in memory["diag"]])  # [j, B, T, K, Dh]
    out = jnp.einsum("bkgts,bskd->btkgd", p[..., :T].astype(v.dtype), memory["v0"],
                     preferred_element_type=jnp.float32)
    out += jnp.einsum("bkgtj,jbtkd->btkgd", p[..., T:].astype(v.dtype), v_diag,
                      preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, Dh).astype(q.dtype)
  return attend


def ttt_forward(draft: Eagle3Draft, features: jax.Array, tokens: jax.Array, embed: jax.Array,
                length: int) -> list[jax.Array]:
  """Unrolled draft steps over every base position: features [B, T, 3D] from the target,
  tokens [B, T]. Returns per step j the draft logits [B, T-1, Vd] at base positions 0..T-2 (step j
  at base i reads token i+1+j, positions past the end read token 0 and must be masked)."""
  B, T = tokens.shape
  n = T - 1
  base = jnp.arange(n)
  tok_pad = jnp.concatenate([tokens, jnp.zeros((B, length + 1), tokens.dtype)], axis=1)
  hidden = draft.fuse(features[:, :n])
  memory = {"diag": []}
  logits = []
  for j in range(length):
    tok_j = jax.lax.dynamic_slice_in_dim(tok_pad, 1 + j, n, axis=1)
    out = draft(tok_j, hidden, embed, positions_bt=jnp.broadcast_to(base + j, (B, n)),
                attention_fn=_step_attention(j, memory))
    logits.append(out.logits)
    hidden = out.hidden
  return logits


def ttt_loss(draft: Eagle3Draft, target: model_lib.Llama4, tokens: jax.Array, ttt: TTTConfig):
  """tokens [B, T] -> (weighted loss, metrics: per-step loss and top-1 agreement with the target)."""
  B, T = tokens.shape
  cfg = draft.config
  t_out = target(tokens, capture_layers=cfg.aux_layer_ids)
  features = jax.lax.stop_gradient(jnp.concatenate(list(t_out.hidden), axis=-1))
  t_logits = jax.lax.stop_gradient(t_out.logits.astype(jnp.float32))
  embed = jax.lax.stop_gradient(target.embed[...])
  draft_ids = draft.target_ids(jnp.arange(cfg.draft_vocab_size))
  n = T - 1
  base = jnp.arange(n)
  logit_pad = jnp.concatenate([t_logits, jnp.zeros((B, ttt.length + 1, t_logits.shape[-1]))], 1)
  total, metrics = 0.0, {}
  for j, d_logits in enumerate(ttt_forward(draft, features, tokens, embed, ttt.length)):
    tgt_j = jax.lax.dynamic_slice_in_dim(logit_pad, 1 + j, n, axis=1)
    valid = jnp.broadcast_to((base + 1 + j <= T - 1)[None, :], (B, n))
    # Target distribution restricted to (and renormalised over) the draft vocabulary; positions
    # whose target argmax lies outside it carry no loss.
    p_target = jax.nn.softmax(tgt_j[..., draft_ids], axis=-1)
    in_vocab = jnp.isin(jnp.argmax(tgt_j, -1), draft_ids)
    mask = (valid & in_vocab).astype(jnp.float32)
    logq = jax.nn.log_softmax(d_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.sum(p_target * logq, axis=-1)
    loss_j = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    agree = draft_ids[jnp.argmax(d_logits, -1)] == jnp.argmax(tgt_j, -1)
    metrics[f"loss_{j}"] = loss_j
    metrics[f"acc_{j}"] = jnp.sum(agree * valid) / jnp.maximum(jnp.sum(valid), 1)
    total = total + (ttt.decay ** j) * loss_j
  return total, metrics


def generate_sequences(target: model_lib.Llama4, stream: np.ndarray, *, num: int, prompt_len: int,
                       gen_len: int, temperature: float, seed: int, batch_size: int = 64,
                       progress: bool = True) -> np.ndarray:
  """Target-generated continuations of random corpus windows: [num, prompt_len + gen_len] int32.
  The draft must predict the TARGET, so it learns on the target's own outputs."""
  if len(stream) <= prompt_len:
    raise train_lib.TrainError(f"corpus of {len(stream)} tokens is shorter than one prompt of "
                               f"{prompt_len}")
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(stream) - prompt_len, size=num)
  prompts = np.stack([stream[s:s + prompt_len] for s in starts])
  out = []
  for i in tqdm(range(0, num, batch_size), desc="generating", disable=not progress):
    chunk = prompts[i:i + batch_size]
    rows = len(chunk)
    if rows < batch_size:  # fixed batch shape: one compilation
      chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - rows, axis=0)])
    g = plain.generate(target, chunk, max_new_tokens=gen_len, temperature=temperature,
                       seed=seed + i, stop_tokens=[])
    cont = np.asarray([t[:gen_len] for t in g.tokens[:rows]], np.int32)
    out.append(np.concatenate([chunk[:rows], cont], axis=1))
  return np.concatenate(out).astype(np.int32)


def vocab_map(sequences: np.ndarray, target_vocab: int, draft_vocab: int) -> np.ndarray:
  """d2t offsets for the `draft_vocab` most frequent target ids in the training data (ties and
  unseen ids filled by id order); spec: d2t[i] = used[i] - i with `used` sorted."""
  counts = np.bincount(sequences.ravel(), minlength=target_vocab).astype(np.int64)
  order = np.lexsort((np.arange(target_vocab), -counts))  # most frequent first, then by id
  used = np.sort(order[:draft_vocab])
  return (used - np.arange(draft_vocab)).astype(np.int32)


@dataclasses.dataclass
class DraftTrainResult:
  draft: Eagle3Draft
  step: int
  history: list[dict]
  resumed_from: int | None
  seconds: float


def train_draft(target: model_lib.Llama4, dcfg: Eagle3Config, tc: train_lib.TrainConfig,
                sequences: np.ndarray, workdir: str, *, ttt: TTTConfig = TTTConfig(),
                d2t: np.ndarray | None = None, progress: bool = True,
                stop_after: int | None = None,
                evaluate: Callable[[int, Eagle3Draft], bool] | None = None,
                eval_every: int = 0, init: Eagle3Draft | None = None) -> DraftTrainResult:
  """Trains an EAGLE-3 draft on fixed token sequences [N, T] (resumable, see train_loop).
  `evaluate(step, draft) -> stop` runs every `eval_every` steps on the float32 draft being trained
  (early stopping on held-out acceptance). `init`: a draft of the same config to continue from
  (its weights, as float32, replace the random init; a resumed run still restores the workdir)."""
  dcfg.check_target(target.config)
  if sequences.ndim != 2 or sequences.shape[1] < 2:
    raise train_lib.TrainError(f"training sequences must be [N, T>=2], got {sequences.shape}")
  dcfg = dataclasses.replace(dcfg, layer=dcfg.layer.replace(dtype="float32"))
  draft = init_draft(dcfg, seed=tc.seed)
  if init is not None:
    if init.config.to_dict() | {"layer": None} != dcfg.to_dict() | {"layer": None} or (
        init.config.layer.replace(dtype="float32") != dcfg.layer):
      raise train_lib.TrainError(f"the draft to continue from has config {init.config}, not the "
                                 f"one being trained {dcfg}; drop --init_draft or match its "
                                 "flags (--mlp_width, --draft_vocab_size)")
    # Its d2t too: the lm_head rows are tied to the vocabulary map they were trained with.
    nnx.update(draft, jax.tree.map(lambda x, ref: x.astype(ref.dtype), nnx.state(init),
                                   nnx.state(draft)))
  elif d2t is not None:
    draft.d2t[...] = jnp.asarray(d2t, jnp.int32)
  graphdef, params, buffers = nnx.split(draft, nnx.Param, Buffer)
  t_graphdef, t_state = nnx.split(target)
  t_state = jax.tree.map(lambda x: x.astype(tc.compute_dtype), t_state)

  def loss_fn(p, batch):
    tokens, t_params = batch
    p = jax.tree.map(lambda w: w.astype(tc.compute_dtype), p)
    return ttt_loss(nnx.merge(graphdef, p, buffers), nnx.merge(t_graphdef, t_params), tokens, ttt)

  def batch_fn(step):
    rows = np.random.default_rng([tc.seed, step]).integers(0, len(sequences), tc.batch_size)
    return sequences[rows], t_state  # the frozen target rides along as an input, not a constant

  on_eval = None if evaluate is None else (
      lambda step, p: evaluate(step, nnx.merge(graphdef, p, buffers)))
  r = train_lib.train_loop(params, loss_fn, batch_fn, tc, workdir, progress=progress,
                           stop_after=stop_after, postfix=("loss", "acc_0", "acc_1"),
                           evaluate=on_eval, eval_every=eval_every)
  draft = nnx.merge(graphdef, r.params, buffers)
  return DraftTrainResult(draft, r.step, r.history, r.resumed_from, r.seconds)


