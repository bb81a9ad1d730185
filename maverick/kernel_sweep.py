"""Every kernel call Maverick and Scout make, as shapes: the sweep behind
tests/test_kernel_lowering_sweep.py and scripts/kernel_support.py.

A `Case` is one kernel call: the op, which of the model's calls it is (q, k, ..., experts gate/up,
prefill, decode T=3, tree; decode and tree also over a paged cache of 64-slot blocks), the
model, its tensor-parallel degree (heads, kv heads, FFN and expert widths, vocab divided by TP;
at least one kv head), the precision ("bf16": all BF16, weights as
declared, (K, N); "fp8": FP8 weights stored K-major with per-token activation quantization and an
FP8 KV cache; router and lm_head stay BF16 as `maverick.quant.DEFAULT_SKIP` says), the number of
tokens M and the architecture. `plan(case)` asks the op's resource planner; `lower(case)` lowers
the public op for that architecture on this host (pallas_kernels.lower_for_gpu).

`lowering_key(case)` says which cases lower to the same Mosaic GPU kernel: the planner's config
plus everything else that is static in the kernel body (dtypes, layouts, scales, out dtype, chunked
or not, tree words), and the shapes after padding to the config's tiles. `config_key(case)` drops
the shapes: what Mosaic checks when it lowers (SMEM, TMEM, barriers, layouts, swizzles, wgmma /
tcgen05 operand shapes) is a function of the tile config and dtypes, while the shapes only set
grid sizes, loop trip counts and TMA descriptors over GMEM (whose strides the planner's alignment
rules cover).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp

from maverick import config as config_lib
import pallas_kernels
from pallas_kernels import decode_attention, gemm, grouped_gemm, prefill_attention
from pallas_kernels.decode_attention import plan as da_plan
from pallas_kernels.gemm import plan as gemm_plan
from pallas_kernels.grouped_gemm import plan as gg_plan
from pallas_kernels.prefill_attention import plan as pa_plan

TOKENS = (1, 2, 4, 8, 16, 32, 64, 127, 128, 129, 256, 512, 768, 1000, 2048, 4096, 8192)
TPS = (1, 4, 8)
ARCHS = ("sm90", "sm100")
PRECISIONS = ("bf16", "fp8")
MODELS = ("maverick", "scout")
DECODE_QUERIES = (1, 2, 3, 4)  # decode (1) and EAGLE-3 chain verify (K + 1 queries)
TREE_NODES = 8  # tree verify: 8 query nodes over an 8-slot tree block
CHUNKED = (True, False)
PAGED_BLOCK = 64  # = maverick.serving.blocks.DEFAULT_BLOCK_SIZE  # RoPE layers attend within 8192-token chunks, NoPE layers globally

BF16 = jnp.dtype(jnp.bfloat16)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Case:
  op: str  # gemm | grouped_gemm | prefill_attention | decode_attention
  name: str  # which call of the model
  model: str
  tp: int
  precision: str
  m: int  # tokens
  arch: str
  # Op-specific static shape facts (a tuple of (key, value) pairs so the case hashes).
  params: tuple

  @property
  def p(self) -> dict:
    return dict(self.params)

  def describe(self) -> str:
    shape = " ".join(f"{k}={v}" for k, v in self.params)
    return (f"{self.op:17s} {self.arch:5s} {self.model:8s} tp{self.tp} {self.precision:4s} "
            f"{self.name:14s} M={self.m:<5d} {shape}")


def _dims(model: str, tp: int) -> dict:
  cfg = getattr(config_lib, model)()
  return dict(
      D=cfg.hidden_size, H=cfg.num_attention_heads // tp,
      KV=max(1, cfg.num_key_value_heads // tp), Dh=cfg.head_dim,
      F=cfg.intermediate_size // tp, F_mlp=cfg.intermediate_size_mlp // tp,
      V=cfg.vocab_size // tp, E=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
      dense=cfg.interleave_moe_layer_step > 1, chunk=cfg.attention_chunk_size)


def _gemm_calls(d: dict):
  """(name, N, K, quantized) per projection."""
  D, H, KV, Dh = d["D"], d["H"], d["KV"], d["Dh"]
  calls = [("q", H * Dh, D, True), ("k", KV * Dh, D, True), ("v", KV * Dh, D, True),
           ("o", D, H * Dh, True)]
  if d["dense"]:  # Scout has MoE in every layer: no dense MLP
    calls += [("mlp.gate", d["F_mlp"], D, True), ("mlp.up", d["F_mlp"], D, True),
              ("mlp.down", D, d["F_mlp"], True)]
  calls += [("shared.gate", d["F"], D, True), ("shared.up", d["F"], D, True),
            ("shared.down", D, d["F"], True), ("router", d["E"], D, False),
            ("lm_head", d["V"], D, False)]
  return calls


def cases(models: Iterable[str] = MODELS, archs: Iterable[str] = ARCHS,
          tps: Iterable[int] = TPS, precisions: Iterable[str] = PRECISIONS,
          tokens: Iterable[int] = TOKENS, ops: Iterable[str] | None = None) -> Iterator[Case]:
  tokens = tuple(tokens)
  for model, tp, precision, arch in itertools.product(models, tps, precisions, archs):
    d = _dims(model, tp)
    fp8 = precision == "fp8"
    out = []
    for m in tokens:
      for name, n, k, quantized in _gemm_calls(d):
        q = fp8 and quantized
        out.append(Case("gemm", name, model, tp, precision, m, arch, (
            ("n", n), ("k", k), ("dtype", "float8_e4m3fn" if q else "bfloat16"),
            ("layout", "nk" if q else "kn"))))
      for name, n, k in (("experts.gate_up", d["F"], d["D"]), ("experts.down", d["D"], d["F"])):
        out.append(Case("grouped_gemm", name, model, tp, precision, m, arch, (
            ("rows", m * d["top_k"]), ("experts", d["E"]), ("n", n), ("k", k),
            ("dtype", "float8_e4m3fn" if fp8 else "bfloat16"),
            ("swiglu", name == "experts.gate_up"))))
      for chunked in CHUNKED:
        out.append(Case("prefill_attention", "prefill" if chunked else "prefill.global", model,
                        tp, precision, m, arch, (
            ("heads", d["H"]), ("kv_heads", d["KV"]), ("head_dim", d["Dh"]),
            ("chunk", d["chunk"] if chunked else None))))
      # The cache holds the M-token context plus the new queries, in whole 64-slot blocks;
      # contiguous, or paged (pools of PAGED_BLOCK-slot blocks + a block table).
      for t, tree in [(t, False) for t in DECODE_QUERIES] + [(TREE_NODES, True)]:
        for block in (None, PAGED_BLOCK):
          name = f"tree T={t}" if tree else f"decode T={t}"
          out.append(Case("decode_attention", name if block is None else f"paged {name}", model,
                          tp, precision, m, arch, (
              ("queries", t), ("heads", d["H"]), ("kv_heads", d["KV"]), ("head_dim", d["Dh"]),
              ("cache", -(-(m + t) // 64) * 64),
              ("kv_dtype", "float8_e4m3fn" if fp8 else "bfloat16"),
              ("tree", t if tree else None), ("chunk", d["chunk"]), ("block", block))))
    yield from (c for c in out if ops is None or c.op in ops)


def plan(case: Case):
  """The op planner's Plan for the case."""
  p = case.p
  if case.op == "gemm":
    dt = jnp.dtype(p["dtype"])
    return gemm_plan.plan(case.m, p["n"], p["k"], dt, dt, w_layout=p["layout"], arch=case.arch)
  if case.op == "grouped_gemm":
    dt = jnp.dtype(p["dtype"])
    return gg_plan.plan(p["rows"], p["experts"], p["n"], p["k"], dt, dt, scaled=dt == FP8,
                        num_weights=2 if p["swiglu"] else 1,
                        w_layout="enk" if dt == FP8 else "ekn", arch=case.arch)
  if case.op == "prefill_attention":
    return pa_plan.plan(case.m, p["heads"], p["kv_heads"], p["head_dim"], arch=case.arch,
                        interpreting=False)
  return da_plan.plan(p["queries"], p["heads"], p["kv_heads"], p["head_dim"], p["cache"],
                      jnp.dtype(p["kv_dtype"]), tree_size=p["tree"], arch=case.arch,
                      interpreting=False, block_size=p["block"])


