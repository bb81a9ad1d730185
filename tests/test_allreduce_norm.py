"""The fused all-reduce + residual + RMSNorm (pallas_kernels.allreduce_norm) and its use in the
sharded model.

Multi-device kernels do not run in GPU interpret mode, so (as tests/test_sharded_kernels.py does)
it is shown in parts: the kernel's body without the multimem load (`residual_norm`) in interpret
mode against float64 NumPy; the reference all-reduce under shard_map on 8 CPU devices against
NumPy; the kernel inside shard_map lowered for sm_90 / sm_100 at the Maverick TP8 shard shape; a
TP8 model whose every row-parallel site fuses (lowered: one kernel per site, no all-reduce left;
run with the entry swapped for its reference: same logits as the sharded XLA path).
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from maverick import kernels as kernels_lib
from maverick import model as model_lib
from maverick import sharding
from pallas_kernels import allreduce_norm, common, selfcheck
from pallas_kernels.allreduce_norm import api
from test_sharded_kernels import B, _decode_step, _prefill_then_decode, aligned_config
from test_sharded_kernels import reference_kernels  # noqa: F401 (fixture)

EPS = 1e-5
BF16 = jnp.bfloat16


def _bf16(rng, *shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, BF16)


def _numpy_residual_norm(summed, residual, weight, eps):
  """float64 NumPy: h = bf16(residual + summed); normed = bf16(bf16(h / rms(h)) * weight)."""
  f64 = lambda a: np.asarray(a, np.float64)
  h = f64(jnp.asarray(f64(residual) + f64(summed), BF16))
  y = f64(jnp.asarray(h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps), BF16))
  return h, y * f64(weight)


def _close(out, ref, tol=1e-2):
  out = np.asarray(out, np.float64)
  assert np.max(np.abs(out - ref)) <= tol * np.max(np.abs(ref)), np.max(np.abs(out - ref))


def test_kernel_body_matches_numpy_in_interpret_mode():
  """The single-device kernel (the sum given): rows of D = 256 and 1024 (vectors of 2 and 8)."""
  rng = np.random.default_rng(0)
  for shape in ((3, 256), (2, 1, 1024)):
    s, r = _bf16(rng, *shape), _bf16(rng, *shape, scale=3.0)
    w = jnp.asarray(rng.uniform(0.5, 2.0, shape[-1]), BF16)
    with pallas_kernels.interpret():
      h, y = api.residual_norm(s, r, w, EPS, implementation="pallas")
    h_ref, y_ref = _numpy_residual_norm(s, r, w, EPS)
    assert h.shape == y.shape == shape and h.dtype == y.dtype == BF16
    _close(h, h_ref)
    _close(y, y_ref)


@pytest.mark.parametrize("ub", [None, 0.5], ids=["no_cap", "ub_caps"])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_quantize_epilogue_matches_float64_quantization_of_the_normed_rows(implementation, ub):
  """The FP8 epilogue (the next GEMM's input): the normed rows, as the kernel wrote them in bf16,
  quantized per row in float64 NumPy (test_kernel_quantize_rows' quantizer), padded to the tile
  with zero rows at the floor scale; a cap below the rows' max clips them at 448. The first and
  last real rows and the first padding row are all checked: rows 0..2 of 3 plus 5 pad rows."""
  from test_kernel_quantize_rows import _np_quantize
  rng = np.random.default_rng(7)
  s, r = _bf16(rng, 1, 3, 1024), _bf16(rng, 1, 3, 1024, scale=3.0)
  w = jnp.asarray(rng.uniform(0.5, 2.0, 1024), BF16)
  with pallas_kernels.interpret():
    h, y, q, scale = api.residual_norm(s, r, w, EPS, implementation=implementation,
                                       quantize=(8, ub))
  _, y_ref = _numpy_residual_norm(s, r, w, EPS)
  _close(y, y_ref)
  assert q.shape == (8, 1024) and q.dtype == jnp.float8_e4m3fn and scale.shape == (8,)
  # The quantizer may see the normed product before its bf16 rounding (XLA's excess precision
  # in interpret mode, as in the XLA path's fusions): scales within one bf16 step (2^-8), values
  # within one e4m3 step (2^-3 relative) plus that.
  want_q, want_s = _np_quantize(np.asarray(y, np.float64).reshape(3, 1024), 8, ub)
  np.testing.assert_allclose(np.asarray(scale), want_s, rtol=2.0 ** -8)
  got = np.asarray(q.astype(jnp.float32), np.float64)
  assert np.all(np.abs(got - want_q) <= np.abs(want_q) * (2.0 ** -3 + 2.0 ** -7) + 2.0 ** -6)
  if ub is not None:  # the cap binds: rows clip at +-448
    assert np.max(np.abs(got)) == 448
  assert np.all(got[3:] == 0)  # pad rows (their floor scales checked with the others above)
  np.testing.assert_allclose(np.asarray(scale[3:]), want_s[3:], rtol=1e-6)
  with pytest.raises(pallas_kernels.KernelInputError, match=r"rows_out >= 3"):
    api.residual_norm(s, r, w, EPS, implementation=implementation, quantize=(2, None))


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_quantizing_site_also_gives_its_normed_rows_padded(implementation):
  """With the FP8 epilogue the kernel writes the normed rows padded to the FP8 rows' tile (zero
  rows past them: the bf16 router GEMM takes them without a pad launch); `padded_normed` returns
  them: the normed rows, then zeros."""
  rng = np.random.default_rng(8)
  s, r = _bf16(rng, 1, 3, 256), _bf16(rng, 1, 3, 256, scale=3.0)
  w = jnp.asarray(rng.uniform(0.5, 2.0, 256), BF16)
  with pallas_kernels.interpret():
    h, y, q, scale, padded = api.residual_norm(s, r, w, EPS, implementation=implementation,
                                               quantize=(8, None), padded_normed=True)
  assert padded.shape == (8, 256) and padded.dtype == BF16
  np.testing.assert_array_equal(np.asarray(padded[:3], np.float32),
                                np.asarray(y.reshape(3, 256), np.float32))
  assert np.all(np.asarray(padded[3:], np.float32) == 0)
  _, y_ref = _numpy_residual_norm(s, r, w, EPS)
  _close(padded[:3].reshape(y_ref.shape), y_ref)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_row_padded_partial_reads_only_the_residual_rows(implementation):
  """A GEMM's tile-padded product [R >= rows, D] goes in unsliced: the rows past the residual's
  (NaN here) change nothing."""
  rng = np.random.default_rng(4)
  s, r = _bf16(rng, 3, 256), _bf16(rng, 1, 3, 256, scale=3.0)
  w = jnp.asarray(rng.uniform(0.5, 2.0, 256), BF16)
  padded = jnp.concatenate([s, jnp.full((5, 256), jnp.nan, BF16)])
  with pallas_kernels.interpret():
    h, y = api.residual_norm(padded, r, w, EPS, implementation=implementation)
  h_ref, y_ref = _numpy_residual_norm(s.reshape(r.shape), r, w, EPS)
  assert h.shape == y.shape == r.shape
  _close(h, h_ref)
  _close(y, y_ref)
  with pytest.raises(pallas_kernels.KernelInputError, match=r"R >= 3"):
    api.residual_norm(padded[:2], r, w, EPS, implementation=implementation)


def test_reference_allreduce_under_shard_map_matches_numpy():
  """psum of the bf16-rounded partials of 8 devices, + residual, normed, on every device."""
  rng = np.random.default_rng(1)
  mesh = sharding.make_mesh(tensor=8)
  partials = jnp.asarray(rng.standard_normal((8, 2, 3, 256)), jnp.float32)
  r, w = _bf16(rng, 2, 3, 256), jnp.asarray(rng.uniform(0.5, 2.0, 256), BF16)

  def body(p, r, w):
    return allreduce_norm.allreduce_residual_norm(p[0], r, w, EPS, "tensor",
                                                  implementation="xla")
  h, y = jax.shard_map(body, mesh=mesh, in_specs=(P("tensor"), P(), P()), out_specs=(P(), P()),
                       check_vma=False)(partials, r, w)
  summed = np.asarray(partials.astype(BF16), np.float64).sum(0)
  h_ref, y_ref = _numpy_residual_norm(summed, r, w, EPS)
  _close(h, h_ref)
  _close(y, y_ref)


def test_bad_input_and_support():
  x = jnp.ones((2, 256), BF16)
  with pytest.raises(pallas_kernels.KernelInputError, match="same shape"):
    api.residual_norm(x, jnp.ones((2, 512), BF16), jnp.ones((512,), BF16), EPS)
  with pytest.raises(pallas_kernels.KernelInputError, match=r"weight has shape \(128,\)"):
    api.residual_norm(x, x, jnp.ones((128,), BF16), EPS)
  assert api.pallas_support((4, 5120), BF16, BF16) == (True, "")
  assert not api.pallas_support((4, 128), BF16, BF16)[0]  # under one 2-wide vector per thread
  assert not api.pallas_support((api.MAX_ROWS + 1, 5120), BF16, BF16)[0]  # prefill
  assert not api.pallas_support((4, 5120), jnp.float32, jnp.float32)[0]


def _fused_site(kernels):
  """`maverick.kernels.fused_allreduce_norm` on 8 devices: (h, y, numpy h, numpy y)."""
  rng = np.random.default_rng(3)
  mesh = sharding.make_mesh(tensor=8)
  p = _bf16(rng, 8, 2, 256)
  r, w = _bf16(rng, 2, 256), jnp.asarray(rng.uniform(0.5, 2.0, 256), BF16)
  body = lambda p, r, w: kernels_lib.fused_allreduce_norm(
      p[0], r, w, kernels_lib.Fuse(r, w, EPS, kernels), ("tensor",), mesh)
  h, y = jax.shard_map(body, mesh=mesh, in_specs=(P("tensor"), P(), P()), out_specs=(P(), P()),
                       check_vma=False)(p, r, w)
  return (h, y, *_numpy_residual_norm(np.asarray(p, np.float64).sum(0), r, w, EPS))


def test_self_check_probes_on_the_mesh(monkeypatch, tmp_path):
  """Auto mode probes the kernel as one program over the caller's mesh. GPU interpret mode cannot
  run a multi-device kernel (like a GPU without multimem): the probe fails, one
  KernelFallbackWarning, the site runs psum + norm. With the entry swapped for its reference the
  probe passes (its program and comparison are right) and the site takes the kernel branch."""
  original, calls = allreduce_norm.allreduce_residual_norm, []
  monkeypatch.setenv("MAVERICK_CACHE_DIR", str(tmp_path / "failing"))
  selfcheck.clear_memory()
  with pallas_kernels.interpret(), selfcheck.force(), warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    h, y, h_ref, y_ref = _fused_site(None)
  fallbacks = [w for w in ws if issubclass(w.category, selfcheck.KernelFallbackWarning)]
  assert len(fallbacks) == 1 and "allreduce_norm" in str(fallbacks[0].message), ws
  _close(h, h_ref)
  _close(y, y_ref)

  def reference(*args, **kw):
    calls.append(kw["implementation"])
    return original(*args, **dict(kw, implementation="xla"))
  monkeypatch.setattr(allreduce_norm, "allreduce_residual_norm", reference)
  monkeypatch.setenv("MAVERICK_CACHE_DIR", str(tmp_path / "passing"))
  selfcheck.clear_memory()
  with pallas_kernels.interpret(), selfcheck.force():
    h, y, h_ref, y_ref = _fused_site(None)
  assert selfcheck.probes_run == 1 and calls[-1] == "pallas", calls
  _close(y, y_ref)
  selfcheck.clear_memory()


def test_fp8_epilogue_has_its_own_self_check(monkeypatch, tmp_path):
  """A site that quantizes for the next GEMM runs the kernel only when both probes pass: the
  site's (h, y) and its FP8 rows (dequantized, within one e4m3 step). The entry swapped for its
  reference passes both (2 probes); a reference whose FP8 scales are off by 2x on the kernel
  side fails the second: one KernelFallbackWarning naming the epilogue, the site runs XLA."""
  original, calls = allreduce_norm.allreduce_residual_norm, []
  rng = np.random.default_rng(3)
  mesh = sharding.make_mesh(tensor=8)
  p = _bf16(rng, 8, 2, 256)
  r, w = _bf16(rng, 2, 256), jnp.asarray(rng.uniform(0.5, 2.0, 256), BF16)

  def site():
    body = lambda p, r, w: kernels_lib.fused_allreduce_norm(
        p[0], r, w, kernels_lib.Fuse(r, w, EPS, None, True), ("tensor",), mesh)
    return jax.shard_map(body, mesh=mesh, in_specs=(P("tensor"), P(), P()),
                         out_specs=(P(),) * 5, check_vma=False)(p, r, w)

  def reference(*args, bad_scale=False, **kw):
    calls.append(kw["implementation"])
    out = original(*args, **dict(kw, implementation="xla"))
    if bad_scale and kw["implementation"] == "pallas" and len(out) == 4:
      out = (*out[:3], out[3] * 2)
    return out

  for bad, probes, impl in ((False, 2, "pallas"), (True, 2, "xla")):
    monkeypatch.setattr(allreduce_norm, "allreduce_residual_norm",
                        lambda *a, _bad=bad, **k: reference(*a, bad_scale=_bad, **k))
    monkeypatch.setenv("MAVERICK_CACHE_DIR", str(tmp_path / str(bad)))
    selfcheck.clear_memory()
    with pallas_kernels.interpret(), selfcheck.force(), warnings.catch_warnings(record=True) as ws:
      warnings.simplefilter("always")
      h, y, q, scale, padded = site()
    fallbacks = [w for w in ws if issubclass(w.category, selfcheck.KernelFallbackWarning)]
    assert selfcheck.probes_run == probes and calls[-1] == impl, (calls, selfcheck.probes_run)
    assert len(fallbacks) == bad and (not bad or "FP8 epilogue" in str(fallbacks[0].message))
    assert q.shape == (64, 256) and scale.shape == (64,) and padded.shape == (64, 256)
  selfcheck.clear_memory()


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_split_k_partials_and_a_second_term_are_summed_in_f32(implementation):
  """Terms as a MoE layer's last site has them: the shared expert's down GEMM split in 3 along K
  (f32 partials [3, R, D], each scaled) and the routed experts' bf16 product [R, D]; rows past
  the residual's (NaN) unread; the f32 partials summed unrounded (float64 reference)."""
  rng = np.random.default_rng(5)
  r = _bf16(rng, 1, 3, 256, scale=3.0)
  w = jnp.asarray(rng.uniform(0.5, 2.0, 256), BF16)
  split = rng.standard_normal((3, 8, 256)).astype(np.float32) / 3
  split[:, 3:] = np.nan
  routed = np.asarray(_bf16(rng, 8, 256), np.float32)
  routed[3:] = np.nan
  terms = (jnp.asarray(split), jnp.asarray(routed, BF16))
  with pallas_kernels.interpret():
    h, y = api.residual_norm(terms, r, w, EPS, implementation=implementation)
  summed = (np.asarray(split, np.float64).sum(0) + np.asarray(routed, np.float64))[:3]
  h_ref, y_ref = _numpy_residual_norm(summed.reshape(r.shape), r, w, EPS)
  assert h.shape == y.shape == r.shape
  _close(h, h_ref)
  _close(y, y_ref)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_split_k_terms_lower_inside_shard_map_at_tp8_shard_shape(arch):
  """The TP8 MoE site: the shared expert's down partials enter the kernel as f32 [2, 64, 5120]
  and the routed product as bf16 [64, 5120], no XLA fusion before it: one Mosaic GPU call."""
  mesh = sharding.make_mesh(tensor=8)
  S = jax.ShapeDtypeStruct

  def f(p, routed, r, w):
    body = lambda p, routed, r, w: allreduce_norm.allreduce_residual_norm(
        (p[0], routed[0]), r, w, EPS, mesh.axis_names, implementation="pallas")
    return jax.shard_map(body, mesh=mesh, in_specs=(P("tensor"), P("tensor"), P(), P()),
                         out_specs=(P(), P()), check_vma=False)(p, routed, r, w)

  on = lambda spec: NamedSharding(mesh, spec)
  hlo = pallas_kernels.lower_for_gpu(
      f, S((8, 2, 64, 5120), jnp.float32, sharding=on(P("tensor"))),
      S((8, 64, 5120), BF16, sharding=on(P("tensor"))), S((1, 5120), BF16), S((5120,), BF16),
      arch=arch)
  assert hlo.count("@mosaic_gpu_v2(") == 1
  assert "tensor<2x64x5120xf32>" in hlo and "tensor<64x5120xbf16>" in hlo


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_kernel_lowers_inside_shard_map_at_tp8_shard_shape(arch):
  """Maverick TP8 decode / verify rows (B x (K + 1) = 4 x 4) of D = 5120, f32 partials: one
  Mosaic GPU call, the all-reduce inside it."""
  mesh = sharding.make_mesh(tensor=8)
  S = jax.ShapeDtypeStruct

  def f(p, r, w):
    body = lambda p, r, w: allreduce_norm.allreduce_residual_norm(
        p, r, w, EPS, mesh.axis_names, implementation="pallas")
    return jax.shard_map(body, mesh=mesh, in_specs=(P("tensor"), P(), P()),
                         out_specs=(P(), P()), check_vma=False)(p, r, w)

  hlo = pallas_kernels.lower_for_gpu(
      f, S((8 * 4, 4, 5120), jnp.float32, sharding=NamedSharding(mesh, P("tensor"))),
      S((4, 4, 5120), BF16), S((5120,), BF16), arch=arch)
  assert hlo.count("@mosaic_gpu_v2(") == 1
  assert "all_reduce" not in hlo
  assert "tensor<4x4x5120xbf16>" in hlo  # the payload enters the kernel as bf16


_FUSED_CALL = re.compile(r"stablehlo\.custom_call @mosaic_gpu_v2\(([^)]*)\).*?"
                         r"symmetric_memory_parameters.*? -> \(([^)]*)\)")


def _fused_calls(hlo: str) -> list[tuple[int, str, int]]:
  """(operand count, operand memory spaces, result count) of each multimem (fused) kernel call."""
  calls = []
  for line in hlo.splitlines():
    m = _FUSED_CALL.search(line)
    if m:
      spaces = re.search(r'operands_memory_spaces = "([^"]*)"', line)
      calls.append((len(m.group(1).split(",")), spaces.group(1) if spaces else "",
                    len(m.group(2).split(", tensor")) ))
  return calls


@pytest.mark.skipif(not allreduce_norm.shared_semaphores_supported(),
                    reason="this jax has no plgpu.alloc_semaphore (0.11.2): kernels keep their own")
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_sites_share_one_semaphore_buffer(arch):
  """Three fused sites given one `new_semaphores` buffer: each kernel takes it as its last operand
  in collective memory (space 7) and returns only (h, y), so XLA allocates it once; without it
  each kernel returns its own zero-initialised scratch buffer, which XLA copies into collective
  memory before every kernel (a launch a site; 96 in the 48-layer decode step)."""
  mesh = sharding.make_mesh(tensor=8)
  S = jax.ShapeDtypeStruct

  def sites(shared):
    def f(p, r, w):
      sems = allreduce_norm.new_semaphores(4) if shared else None
      body = lambda p, r, w, s: allreduce_norm.allreduce_residual_norm(
          p, r, w, EPS, mesh.axis_names, implementation="pallas", semaphores=s)
      for _ in range(3):
        r, _ = jax.shard_map(body, mesh=mesh,
                             in_specs=(P("tensor"), P(), P(), None if sems is None else P()),
                             out_specs=(P(), P()), check_vma=False)(p, r, w, sems)
      return r
    hlo = pallas_kernels.lower_for_gpu(
        f, S((8 * 4, 5120), jnp.float32, sharding=NamedSharding(mesh, P("tensor"))),
        S((4, 5120), BF16), S((5120,), BF16), arch=arch)
    # A shared buffer must be zero again when a kernel ends: its waits take back what they
    # waited for (an atomic compare-and-swap; a wait that does not decrement is a plain poll).
    assert "atom.relaxed.sys.global.cas.b32" in hlo
    return _fused_calls(hlo)

  assert sites(True) == [(4, "{0:7,3:7}", 2)] * 3
  own = sites(False)  # the kernel's scratch: an aliased operand and result of its own
  assert len(own) == 3 and all(results == 3 for _, _, results in own), own
  with pytest.raises(common.KernelInputError, match=r"new_semaphores\(4\)"):
    mesh1 = sharding.make_mesh(tensor=8)
    jax.eval_shape(jax.shard_map(
        lambda p, r, w, s: allreduce_norm.allreduce_residual_norm(
            p, r, w, EPS, mesh1.axis_names, implementation="pallas", semaphores=s),
        mesh=mesh1, in_specs=(P("tensor"), P(), P(), P()), out_specs=(P(), P()),
        check_vma=False), S((32, 5120), jnp.float32), S((4, 5120), BF16), S((5120,), BF16),
        S((6,), jnp.int32))


def _fused_model():
  """aligned_config widened to D = 256 (the kernel's smallest row) with random norm weights (a
  norm applied with the wrong weight must show)."""
  cfg = aligned_config().replace(hidden_size=256)
  model = model_lib.init_model(cfg, seed=0)
  rng = np.random.default_rng(2)
  for _, m in nnx.iter_graph(model):
    if isinstance(m, model_lib.RMSNorm):
      m.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, m.weight.shape), m.weight.dtype)
  return sharding.shard_model(model, sharding.make_mesh(tensor=8), "tp")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_tp8_decode_step_has_one_fused_kernel_per_site_and_no_all_reduce(arch):
  model = _fused_model()
  L = model.config.num_hidden_layers
  kernels_lib.set_kernels(model, None)
  fn, args = _decode_step(model)
  hlo = pallas_kernels.lower_for_gpu(lambda *a: fn(*a), *args, arch=arch)
  # GEMMs (q/k/v one launch, o, gate/up one, down; + head), grouped, attention, fused (2 per
  # layer + the embedding lookup); kernels counted at
  # their call sites (common.lowered_once)
  assert common.mosaic_call_sites(hlo) == 4 * L + 1 + 2 + L + 2 * L + 1
  assert '"stablehlo.all_reduce"(' not in hlo
  if allreduce_norm.shared_semaphores_supported():
    # Every fused site (2 a layer + the embedding lookup) takes the forward's one semaphore
    # buffer (kernels.fused_forward), none a scratch buffer of its own.
    calls = _fused_calls(hlo)
    assert len(calls) == 2 * L + 1 and {c[1:] for c in calls} == {("{0:7,3:7}", 2)}, calls


