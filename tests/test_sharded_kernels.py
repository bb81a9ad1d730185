"""Pallas kernels inside sharded models (`maverick.kernels` under `shard_map`), on 8 CPU devices.

GPU interpret mode does not run under shard_map on 8 host devices with this JAX: the interpreter's
end-of-kernel consistency check (`assert_no_barriers_allocated`) looks at every simulated device's
barriers, so it fails while another device's kernel is running, and with that check disabled a
whole model deadlocked. So the sharded kernel path is shown in three parts:

  1. numerics: the whole sharded model (TP8, and EP expert=2 x tensor=4) with kernels="pallas",
     the kernel entry points swapped for their XLA references, so each device runs the reference
     on exactly the LOCAL operands the kernel would get, under the same shard_map specs and psums;
     against the sharded XLA path (GSPMD), prefill and one decode step;
  2. the lowering: the whole TP8 decode step and prefill lowered for sm_90 / sm_100 hold the
     Mosaic GPU custom calls inside the shard_map'd (manual) computations, at local shapes, and
     exactly 2 all-reduces per layer; the compiled decode step has the XLA path's collectives;
  3. each kernel at its TP8 shard shape in interpret mode against the XLA path.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from maverick import config as config_lib
from maverick import kernel_attention
from maverick import kernel_moe
from maverick import kernels as kernels_lib
from maverick import multi_linear
from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick import sharding
from pallas_kernels import (allreduce_norm, common, decode_attention, gemm, grouped_gemm,
                            moe_route, prefill_attention, qkv_finish, quantize_rows)
from test_sharding import collectives

B, T, CAPACITY = 2, 40, 128


def aligned_config():
  """2 layers (dense, then MoE with 8 experts, top-1), 8 q / 8 KV heads of 64, widths 512: every
  TP8 shard (1 head, width 64, vocab 64) and EP expert=2 x tensor=4 shard is a kernel shape."""
  return config_lib.tiny("bfloat16").replace(
      hidden_size=128, head_dim=64, num_attention_heads=8, num_key_value_heads=8,
      intermediate_size=512, intermediate_size_mlp=512, num_hidden_layers=2, no_rope_layers=None,
      moe_layers=None, layer_types=None, attention_chunk_size=64)


_ENTRY_POINTS = [(gemm, "gemm"), (gemm, "gemm_many"), (grouped_gemm, "grouped_swiglu"),
                 (grouped_gemm, "grouped_matmul"), (prefill_attention, "prefill_attention"),
                 (decode_attention, "decode_attention"),
                 (allreduce_norm, "allreduce_residual_norm"),
                 # the fused sites' o / down (their K-split partials, summed by the site), and
                 # the MoE router's GEMM, then its top-1 routing:
                 (gemm, "gemm_many_partials"), (moe_route, "route_top1"),
                 # FP8 models only (maverick.fused_mlp, the per-token quantization):
                 (quantize_rows, "swiglu_quantize_rows"), (quantize_rows, "quantize_rows"),
                 (quantize_rows, "swiglu_and_quantize_rows"),
                 # head_dim 128 only (maverick.fused_attention; tests/test_fused_attention.py):
                 (qkv_finish, "qkv_finish")]
FP8_ONLY = {"swiglu_quantize_rows", "quantize_rows", "swiglu_and_quantize_rows"}
HEAD_DIM_128_ONLY = {"qkv_finish"}


@pytest.fixture
def reference_kernels(monkeypatch):
  """Kernel entry points that run their XLA reference (implementation="xla") and record the
  shapes of the operands they were given (and the first operand's dtype); inside `interpret()`
  the model's helpers then take the kernel path (shard_map and all) with nothing to interpret."""
  seen = []
  for module, name in _ENTRY_POINTS:
    original = getattr(module, name)

    def ref(*args, _original=original, _name=name, **kw):
      seen.append((_name, tuple(a.shape for a in jax.tree.leaves(args) if hasattr(a, "shape")),
                   jax.tree.leaves(args)[0].dtype,
                   kw.get("implementation")))
      return _original(*args, **dict(kw, implementation="xla"))
    monkeypatch.setattr(module, name, ref)
  return seen


def _sharded(layout, mesh_kw):
  model = model_lib.init_model(aligned_config(), seed=0)
  return sharding.shard_model(model, sharding.make_mesh(**mesh_kw), layout)


def _prefill_then_decode(model, tokens):
  graphdef, state = nnx.split(model)
  plan = sharding.plan_of(model)
  cache = sharding.constrain_cache(kvc.KVCache.init(model.config, B, CAPACITY), plan)
  out = model_lib.apply(graphdef, state, tokens, cache=cache, prefill=True)
  step = model_lib.apply(graphdef, state, tokens[:, :1], cache=out.cache)
  return np.asarray(out.logits, np.float32), np.asarray(step.logits, np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw,local", [
    ("tp", dict(tensor=8), dict(rows=B, heads=1, experts=8, width=64)),
    ("ep", dict(expert=2, tensor=4), dict(rows=B // 2, heads=2, experts=4, width=128))])
def test_kernel_path_matches_sharded_xla(reference_kernels, layout, mesh_kw, local):
  """Rows over `expert` in EP (data-parallel attention), heads / widths over `tensor`."""
  model = _sharded(layout, mesh_kw)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (B, T)), jnp.int32)
  kernels_lib.set_kernels(model, "xla")
  ref = _prefill_then_decode(model, tokens)
  assert not reference_kernels
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    out = _prefill_then_decode(model, tokens)
  # The fused all-reduce + norm sites round the residual to bf16 at their shard_map boundary,
  # where jitted XLA keeps it in f32 inside a fusion (excess precision; with
  # --xla_allow_excess_precision=false this was under 1e-2). Measured (prefill, decode) rel /
  # top-1 on an EPYC: jax 0.12.0.1 tp 9.5e-3 / 0.975, 1.0e-2 / 1.0; ep 9.5e-3 / 0.99,
  # 9.2e-3 / 1.0. jax 0.12.1: tp 9.4e-3 / 0.95, 1.1e-2 / 1.0; ep 3.2e-2 / 0.99, 1.0e-2 / 1.0
  # (not root-caused). A wrong kernel or shard is O(1) away.
  for o, r in zip(out, ref):
    rel = np.linalg.norm(o - r) / np.linalg.norm(r)
    assert rel < 6e-2 and np.mean(o.argmax(-1) == r.argmax(-1)) >= 0.9, rel
  # Every kernel ran, on the device's shards only.
  calls = {}
  for name, shapes, *_ in reference_kernels:
    calls.setdefault(name, set()).add(shapes)
  # 8 experts: not the routing kernel's warpgroup of 128 (moe.route's XLA routing runs).
  assert set(calls) == ({name for _, name in _ENTRY_POINTS} - FP8_ONLY - HEAD_DIM_128_ONLY
                        - {"route_top1"}), set(calls)
  r, h, e, f = local["rows"], local["heads"], local["experts"], local["width"]
  assert calls["prefill_attention"] == {((r, T, h, 64),) * 3}
  assert calls["decode_attention"] == {((r, 1, h, 64), (r, CAPACITY, h, 64),
                                        (r, CAPACITY, h, 64), (r, 1))}
  assert {s[1] for s in calls["grouped_swiglu"]} == {(e, 128, f)}
  assert {s[1] for s in calls["grouped_matmul"]} == {(e, f, 128)}
  # q/k/v (h heads of 64) and MLP/shared gate/up in one launch each (gemm_many: x, then the
  # weights), o/down (gemm_many_partials at the fused sites): K or N is the local slice.
  gemm_weights = ({s[1] for s in calls["gemm"]} | {s[1] for s in calls["gemm_many_partials"]}
                  | {w for s in calls["gemm_many"] for w in s[1:]})
  assert {len(s) for s in calls["gemm_many"]} == {3, 4}, calls["gemm_many"]  # gate/up; q/k/v
  assert (128, h * 64) in gemm_weights and (h * 64, 128) in gemm_weights, gemm_weights
  assert all(128 in w and max(w) == 128 for w in gemm_weights), gemm_weights


def _decode_step(model):
  graphdef, state = nnx.split(model)
  plan = sharding.plan_of(model)

  def step(state, tokens, cache):
    out = nnx.merge(graphdef, state)(tokens, cache=sharding.constrain_cache(cache, plan))
    return out.logits, sharding.constrain_cache(out.cache, plan)

  cache = jax.eval_shape(lambda: kvc.KVCache.init(model.config, B, CAPACITY))
  return step, (state, jax.ShapeDtypeStruct((B, 1), jnp.int32), cache)


def _prefill(model):
  graphdef, state = nnx.split(model)
  plan = sharding.plan_of(model)

  def prefill(state, tokens, cache):
    out = nnx.merge(graphdef, state)(tokens, cache=sharding.constrain_cache(cache, plan),
                                     prefill=True)
    return out.logits

  cache = jax.eval_shape(lambda: kvc.KVCache.init(model.config, B, CAPACITY))
  return prefill, (state, jax.ShapeDtypeStruct((B, T), jnp.int32), cache)


def _main(hlo: str) -> str:
  return hlo.split("func.func public @main")[1].split("\n  }\n")[0]


# Per layer q, k, v, o + 3 dense-MLP / shared-expert GEMMs, + the LM head; the MoE layer's 2
# grouped GEMMs; one attention kernel per layer. Kernels are shared functions
# (common.lowered_once): counted at their call sites.
# GEMM launches: per layer q/k/v (one gemm_many), o, gate/up (one), down; + the LM head.
GEMMS, GROUPED = 2 * 4 + 1, 2


@pytest.mark.slow
@pytest.mark.parametrize("arch,what", [("sm90", "decode"), ("sm90", "prefill"),
                                       ("sm100", "decode")])
def test_tp8_lowering_has_kernels_inside_shard_map(arch, what):
  model = _sharded("tp", dict(tensor=8))
  kernels_lib.set_kernels(model, None)  # auto: lower_for_gpu targets `arch`
  fn, args = (_decode_step if what == "decode" else _prefill)(model)
  hlo = pallas_kernels.lower_for_gpu(lambda *a: fn(*a), *args, arch=arch)
  assert common.mosaic_call_sites(hlo) == GEMMS + GROUPED + 2
  main = _main(hlo)
  # Every kernel is called from a manual (shard_map) region, never at the top level of main,
  # where XLA would have to partition it: one region per GEMM and attention call, one for the MoE.
  kernel_calls = tuple(f"call @{f}(" for f in common.kernel_functions(hlo))
  for line in main.splitlines():
    if line.startswith("    %") and ("mosaic_gpu_v2" in line or any(c in line for c in kernel_calls)):
      raise AssertionError(f"a kernel outside shard_map: {line[:200]}")
  # (+ 1: the embedding lookup's fused site)
  assert main.count("sdy.manual_computation(") == GEMMS - 2 + 2 + 1 + 1  # shared expert (2 launches): in the MoE
  # Local shapes: one head of 64 per device (q / KV cache), the expert width 512 / 8.
  rows = f"{B}x1" if what == "decode" else f"{B}x{T}"
  assert f"tensor<{rows}x1x64xbf16>" in main
  if what == "decode":
    assert f"tensor<{B}x{CAPACITY}x1x64xbf16>" in main
  assert "tensor<8x128x64xbf16>" in main  # the gate/up experts' local shard
  # The shard_map'd program's own all-reduces: o and MLP down (layer 0), o and MoE (layer 1), and
  # the embedding lookup (D = 128: below the fused kernel's 256, each site is psum + norm).
  assert hlo.count('"stablehlo.all_reduce"(') == 2 * model.config.num_hidden_layers + 1


def test_tp8_xla_path_unchanged_and_kernel_path_collectives(reference_kernels):
  """kernels="xla" (and auto on CPU, where no kernel runs) lowers to the same program as before
  this feature: no kernel, one shard_map (the MoE), GSPMD's 2 all-reduces per layer + 1 (the
  vocab-sharded embedding lookup) after compiling. The kernel path (reference kernels under the
  same shard_maps, and the lookup's own shard_map) compiles to exactly the same all-reduces: 2
  per layer + 1, each B x D."""
  model = _sharded("tp", dict(tensor=8))
  L, D = model.config.num_hidden_layers, model.config.hidden_size

  def lowered(kernels):
    kernels_lib.set_kernels(model, kernels)
    fn, args = _decode_step(model)
    return jax.jit(fn).lower(*args)

  xla = lowered("xla")
  xla_text = xla.as_text()
  assert "mosaic_gpu" not in xla_text and xla_text.count("sdy.manual_computation(") == 1
  assert re.sub(r"@jit_\w+", "", lowered(None).as_text()) == re.sub(r"@jit_\w+", "", xla_text)
  with pallas_kernels.interpret():
    kernel = lowered("pallas")
  # One region per GEMM launch (the shared expert's two run inside the MoE's), per attention,
  # the MoE and the embedding lookup.
  assert kernel.as_text().count("sdy.manual_computation(") == GEMMS - 2 + 2 + 1 + 1
  for program in (xla, kernel):
    found = collectives(program.compile().as_text())
    assert len(found["all-reduce"]) == 2 * L + 1, "\n".join(found["all-reduce"])
    assert not any(found[op] for op in found if op != "all-reduce"), found
    for line in found["all-reduce"]:
      shape = re.search(r"=\s*\w+\[([\d,]*)\]", line).group(1)
      assert np.prod([int(d) for d in shape.split(",") if d]) == B * D, line


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
def test_kernels_at_tp8_shard_shapes_in_interpret_mode():
  """What each device runs in the TP8 model above: q projection (1 head), o projection (1-head
  slice of the contraction), the MoE on 8 experts of width 64, prefill attention over 1 q / 1 KV
  head, decode attention of 1 head over its cache shard; interpret mode against kernels="xla"."""
  from maverick import moe
  rng = np.random.default_rng(0)
  bf = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.5, jnp.bfloat16)
  x, wq, wo = bf(B, 1, 128), bf(128, 1, 64), bf(1, 64, 128)
  xo = bf(B, 1, 1, 64)
  xm, gate, up, down = bf(8, 128), bf(8, 128, 64), bf(8, 128, 64), bf(8, 64, 128)
  top = jnp.asarray(rng.integers(0, 8, (8, 1)), jnp.int32)
  scores = jnp.asarray(rng.uniform(0.2, 1, (8, 1)), jnp.bfloat16)
  q, k, v = bf(1, 80, 1, 64), bf(1, 80, 1, 64), bf(1, 80, 1, 64)
  qd, kc, vc = bf(B, 1, 1, 64), bf(B, CAPACITY, 1, 64), bf(B, CAPACITY, 1, 64)
  pos = jnp.asarray([[40], [77]], jnp.int32)
  calls = {
      "q": lambda kn: kernels_lib.linear("btd,dhk->bthk", x, wq, None, None, kn),
      "o": lambda kn: kernels_lib.linear("bthk,hkd->btd", xo, wo, None, None, kn),
      "moe": lambda kn: kernel_moe.moe_experts(xm, top, scores, gate, up, down, kn),
      "prefill": lambda kn: kernel_attention.prefill_attention(q, k, v, 64, kn),
      "decode": lambda kn: kernel_attention.cache_attention(qd, kc, vc, pos, 64, None, {}, kn)}
  refs = {
      "q": jnp.einsum("btd,dhk->bthk", x, wq), "o": jnp.einsum("bthk,hkd->btd", xo, wo),
      "moe": moe.moe_experts(xm, top, scores, gate, up, down, kernels="xla"),
      "prefill": model_lib.chunked_self_attention(q, k, v, 64),
      "decode": model_lib.attention(qd, kc, vc, model_lib.cache_mask(pos, CAPACITY, 64))}
  with pallas_kernels.interpret(detect_races=False):  # races: covered per kernel
    for name, call in calls.items():
      out = call("pallas")
      assert out is not None, f"{name}: the kernel does not take the shard shape"
      assert _rel(out, refs[name]) < 1e-2, name


@pytest.mark.parametrize("layout,mesh_kw,local", [
    ("tp", dict(tensor=8), dict(rows=B, heads=1)),
    ("ep", dict(expert=2, tensor=4), dict(rows=B // 2, heads=2))])
def test_paged_decode_kernel_gets_local_pools_and_table(monkeypatch, layout, mesh_kw, local):
  """A decode step on a paged cache (shuffled tables over a shared pool) with kernels="pallas":
  decode_attention_paged (its XLA reference, as above) gets the device's KV heads of the WHOLE
  pools (they have no row axis) and its rows of the block table, and the logits match the
  sharded XLA path (which gathers). Only the attention entry point is swapped: the other helpers
  stay on XLA (kernels="xla" for them)."""
  seen = []
  original = decode_attention.decode_attention_paged

  def ref(*args, **kw):
    seen.append(tuple(a.shape for a in args))
    return original(*args, **dict(kw, implementation="xla"))
  monkeypatch.setattr(decode_attention, "decode_attention_paged", ref)
  monkeypatch.setattr(multi_linear, "linear_many", lambda *a, **kw: None)
  for module, name, i in ((kernels_lib, "linear", 5), (kernel_moe, "moe_experts", 6)):
    monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _i=i, **kw:
                        _f(*a[:_i], "xla", *a[_i + 1:], **kw))  # [_i]: the kernels argument
  monkeypatch.setattr(kernels_lib, "fuses_residual_norm", lambda *a: False)
  model = _sharded(layout, mesh_kw)
  plan = sharding.plan_of(model)
  M, bs, N = 2, 64, 6
  cache = kvc.PagedKVCache.init(model.config, B, N, M, bs)
  rng = np.random.default_rng(3)
  fill = lambda xs: tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in xs)
  cache = dataclasses.replace(cache, k=fill(cache.k), v=fill(cache.v))
  cache = cache.with_tables(rng.permutation(N)[:B * M].reshape(B, 1, M))
  cache = sharding.constrain_cache(cache.with_lengths(jnp.array([100, 37], jnp.int32)), plan)
  tokens = jnp.asarray(rng.integers(0, 512, (B, 1)), jnp.int32)
  step = lambda: np.asarray(model_lib.apply(*nnx.split(model), tokens, cache=cache).logits,
                            np.float32)
  kernels_lib.set_kernels(model, "xla")
  ref_logits = step()
  assert not seen
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    out = step()
  r, h = local["rows"], local["heads"]
  assert set(seen) == {((r, 1, h, 64), (N, bs, h, 64), (N, bs, h, 64), (r, M), (r, 1))}, seen
  assert _rel(out, ref_logits) < 1e-2
