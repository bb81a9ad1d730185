"""Auto mode cannot crash a user: a kernel config runs only after its on-device self-check
(`pallas_kernels.selfcheck`), and a config that fails to compile or disagrees with XLA falls back
to XLA with exactly one warning naming the op, the shapes and the reason.

There is no GPU here, so the check is forced on in GPU interpret mode (`selfcheck.force()`), and
the failures are made by replacing the real kernel with one that raises as a Mosaic compile error
would, or with one whose numbers are off. Each op's probe is also run against its real kernel,
so a probe that draws invalid inputs (or a kernel that disagrees) shows up here.
"""

import json
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels
from maverick import kernel_attention
from maverick import kernel_moe
from maverick import kernels as kernels_lib
from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick import quant
from maverick.model import TreeMask
from pallas_kernels import selfcheck
from pallas_kernels.gemm import api as gemm_api


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
  monkeypatch.setenv("MAVERICK_CACHE_DIR", str(tmp_path))
  selfcheck.clear_memory()
  yield
  selfcheck.clear_memory()


def _linear_call(kernels):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 5, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((128, 256)) / 11, jnp.bfloat16)
  y = kernels_lib.linear("btd,df->btf", x, w, None, None, kernels)
  ref = jnp.einsum("btd,df->btf", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  return y, np.asarray(ref, np.float32)


def _auto_linear_twice():
  """Two auto-mode calls of the same config, in interpret mode with the check forced on; returns
  (outputs, the KernelFallbackWarnings raised)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pallas_kernels.interpret(detect_races=False), selfcheck.force():
      outs = [_linear_call(None) for _ in range(2)]
  return outs, [w for w in caught if issubclass(w.category, selfcheck.KernelFallbackWarning)]


def _cache():
  return json.loads(selfcheck.cache_path().read_text())


def test_passing_config_runs_the_kernel_and_is_cached_on_disk(monkeypatch):
  calls = []
  real = gemm_api._KERNELS["sm90"]
  monkeypatch.setitem(gemm_api._KERNELS, "sm90", lambda *a, **k: calls.append(1) or real(*a, **k))
  outs, warned = _auto_linear_twice()
  assert not warned and selfcheck.probes_run == 1
  for y, ref in outs:
    assert y is not None  # the Pallas path was taken
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-2)
  # probe + two real calls went through the kernel
  assert len(calls) == 3
  (record,) = _cache().values()
  assert record["ok"] and record["max_rel_error"] < kernels_lib.PROBE_TOL
  # A new process (memory cleared) trusts the disk cache: no new probe.
  selfcheck.clear_memory()
  _, warned = _auto_linear_twice()
  assert not warned and selfcheck.probes_run == 0


def _assert_fell_back(outs, warned, reason):
  assert len(warned) == 1, [str(w.message) for w in warned]
  message = str(warned[0].message)
  assert "gemm" in message and "bfloat16[15, 128]" in message and reason in message, message
  for y, _ in outs:
    assert y is None  # the caller runs its XLA path
  (record,) = _cache().values()
  assert not record["ok"] and reason in record["reason"]


def test_compile_failure_falls_back_to_xla_with_one_warning(monkeypatch):
  def does_not_build(*_, **__):
    raise ValueError("Mosaic GPU kernel exceeds available shared memory: smem_bytes=280656 > "
                     "max_smem_bytes=232448")
  monkeypatch.setitem(gemm_api._KERNELS, "sm90", does_not_build)
  outs, warned = _auto_linear_twice()
  _assert_fell_back(outs, warned, "does not compile")
  assert "exceeds available shared memory" in str(warned[0].message)


def test_numeric_mismatch_falls_back_to_xla_with_one_warning(monkeypatch):
  real = gemm_api._KERNELS["sm90"]
  monkeypatch.setitem(gemm_api._KERNELS, "sm90",
                      lambda *a, **k: tuple((o.astype(jnp.float32) * 1.05).astype(jnp.bfloat16)
                                            for o in real(*a, **k)))
  outs, warned = _auto_linear_twice()
  _assert_fell_back(outs, warned, "disagrees with XLA")


def test_forced_pallas_skips_the_check_and_xla_never_probes(monkeypatch):
  real = gemm_api._KERNELS["sm90"]
  monkeypatch.setitem(gemm_api._KERNELS, "sm90",
                      lambda *a, **k: tuple((o.astype(jnp.float32) * 1.05).astype(jnp.bfloat16)
                                            for o in real(*a, **k)))
  with pallas_kernels.interpret(detect_races=False), selfcheck.force():
    y, _ = _linear_call("pallas")
    assert y is not None
    assert _linear_call("xla")[0] is None
  assert selfcheck.probes_run == 0


def test_the_check_is_off_where_no_gpu_runs_it():
  """Off a GPU (here: interpret mode, not forced) auto mode uses the planner's answer alone."""
  with pallas_kernels.interpret(detect_races=False):
    assert selfcheck.active() is False
    assert _linear_call(None)[0] is not None
  assert selfcheck.probes_run == 0 and not selfcheck.cache_path().exists()


def _probe_passes(fn):
  """Runs `fn` (one kernel helper call in auto mode) with the check forced: every op's probe must
  draw valid inputs, and the real kernel must pass it."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", selfcheck.KernelFallbackWarning)
    with pallas_kernels.interpret(detect_races=False), selfcheck.force():
      out = fn()
  assert out is not None and selfcheck.probes_run == 1
  assert all(r["ok"] for r in _cache().values())


@pytest.mark.slow
def test_probes_of_the_attention_and_expert_kernels_pass():
  rng = np.random.default_rng(2)
  bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v = bf(1, 70, 4, 64), bf(1, 70, 1, 64), bf(1, 70, 1, 64)
  _probe_passes(lambda: kernel_attention.prefill_attention(q, k, v, 32, None))
  selfcheck.clear_memory()

  cache_k, cache_v = bf(2, 128, 1, 64), bf(2, 128, 1, 64)
  positions = jnp.asarray([[40, 41], [90, 91]], jnp.int32)
  _probe_passes(lambda: kernel_attention.cache_attention(bf(2, 2, 4, 64), cache_k, cache_v,
                                                         positions, None, None, {}, None))
  selfcheck.clear_memory()

  R = 5
  tree = TreeMask(start=jnp.asarray([30, 60], jnp.int32),
                  positions=jnp.asarray([[30, 31, 31, 32, 32], [60, 61, 62, 62, 63]], jnp.int32),
                  visible=jnp.asarray(rng.random((2, R, R)) < 0.6))
  _probe_passes(lambda: kernel_attention.cache_attention(
      bf(2, R, 4, 64), cache_k, cache_v, tree.positions, 64, tree, {}, None))
  selfcheck.clear_memory()

  N, D, F, E, top = 6, 128, 128, 4, 1
  experts = [bf(E, D, F), bf(E, D, F), bf(E, F, D)]
  top_idx = jnp.asarray(rng.integers(0, E, (N, top)), jnp.int32)
  scores = jnp.asarray(rng.random((N, top)), jnp.bfloat16)
  _probe_passes(lambda: kernel_moe.moe_experts(bf(N, D), top_idx, scores, *experts, None))


@pytest.mark.slow
def test_probes_of_the_static_fp8_kernels_pass():
  """The static-activation FP8 configs (ModelOpt checkpoints): the probes draw a scalar input
  scale (and per-tensor-like weight scales) the real kernels pass with, and their key is not the
  per-token mode's: the same shapes in that mode probe again instead of reusing the result."""
  rng = np.random.default_rng(4)
  static, dynamic = quant.QuantConfig(activations="static_per_tensor"), quant.QuantConfig()
  fp8 = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float8_e4m3fn)
  ones = lambda *s: jnp.full(s, 0.01, jnp.float32)
  x, si = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16), jnp.float32(4 / 448)
  w = fp8(256, 128)  # K-major [N, K]
  for qc in (static, dynamic):
    _probe_passes(lambda: kernels_lib.linear("td,fd->tf", x, w, ones(256), qc, None,
                                             input_scale=si))
    selfcheck.clear_memory()
  assert len(_cache()) == 2

  N, D, F, E = 5, 128, 128, 4  # N: x's 5 rows (6 read past them, which a gather hid)
  experts = [fp8(E, F, D), fp8(E, F, D), fp8(E, D, F)]  # K-major gate/up [E, F, D], down
  top_idx = jnp.asarray(rng.integers(0, E, (N, 1)), jnp.int32)
  scores = jnp.asarray(rng.random((N, 1)), jnp.bfloat16)
  for qc in (static, dynamic):
    _probe_passes(lambda: kernel_moe.moe_experts(
        x[:N], top_idx, scores, *experts, None, scales=(ones(E, F), ones(E, F), ones(E, D)),
        quant=qc, input_scales=(si, si, si)))
    selfcheck.clear_memory()
  assert len(_cache()) == 4


