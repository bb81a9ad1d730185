"""Sparse MoE dispatch against float64 NumPy, and proof that unselected experts are never computed."""

import ast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maverick import moe


def _np_expert_ffn(x, top_idx, scores, gate, up, down):
  """float64 reference of Llama 4 routed experts: sum_k Expert_e(s * x)."""
  x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    for e, s in zip(top_idx[n], np.asarray(scores[n], np.float64)):
      z = s * x[n]
      g, u = z @ gate[e], z @ up[e]
      out[n] += (g / (1 + np.exp(-g)) * u) @ down[e]
  return out


@pytest.mark.parametrize("impl", ["tiles", "ragged_dot"])
@pytest.mark.parametrize("sizes", [[0, 5, 0, 17, 1, 0, 3, 9], [40, 0, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 1, 1, 1, 1, 1, 1]])
def test_grouped_matmul_matches_numpy(impl, sizes):
  rng = np.random.default_rng(0)
  E, D, F = len(sizes), 12, 20
  A = sum(sizes)
  x = rng.normal(size=(A, D)).astype(np.float32)
  w = rng.normal(size=(E, D, F)).astype(np.float32)
  group = np.repeat(np.arange(E), sizes)
  expected = np.einsum("ad,adf->af", x.astype(np.float64), w[group].astype(np.float64))
  got = moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32),
                           tile_m=8 if impl == "tiles" else None, impl=impl)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_moe_experts_matches_numpy(k):
  rng = np.random.default_rng(1)
  N, D, F, E = 37, 16, 24, 6
  x = rng.normal(size=(N, D)).astype(np.float32)
  router = rng.normal(size=(D, E)).astype(np.float32)
  gate, up = (rng.normal(size=(E, D, F)).astype(np.float32) * 0.3 for _ in range(2))
  down = rng.normal(size=(E, F, D)).astype(np.float32) * 0.3
  top_idx, scores, _ = moe.route(jnp.asarray(x), jnp.asarray(router), k)
  logits = x.astype(np.float64) @ router
  np.testing.assert_array_equal(np.sort(np.asarray(top_idx), -1),
                                np.sort(np.argsort(-logits, -1)[:, :k], -1))
  np.testing.assert_allclose(np.asarray(scores),
                             1 / (1 + np.exp(-np.take_along_axis(logits, np.asarray(top_idx), -1))),
                             rtol=1e-5)
  got = moe.moe_experts(jnp.asarray(x), top_idx, scores, jnp.asarray(gate), jnp.asarray(up),
                        jnp.asarray(down))
  want = _np_expert_ffn(x, np.asarray(top_idx), np.asarray(scores), gate, up, down)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def _routed_problem(rng, N=24, D=8, F=16, E=16, used=4):
  """Positive inputs and a router whose columns >= `used` are negative: those experts are never
  picked."""
  x = rng.uniform(0.5, 1.5, size=(N, D)).astype(np.float32)
  router = rng.uniform(0.1, 1.0, size=(D, E)).astype(np.float32)
  router[:, used:] *= -1
  gate, up = (rng.normal(size=(E, D, F)).astype(np.float32) for _ in range(2))
  down = rng.normal(size=(E, F, D)).astype(np.float32)
  return x, router, gate, up, down


@pytest.mark.parametrize("impl", ["tiles"])
def test_unselected_experts_are_never_computed(impl):
  """NaN weights in experts nobody picks must not reach the output: a dense evaluation (every
  expert on every token, or a masked dense product, as lax.ragged_dot lowers on CPU) would give
  NaN * 0 = NaN."""
  x, router, gate, up, down = _routed_problem(np.random.default_rng(2))
  top_idx, scores, _ = moe.route(jnp.asarray(x), jnp.asarray(router), 1)
  assert set(np.asarray(top_idx).ravel().tolist()) <= set(range(4))
  for w in (gate, up, down):
    w[4:] = np.nan
  out = moe.moe_experts(jnp.asarray(x), top_idx, scores, jnp.asarray(gate), jnp.asarray(up),
                        jnp.asarray(down), impl=impl)
  assert np.isfinite(np.asarray(out)).all()


def test_tile_loop_length_scales_with_tokens_not_experts():
  """8 decode tokens over 128 experts run at most 8/tile + 8 tile matmuls, not 128."""
  x = jnp.ones((8, 4), jnp.float32)
  w = jnp.ones((128, 4, 6), jnp.float32)
  sizes = jnp.zeros((128,), jnp.int32).at[:8].set(1)
  jaxpr = jax.make_jaxpr(lambda a, b, c: moe.grouped_matmul(a, b, c))(x, w, sizes)
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert len(scans) == 1 and scans[0].params["length"] <= 9


def test_tile_loop_slices_nothing_at_its_index():
  """The tile loop takes no per-iteration inputs and stacks no outputs (scan xs / ys): XLA:GPU
  turns those slices at the loop index into async copies, which keep the loop host-driven (out
  of a CUDA graph) on a GPU (scripts/gpu_compile_check.py, prefill program)."""
  x = jnp.ones((40, 4), jnp.float32)
  w = jnp.ones((8, 4, 6), jnp.float32)
  sizes = jnp.full((8,), 5, jnp.int32)
  jaxpr = jax.make_jaxpr(lambda a, b, c: moe.grouped_matmul(a, b, c, tile_m=8))(x, w, sizes)
  (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  # This jax's scan keeps (consts, carry, xs) in and (carry, ys) out as flat trees (FTTuple) whose
  # repr is the nested tuple.
  consts, carry, xs = ast.literal_eval(repr(scan.params["ft_in"]))
  assert len(consts) + len(carry) == len(scan.invars) and xs == ()
  assert ast.literal_eval(repr(scan.params["ft_out"]))[1] == ()