def _static(case: Case) -> tuple:
  """What, besides the config, is static in the kernel body."""
  p = case.p
  if case.op == "gemm":
    return (p["dtype"], p["layout"])
  if case.op == "grouped_gemm":
    return (p["dtype"], p["swiglu"])
  if case.op == "prefill_attention":
    return (p["head_dim"], p["heads"] // p["kv_heads"], p["chunk"] is not None)
  return (p["head_dim"], p["kv_dtype"], p["tree"] is not None, -(-(p["tree"] or 0) // 32),
          p["block"] is not None)


def config_key(case: Case, the_plan=None) -> tuple:
  """Cases with equal keys differ only in shapes that set grids and loop trip counts."""
  the_plan = the_plan or plan(case)
  return (case.op, case.arch, the_plan.config, _static(case))


def _padded(case: Case, the_plan) -> tuple:
  p, cfg = case.p, the_plan.config
  if case.op == "gemm":
    return (-(-case.m // cfg.cta_m) * cfg.cta_m, p["n"], p["k"])
  if case.op == "grouped_gemm":
    return (-(-p["rows"] // cfg.tile_m) * cfg.tile_m, p["experts"], p["n"], p["k"])
  if case.op == "prefill_attention":
    return (case.m, p["heads"], p["kv_heads"])
  return (p["queries"] * p["heads"] // p["kv_heads"], p["kv_heads"], p["cache"])


def lowering_key(case: Case, the_plan=None) -> tuple:
  """Cases with equal keys lower to the same kernel (config, static facts, padded shapes)."""
  the_plan = the_plan or plan(case)
  return config_key(case, the_plan) + (_padded(case, the_plan),)


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def lower(case: Case) -> str:
  """Lowers the op's public API with implementation="pallas" for case.arch (raises on failure)."""
  fn, args = call(case)
  return pallas_kernels.lower_for_gpu(fn, *args, arch=case.arch)


def call(case: Case):
  """(fn, args): the op's public API with implementation="pallas", and ShapeDtypeStructs (None
  where the call passes no array) for one call of the case."""
  p = case.p
  if case.op == "gemm":
    dt, n, k = jnp.dtype(p["dtype"]), p["n"], p["k"]
    w = _sds((n, k) if p["layout"] == "nk" else (k, n), dt)
    if dt == FP8:
      fn = lambda x, w, xs, ws: gemm.gemm(x, w, xs, ws, w_layout="nk", implementation="pallas")
      args = (_sds((case.m, k), dt), w, _sds((case.m,), F32), _sds((n,), F32))
    else:
      fn = lambda x, w: gemm.gemm(x, w, w_layout=p["layout"], implementation="pallas")
      args = (_sds((case.m, k), dt), w)
  elif case.op == "grouped_gemm":
    dt, a, e, n, k = jnp.dtype(p["dtype"]), p["rows"], p["experts"], p["n"], p["k"]
    fp8 = dt == FP8
    w = _sds((e, n, k) if fp8 else (e, k, n), dt)
    layout = "enk" if fp8 else "ekn"
    gs = _sds((e,), jnp.int32)
    scales = (_sds((a,), F32), _sds((e, n), F32)) if fp8 else (None, None)
    if p["swiglu"]:
      def fn(x, wg, wu, g, xs, ws):
        return grouped_gemm.grouped_swiglu(x, wg, wu, g, x_scale=xs, gate_scale=ws, up_scale=ws,
                                           w_layout=layout, implementation="pallas")
      args = (_sds((a, k), dt), w, w, gs, *scales)
    else:
      def fn(x, w, g, xs, ws):
        return grouped_gemm.grouped_matmul(x, w, g, x_scale=xs, w_scale=ws, w_layout=layout,
                                           implementation="pallas")
      args = (_sds((a, k), dt), w, gs, *scales)
  elif case.op == "prefill_attention":
    h, kv, dh = p["heads"], p["kv_heads"], p["head_dim"]
    fn = lambda q, k, v: prefill_attention.prefill_attention(
        q, k, v, chunk_size=p["chunk"], implementation="pallas")
    args = (_sds((1, case.m, h, dh), BF16), _sds((1, case.m, kv, dh), BF16),
            _sds((1, case.m, kv, dh), BF16))
  else:
    t, h, kv, dh, s = p["queries"], p["heads"], p["kv_heads"], p["head_dim"], p["cache"]
    kvd = jnp.dtype(p["kv_dtype"])
    r = p["tree"]

    bs = p["block"]
    kw = lambda ks, vs, ts, tp, tv: dict(
        chunk_size=p["chunk"], k_scale=ks, v_scale=vs, tree_start=ts, tree_positions=tp,
        tree_visible=tv, implementation="pallas")
    # Paged: one row's blocks, a pool of exactly as many (the kernel's shapes do not depend on N).
    lead = (1, s) if bs is None else (s // bs, bs)
    scales = (_sds(lead + (kv,), F32),) * 2 if kvd == FP8 else (None, None)
    tree = ((_sds((1,), jnp.int32), _sds((1, r), jnp.int32), _sds((1, t, r), jnp.bool_)) if r
            else (None, None, None))
    q_args = (_sds((1, t, h, dh), BF16), _sds(lead + (kv, dh), kvd), _sds(lead + (kv, dh), kvd))
    if bs is None:
      def fn(q, kc, vc, pos, *rest):
        return decode_attention.decode_attention(q, kc, vc, pos, **kw(*rest))
      args = (*q_args, _sds((1, t), jnp.int32), *scales, *tree)
    else:
      def fn(q, kc, vc, table, pos, *rest):
        return decode_attention.decode_attention_paged(q, kc, vc, table, pos, **kw(*rest))
      args = (*q_args, _sds((1, s // bs), jnp.int32), _sds((1, t), jnp.int32), *scales, *tree)
  return fn, args