def test_probe_runs_while_the_model_is_being_traced():
  """The kernel choice is made while jit traces the model: the probe must run outside that trace
  (its own small program), and a failing config must still leave an XLA path in the jit."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((128, 256)) / 11, jnp.bfloat16)

  @jax.jit
  def f(x, w):
    y = kernels_lib.linear("td,df->tf", x, w, None, None, None)
    return jnp.einsum("td,df->tf", x, w) if y is None else y

  ref = np.asarray(jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32), np.float32)
  with pallas_kernels.interpret(detect_races=False), selfcheck.force():
    y = f(x, w)
  assert selfcheck.probes_run == 1 and _cache() and all(r["ok"] for r in _cache().values())
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_load_takes_the_kernels_switch():
  import maverick
  from pallas_kernels.common import KernelInputError
  model = maverick.load("random:tiny", kernels="xla").model
  assert {layer.attn.kernels for layer in model.layers} == {"xla"}
  with pytest.raises(KernelInputError, match="kernels='pallas' needs a Hopper"):
    maverick.load("random:tiny", kernels="pallas")


# ----------------------------------------------------------------------------------------------
# What the cache key holds, and agreement across processes
# ----------------------------------------------------------------------------------------------
def test_key_names_the_wrapper_source_toolchain_and_mesh(monkeypatch):
  """A cached outcome is reused only for the same probe wrapper source (maverick/kernels.py), CUDA
  driver / runtime / ptxas, and mesh: a change of any of them checks the config again."""
  import hashlib
  import pathlib
  wrapper = pathlib.Path(kernels_lib.__file__).read_bytes()
  monkeypatch.setattr(selfcheck, "toolchain", lambda: "driver 12080 runtime 12080 ptxas V12.8.93")
  _, warned = _auto_linear_twice()
  assert not warned and selfcheck.probes_run == 1
  (key,) = _cache()
  assert f"wrapper {hashlib.sha1(wrapper).hexdigest()[:12]}" in key, key
  assert "ptxas V12.8.93" in key and "mesh none" in key and "processes 1" in key, key

  def probes_after(change):
    selfcheck.clear_memory()
    with change():
      _auto_linear_twice()
    return selfcheck.probes_run

  import contextlib
  assert probes_after(contextlib.nullcontext) == 0  # same everything: the disk answers
  monkeypatch.setattr(selfcheck, "toolchain", lambda: "driver 13000 runtime 12080 ptxas V12.8.93")
  assert probes_after(contextlib.nullcontext) == 1  # a driver update
  monkeypatch.setattr(selfcheck, "_wrapper_hash", lambda probe: "edited")
  assert probes_after(contextlib.nullcontext) == 1  # kernels.py changed
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), devices=jax.devices()[:8])
  assert probes_after(lambda: selfcheck.on_mesh(mesh)) == 1  # the same shapes on a mesh
  assert any("mesh data=2,tensor=4" in k for k in _cache())


def test_ptxas_version_is_read_from_the_cuda_path(tmp_path):
  ptxas = tmp_path / "bin" / "ptxas"
  ptxas.parent.mkdir()
  ptxas.write_text("#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\n"
                   "echo 'Cuda compilation tools, release 12.9, V12.9.86'\n")
  ptxas.chmod(0o755)
  assert selfcheck._ptxas_version(str(tmp_path)) == "V12.9.86"
  assert selfcheck._ptxas_version(str(tmp_path / "missing")) in ("none",) or \
      selfcheck._ptxas_version(str(tmp_path / "missing")).startswith("V")  # a ptxas on PATH


def test_processes_agree_on_one_outcome(monkeypatch):
  """Multi-process: a config whose check passed here but failed on another process runs on XLA
  here too (every host must trace the same program); each process joins the all-gather even when
  its own check failed, and only once per config."""
  from jax.experimental import multihost_utils
  gathered = []

  def allgather(x):  # the other process failed
    gathered.append(int(x))
    return np.asarray([int(x), 0])

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  outs, warned = _auto_linear_twice()
  assert gathered == [1]  # this process passed; one agreement for the two calls
  assert len(warned) == 1 and "failed on another process" in str(warned[0].message)
  assert all(y is None for y, _ in outs)
  (record,) = _cache().values()
  assert record["ok"]  # this process's own outcome is what its disk keeps
  # A failing process joins the agreement as well (else the others would wait for it forever).
  selfcheck.clear_memory()
  monkeypatch.setattr(selfcheck, "_load_disk", lambda: {})
  monkeypatch.setattr(selfcheck, "_check", lambda probe: (dict(ok=False, reason="boom"), True))
  _auto_linear_twice()
  assert gathered == [1, 0]


def _paged_call(fp8: bool):
  """cache_attention in auto mode on pools [N=6, 128, 1, 64] through a [2, 2] block table."""
  rng = np.random.default_rng(9)
  kv = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
  pool = lambda: jnp.asarray(rng.standard_normal((6, 128, 1, 64)), kv)
  scales = ({n: jnp.asarray(rng.uniform(0.5, 2, (6, 128, 1)), jnp.float32)
             for n in ("k_scale", "v_scale")} if fp8 else {})
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 64)), jnp.bfloat16)
  table = jnp.asarray([[4, 1], [0, 5]], jnp.int32)
  positions = jnp.asarray([[140, 141], [90, 91]], jnp.int32)
  return kernel_attention.cache_attention(q, pool(), pool(), positions, None, None, scales, None,
                                          block_table=table)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_probe_of_the_paged_decode_kernel_passes(fp8):
  """The paged probe draws pools and a table of distinct shuffled blocks (and pool scales)."""
  _probe_passes(lambda: _paged_call(fp8))
  assert any("decode_attention_paged" in key for key in _cache())


def test_paged_decode_kernel_that_disagrees_falls_back(monkeypatch):
  """A paged kernel that ignores the block table (reads the pool as if contiguous) fails its
  probe: XLA runs, with one warning naming the op."""
  from pallas_kernels.decode_attention import api as decode_api
  real = decode_api._pallas_paged

  def ignores_table(q, k, v, table, *rest):
    return real(q, k, v, jnp.broadcast_to(jnp.arange(table.shape[1], dtype=jnp.int32),
                                          table.shape), *rest)
  monkeypatch.setattr(decode_api, "_pallas_paged", ignores_table)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pallas_kernels.interpret(detect_races=False), selfcheck.force():
      out = _paged_call(False)
  warned = [w for w in caught if issubclass(w.category, selfcheck.KernelFallbackWarning)]
  assert out is None and len(warned) == 1 and "decode_attention_paged" in str(warned[0].message)
