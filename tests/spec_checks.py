"""Fast losslessness checks of speculative decoding, as plain functions: tests/test_spec_lossless.py
runs them under pytest and scripts/mutation_score.py runs them against each mutant (tests/mutants.py).

References are independent of spec_decode: plain greedy decoding (maverick.generate) and exact
probabilities from the target's logits in float64 NumPy. Every check raises AssertionError on a
mismatch. Inputs (models, references) are built once per process by `cases()`.
"""

from __future__ import annotations

import functools
import pathlib

import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

from maverick import config as config_lib
from maverick import model as model_lib
from spec_decode import draft as draft_lib
from spec_decode import speculative as spec

import spec_oracles as so

FIXTURE_DIR = pathlib.Path(__file__).parent / "fixtures" / "hf_llama4_tiny"
CHAIN_K, TREE = 4, "4x2x8"
N_LONG = 40  # greedy tokens in the teacher's table: more than any row generates
SMALL = config_lib.Config(
    vocab_size=24, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
    attention_chunk_size=4, no_rope_layer_interval=4, floor_scale=2.0, attn_scale=0.5,
    rope_theta=10000.0, dtype="float32")
# The teacher tests' target: real (cached, chunked, NoPE, MoE) attention at a quarter of the
# fixture's compile time.
TEACHER_CFG = SMALL.replace(vocab_size=128, attention_chunk_size=8)


class TeacherCase:
  """The fixture target (real attention over its cache), 4 prompts, their long greedy
  continuations, deliberate teacher errors, per-row stops / limits inside accepted runs, and the
  plain greedy outputs under those stops / limits."""

  def __init__(self, target):
    self.target = target
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    self.prompts = [rng.integers(1, V, n).tolist() for n in (5, 13, 9, 3)]
    long = so.greedy(target, self.prompts, N_LONG)
    self.seqs = [p + g for p, g in zip(self.prompts, long)]
    # Wrong first proposals every 7th generated token (a different phase per row).
    gen_err = [set(range(2 + b, N_LONG, 7)) for b in range(4)]
    self.errors = [[len(p) + i for i in e] for p, e in zip(self.prompts, gen_err)]
    clean = lambda b, i: not ({i - 1, i, i + 1} & gen_err[b])

    def stop_at(b, lo):  # a token first seen at generated index i >= lo, inside a clean run
      g = long[b]
      return next(i for i in range(lo, 30) if g[i] not in g[:i] and clean(b, i))

    self.limits = [30, next(i for i in range(9, 30) if clean(1, i - 1)), 30, 24]
    s0, s2 = stop_at(0, 5), stop_at(2, 9)
    self.stops = [[long[0][s0]], [], [long[2][s2], V - 1], []]
    self.want = so.greedy(target, self.prompts, self.limits, stop_tokens=self.stops)
    assert len(self.want[0]) == s0 + 1 and len(self.want[2]) == s2 + 1
    assert len(self.want[1]) == self.limits[1] and len(self.want[3]) == self.limits[3]
    self.draft = so.teacher_draft(target, self.seqs, self.errors)
    self.row_drafts = [so.teacher_draft(target, [s], [e], width=64 + N_LONG + 16 - len(s))
                       for s, e in zip(self.seqs, self.errors)]


@functools.lru_cache(maxsize=None)
def cases():
  return {"teacher": TeacherCase(model_lib.init_model(TEACHER_CFG, seed=5))}


def _shape(mode):
  return dict(k=CHAIN_K) if mode == "chain" else dict(tree=TREE)


def teacher_greedy(mode: str, batch: int):
  """Greedy speculative output with the teacher draft == plain greedy output, with stops in the
  middle of accepted runs and limits that cut one; > 2 tokens per round. Batch 1 runs each row
  alone and must also give that row's batch-4 acceptance statistics (a finished row counts
  nothing, whatever the other rows do)."""
  c = cases()["teacher"]
  out = spec.generate(c.target, c.draft, c.prompts, max_new_tokens=c.limits,
                      stop_tokens=c.stops, **_shape(mode))
  assert out.tokens == c.want, (mode, out.tokens, c.want)
  assert out.acceptance_length > 2.5, (mode, out.acceptance_length)
  if batch == 1:
    for b in range(len(c.prompts)):
      one = spec.generate(c.target, c.row_drafts[b], [c.prompts[b]], max_new_tokens=c.limits[b],
                          stop_tokens=[c.stops[b]], **_shape(mode))
      assert one.tokens == [c.want[b]], (mode, b, one.tokens, c.want[b])
      assert (one.rounds[0], one.accepted[0]) == (out.rounds[b], out.accepted[b]), (mode, b)
      np.testing.assert_array_equal(one.accepted_at[0], out.accepted_at[b])
