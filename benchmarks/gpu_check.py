"""One prepared GPU check: kernel correctness, kernel timings against the right baselines, and the
end-to-end decode step / EAGLE-3 round of a Maverick TP8-rank shard, in one command.

On a lent Hopper/Blackwell GPU (budgeted to finish in 10 minutes, compiles included):
  python benchmarks/gpu_check.py
writes benchmarks/results/<device>-gpu_check.json and .md (rewritten after every case, so a run
that is stopped still leaves its results). On any host, at toy sizes, in GPU interpret mode:
  python benchmarks/gpu_check.py --interpret --toy
(what CI runs; its timings are host wall-clock of the interpreter and say nothing about a GPU).

FP8 GEMM and grouped GEMM cases come in both activation modes: per-token x scales, and "static"
(one scalar x scale and one scalar w scale, for fused experts one for all experts, broadcast as
the model broadcasts them). The record command (README "Run NVIDIA's record checkpoints": a
ModelOpt FP8 checkpoint with static per-tensor scales) runs the static mode; the e2e shard below
is quantized with per-token scales.

Sections, each with its own time budget (a case that would start past it is recorded as skipped):
  kernels  every Pallas kernel vs its XLA reference at Maverick and Scout TP8-rank shard shapes
           (each rank holds 1/8 of the heads, KV heads, FFN / expert widths and vocabulary), bf16
           and FP8. A wrong result or a failure is recorded, never fatal.
  timings  the same cases timed against the baselines that matter: XLA's dot (cuBLASLt, FP8 with the
           scales as an XLA epilogue), JAX's reference Mosaic GPU kernels
           (jax.experimental.pallas.ops.gpu: hopper/blackwell matmul, ragged_dot_mgpu,
           attention_mgpu, where installed), cuDNN attention, and lax.ragged_dot as a footnote.
           Caches are cold: every timed call reads its own copy of the inputs, and the copies
           together are larger than twice the L2. Device time from CUPTI; fractions are of the
           datasheet peaks in PEAKS.
  e2e      a Maverick TP8-rank shard (every width / 8, all 48 layers, FP8 weights, random, built on
           the device): decode step and EAGLE-3 (K=3) round, kernels "auto" (the default: each
           kernel after its on-device self-check; the row counts the Mosaic calls the compiled
           program holds) and "xla", with the on-device loop flags of maverick.gpu_flags on (this
           process) and off (a child process of this script, run first, plain decode on XLA,
           because XLA reads its flags once at start-up), and the device-to-host copies inside one
           generate call counted from a jax.profiler trace of the very program generate() ran (a
           trace with no GPU activity is an error, not 0 copies).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# What the user started with, before maverick.gpu_flags adds to it: the flags-off child gets this.
_ORIGINAL_XLA_FLAGS = os.environ.get("XLA_FLAGS")

# Datasheet peaks (dense tensor-core math, no sparsity) and L2 sizes, by device kind.
PEAKS = {
    "H200": {"hbm_TBps": 4.8, "bf16_TFLOPs": 989.0, "fp8_TFLOPs": 1979.0, "l2_MB": 50},
    "B200": {"hbm_TBps": 8.0, "bf16_TFLOPs": 2250.0, "fp8_TFLOPs": 4500.0, "l2_MB": 126},
}
TP = 8  # tensor-parallel ranks of the shard shapes
GOALS = (
    ("decode_fp8_gemm", "decode FP8 GEMM >= 80% of HBM peak"),
    ("prefill_fp8_gemm", "prefill FP8 GEMM >= 1.0x the XLA FP8 dot"),
    ("grouped_gemm", "grouped GEMM >= 1.0x jax's ragged dot (ragged_dot_mgpu; "
     "blackwell_ragged_dot_mgpu on B200)"),
    ("decode_attention", "decode attention >= 70% of HBM peak at 8k context"),
    ("shard_decode_step", "TP8-rank shard decode step <= 0.8 ms"),
    ("zero_d2h", "zero device-to-host copies inside a generate call"),
)
SECTIONS = ("kernels", "timings", "e2e")
# The goal's baseline: jax's Mosaic GPU ragged dot for the GPU at hand (Hopper or Blackwell kernel).
GROUPED_BASELINE = "jax ragged dot (mgpu)"
NOT_MEASURED = "not measured"


def sanitize(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def peaks_for(device_kind: str) -> dict | None:
  for key, peaks in PEAKS.items():
    if key in device_kind.upper():
      return peaks
  return None


# ------------------------------------------------------------------------------------------------
# Results: one payload, written (JSON + Markdown) after every case.
# ------------------------------------------------------------------------------------------------
class Results:

  def __init__(self, out_dir: Path, device: str, payload: dict):
    self.json_path = out_dir / f"{device}-gpu_check.json"
    self.md_path = out_dir / f"{device}-gpu_check.md"
    self.payload = payload
    self.lock = threading.Lock()

  def write(self) -> None:
    with self.lock:
      self.payload["goals"] = evaluate_goals(self.payload)
      self.json_path.parent.mkdir(parents=True, exist_ok=True)
      for path, text in ((self.json_path, json.dumps(self.payload, indent=1, default=str)),
                         (self.md_path, render_markdown(self.payload))):
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
          f.write(text)
        os.replace(tmp, path)


class Budget:
  """Seconds left for a section, and for the whole run."""

  def __init__(self, seconds: float, parent: "Budget | None" = None):
    self.deadline = time.monotonic() + seconds
    if parent is not None:
      self.deadline = min(self.deadline, parent.deadline)

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def over(self) -> bool:
    return self.left() <= 0


# ------------------------------------------------------------------------------------------------
# Kernel cases at TP8-rank shard shapes.
# ------------------------------------------------------------------------------------------------
class Case:
  """One kernel call: `make()` -> device args; `kernel` / `reference` take them; `baselines` maps a
  name to (prepare(args) -> baseline args, fn). Baseline outputs are not checked (they may compute
  in another dtype); they are timed only."""

  def __init__(self, op, name, make, kernel, reference, baselines, flops, bytes_, dtype, tol,
               regime, goal=None):
    self.op, self.name, self.make = op, name, make
    self.kernel, self.reference, self.baselines = kernel, reference, baselines
    self.flops, self.bytes, self.dtype, self.tol = flops, bytes_, dtype, tol
    self.regime, self.goal = regime, goal
    self.args = None


def _same(args):
  return args


def _broadcast_scales(fn, shapes):
  """`fn` taking per-row / per-channel scales, called with scalars instead (its last
  len(shapes) args), broadcast inside the timed program as the model does for static per-tensor
  FP8 (a ModelOpt checkpoint's input_scale and weight_scale)."""
  import jax.numpy as jnp

  def wrapped(*args):
    head, scalars = args[:-len(shapes)], args[-len(shapes):]
    return fn(*head, *(jnp.broadcast_to(s, shape) for s, shape in zip(scalars, shapes)))
  return wrapped


def build_cases(toy: bool, arch: str | None) -> list[Case]:
  import functools

  import jax
  import jax.numpy as jnp

  from pallas_kernels import decode_attention as da_lib
  from pallas_kernels import gemm as gemm_lib
  from pallas_kernels import grouped_gemm as gg_lib
  from pallas_kernels import prefill_attention as pa_lib

  FP8, BF16 = jnp.float8_e4m3fn, jnp.bfloat16
  on_gpu = arch is not None
  mgpu = _jax_mgpu_ops(arch) if on_gpu else {}

  @functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
  def draw(key, shape, dtype, scale, kind):
    if kind == "normal":
      return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
    return jax.random.uniform(key, shape, jnp.float32, scale, 2 * scale).astype(dtype)

  seed = [0]

  def rnd(shape, dtype, scale=1.0, kind="normal"):
    seed[0] += 1
    return draw(jax.random.key(seed[0]), tuple(shape), jnp.dtype(dtype), scale, kind)

  # ---- dense GEMM: x [M, K] . w [N, K] (K-major, as the model stores FP8 weights) ----
  # static: FP8 with one scalar x scale and one scalar w scale (ModelOpt), broadcast per row /
  # per channel inside the timed program, as the model does; otherwise per-token x scales.
  def gemm_case(model, what, m, n, k, dtype, regime, static=False):
    fp8 = jnp.dtype(dtype) == jnp.dtype(FP8)
    scale_shapes = ((), ()) if static else ((m,), (n,))

    def make():
      x, w = rnd((m, k), dtype), rnd((n, k), dtype, 0.05)
      xs = rnd(scale_shapes[0], jnp.float32, 0.5, "uniform") if fp8 else None
      ws = rnd(scale_shapes[1], jnp.float32, 0.5, "uniform") if fp8 else None
      return (x, w, xs, ws)

    def call(impl):
      fn = lambda x, w, xs, ws: gemm_lib.gemm(x, w, xs, ws, out_dtype=BF16, implementation=impl)
      return _broadcast_scales(fn, ((m,), (n,))) if static else fn

    baselines = {("xla_fp8_dot_scaled (cuBLASLt)" if fp8 else "xla_bf16_dot (cuBLAS)"):
                 (_same, call("xla"))}
    if not fp8 and regime == "prefill" and "matmul" in mgpu:  # takes w as [K, N]; M % 128 == 0
      prep = lambda a: (a[0], a[1].T.copy())
      baselines[f"jax {mgpu['matmul_name']}"] = (prep, lambda x, wt: mgpu["matmul"](x, wt))
    item = jnp.dtype(dtype).itemsize
    goal = None
    if fp8 and regime == "decode":
      goal = "decode_fp8_gemm"
    elif fp8 and regime == "prefill":
      goal = "prefill_fp8_gemm"
    mode = " static" if static else ""
    return Case("gemm", f"{model} {regime} {what} {jnp.dtype(dtype).name}{mode} M={m} N={n} K={k}",
                make,
                call("pallas"), call("xla"), baselines, 2.0 * m * n * k,
                float((m + n) * k * item + m * n * 2 + (m + n) * 4 * fp8), jnp.dtype(dtype).name,
                2.0 ** -7, regime, goal)

  # ---- grouped GEMM (MoE experts): rows sorted by expert, group sizes on device ----
  def group_sizes(rows, groups, s):  # uneven expert loads (some experts empty), fixed seed
    import numpy as np
    rng = np.random.default_rng(s)
    ids = rng.choice(groups, size=rows, p=rng.dirichlet(np.full(groups, 0.5)))
    return np.bincount(ids, minlength=groups).astype(np.int32)

  def grouped_case(model, what, rows, groups, d, f, dtype, regime, static=False):
    fp8 = jnp.dtype(dtype) == jnp.dtype(FP8)
    layout = "enk" if fp8 else "ekn"  # FP8 experts stored K-major; bf16 as declared
    swiglu = what == "swiglu(gate, up)"
    k, n = (d, f) if swiglu else (f, d)
    wshape = (groups, n, k) if fp8 else (groups, k, n)
    sizes = group_sizes(rows, groups, rows + groups)
    used = int((sizes > 0).sum())  # only these experts' weights have to be read

    def make():
      g = jnp.asarray(sizes)
      x = rnd((rows, k), dtype)
      ws = [rnd(wshape, dtype, 0.05) for _ in range(2 if swiglu else 1)]
      if not fp8:
        return (x, *ws, g)
      if static:  # one x scale; one w scale for all experts (gate and up: one each)
        return (x, *ws, g, *[rnd((), jnp.float32, 0.01, "uniform") for _ in range(1 + len(ws))])
      xs = rnd((rows,), jnp.float32, 0.5, "uniform")
      return (x, *ws, g, xs, *[rnd((groups, n), jnp.float32, 0.01, "uniform") for _ in ws])

    def call(impl):
      if swiglu:
        def fn(x, wg, wu, g, *s):
          kw = dict(x_scale=s[0], gate_scale=s[1], up_scale=s[2]) if s else {}
          return gg_lib.grouped_swiglu(x, wg, wu, g, **kw, w_layout=layout, out_dtype=BF16,
                                       implementation=impl)
      else:
        def fn(x, w, g, *s):
          kw = dict(x_scale=s[0], w_scale=s[1]) if s else {}
          return gg_lib.grouped_matmul(x, w, g, **kw, w_layout=layout, out_dtype=BF16,
                                       implementation=impl)
      return fn

    def ragged(dot):  # the same math from a plain ragged dot per weight, scales and SwiGLU in XLA
      def fn(x, *rest):
        nw = 2 if swiglu else 1
        ws, g, s = rest[:nw], rest[nw], rest[nw + 1:]
        outs = [dot(x, w, g).astype(jnp.float32) for w in ws]
        if s:
          rows_group = jnp.repeat(jnp.arange(groups), g, total_repeat_length=rows)
          outs = [o * s[0][:, None] * ws_[rows_group] for o, ws_ in zip(outs, s[1:])]
        out = jax.nn.silu(outs[0]) * outs[1] if swiglu else outs[0]
        return out.astype(BF16)
      return fn

    def lax_dot(x, w, g):
      w_kn = jnp.swapaxes(w, 1, 2) if fp8 else w
      return jax.lax.ragged_dot(x, w_kn, g, preferred_element_type=jnp.float32)

    baselines = {"xla reference": (_same, call("xla"))}
    if "ragged_dot" in mgpu:
      prep = _same
      if fp8 and mgpu.get("ragged_dot_needs_ekn"):
        nw_ = 2 if swiglu else 1
        prep = lambda a: (a[0], *[jnp.swapaxes(w, 1, 2).copy() for w in a[1:1 + nw_]],
                          *a[1 + nw_:])
      transpose = fp8 and not mgpu.get("ragged_dot_needs_ekn")
      baselines[GROUPED_BASELINE] = (prep, ragged(
          lambda x, w, g: mgpu["ragged_dot"](x, w, g, transpose_rhs=transpose)))
    baselines["lax.ragged_dot (footnote)"] = (_same, ragged(lax_dot))
    item = jnp.dtype(dtype).itemsize
    nw = 2 if swiglu else 1
    kernel, reference = call("pallas"), call("xla")
    if static:
      shapes = ((rows,),) + ((groups, n),) * nw
      kernel, reference = _broadcast_scales(kernel, shapes), _broadcast_scales(reference, shapes)
      baselines = {name: (prep, _broadcast_scales(fn, shapes))
                   for name, (prep, fn) in baselines.items()}
    mode = " static" if static else ""
    return Case("grouped_gemm", f"{model} {regime} {jnp.dtype(dtype).name}{mode} {what} A={rows} "
                f"E={groups} K={k} N={n}", make, kernel, reference, baselines,
                2.0 * nw * rows * n * k,
                float(nw * used * n * k * item + rows * k * item + rows * n * 2),
                jnp.dtype(dtype).name,
                2e-2, regime, "grouped_gemm")

  # ---- prefill attention (causal; chunked = global when chunk >= T) ----
  def prefill_case(model, b, t, h, kv, dh, chunk):
    def make():
      return (rnd((b, t, h, dh), BF16), rnd((b, t, kv, dh), BF16), rnd((b, t, kv, dh), BF16),
              jnp.full((b,), t, jnp.int32))

    def call(impl):
      return lambda q, k, v, n: pa_lib.prefill_attention(q, k, v, lengths=n, chunk_size=chunk,
                                                         implementation=impl)

    baselines = {}
    if on_gpu:
      baselines["cudnn causal"] = (_same, lambda q, k, v, n: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn"))
      if "attention" in mgpu:  # its softmax path is f16-only here; f16 and bf16 MMAs cost the same
        to_f16 = lambda a: tuple(x.astype(jnp.float16) for x in a[:3])
        baselines["jax attention_mgpu (f16)"] = (to_f16, mgpu["attention"])
    c = chunk or t
    full, rest = divmod(t, c)
    pairs = full * c * (c + 1) // 2 + rest * (rest + 1) // 2
    return Case("prefill_attention", f"{model} prefill B={b} T={t} H={h} K={kv} Dh={dh} "
                f"{'chunk=' + str(chunk) if chunk else 'global'}", make, call("pallas"),
                call("xla"), baselines, 4.0 * b * h * dh * pairs,
                2.0 * (2 * b * t * h * dh + 2 * b * t * kv * dh), "bfloat16", 2e-2, "prefill")

  # ---- decode / verify attention over a KV cache ----
  def decode_case(model, b, t, h, kv, dh, s, fp8):
    def make():
      q = rnd((b, t, h, dh), BF16)
      k, v = rnd((b, s, kv, dh), BF16), rnd((b, s, kv, dh), BF16)
      pos = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32), (b, t))
      if not fp8:
        return (q, k, v, pos)
      return (q, k.astype(FP8), v.astype(FP8), pos,
              rnd((b, s, kv), jnp.float32, 0.01, "uniform"),
              rnd((b, s, kv), jnp.float32, 0.01, "uniform"))

    def call(impl):
      def fn(q, k, v, pos, *sc):
        return da_lib.decode_attention(q, k, v, pos, **dict(zip(("k_scale", "v_scale"), sc)),
                                       implementation=impl)
      return fn

    baselines = {}
    if on_gpu and not fp8:
      baselines["cudnn"] = (_same, lambda q, k, v, pos: jax.nn.dot_product_attention(
          q, k, v, key_value_seq_lengths=jnp.max(pos, axis=1) + 1, implementation="cudnn"))
    kv_bytes = 2 * b * s * kv * dh * (1 if fp8 else 2) + (2 * b * s * kv * 4 if fp8 else 0)
    return Case("decode_attention", f"{model} {'verify' if t > 1 else 'decode'} B={b} T={t} H={h} "
                f"K={kv} Dh={dh} ctx={s} {'fp8' if fp8 else 'bf16'} KV", make, call("pallas"),
                call("xla"), baselines, 4.0 * b * t * h * s * dh, float(kv_bytes),
                "fp8" if fp8 else "bfloat16", 2e-2, "decode",
                "decode_attention" if s == 8192 else None)

  if toy:  # the op benches' toy shapes: known to fit the kernels, fast in interpret mode
    per_op = [
        [gemm_case("toy", "proj", 5, 128, 256, FP8, "decode"),
         gemm_case("toy", "proj", 5, 128, 256, FP8, "decode", static=True)],
        [grouped_case("toy", "down", 40, 4, 128, 128, FP8, "prefill"),
         grouped_case("toy", "down", 40, 4, 128, 128, FP8, "prefill", static=True)],
        [prefill_case("toy", 1, 64, 2, 2, 128, None)],
        [decode_case("toy", 1, 4, 4, 1, 64, 128, True)],
    ]
  else:
    D, H, KV, DH = 5120, 40 // TP, 8 // TP, 128
    F_DENSE, F_EXPERT, V = 16384 // TP, 8192 // TP, 202048 // TP
    per_op = [
        [gemm_case("maverick", "mlp gate/up", 16, F_DENSE, D, FP8, "decode"),
         gemm_case("maverick", "mlp gate/up", 16, F_DENSE, D, FP8, "decode", static=True),
         gemm_case("maverick", "mlp down", 16, D, F_DENSE, FP8, "decode"),
         gemm_case("maverick", "q proj", 16, H * DH, D, FP8, "decode"),
         gemm_case("maverick", "prefill mlp gate/up", 8192, F_DENSE, D, FP8, "prefill"),
         gemm_case("maverick", "prefill mlp gate/up", 8192, F_DENSE, D, FP8, "prefill",
                   static=True),
         gemm_case("maverick", "prefill mlp down", 8192, D, F_DENSE, FP8, "prefill"),
         gemm_case("maverick", "mlp gate/up", 16, F_DENSE, D, BF16, "decode"),
         gemm_case("maverick", "prefill mlp gate/up", 8192, F_DENSE, D, BF16, "prefill"),
         gemm_case("maverick/scout", "lm_head", 16, V, D, BF16, "decode")],
        [grouped_case("maverick", "swiglu(gate, up)", 16, 128, D, F_EXPERT, FP8, "decode"),
         grouped_case("maverick", "swiglu(gate, up)", 16, 128, D, F_EXPERT, FP8, "decode",
                      static=True),
         grouped_case("maverick", "down", 16, 128, D, F_EXPERT, FP8, "decode"),
         grouped_case("maverick", "swiglu(gate, up)", 8192, 128, D, F_EXPERT, FP8, "prefill"),
         grouped_case("scout", "swiglu(gate, up)", 16, 16, D, F_EXPERT, FP8, "decode"),
         grouped_case("maverick", "down", 8192, 128, D, F_EXPERT, FP8, "prefill"),
         grouped_case("scout", "swiglu(gate, up)", 8192, 16, D, F_EXPERT, FP8, "prefill"),
         grouped_case("maverick", "swiglu(gate, up)", 8192, 128, D, F_EXPERT, BF16, "prefill")],
        [prefill_case("maverick/scout", 1, 8192, H, KV, DH, 8192),
         prefill_case("maverick/scout", 1, 2048, H, KV, DH, None)],
        [decode_case("maverick/scout", 16, 1, H, KV, DH, 8192, False),
         decode_case("maverick/scout", 16, 1, H, KV, DH, 8192, True),
         decode_case("maverick/scout", 16, 4, H, KV, DH, 8192, False),
         decode_case("maverick/scout", 16, 1, H, KV, DH, 131072, False)],
    ]
  # Round robin over ops: when a budget runs out, every op has had its most important cases.
  cases = []
  for i in range(max(len(c) for c in per_op)):
    cases += [c[i] for c in per_op if i < len(c)]
  return cases


