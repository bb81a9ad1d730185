"""The shipped default model (maverick/assets/tiny): loads with no arguments, has every Llama 4 feature,
reproduces its model card, and generates deterministically."""

import hashlib
import io
import json
import os
import tokenize

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maverick
from maverick import data, evaluation
from maverick import model as model_lib
from maverick.generation import generate
from maverick.loading import EMBEDDED

ASSET = EMBEDDED["tiny"]


@pytest.fixture(scope="module")
def tiny():
  return maverick.load()


@pytest.fixture(scope="module")
def card():
  with open(os.path.join(ASSET, "model_card.json")) as f:
    return json.load(f)


def test_loads_with_no_arguments_and_has_every_feature(tiny):
  cfg = tiny.config
  assert tiny.tokenizer is not None and tiny.tokenizer.vocab_size == cfg.vocab_size
  assert cfg.moe_layers and cfg.num_local_experts >= 8 and cfg.num_experts_per_tok == 1
  assert len(cfg.moe_layers) < cfg.num_hidden_layers  # interleaved with dense layers
  assert 0 in cfg.no_rope_layers and 1 in cfg.no_rope_layers  # NoPE and RoPE layers
  assert cfg.attn_temperature_tuning and cfg.use_qk_norm
  assert cfg.attention_chunk_size < cfg.max_position_embeddings  # chunking is active in context
  assert cfg.eos_token_ids and set(cfg.eos_token_ids) <= set(tiny.stop_tokens)


def test_shipped_checkpoint_fits_16_mb():
  total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ASSET) for f in fs)
  assert total <= 16 * 2**20, total


@pytest.mark.slow
def test_greedy_is_deterministic_and_matches_stepwise_reference(tiny):
  """One-call generate == a host loop of full-recompute forwards taking the argmax, in float32.

  The shipped bf16 weights are only checked for determinism and near-tie agreement: the cached
  decode and the full recompute sum in different orders, and bf16 rounds those sums far enough
  apart (p99 8e-2, greedy_consistency.md) to flip a near-tie -- it did at step 11 on an AVX-512
  Xeon while an EPYC kept the tie."""
  prompt = tiny.tokenizer.encode("import os\n\n\ndef read_file(path):\n")
  n_new = 24
  a = generate(tiny.model, [prompt], max_new_tokens=n_new, stop_tokens=[]).tokens[0]
  b = generate(tiny.model, [prompt], max_new_tokens=n_new, stop_tokens=[]).tokens[0]
  assert a == b and len(a) == n_new
  # bf16: teacher-forced through one full forward, each greedy token is the argmax or within
  # bf16 sum-order noise of it.
  seq = jnp.asarray([prompt + a[:-1]])
  logits = np.asarray(model_lib.apply(*nnx.split(tiny.model), seq).logits[0, len(prompt) - 1:],
                      np.float32)
  gaps = logits.max(-1) - logits[np.arange(n_new), a]
  assert gaps[0] == 0 and (gaps < 0.25).all() and (gaps == 0).mean() >= 0.8, gaps

  model32 = maverick.load(dtype="float32").model
  got = generate(model32, [prompt], max_new_tokens=n_new, stop_tokens=[]).tokens[0]
  graphdef, state = nnx.split(model32)
  # Full causal recompute over a fixed-length buffer (one compile): positions after the last real
  # token cannot change the logits taken at it.
  forward = jax.jit(lambda tokens, last: model_lib.apply(graphdef, state, tokens,
                                                         logits_at=last).logits)
  seq = np.zeros((1, len(prompt) + n_new), np.int32)
  seq[0, :len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + n_new):
    seq[0, t] = int(np.argmax(np.asarray(forward(jnp.asarray(seq), jnp.asarray([t - 1])))))
  assert seq[0, len(prompt):].tolist() == got


def test_generates_plausible_python(tiny):
  """Greedy continuations of Python prompts are Python: complete lines tokenize as Python source and
  use its keywords (the model is small: it repeats itself, but in Python)."""
  prompts = ["import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def push(self, item):"]
  for prompt in prompts:
    out = generate(tiny.model, [tiny.tokenizer.encode(prompt)], max_new_tokens=64,
                   stop_tokens=tiny.stop_tokens).tokens[0]
    text = prompt + tiny.tokenizer.decode(out)
    complete = text[:text.rfind("\n") + 1]
    toks = list(tokenize.generate_tokens(io.StringIO(complete).readline))
    assert not [t for t in toks if t.type == tokenize.ERRORTOKEN and not t.string.isspace()]
    names = {t.string for t in toks if t.type == tokenize.NAME}
    assert names & {"def", "return", "self", "import", "if", "for", "class", "in", "None"}, text


def _subset_texts(card):
  root = data.stdlib_root()
  sub = card["validation_subset"]
  texts = data.read_texts(root, sub["files"]).texts
  if [hashlib.sha256(t.encode()).hexdigest() for t in texts] != sub["sha256"]:
    pytest.skip("this Python's stdlib files differ from those the model card was measured on "
                f"(Python {card['data']['python']})")
  return texts


@pytest.mark.slow
def test_validation_subset_bits_per_byte_reproduces_model_card(tiny, card):
  """Tolerance 0.01 bits/byte: same weights and data; only CPU float differences may move it."""
  texts = _subset_texts(card)
  result = evaluation.evaluate(tiny.model, tiny.tokenizer, texts, seq_len=card["train"]["seq_len"])
  assert result.bytes == card["validation_subset"]["bytes"]
  assert abs(result.bits_per_byte - card["validation_subset"]["bits_per_byte"]) < 0.01


@pytest.mark.slow
def test_beats_unigram_byte_model_by_a_wide_margin(tiny, card):
  texts = _subset_texts(card)
  train = data.load_split(None, "train", card["data"]["val_fraction"]).texts
  unigram = evaluation.unigram_byte_bits_per_byte(train, texts)
  result = evaluation.evaluate(tiny.model, tiny.tokenizer, texts, seq_len=card["train"]["seq_len"])
  assert unigram > 4.0  # sanity of the baseline on Python source
  assert result.bits_per_byte < 0.5 * unigram
  assert card["validation"]["bits_per_byte"] < 0.5 * card["unigram_byte_baseline_bits_per_byte"]
