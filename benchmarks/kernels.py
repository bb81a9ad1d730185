"""Checks and times every Pallas kernel against its XLA reference and the baselines the issue names.

On a Hopper/Blackwell GPU (Maverick shapes):
  python benchmarks/kernels.py
measures the device's ceilings in the same run (a large copy -> HBM GB/s; a large bf16 matmul ->
TFLOP/s), then per kernel case: correctness against the reference, the median of device-timed runs
(CUPTI, via Mosaic GPU's profiler) for the kernel and each baseline, TFLOP/s, GB/s, the fraction of
the ceilings, speed-ups, and whether the case's goal is met. Writes
benchmarks/results/<device>-kernels.json.

On any host, at toy sizes, in GPU interpret mode (what CI runs: it proves the script works):
  python benchmarks/kernels.py --interpret
Timings there are host wall-clock of the interpreter and mean nothing about GPU speed.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from maverick import cli  # noqa: E402
from pallas_kernels import common  # noqa: E402

OPS = ("gemm", "grouped_gemm", "prefill_attention", "decode_attention")

_INTERPRET = flags.DEFINE_bool("interpret", False, "toy shapes in GPU interpret mode (any host)")
_OPS = flags.DEFINE_list("ops", list(OPS), f"which ops to run, of {OPS}")
_ITERS = flags.DEFINE_integer("iters", 20, "timed runs per function (the median is reported)")
_OUT = flags.DEFINE_string("out", None, "output JSON (default benchmarks/results/<device>-kernels.json)")


def device_name() -> str:
  d = jax.devices()[0]
  kind = "cpu-interpret" if d.platform == "cpu" else d.device_kind
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def _timer(on_gpu: bool, iters: int):
  """fn, args -> median milliseconds: CUPTI device time on a GPU, host wall-clock elsewhere."""
  if on_gpu:
    from jax.experimental.mosaic.gpu import profiler

    def gpu_time(fn, args):
      _, runs = profiler.measure(fn, iterations=iters)(*args)
      return statistics.median(runs)
    return gpu_time

  def wall_time(fn, args):
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(iters):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      runs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(runs)
  return wall_time


def ceilings(time_ms, on_gpu: bool) -> dict:
  """HBM bandwidth from a large copy (read + write) and tensor-core TFLOP/s from a large bf16
  matmul, measured now on this device (the fractions below are of these, not of a datasheet)."""
  n_copy, n_mm = (1 << 30, 8192) if on_gpu else (1 << 22, 256)
  x = jnp.ones((n_copy // 4,), jnp.float32)
  copy_ms = time_ms(jax.jit(lambda a: a + 1.0), (x,))
  a = jax.random.normal(jax.random.key(0), (n_mm, n_mm), jnp.bfloat16)
  mm_ms = time_ms(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16)), (a, a))
  return {"hbm_GBps": 2 * n_copy / copy_ms / 1e6, "copy_bytes": 2 * n_copy,
          "bf16_matmul_TFLOPs": 2 * n_mm ** 3 / mm_ms / 1e9, "matmul_n": n_mm}


def goal_met(goal: str, result: dict) -> bool | None:
  """Evaluates '>= 80% of HBM bandwidth' / '>= 1.0x <baseline>' goals; None when there is none."""
  if m := re.match(r">=\s*([\d.]+)% of HBM", goal):
    return result["hbm_fraction"] >= float(m.group(1)) / 100
  if m := re.match(r">=\s*([\d.]+)x (\S+)", goal):
    speedup = result["speedup"].get(m.group(2))
    return None if speedup is None else speedup >= float(m.group(1))
  return None


def run_case(case: common.BenchCase, time_ms, ceiling: dict) -> dict:
  kernel = jax.jit(case.kernel)
  out = np.asarray(kernel(*case.args), np.float64)
  ref = np.asarray(jax.jit(case.reference)(*case.args), np.float64)
  rel_error = float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
  result = {"op": case.op, "case": case.name, "rel_error": rel_error,
            "max_rel_error": case.max_rel_error, "correct": rel_error <= case.max_rel_error,
            "flops": case.flops, "bytes": case.bytes, "goal": case.goal}
  ms = time_ms(kernel, case.args)
  result.update(time_us=ms * 1e3, TFLOPs=case.flops / ms / 1e9, GBps=case.bytes / ms / 1e6)
  result["hbm_fraction"] = result["GBps"] / ceiling["hbm_GBps"]
  result["tensor_core_fraction"] = result["TFLOPs"] / ceiling["bf16_matmul_TFLOPs"]
  result["baselines_us"], result["speedup"] = {}, {}
  for name, fn in case.baselines.items():
    try:
      b_ms = time_ms(jax.jit(fn), case.args)
    except Exception as e:  # e.g. cuDNN attention off a GPU: recorded, not fatal
      result["baselines_us"][name] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
      continue
    result["baselines_us"][name] = b_ms * 1e3
    result["speedup"][name] = b_ms / ms
  result["goal_met"] = goal_met(case.goal, result)
  return result


def write_json(path: Path, payload: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    json.dump(payload, f, indent=1)
  os.replace(tmp, path)


def run(ops, interpret: bool, iters: int, out: str | None) -> dict:
  unknown = sorted(set(ops) - set(OPS))
  if unknown:
    raise app.UsageError(f"--ops: unknown {unknown}; choose from {OPS}")
  on_gpu = common.gpu_arch() is not None
  if not on_gpu and not interpret:
    raise app.UsageError(
        f"no Hopper/Blackwell GPU here ({jax.devices()[0].device_kind}); pass --interpret to run "
        f"toy shapes in GPU interpret mode")
  time_ms = _timer(on_gpu and not interpret, iters)
  ceiling = ceilings(time_ms, on_gpu and not interpret)
  results = []
  for op in ops:
    bench = importlib.import_module(f"pallas_kernels.{op}.bench")
    for case in bench.benchmark_cases(toy=interpret):
      if interpret:
        with pallas_kernels.interpret(detect_races=False):
          r = run_case(case, time_ms, ceiling)
      else:
        r = run_case(case, time_ms, ceiling)
      results.append(r)
      met = {True: "met", False: "MISSED", None: "-"}[r["goal_met"]]
      print(f"{op:18s} {r['case']:48s} err {r['rel_error']:.1e} {'ok' if r['correct'] else 'WRONG'}"
            f"  {r['time_us']:10.1f} us  {r['TFLOPs']:7.1f} TFLOP/s  {r['GBps']:7.0f} GB/s"
            f"  {r['hbm_fraction']:5.0%} HBM  goal {r['goal'] or '-'}: {met}", flush=True)
  payload = {"device": device_name(), "device_kind": jax.devices()[0].device_kind,
             "jax": jax.__version__, "interpret": interpret, "iters": iters,
             "timing": "CUPTI device time (median)" if on_gpu and not interpret
             else "host wall-clock of GPU interpret mode: not a GPU speed",
             "ceilings": ceiling, "results": results}
  path = Path(out) if out else (Path(__file__).parent / "results" / f"{device_name()}-kernels.json")
  write_json(path, payload)
  print(f"wrote {path}")
  return payload


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("kernels", _main, argv)


def _main(argv):
  del argv
  payload = run(_OPS.value, _INTERPRET.value, _ITERS.value, _OUT.value)
  if not all(r["correct"] for r in payload["results"]):
    sys.exit("some kernel disagrees with its reference (see 'correct' in the JSON)")


if __name__ == "__main__":
  app.run(main)