def _jax_mgpu_ops(arch: str) -> dict:
  """JAX's own Mosaic GPU kernels (jax.experimental.pallas.ops.gpu), where this jax has them."""
  import importlib
  ops = {}

  def load(name):
    try:
      return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
    except Exception:  # missing in this jax version, or failing to import: skip that baseline
      return None

  if arch == "sm90" and (mod := load("hopper_matmul_mgpu")):
    cfg = mod.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
    ops["matmul"] = lambda a, b, mod=mod, cfg=cfg: mod.matmul(a, b, None, cfg)  # bind now
    ops["matmul_name"] = "hopper_matmul_mgpu"
  if arch == "sm100" and (mod := load("blackwell_matmul_mgpu")):
    cfg = mod.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                           collective=False)
    ops["matmul"] = lambda a, b, mod=mod, cfg=cfg: mod.matmul_kernel(a, b, cfg)
    ops["matmul_name"] = "blackwell_matmul_mgpu"
  if arch == "sm90" and (mod := load("ragged_dot_mgpu")):
    ops["ragged_dot"] = lambda x, w, g, transpose_rhs, mod=mod: mod.ragged_dot(
        x, w, group_sizes=g, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4,
        grid_block_n=1, transpose_rhs=transpose_rhs)
    ops["ragged_dot_name"] = "ragged_dot_mgpu"
  if arch == "sm100" and (mod := load("blackwell_ragged_dot_mgpu")):
    # Takes w as [E, K, N] only: K-major (FP8) weights are transposed outside the timed call.
    cfg = mod.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                           collective=False, grid_tile_width=1,
                           grid_minor_dim=mod.blackwell_matmul_mgpu.MatmulDimension.M)
    ops["ragged_dot"] = lambda x, w, g, transpose_rhs, mod=mod, cfg=cfg: mod.ragged_dot_kernel(
        x, w, g, cfg)
    ops["ragged_dot_name"] = "blackwell_ragged_dot_mgpu"
    ops["ragged_dot_needs_ekn"] = True
  if arch == "sm90" and (mod := load("attention_mgpu")):
    cfg = mod.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    ops["attention"] = lambda q, k, v, mod=mod, cfg=cfg: mod.attention(q, k, v, cfg)
  return ops