@pytest.mark.slow
def test_tp8_fused_path_matches_sharded_xla(reference_kernels):
  """Every kernel entry runs its reference on the local operands (test_sharded_kernels'
  fixture): prefill and a decode step of the TP8 model through the fused sites equal the sharded
  XLA path (GSPMD, unfused), and the fused entry ran as the kernel ("pallas") at both sites of
  every layer, on the [B * T, D] rows of each device. Tolerance: bf16 rounding (2e-2, twice the
  1e-2 of test_sharded_kernels): jitted, XLA may keep the unfused path's residual in f32 inside
  its fusions (excess precision), while the fused site rounds it to bf16 at the shard_map
  boundary; both are ~1.2-1.4 % from a float32 copy of the model (measured, docs/guides/kernels.md)."""
  model = _fused_model()
  L, D, T = model.config.num_hidden_layers, model.config.hidden_size, 40
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (B, T)), jnp.int32)
  kernels_lib.set_kernels(model, "xla")
  ref = _prefill_then_decode(model, tokens)
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    out = _prefill_then_decode(model, tokens)
  for o, r in zip(out, ref):
    rel = np.linalg.norm(o - r) / np.linalg.norm(r)
    assert rel < 2e-2 and np.mean(o.argmax(-1) == r.argmax(-1)) >= 0.95, rel
  fused = [(shapes, impl) for name, shapes, _, impl in reference_kernels
           if name == "allreduce_residual_norm"]
  # Prefill (B x T rows) and decode (B x 1): o (3-D [B, T, D]), FFN (MoE: [B * T, D]) and the
  # embedding lookup.
  assert len(fused) == 2 * (2 * L + 1), len(fused)
  assert {impl for _, impl in fused} == {"pallas"}
  assert {s[0][-1] for s, _ in fused} == {D}


