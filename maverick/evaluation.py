"""Perplexity and bits per byte of a model on text files, batched and jitted.

Each document is [BOS] + tokens, cut into non-overlapping windows of `seq_len` predicted tokens (a
window's inputs start with the last token of the previous window). Bits per byte divides the total
negative log-likelihood (in bits) by the UTF-8 bytes of the texts, so it compares across tokenizers;
the end-of-text prediction is not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from maverick import data


@dataclasses.dataclass
class EvalResult:
  nll_nats: float  # summed over predicted tokens
  tokens: int
  bytes: int
  files: int

  @property
  def bits_per_byte(self) -> float:
    return self.nll_nats / math.log(2) / self.bytes

  @property
  def perplexity(self) -> float:
    return math.exp(self.nll_nats / self.tokens)

  @property
  def nats_per_token(self) -> float:
    return self.nll_nats / self.tokens


def windows(documents: Sequence[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) [n, seq_len] with target -1 where nothing is predicted."""
  ins, outs = [], []
  for doc in documents:
    for s in range(0, len(doc) - 1, seq_len):
      piece = doc[s:s + seq_len + 1]
      x = np.zeros(seq_len, np.int32)
      y = np.full(seq_len, -1, np.int32)
      x[:len(piece) - 1] = piece[:-1]
      y[:len(piece) - 1] = piece[1:]
      ins.append(x)
      outs.append(y)
  return np.stack(ins), np.stack(outs)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _window_nll(graphdef, state, inputs, targets):
  logits = nnx.merge(graphdef, state)(inputs).logits.astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
  return jnp.sum(jnp.where(targets >= 0, nll, 0.0))


def evaluate(model, tokenizer, texts: Sequence[str], *, seq_len: int = 512, batch_size: int = 8,
             progress: bool = False) -> EvalResult:
  if not texts:
    raise ValueError("no texts to evaluate")
  docs = data.encode_documents(tokenizer.hf_tokenizer, texts, tokenizer.bos_id)
  inputs, targets = windows(docs, seq_len)
  n = len(inputs)
  pad = (-n) % batch_size  # fixed batch shape: one compilation
  inputs = np.concatenate([inputs, np.zeros((pad, seq_len), np.int32)])
  targets = np.concatenate([targets, np.full((pad, seq_len), -1, np.int32)])
  graphdef, state = nnx.split(model)
  total = 0.0
  for i in tqdm(range(0, len(inputs), batch_size), desc="eval", disable=not progress):
    total += float(_window_nll(graphdef, state, jax.device_put(inputs[i:i + batch_size]),
                               jax.device_put(targets[i:i + batch_size])))
  n_tokens = int(sum(len(d) - 1 for d in docs))
  return EvalResult(total, n_tokens, sum(len(t.encode("utf-8")) for t in texts), len(texts))


def unigram_byte_bits_per_byte(train_texts: Sequence[str], eval_texts: Sequence[str]) -> float:
  """Cross-entropy (bits/byte) of a byte-frequency model fit on train_texts (add-one smoothed):
  the baseline any language model must beat."""
  counts = np.ones(256, np.float64)
  for t in train_texts:
    counts += np.bincount(np.frombuffer(t.encode("utf-8"), np.uint8), minlength=256)
  logp = np.log2(counts / counts.sum())
  total_bits, total_bytes = 0.0, 0
  for t in eval_texts:
    b = np.frombuffer(t.encode("utf-8"), np.uint8)
    total_bits -= logp[b].sum()
    total_bytes += len(b)
  return total_bits / total_bytes
