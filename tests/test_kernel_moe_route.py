"""pallas_kernels.moe_route: top-1 routing from the router GEMM's output, in GPU interpret mode,
against a float64 NumPy router written here (bf16 logits by ml_dtypes, the first argmax, the
logistic of the max) and maverick.moe.route (the model's XLA path: equal ids and scores)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels
from maverick import moe
from pallas_kernels import KernelInputError
from pallas_kernels import moe_route
from test_sharded_kernels import reference_kernels  # noqa: F401 (fixture)


def _np_route(partials, rows):
  logits = np.asarray(partials, np.float64).sum(0)[:rows]
  logits = logits.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
  top = logits.argmax(-1)
  return top, 1 / (1 + np.exp(-logits.max(-1)))


@pytest.mark.parametrize("splits,rows,ties", [(4, 3, False), (1, 2, True)],
                         ids=["split4_padded", "finished_first_of_ties"])
def test_matches_float64_in_interpret_mode(splits, rows, ties):
  """f32 K-split partials of padded rows (R = 8 > rows: not read), or one finished product with
  a tie for the max in row 0 (the first index wins, as jnp.argmax)."""
  rng = np.random.default_rng(splits)
  partials = rng.standard_normal((splits, 8, 128)).astype(np.float32)
  partials[:, rows:] = np.nan
  if ties:
    partials[0, 0, [17, 90]] = partials[0, 0].max() + 1.0
  with pallas_kernels.interpret():
    top, score = moe_route.route_top1(jnp.asarray(partials), rows, implementation="pallas")
  want_top, want_score = _np_route(partials, rows)
  assert top.shape == (rows, 1) and top.dtype == jnp.int32 and score.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(top)[:, 0], want_top)
  if ties:
    assert int(top[0, 0]) == 17
  np.testing.assert_allclose(np.asarray(score, np.float64)[:, 0], want_score, rtol=2.0 ** -8)
  xla_top, xla_score = moe_route.route_top1(jnp.asarray(partials), rows, implementation="xla")
  np.testing.assert_array_equal(np.asarray(xla_top), np.asarray(top))
  np.testing.assert_array_equal(np.asarray(xla_score, np.float32), np.asarray(score, np.float32))


def test_reference_equals_the_models_routing():
  """The op's reference on a finished product is maverick.moe.route's top-1 on the same bf16
  logits, ids and scores bit for bit."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
  router = jnp.asarray(rng.standard_normal((64, 128)) / 8, jnp.bfloat16)
  top, score, logits = moe.route(x, router, 1)
  got_top, got_score = moe_route.route_top1(logits[None], 5, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got_top), np.asarray(top))
  np.testing.assert_array_equal(np.asarray(got_score, np.float32), np.asarray(score, np.float32))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_lowers_at_the_maverick_router_shape(arch):
  """128 experts, 16 K-split partials of a 64-row tile (the router GEMM at decode)."""
  text = pallas_kernels.lower_for_gpu(
      lambda p: moe_route.route_top1(p, 1, implementation="pallas"),
      jax.ShapeDtypeStruct((16, 64, 128), jnp.float32), arch=arch)
  assert text.count("mosaic_gpu_v2(") == 1


def test_support_and_bad_input():
  assert moe_route.pallas_support(1, 128) == (True, "")
  assert not moe_route.pallas_support(1, 100)[0]
  assert not moe_route.pallas_support(2000, 128)[0]
  with pytest.raises(KernelInputError, match=r"rows=9 for partials of 8 rows"):
    moe_route.route_top1(jnp.ones((1, 8, 128)), 9)
  with pytest.raises(KernelInputError, match=r"\[S, R, E\]"):
    moe_route.route_top1(jnp.ones((8, 128)), 1)


@pytest.mark.slow
def test_tp8_moe_routes_on_the_kernels_from_the_sites_padded_rows(reference_kernels, monkeypatch):
  """A TP8 FP8 model's MoE layer routes through the router GEMM (bf16, [D, E] as stored) and
  the routing op, the GEMM reading the fused site's normed rows already padded to its tile (at
  decode: 64 rows for 2 tokens, no pad launch); prefill and decode logits match the run routed
  by maverick.moe.route (XLA). Entries run their XLA references (multi-device interpret mode does
  not run Mosaic kernels; the kernels are tested above)."""
  from maverick import config as config_lib
  from maverick import kernel_moe
  from maverick import kernels as kernels_lib
  from maverick import model as model_lib
  from maverick import quant, sharding
  from test_sharded_kernels import _prefill_then_decode
  cfg = config_lib.tiny("bfloat16").replace(
      hidden_size=128, head_dim=64, num_attention_heads=8, num_key_value_heads=8,
      intermediate_size=128, intermediate_size_mlp=1024, num_local_experts=128,
      num_hidden_layers=2, no_rope_layers=None, moe_layers=None, layer_types=None,
      attention_chunk_size=64)  # 128 experts: the routing kernel's warpgroup, one a thread
  model = sharding.shard_model(quant.quantize_model(model_lib.init_model(cfg, seed=0),
                                                    quant.QuantConfig()),
                               sharding.make_mesh(tensor=8), "tp")
  D, E = model.config.hidden_size, model.config.num_local_experts
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 512, (2, 12)), jnp.int32)

  def run():
    jax.clear_caches()
    with pallas_kernels.interpret():
      kernels_lib.set_kernels(model, "pallas")
      out = _prefill_then_decode(model, tokens)
    calls = [(name, shapes) for name, shapes, *_ in reference_kernels
             if name in ("route_top1", "gemm_many_partials")]
    reference_kernels.clear()
    return out, calls

  (prefill, step), calls = run()
  routes = [shapes for name, shapes in calls if name == "route_top1"]
  router_gemms = [shapes for name, shapes in calls if name == "gemm_many_partials"
                  and len(shapes) == 2 and shapes[1] == (D, E)]  # bf16: no scales
  assert len(routes) == 2 and len(router_gemms) == 2, calls  # prefill, decode
  assert router_gemms[1][0] == (64, D), router_gemms  # decode: the site's padded rows
  with monkeypatch.context() as m:
    m.setattr(kernel_moe, "route_top1", lambda *a, **k: None)
    (prefill0, step0), calls0 = run()
  assert not [c for c in calls0 if c[0] == "route_top1"]
  # Equal on this host (measured: bit for bit), but the router GEMM's reference runs on 64
  # padded rows where moe.route's einsum runs on the token rows: another x86 host's XLA:CPU may
  # order the f32 sums apart and land a bf16 logit a step away (a score one bf16 step off, or a
  # near-tie routed apart). Bound: a bf16 step's worth; a wrong expert or score is O(1) off.
  for got, want in ((prefill, prefill0), (step, step0)):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