def _fp8_fused_model():
  from maverick import quant
  return sharding.shard_model(quant.quantize_model(
      model_lib.init_model(_fused_model().config, seed=0), quant.QuantConfig()),
      sharding.make_mesh(tensor=8), "tp")


@pytest.mark.slow
def test_tp8_fp8_sites_quantize_the_next_gemms_input(reference_kernels, monkeypatch):
  """FP8 weights with per-token activations, TP8, the fused path (entries run their references):
  each fused site whose next GEMMs quantize their input (the embedding lookup and post-attention
  sites, and each layer's last site but the final norm's, which feeds the bf16 LM head) also
  quantizes its normed rows, and q/k/v, the dense gate/up and the shared expert's gate/up take
  those rows instead of quantizing again (no quantization of a D-wide row is traced), with the
  same logits:
  the same FP8 rows either way (the site quantizes with quantize_rows' reference, bit-equal to
  the consumers' quantization)."""
  model = _fp8_fused_model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (B, 40)), jnp.int32)
  quantized = []
  original = kernels_lib._quantize_dynamic
  monkeypatch.setattr(kernels_lib, "_quantize_dynamic",
                      lambda x2, *a, **k: quantized.append(x2.shape) or original(x2, *a, **k))

  def run(site_quantizes: bool):
    jax.clear_caches()  # trace again: the count is of the traced calls
    quantized.clear()
    with monkeypatch.context() as m:
      if not site_quantizes:
        m.setattr(kernels_lib, "fp8_input_ub", lambda quant: None)
      with pallas_kernels.interpret():
        kernels_lib.set_kernels(model, "pallas")
        out = _prefill_then_decode(model, tokens)
    fused = [impl for name, _, _, impl in reference_kernels if name == "allreduce_residual_norm"]
    reference_kernels.clear()
    return out, list(quantized), fused

  (prefill, step), n_site, fused = run(True)
  (prefill0, step0), n_own, _ = run(False)
  L = model.config.num_hidden_layers
  assert len(fused) == 2 * (2 * L + 1) and set(fused) == {"pallas"}
  D = model.config.hidden_size  # the normed rows' width: what only their consumers quantize
  assert [q for q in n_site if q[-1] == D] == [] and [q for q in n_own if q[-1] == D], n_own
  np.testing.assert_array_equal(prefill, prefill0)
  np.testing.assert_array_equal(step, step0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_tp8_fp8_decode_step_quantizes_in_the_fused_sites(arch, monkeypatch):
  """Lowered for the GPU (the kernel's FP8 epilogue through Mosaic at the TP8 shard): every
  fused site but the final norm's returns (h, y, e4m3 rows, scales); the final one (h, y)."""
  model = _fp8_fused_model()
  L = model.config.num_hidden_layers
  kernels_lib.set_kernels(model, None)

  def fused_results():
    fn, args = _decode_step(model)
    hlo = pallas_kernels.lower_for_gpu(lambda *a: fn(*a), *args, arch=arch)
    return sorted(results for _, _, results in _fused_calls(hlo))

  assert fused_results() == [2] + [4] * (2 * L)
  monkeypatch.setattr(kernels_lib, "fp8_input_ub", lambda quant: None)
  assert fused_results() == [2] * (2 * L + 1)


def _all_reduces(compiled_hlo: str) -> int:
  return sum(line.count(" all-reduce(") + line.count(" all-reduce-start(")
             for line in compiled_hlo.splitlines())


@pytest.mark.slow
def test_tp8_decode_step_compiled_has_no_all_reduce_besides_the_fused_sites(reference_kernels):
  """Compiled (CPU, the fused entries swapped for their psum references): every all-reduce of the
  decode step is one of the fused sites' (2 per layer + the embedding lookup), so on the GPU,
  where each site is one kernel, none is left. GSPMD's own all-reduce of the vocab-split lookup
  is what this catches (lowered StableHLO does not show it: the partitioner adds it later)."""
  model = _fused_model()
  L = model.config.num_hidden_layers
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    fn, args = _decode_step(model)
    hlo = jax.jit(fn).lower(*args).compile().as_text()
  fused = [s for name, s, _, impl in reference_kernels if name == "allreduce_residual_norm"]
  assert _all_reduces(hlo) == len(fused), (_all_reduces(hlo), len(fused))
  assert len(fused) == 2 * L + 1


@pytest.mark.slow
def test_tp8_draft_embedding_lookup_fuses_and_matches_xla(reference_kernels):
  """The EAGLE-3 draft's three all-reduce sites fuse: the lookup in the target's vocab-split
  table (+ its embedding norm), o (+ post-attention norm) and the MLP's down (+ final norm).
  Logits equal the sharded XLA path's; each site ran as the kernel; compiled, the draft step has
  no other all-reduce."""
  from spec_decode import draft as draft_lib
  target = _fused_model()
  plan = sharding.plan_of(target)
  dcfg = draft_lib.Eagle3Config.for_target(target.config)
  draft = draft_lib.init_draft(dcfg, seed=1)
  draft.embed_norm.weight[...] = jnp.asarray(
      np.random.default_rng(3).uniform(0.5, 1.5, draft.embed_norm.weight.shape), BF16)
  draft = sharding.shard_model(draft, plan.mesh, "tp")
  rng = np.random.default_rng(4)
  D, T = target.config.hidden_size, 5
  tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (B, T)), jnp.int32)
  hidden = _bf16(rng, B, T, D)

  def logits(kernels):  # (logits, the compiled program's HLO)
    kernels_lib.set_kernels(draft, kernels)
    graphdef, state = nnx.split(draft)
    args = (state, tokens, hidden, target.embed[...])
    run = jax.jit(lambda state, t, h, e: nnx.merge(graphdef, state)(t, h, e).logits)
    compiled = run.lower(*args).compile()
    return np.asarray(compiled(*args), np.float64), compiled.as_text()

  ref, _ = logits("xla")
  assert not reference_kernels
  with pallas_kernels.interpret():
    out, hlo = logits("pallas")
  rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert rel < 2e-2 and np.mean(out.argmax(-1) == ref.argmax(-1)) >= 0.95, rel
  # (residual, impl): the partial is the residual's shape, or (o, down) the GEMM's rows as it
  # padded them to its tile, with its K split: [S, R >= B * T, D].
  fused = [(s[1], impl) for name, s, _, impl in reference_kernels
           if name == "allreduce_residual_norm"]
  assert fused == [((B, T, D), "pallas")] * 3, fused
  assert all(s[0] == s[1] or (len(s[0]) == 3 and s[0][1] >= B * T and s[0][2] == D)
             for name, s, _, _ in reference_kernels if name == "allreduce_residual_norm")
  assert _all_reduces(hlo) == 3, _all_reduces(hlo)