# ------------------------------------------------------------------------------------------------
# Sections a and b.
# ------------------------------------------------------------------------------------------------
def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e)[:300]}"


def check_case(case: Case, interpret: bool) -> dict:
  import jax
  import jax.numpy as jnp

  import pallas_kernels
  row = {"op": case.op, "case": case.name, "dtype": case.dtype, "tol": case.tol}
  try:
    if case.args is None:
      case.args = case.make()

    @jax.jit
    def err(out, ref):  # on the device: no large host copies
      out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
      return jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)

    ref = jax.jit(case.reference)(*case.args)
    if interpret:
      with pallas_kernels.interpret(detect_races=False):
        out = jax.jit(case.kernel)(*case.args)
    else:
      out = jax.jit(case.kernel)(*case.args)
    rel = float(err(out, ref))
    row.update(rel_error=rel, correct=bool(rel <= case.tol), status="ok")
  except pallas_kernels.KernelInputError as e:
    row.update(correct=None, status=f"unsupported: {_error(e)}")
  except Exception as e:  # recorded, not fatal
    row.update(correct=False, status=f"failed: {_error(e)}")
  return row


def _copies(args, case_bytes: float, l2_bytes: float):
  """Enough copies of the inputs that cycling through them defeats the L2 (> 2x L2 in total)."""
  import jax
  n = int(min(32, max(2, math.ceil(2 * l2_bytes / max(case_bytes, 1.0)) + 1)))
  n = max(2, min(n, int(8e9 // max(case_bytes, 1.0))))  # at most ~8 GB of copies
  return [args] + [jax.tree.map(lambda a: a.copy(), args) for _ in range(n - 1)]  # None: no leaf


def time_fn(fn, copies, on_gpu: bool, iters: int, interpret: bool) -> float:
  """Milliseconds per call, each call on its own copy of the inputs (cold L2)."""
  import jax

  import pallas_kernels
  rotate = jax.jit(lambda cs: tuple(fn(*c) for c in cs))

  def run():
    return jax.block_until_ready(rotate(copies))

  if interpret:
    with pallas_kernels.interpret(detect_races=False):
      run()  # trace + compile inside the interpret context
      ts = []
      for _ in range(iters):
        t = time.perf_counter()
        run()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts) / len(copies)
  run()  # compile (and XLA autotuning) outside the measurement
  if on_gpu:
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(rotate, iterations=iters)(copies)
    if runs is None:
      raise RuntimeError("CUPTI recorded no kernel for this function")
    runs = runs if isinstance(runs, list) else [runs]
    return statistics.median(runs) / len(copies)
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    run()
    ts.append((time.perf_counter() - t) * 1e3)
  return statistics.median(ts) / len(copies)


def time_case(case: Case, on_gpu: bool, iters: int, interpret: bool, peaks: dict | None,
              budget: Budget) -> dict:
  row = {"op": case.op, "case": case.name, "dtype": case.dtype, "flops": case.flops,
         "bytes": case.bytes, "regime": case.regime, "goal": case.goal, "baselines_us": {},
         "speedup": {}}
  try:
    if case.args is None:
      case.args = case.make()
    l2 = (peaks or {}).get("l2_MB", 128) * 1e6
    # Interpret mode has no cache to flush, and every copy is one more interpreted call.
    copies = [case.args, case.args] if interpret else _copies(case.args, case.bytes, l2)
    row["input_copies"] = len(copies)
    ms = time_fn(case.kernel, copies, on_gpu, iters, interpret)
    row.update(time_us=ms * 1e3, TFLOPs=case.flops / ms / 1e9, GBps=case.bytes / ms / 1e6,
               status="ok")
    if peaks and not interpret:
      flops_peak = peaks["fp8_TFLOPs" if case.dtype == "float8_e4m3fn" else "bf16_TFLOPs"]
      row["hbm_peak_fraction"] = row["GBps"] / (peaks["hbm_TBps"] * 1e3)
      row["tensor_peak_fraction"] = row["TFLOPs"] / flops_peak
    for name, (prep, fn) in case.baselines.items():
      if budget.over():
        row["baselines_us"][name] = "skipped: over the section's time budget"
        continue
      try:
        b_copies = [prep(c) for c in copies]
        b_ms = time_fn(fn, b_copies, on_gpu, iters, False)
      except Exception as e:
        row["baselines_us"][name] = f"unavailable: {_error(e)}"
        continue
      row["baselines_us"][name] = b_ms * 1e3
      row["speedup"][name] = b_ms / ms
    del copies
  except Exception as e:
    kind = "unsupported" if type(e).__name__ == "KernelInputError" else "failed"
    row["status"] = f"{kind}: {_error(e)}"
  return row


# ------------------------------------------------------------------------------------------------
# Section c: end to end.
# ------------------------------------------------------------------------------------------------
def shard_config(toy: bool):
  """Maverick with every width divided by TP (one TP8 rank's shard), FP8 weights; or, for --toy,
  the small test model with FP8 weights."""
  from maverick import config as config_lib
  from maverick.quant import QuantConfig
  if toy:
    return config_lib.tiny("bfloat16").replace(  # 4 layers: 2 MoE, 1 NoPE, fewer to compile
        num_hidden_layers=4, no_rope_layers=None, moe_layers=None, layer_types=None,
        quant=QuantConfig())
  cfg = config_lib.maverick()
  return cfg.replace(num_attention_heads=cfg.num_attention_heads // TP,
                     num_key_value_heads=max(1, cfg.num_key_value_heads // TP),
                     intermediate_size=cfg.intermediate_size // TP,
                     intermediate_size_mlp=cfg.intermediate_size_mlp // TP,
                     vocab_size=cfg.vocab_size // TP, quant=QuantConfig())


def run_e2e(toy: bool, interpret: bool, kernels_list, modes, budget: Budget, loop_flags: str,
            batch: int, on_gpu: bool, emit) -> None:
  """Appends one row per (kernels, plain/spec) to the results through `emit(row)`."""
  import jax
  from flax import nnx

  from maverick import generation as plain
  from maverick import kernels as kernels_lib
  from maverick import model as model_lib
  from maverick import profiling
  from maverick import sharding
  import spec_decode
  from spec_decode import speculative
  from spec_decode.draft import Eagle3Config, init_draft

  t0 = time.perf_counter()
  try:
    cfg = shard_config(toy)
    model = model_lib.init_model(cfg, seed=0)  # jax.random on the device: no host copies
    draft = init_draft(Eagle3Config.for_target(cfg), seed=1)
    jax.block_until_ready((nnx.state(model), nnx.state(draft)))
  except Exception as e:  # recorded, not fatal
    emit({"mode": ",".join(modes), "kernels": ",".join(kernels_list), "loop_flags": loop_flags,
          "status": f"failed building the model: {_error(e)}"})
    return
  init_s = time.perf_counter() - t0
  n_bytes = sum(v.nbytes for _, v in nnx.to_flat_state(nnx.state(model)))
  prompt_len, long_new, short_new = 16, 64, 33  # 64 and 33 share the step bucket (64): one compile
  prompts = [[(7 * i + j) % cfg.vocab_size for j in range(prompt_len)] for i in range(batch)]
  base = {"config": "toy (tiny + FP8)" if toy else "maverick TP8-rank shard, FP8 weights",
          "layers": cfg.num_hidden_layers, "param_GB": n_bytes / 1e9, "init_s": init_s,
          "batch": batch, "prompt_len": prompt_len, "loop_flags": loop_flags}

  def timed(call, new_tokens, reps):
    outs = [call(new_tokens) for _ in range(reps)]
    return statistics.median(o.run_seconds for o in outs), outs[-1]

  def count_d2h(exe, args) -> int | str:
    if not on_gpu:
      return NOT_MEASURED + " (no GPU)"
    try:  # a profiler failure must not cost the row its timings
      jax.block_until_ready(exe(*args))
      with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
          jax.block_until_ready(exe(*args))  # the executable only: not the fetch of the results
        files = [p for p in profiling.trace_files(d) if p.name.endswith(".xplane.pb")]
        if not files:
          return f"{NOT_MEASURED}: no trace file written"
        # Raises when the trace holds no GPU activity at all: 0 copies must mean 0, not "unseen".
        return profiling.count_device_to_host(files[0], require_device_activity=True)
    except Exception as e:
      return f"{NOT_MEASURED}: {_error(e)}"

  # In the order given (XLA first by default: its compiles are the quick ones), plain decode (the
  # step-time and zero-copy goals) before the speculative round.
  for kernels in kernels_list:
    for mode in modes:
      row = dict(base, kernels=kernels, mode=mode)
      if budget.over():
        row["status"] = "skipped: over the section's time budget"
        emit(row)
        continue
      try:
        switch = None if kernels == "auto" else kernels
        kernels_lib.set_kernels(model, switch)
        kernels_lib.set_kernels(draft, switch)
        if mode == "plain":
          build = lambda n: plain.program(model, prompts, max_new_tokens=n, stop_tokens=[])
          call = lambda n: plain.generate(model, prompts, max_new_tokens=n, stop_tokens=[])
        else:
          build = lambda n: speculative.program(model, draft, prompts, k=3, max_new_tokens=n,
                                                stop_tokens=[])
          call = lambda n: spec_decode.generate(model, draft, prompts, k=3, max_new_tokens=n,
                                                stop_tokens=[])
        first = call(long_new)
        row["compile_s"] = first.compile_seconds
        reps = 3
        t_long, g_long = timed(call, long_new, reps)
        t_short, g_short = timed(call, short_new, reps)
        if mode == "plain":
          steps = (long_new - 1) - (short_new - 1)  # loop iterations: one token each
          row["loop_iterations"] = long_new - 1
        else:
          steps = int(g_long.rounds.max()) - int(g_short.rounds.max())
          row["loop_iterations"] = int(g_long.rounds.max())
          row["acceptance_length"] = g_long.acceptance_length
        per = (t_long - t_short) / max(steps, 1) * 1e3
        row["per_step_ms" if mode == "plain" else "per_round_ms"] = per
        row["tokens_per_s"] = float(g_long.num_tokens.sum()) / t_long
        row["decode_tokens_per_s"] = batch * (1 if mode == "plain" else
                                              g_long.acceptance_length) / (per / 1e3)
        # The very program generate() ran for the long call (cached: no compile here).
        exe, args, _ = build(long_new)
        row["mosaic_kernel_calls"] = _count_mosaic_calls(exe)
        row["d2h_copies_per_call"] = count_d2h(exe, args)
        row["status"] = "ok"
      except Exception as e:
        row["status"] = f"failed: {_error(e)}"
        row["traceback"] = traceback.format_exc()[-1500:]
      emit(row)


def _count_mosaic_calls(exe) -> int | str:
  """Mosaic GPU custom calls in a compiled program: which kernels the model dispatched."""
  try:
    return len(re.findall(r'custom_call_target="mosaic_gpu', exe.as_text()))
  except Exception as e:  # an executable without HLO text (a deserialized one): say so
    return f"unknown: {_error(e)}"


# ------------------------------------------------------------------------------------------------
# Goals and the Markdown report.
# ------------------------------------------------------------------------------------------------
def evaluate_goals(p: dict) -> list[dict]:
  gpu = not p.get("interpret")
  timings = [r for r in p.get("timings", []) if r.get("status") == "ok"]
  e2e = [r for r in p.get("e2e", []) if r.get("status") == "ok"]
  out = []

  def add(key, text, measured, target, met):
    out.append({"goal": key, "text": text, "measured": measured, "target": target, "met": met})

  def worst(rows, value):
    vals = [(value(r), r["case"]) for r in rows if value(r) is not None]
    return min(vals) if vals else None

  for key, text in GOALS:
    if not gpu:
      add(key, text, NOT_MEASURED + " (no GPU: interpret mode)", None, None)
      continue
    if key == "decode_fp8_gemm":
      w = worst([r for r in timings if r["goal"] == key], lambda r: r.get("hbm_peak_fraction"))
      add(key, text, NOT_MEASURED if w is None else f"worst {w[0]:.1%} ({w[1]})", 0.8,
          None if w is None else w[0] >= 0.8)
    elif key in ("prefill_fp8_gemm", "grouped_gemm"):
      base = "xla_fp8_dot_scaled (cuBLASLt)" if key == "prefill_fp8_gemm" else GROUPED_BASELINE
      w = worst([r for r in timings if r["goal"] == key], lambda r: r["speedup"].get(base))
      add(key, text, NOT_MEASURED if w is None else f"worst {w[0]:.2f}x ({w[1]})", 1.0,
          None if w is None else w[0] >= 1.0)
    elif key == "decode_attention":
      w = worst([r for r in timings if r["goal"] == key], lambda r: r.get("hbm_peak_fraction"))
      add(key, text, NOT_MEASURED if w is None else f"worst {w[0]:.1%} ({w[1]})", 0.7,
          None if w is None else w[0] >= 0.7)
    elif key == "shard_decode_step":
      rows = [r for r in e2e if r["mode"] == "plain" and r["loop_flags"] == "on"
              and r.get("per_step_ms") is not None]
      best = min(rows, key=lambda r: r["per_step_ms"]) if rows else None
      add(key, text, NOT_MEASURED if best is None else
          f"{best['per_step_ms']:.3f} ms (kernels={best['kernels']}, batch {best['batch']})", 0.8,
          None if best is None else best["per_step_ms"] <= 0.8)
    elif key == "zero_d2h":
      rows = [r for r in e2e if r["loop_flags"] == "on"
              and isinstance(r.get("d2h_copies_per_call"), int)]
      add(key, text, NOT_MEASURED if not rows else ", ".join(
          f"{r['mode']}/{r['kernels']}: {r['d2h_copies_per_call']}" for r in rows), 0,
          None if not rows else all(r["d2h_copies_per_call"] == 0 for r in rows))
  return out


def _fmt(v, spec=".1f"):
  if isinstance(v, float):
    return format(v, spec)
  return "-" if v is None else str(v)


def render_markdown(p: dict) -> str:
  lines = [f"# GPU check: {p['device_kind']}", "",
           f"`{p['command']}` | jax {p['jax']} | {p['timing']}", "",
           f"Loop flags ({p['loop_flags']['status']}): `{p['loop_flags']['xla_flags']}`", "",
           "Section wall times (s, compiles included): " + (", ".join(
               f"{k} {v:.0f}" for k, v in p.get("section_s", {}).items()) or "-")
           + (f"; whole run {p['wall_s']:.0f}" if "wall_s" in p else ""), "",
           "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
  for g in p.get("goals", []):
    met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
    lines.append(f"| {g['text']} | {g['measured']} | {met} |")
  lines += ["", "## Kernel correctness (Pallas vs XLA reference)", "",
            "| op | case | rel. error | tol | result |", "|---|---|---|---|---|"]
  for r in p.get("kernels", []):
    res = {True: "ok", False: "**WRONG**", None: "-"}[r.get("correct")]
    if not str(r.get("status", "")).startswith("ok"):
      res = r.get("status")
    lines.append(f"| {r['op']} | {r['case']} | {_fmt(r.get('rel_error'), '.1e')} | "
                 f"{_fmt(r.get('tol'), '.1e')} | {res} |")
  lines += ["", "## Kernel timings (cold L2, per call)", "",
            "| op | case | us | TFLOP/s | GB/s | % HBM peak | % tensor peak | baselines (us, speed-up) |",
            "|---|---|---|---|---|---|---|---|"]
  for r in p.get("timings", []):
    if r.get("status") != "ok":
      lines.append(f"| {r['op']} | {r['case']} | {r.get('status')} | | | | | |")
      continue
    base = "; ".join(
        f"{k}: {_fmt(v)}" + (f" ({r['speedup'][k]:.2f}x)" if k in r["speedup"] else "")
        for k, v in r["baselines_us"].items())
    lines.append(f"| {r['op']} | {r['case']} | {_fmt(r['time_us'])} | {_fmt(r['TFLOPs'])} | "
                 f"{_fmt(r['GBps'], '.0f')} | {_fmt(r.get('hbm_peak_fraction'), '.1%')} | "
                 f"{_fmt(r.get('tensor_peak_fraction'), '.1%')} | {base} |")
  lines += ["", "Speed-up = baseline time / Pallas time. lax.ragged_dot is a footnote only (not a "
            "goal baseline).", "", "## End to end", "",
            "| mode | kernels | loop flags | batch | per step/round ms | tokens/s | D2H copies per "
            "call | loop iterations | compile s | status |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in p.get("e2e", []):
    per = r.get("per_step_ms", r.get("per_round_ms"))
    lines.append(f"| {r.get('mode')} | {r.get('kernels')} | {r.get('loop_flags')} | "
                 f"{r.get('batch')} | {_fmt(per, '.3f')} | {_fmt(r.get('tokens_per_s'))} | "
                 f"{_fmt(r.get('d2h_copies_per_call'))} | {_fmt(r.get('loop_iterations'))} | "
                 f"{_fmt(r.get('compile_s'))} | {str(r.get('status'))[:120]} |")
  lines += ["", "## Notes", ""] + [f"- {n}" for n in p.get("notes", [])]
  return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Entry point.
# ------------------------------------------------------------------------------------------------
def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--interpret", action="store_true", help="kernels in GPU interpret mode (any host)")
  ap.add_argument("--toy", action="store_true", help="tiny shapes and a tiny model")
  ap.add_argument("--sections", default=",".join(SECTIONS), help=f"of {SECTIONS}")
  ap.add_argument("--budget_s", type=float, default=510.0,
                  help="whole run, compiles included (a watchdog writes the results and exits 20 s "
                  "past it)")
  ap.add_argument("--iters", type=int, default=None, help="timed runs per function (median)")
  ap.add_argument("--batch", type=int, default=1, help="e2e batch")
  ap.add_argument("--e2e_kernels", default=None,
                  help="comma list, run in this order, of xla, auto (the default path: kernels "
                  "that pass their on-device self-check) and pallas (default xla,auto; toy: xla)")
  ap.add_argument("--e2e_modes", default="plain,spec", help="plain (decode step) and/or spec "
                  "(EAGLE-3 K=3 round)")
  ap.add_argument("--no_flags_off", action="store_true", help="skip the flags-off child run")
  ap.add_argument("--out_dir", default=str(ROOT / "benchmarks" / "results"))
  # An e2e child process: where it writes its rows, and the loop flags it runs with.
  ap.add_argument("--child_out", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--child_flags", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
  return ap.parse_args(argv)


# Share of the whole budget per section, in the order they run (the timings get what is left).
# Measured on an H200 (2026-12-04, jax 0.11.2): a child building the 48-layer shard takes 25 s,
# the XLA decode program compiles in 46 s, and the flags-off child's one row took 87 s in all;
# with the kernels ("auto"), the plain decode program had not finished compiling after 420 s, so
# the flags-on child runs XLA first and the kernels after it.
SHARES = {"e2e_flags_off": 0.17, "e2e_flags_on": 0.45, "kernels": 0.13, "timings": 0.25}


def _run_e2e_child(args, flags: str, kernels, modes, seconds: float):
  """Runs e2e rows in a child process with the loop flags on or off. Returns (rows, note,
  seconds it ran); rows it finished before its time limit are kept."""
  rows, note = [], None
  with tempfile.TemporaryDirectory() as d:
    out = Path(d) / "child.json"
    env = dict(os.environ)
    if flags == "off":
      env["MAVERICK_GPU_LOOP_FLAGS"] = "0"
      env.pop("XLA_FLAGS", None)
      if _ORIGINAL_XLA_FLAGS is not None:
        env["XLA_FLAGS"] = _ORIGINAL_XLA_FLAGS
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sections", "e2e", "--budget_s",
           str(seconds), "--batch", str(args.batch), "--child_out", str(out), "--child_flags",
           flags, "--e2e_kernels", ",".join(kernels), "--e2e_modes", ",".join(modes)]
    cmd += ["--interpret"] * args.interpret + ["--toy"] * args.toy
    t = time.monotonic()
    try:
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 30)
      if proc.returncode != 0 or not out.exists():
        note = f"flags-{flags} child exited {proc.returncode}: {proc.stderr[-800:]}"
    except subprocess.TimeoutExpired:  # the rows it finished are in its file already
      note = f"flags-{flags} child stopped at its time limit ({seconds + 30:.0f} s)"
    if out.exists():
      rows = json.loads(out.read_text())
    ran = time.monotonic() - t
  for row in rows:
    print(f"[e2e] {row.get('mode')} kernels={row.get('kernels')} flags={row.get('loop_flags')}"
          f" step/round ms={_fmt(row.get('per_step_ms', row.get('per_round_ms')), '.3f')} "
          f"d2h={row.get('d2h_copies_per_call')} {str(row.get('status'))[:80]}", flush=True)
  done = {(r.get("mode"), r.get("kernels")) for r in rows}
  missing = [f"{m}/{k}" for k in kernels for m in modes if (m, k) not in done]
  if missing:
    note = (note or f"flags-{flags} child") + f"; not finished: {', '.join(missing)}"
  return rows, note and f"{note} (child ran {ran:.0f} s)", ran


def _e2e_child(args, kernels, modes, loop_flags: str) -> int:
  from pallas_kernels import common
  on_gpu = common.gpu_arch() is not None and not args.interpret
  rows = []

  def emit(row):  # rewritten after every row: a child stopped at its limit keeps them
    rows.append(row)
    tmp = Path(args.child_out + ".tmp")
    tmp.write_text(json.dumps(rows, default=str))
    os.replace(tmp, args.child_out)

  run_e2e(args.toy, args.interpret, kernels, modes, Budget(args.budget_s), loop_flags,
          args.batch, on_gpu, emit)
  return 0


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  sections = [s for s in args.sections.split(",") if s]
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
  e2e_kernels = (args.e2e_kernels or ("xla" if args.toy else "xla,auto")).split(",")
  if set(e2e_kernels) - {"auto", "pallas", "xla"}:
    raise SystemExit(f"--e2e_kernels: {args.e2e_kernels!r}; use xla, auto and/or pallas")
  e2e_modes = [m for m in args.e2e_modes.split(",") if m]
  if set(e2e_modes) - {"plain", "spec"}:
    raise SystemExit(f"--e2e_modes: {args.e2e_modes!r}; use plain and/or spec")
  start = time.monotonic()
  total = Budget(args.budget_s)

  # Flags first: XLA reads XLA_FLAGS once, when the first backend starts.
  if args.child_flags == "off":
    os.environ["MAVERICK_GPU_LOOP_FLAGS"] = "0"
  from maverick import gpu_flags
  flag_status = gpu_flags.configure()
  ours = {name for name, _ in gpu_flags.LOOP_FLAGS}
  if flag_status == "already-set" and not gpu_flags.flag_names(_ORIGINAL_XLA_FLAGS or "") & ours:
    flag_status = "set"  # by `import maverick`, a moment ago
  if gpu_flags.cuda_expected() and not args.interpret:
    # A trace shows what runs unprofiled only if command buffers stay on while profiling.
    os.environ["XLA_FLAGS"] = gpu_flags.merge(
        os.environ.get("XLA_FLAGS"), (("xla_enable_command_buffers_during_profiling", "true"),))
  loop_flags = "off" if gpu_flags.disabled() else "on"
  if not gpu_flags.cuda_expected() and args.child_flags != "off":
    loop_flags = "n/a (no CUDA backend)"

  if args.child_flags is not None:  # an e2e child: only its rows, as JSON, for the parent
    return _e2e_child(args, e2e_kernels, e2e_modes, loop_flags)

  # The end-to-end runs first, each set in a child process started before this process touches
  # the GPU: a child's 50 GB model is freed when it exits, a compile that runs past its share is
  # killed with it (a compile cannot be interrupted in-process), its jax.profiler trace is the
  # only CUPTI user in its process, and the flags-off child starts XLA with other flags.
  e2e_rows, e2e_notes, section_s = [], [], {}
  if "e2e" in sections:
    plans = [] if args.no_flags_off else [("off", ["xla"], e2e_modes[:1], "e2e_flags_off")]
    plans.append(("on", e2e_kernels, e2e_modes, "e2e_flags_on"))
    for flags, kernels, modes, share in plans:
      seconds = min(args.budget_s * SHARES[share], max(0.0, total.left()))
      rows, note, section_s[share] = _run_e2e_child(args, flags, kernels, modes, seconds)
      e2e_rows += rows
      if note:
        e2e_notes.append(note)

  import jax

  from pallas_kernels import common
  arch = common.gpu_arch()
  on_gpu = arch is not None and not args.interpret
  if arch is None and not args.interpret:
    raise SystemExit(f"no Hopper/Blackwell GPU here ({jax.devices()[0].device_kind}); pass "
                     "--interpret --toy to run toy shapes in GPU interpret mode")
  kind = jax.devices()[0].device_kind
  device = sanitize(kind) if on_gpu else "cpu-interpret" + ("-toy" if args.toy else "")
  peaks = peaks_for(kind) if on_gpu else None
  iters = args.iters or (1 if args.interpret else 10)

  payload = {
      "device": device, "device_kind": kind, "arch": arch, "jax": jax.__version__,
      "interpret": args.interpret, "toy": args.toy, "command": " ".join(["python",
                                                                          "benchmarks/gpu_check.py",
                                                                          *(argv or sys.argv[1:])]),
      "timing": ("CUPTI device time per call, median of iterations, inputs rotated through copies "
                 "larger than 2x L2" if on_gpu else
                 "host wall-clock of GPU interpret mode: not a GPU speed"),
      "peaks": peaks, "loop_flags": {"status": flag_status,
                                     "xla_flags": os.environ.get("XLA_FLAGS", "")},
      "budget_s": args.budget_s, "kernels": [], "timings": [], "e2e": e2e_rows,
      "notes": list(e2e_notes),
      # Wall seconds each section took, compiles included (e2e: each child process's whole run).
      "section_s": section_s,
  }
  if on_gpu and peaks is None:
    payload["notes"].append(f"no datasheet peaks for {kind!r}: fractions of peak not computed")
  results = Results(Path(args.out_dir), device, payload)
  results.write()

  def hard_stop():  # a compile cannot be interrupted: at the hard deadline, write and leave
    payload["notes"].append(f"stopped at the hard deadline ({args.budget_s + 20:.0f} s after the "
                            "start): the rows above are what finished")
    results.write()
    os._exit(3)

  watchdog = threading.Timer(max(1.0, total.left()) + 20, hard_stop)
  watchdog.daemon = True
  watchdog.start()
  try:
    cases = build_cases(args.toy, arch if on_gpu else None) if {"kernels", "timings"} & set(
        sections) else []
    if "kernels" in sections:
      budget = Budget(args.budget_s * SHARES["kernels"], total)
      t = time.monotonic()
      for case in cases:
        row = (check_case(case, args.interpret) if not budget.over() else
               {"op": case.op, "case": case.name, "correct": None,
                "status": "skipped: over the section's time budget"})
        payload["kernels"].append(row)
        print(f"[kernels] {case.op:18s} {case.name:70s} {row.get('rel_error', '-')!s:>10.10s} "
              f"{row['status'][:60]}", flush=True)
        section_s["kernels"] = time.monotonic() - t
        results.write()
    if "timings" in sections:
      budget = Budget(max(0.0, total.left()), total)
      t = time.monotonic()
      for case in cases:
        if budget.over():
          row = {"op": case.op, "case": case.name, "status": "skipped: over the section's time budget"}
        else:
          row = time_case(case, on_gpu, iters, args.interpret, peaks, budget)
        case.args = None  # free the inputs
        payload["timings"].append(row)
        print(f"[timings] {case.op:18s} {case.name:70s} {_fmt(row.get('time_us'))} us "
              f"{row['status'][:60]}", flush=True)
        section_s["timings"] = time.monotonic() - t
        results.write()
    cases = None
  finally:
    watchdog.cancel()
    payload["wall_s"] = time.monotonic() - start
    results.write()
  print(f"wrote {results.json_path} and {results.md_path} ({payload['wall_s']:.0f} s)")
  bad = [r for r in payload["kernels"] if r.get("correct") is False]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