@pytest.mark.parametrize("fp8", [False, True])
def test_sharded_embedding_lookup_site_matches_numpy(reference_kernels, fp8):
  """The lookup site alone (TP8, vocab 512 split 8 ways, tokens from every slice and both ends):
  rows exact against NumPy's table[tokens] (times the row scale of an FP8 table), their norm
  within bf16 rounding, through the kernel entry."""
  from maverick import sharding_plan
  from maverick.quant import ops as quant_ops
  mesh = sharding.make_mesh(tensor=8)
  plan = sharding_plan.Plan(mesh, "tp")
  rng = np.random.default_rng(5)
  V, D = 512, 256
  table = _bf16(rng, V, D)
  scale = None
  if fp8:
    table, scale = quant_ops.quantize_weight(table, (1,))
  tokens = np.concatenate([[0, V - 1, 63, 64], rng.integers(0, V, 12)]).reshape(2, 8)
  weight = jnp.asarray(rng.uniform(0.5, 1.5, D), BF16)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  with pallas_kernels.interpret():
    rows, normed = jax.jit(lambda t, w, s, nw: kernels_lib.sharded_embed_norm(
        t, w, s, nw, EPS, "pallas", plan, ("vocab", "embed"), BF16))(
            jnp.asarray(tokens, jnp.int32), put(table, P("tensor")),
            None if scale is None else put(scale, P("tensor")), weight)
  want = np.asarray(table, np.float32)[tokens]
  if fp8:  # the f32 product, as the model's dequantized lookup
    want = want * np.asarray(scale, np.float32)[tokens][..., None]
  want = np.asarray(jnp.asarray(want, BF16), np.float64)
  np.testing.assert_array_equal(np.asarray(rows, np.float64), want)
  _, ref_normed = _numpy_residual_norm(want, np.zeros_like(want), weight, EPS)
  _close(normed, ref_normed)
  assert [impl for name, *_, impl in reference_kernels
          if name == "allreduce_residual_norm"] == ["pallas"]
