"""Compiles the project's GPU programs for H200 and B200 on a host with no GPU, and reports what
only an XLA:GPU compile shows.

Deviceless AOT (jax's CUDA plugin, compile-only devices from XLA's embedded GPU target
descriptions; the recipe is in docs/guides/gpu-compile.md): the real XLA:GPU
passes, buffer assignment, command-buffer conversion, and Mosaic GPU kernels through ptxas. No
autotuning (there is no device), so matmul configurations are XLA's defaults.

  bash tools/setup.sh cuda12      # the CUDA build of the installed jax (brings ptxas)
  .venv/bin/python scripts/gpu_compile_check.py            # H200 and B200, ~10 min on 2 cores
  .venv/bin/python scripts/gpu_compile_check.py --gpus h200 --kernels xla --checks decode
  .venv/bin/python scripts/gpu_compile_check.py --checks decode --programs step   # the step only
  # the launch table (one command line):
  .venv/bin/python scripts/gpu_compile_check.py --checks decode --programs step,verify,draft
      --batch 1 --context 8192 --out benchmarks/results/gpu_launches_b1.md

Checks, per GPU:
  decode  the Maverick FP8 TP8 decode programs (all 48 layers, FP8 weights, --batch rows over a
          --context KV cache, 8 compile-only devices, layout tp), kernels "xla" and "pallas":
          --programs loop / spec (maverick.generate / spec_decode.generate), step (one token a
          row), verify (T=K+1=4 tokens a row, the EAGLE-3 features captured) and draft (one
          chained step of NVIDIA's EAGLE-3 head). Whole-KV-shard copies / transposes (a KV cache
          updated in place has none), XLA:GPU's planned memory next to plan_memory.py's (CPU)
          numbers, the Mosaic kernels, registers / spills of each kernel from ptxas, and
          KERNEL LAUNCHES (maverick.launches): every kernel node of XLA's thunk sequence (XLA
          fusions, Mosaic custom calls, copies, memsets, collectives), a `while` body times its
          trip count, a `conditional` at its smallest branch (and, in the next column, its
          largest), a generate loop per iteration of its decode loop; by kind and per layer.
          At batch 1 a step is launch-bound, so this count is its latency budget. For step,
          verify and draft also a MODELED time (maverick.step_model, never a measurement):
          max(bytes read / HBM bandwidth, flops / FP8 peak) + launches x 1.62 us (calibrated on
          the one H200 measurement; 1.0 us with PDL is an assumption), and tokens/s per user,
          plain and K=3 at an assumed acceptance length of 3.
  loops   maverick.generate and spec_decode.generate of the embedded pair (one device, the loop
          flags of maverick.gpu_flags on): whether each `while` sits inside a command buffer (a
          CUDA graph: the predicate stays on the device) or is driven by the host, and host
          transfer thunks.
  kernels every distinct kernel configuration of maverick.kernel_sweep (all Maverick and Scout
          kernel calls at TP 1/4/8, BF16 and FP8; one call per planner config and static facts,
          as tests/test_kernel_lowering_sweep.py lowers them) through ptxas on one compile-only
          device: registers and spills per op, and every configuration that spills.
The report (Markdown) goes to stdout and to --out.

Run as `maverick-gpu-compile-check` (an installed maverick-jax's console script), as
`python -m maverick.commands.gpu_compile_check`, or from a source checkout as
`python scripts/gpu_compile_check.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import sys
import tempfile
import time

from maverick import cli


GPUS = {"h200": ("NVIDIA H200 141GB HBM3e", "sm90"), "b200": ("NVIDIA B200", "sm100")}
CHECKS = ("decode", "loops", "kernels")
PROGRAMS = ("loop", "spec", "step", "verify", "draft")  # the decode check's programs
SPEC_K = 3  # the verify step's draft tokens (T = K + 1), NVIDIA's record configuration


def _parse(argv):
  import argparse
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--gpus", default="h200,b200", help=f"comma list of {sorted(GPUS)}")
  ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {CHECKS}")
  ap.add_argument("--kernels", default="xla,pallas", help="decode check: xla and/or pallas")
  ap.add_argument("--programs", default=",".join(PROGRAMS),
                  help="decode check: generate loop, spec generate loop, standalone decode step, "
                       f"verify step (T={SPEC_K + 1} tokens per row), EAGLE-3 draft step")
  ap.add_argument("--context", type=int, default=131072, help="decode check: KV cache positions")
  ap.add_argument("--batch", type=int, default=8, help="decode check: rows")
  ap.add_argument("--layers", type=int, default=48, help="decode check: decoder layers")
  ap.add_argument("--prompt_len", type=int, default=16,
                  help="decode check: prompt tokens per row of the generate programs (prefill's "
                       "MoE takes the grouped path once rows x top-k exceed the local experts)")
  ap.add_argument("--out",
                  default=cli.default_path("benchmarks", "results", "gpu_compile_check.md"))
  ap.add_argument("--rows_json", default="", help=argparse.SUPPRESS)  # a per-GPU child's rows
  args = ap.parse_args(argv)
  for name, value, allowed in (("--gpus", args.gpus, GPUS), ("--checks", args.checks, CHECKS),
                               ("--kernels", args.kernels, ("xla", "pallas")),
                               ("--programs", args.programs, PROGRAMS)):
    bad = set(value.split(",")) - set(allowed)
    if bad:
      ap.error(f"{name}: unknown {sorted(bad)}; choose from {sorted(allowed)}")
  for name in ("context", "batch", "layers", "prompt_len"):
    if getattr(args, name) < 1:
      ap.error(f"--{name} must be >= 1")
  return args


# ----------------------------------------------------------------------------------------------
# Compile-only GPU devices
# ----------------------------------------------------------------------------------------------
def _environment(dump_dir: str) -> None:
  """Before jax starts: CPU as the default backend, the CUDA plugin registered without a GPU, the
  loop flags, and dumps of the thunk sequences (where command buffers show)."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  from maverick import gpu_flags
  # The loop flags as maverick.gpu_flags adds them on a GPU host (a flag already in XLA_FLAGS
  # wins, e.g. --xla_gpu_enable_dynamic_slice_fusion=true to compile without ours). Only the
  # generate loops are dumped: the thunk sequences show where each while runs.
  dumps = f"--xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*(generate|step).*"
  os.environ["XLA_FLAGS"] = f"{gpu_flags.merge(os.environ.get('XLA_FLAGS'))} {dumps}".strip()


def target_config(description: str) -> str:
  """XLA's GpuTargetConfigProto text for a GPU, as embedded in the CUDA plugin library."""
  try:
    import jax_plugins.xla_cuda12 as plugin
  except ImportError:
    raise SystemExit("gpu_compile_check needs jax's CUDA plugin: run `bash tools/setup.sh cuda12` "
                     "(the CUDA build of the installed jax)") from None
  lib = next(pathlib.Path(plugin.__file__).parent.glob("xla_cuda_plugin*.so"))
  data = lib.read_bytes()
  for m in re.finditer(rb'device_description_str: "([^"]+)"', data):
    if m.group(1).decode() != description:
      continue
    start, end = data.rfind(b"\0", 0, m.start()) + 1, data.find(b"\0", m.end())
    text = data[start:end]
    if b"gpu_device_info" in text:
      return text.decode()
  raise SystemExit(f"no target description {description!r} in {lib}")


def gpu_devices(gpu: str, count: int):
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(GPUS[gpu][0]),
                                      topology=f"1x1x{count}")
  return topo.devices


@contextlib.contextmanager
def pinned_arch(arch: str):
  """Mosaic GPU and our kernel dispatch read the architecture from the default (CPU) device:
  pin it to the target's, as pallas_kernels.lower_for_gpu does."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  from pallas_kernels import common
  saved = mgpu_utils._infer_arch
  mgpu_utils._infer_arch = lambda: {"sm90": (9, 0), "sm100": (10, 0)}[arch]
  token = common._forced_arch.set(arch)
  try:
    yield
  finally:
    mgpu_utils._infer_arch = saved
    common._forced_arch.reset(token)


@contextlib.contextmanager
def captured_fds():
  """What C++ writes to stdout / stderr (ptxas -v lines), as a list filled on exit."""
  out: list[str] = []
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with tempfile.TemporaryFile(mode="w+b") as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
      yield out
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
      f.seek(0)
      out.append(f.read().decode(errors="replace"))


# ----------------------------------------------------------------------------------------------
# Reading compiled programs
# ----------------------------------------------------------------------------------------------
_INSTR = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\{[^}]*\} (\w[\w\-]*)\(%?([\w.\-]*)")


def whole_buffer_moves(hlo_text: str, dims: tuple[int, ...], dtypes: tuple[str, ...]) -> list[str]:
  """Instructions of a compiled (per-device) HLO module that copy or transpose a whole buffer of
  shape `dims` into any order of its dims: a `copy` or `transpose`, or a fusion whose name says it
  is one (XLA names fusions after their root). An in-place update (dynamic-update-slice, scatter)
  is not a move, nor is materializing a broadcast or constant (a cache's zeros, once)."""
  want = sorted(dims)
  moves = []
  fused = False  # inside a fusion's computation: its fusion instruction is the one counted
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header:
      fused = header.group(2).startswith(("fused_", "wrapped_"))
      continue
    m = _INSTR.match(line)
    if fused:
      continue
    if not m or m.group(2) not in dtypes:
      continue
    shape = [int(d) for d in m.group(3).split(",") if d]
    if sorted(shape) != want:
      continue
    name, op, operand = m.group(1), m.group(4), m.group(5)
    if operand.startswith(("broadcast", "constant")):
      continue
    if op in ("copy", "transpose") or (
        op == "fusion" and re.match(r"(wrapped_)?(copy|transpose)", name)):
      moves.append(f"{name} ({op})")
  return moves


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def xla_collectives(hlo_text: str) -> dict[str, list[str]]:
  """XLA's own collective instructions in a compiled HLO module: kind -> their result shapes (an
  async pair counts once, at its -start). A Mosaic kernel's NVLink reduce is inside its custom
  call, not here."""
  found = {k: [] for k in COLLECTIVES}
  for line in hlo_text.splitlines():
    m = re.match(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?[\}\]\)]) ([a-z][a-z0-9\-]*)\(", line)
    op = m.group(2).removesuffix("-start") if m else None
    if op in found:
      found[op].append(re.sub(r"\{[\d,]*\}", "", m.group(1)))
  return found


def mosaic_kernels(hlo_text: str) -> int:
  return len(re.findall(r'custom_call_target="mosaic_gpu', hlo_text))


def ptxas_kernels(text: str) -> list[dict]:
  """Each kernel ptxas compiled (MOSAIC_GPU_DUMP_PTXAS output): name, registers, spill store
  bytes, and whether ptxas ignored its `setmaxnreg` (info C7504: Mosaic GPU builds relocatable
  code through nvJitLink, so a thread keeps 65536 / threads registers, 168 with 3 warpgroups).
  Spills are read from the "Function properties" line only: ptxas repeats them in a warning."""
  out: list[dict] = []
  ignored = False
  for line in text.splitlines():
    if "'setmaxnreg' ignored" in line:
      ignored = True
    m = re.search(r"Function properties for (\S+)$", line.strip())
    if m and line.lstrip().startswith("ptxas"):
      out.append({"name": m.group(1), "registers": 0, "spill_store_bytes": 0,
                  "setmaxnreg_ignored": ignored})
      ignored = False
      continue
    m = re.search(r"bytes stack frame, (\d+) bytes spill stores", line)
    if m and out:
      out[-1]["spill_store_bytes"] = int(m.group(1))
    m = re.search(r"Used (\d+) registers", line)
    if m and out:
      out[-1]["registers"] = int(m.group(1))
  return out


def ptxas_summary(text: str) -> dict:
  """Kernels ptxas compiled: count, max registers, spill store bytes in all."""
  kernels = ptxas_kernels(text)
  return {"ptxas_kernels": len(kernels),
          "max_registers": max((k["registers"] for k in kernels), default=0),
          "spill_store_bytes": sum(k["spill_store_bytes"] for k in kernels)}


_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def loop_placement(thunk_text: str) -> dict:
  """In a thunk sequence dump: `while` thunks inside a command buffer (one CUDA graph with a
  conditional node: no host round trip per iteration) and outside one (host-driven: the predicate
  is copied to the host every iteration), and host transfer thunks anywhere."""
  stack: list[tuple[int, str]] = []
  out = {"while_in_command_buffer": 0, "while_host_driven": 0, "host_transfers": 0}
  for line in thunk_text.splitlines():
    m = _THUNK.match(line)
    if not m:
      continue
    indent, kind = len(m.group(1)), m.group(2)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    if kind == "kWhile":
      inside = any(k == "kCommandBuffer" for _, k in stack)
      out["while_in_command_buffer" if inside else "while_host_driven"] += 1
    if re.search(r"Host|Infeed|Outfeed|Send|Recv", kind):
      out["host_transfers"] += 1
    stack.append((indent, kind))
  return out


def thunk_text(dump_dir: str, module_hint: str, suffix: str = "") -> str:
  """The thunk sequence (or the dump file ending in `suffix`) of the module named `module_hint`
  compiled last. XLA numbers dumped modules by id, not in compile order (module_0001,
  module_317837, module_100031, ...): newest by time."""
  newest = lambda pattern: sorted(pathlib.Path(dump_dir).glob(pattern),
                                  key=lambda f: f.stat().st_mtime_ns)
  if suffix:
    files = newest(f"*{module_hint}.{suffix}")
  else:
    files = newest(f"*{module_hint}*thunk_sequence_after_thunk_passes.txt")
    files = files or newest(f"*{module_hint}*thunk_sequence.txt")
  if not files:
    raise RuntimeError(f"no thunk sequence dumped for {module_hint!r} in {dump_dir}")
  return files[-1].read_text()


# ----------------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------------
def maverick_fp8(layers: int):
  from maverick import config as config_lib
  from maverick.quant import QuantConfig
  cfg = config_lib.maverick().replace(quant=QuantConfig())
  if layers != cfg.num_hidden_layers:
    # Fewer layers (a quick look): the per-layer lists are derived again from the config's rules.
    cfg = cfg.replace(num_hidden_layers=layers, no_rope_layers=None, moe_layers=None,
                      layer_types=None)
  return cfg


def _sharded_model(cfg, mesh, kernels: str, draft_of=None):
  """(plan, graphdef, state of sharded ShapeDtypeStructs) of the model laid out "tp" on `mesh`;
  with `draft_of` (an Eagle3Config), of that EAGLE-3 draft instead."""
  import jax
  from flax import nnx

  from maverick import model as model_lib
  from maverick import sharding
  from spec_decode import draft as draft_lib
  plan = sharding.Plan(mesh, "tp")
  model = model_lib.abstract_model(cfg) if draft_of is None else draft_lib.abstract_draft(draft_of)
  sharding.check_model_fits(cfg if draft_of is None else draft_of.layer, plan)
  sharding.attach_plan(model, plan)
  model.set_attributes(kernels=kernels, raise_if_not_found=False)
  graphdef, state = nnx.split(model)
  shardings = sharding.param_shardings(state, plan)
  state = nnx.from_flat_state([
      (path, var.replace(value=jax.ShapeDtypeStruct(var.shape, var.dtype,
                                                    sharding=shardings[path])))
      for path, var in nnx.to_flat_state(state)])
  return plan, graphdef, state


def compile_generate_loop(cfg, mesh, batch: int, context: int, kernels: str, spec: bool,
                          prompt_len: int = 16):
  """maverick.generate's program (prefill, then the decode while loop), or with `spec`
  spec_decode.generate's (K=3 chain rounds with NVIDIA's EAGLE-3 head for the target, as
  plan_memory.py describes it), for `batch` prompts of `prompt_len` tokens and 64 new tokens over a
  `context`-slot cache: the cache lives inside the program, so XLA picks its layout for the loop.
  Returns (compiled, seconds in all, seconds of those spent in JAX's lowering)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from maverick import generation as plain
  from maverick import memory_plan
  from spec_decode import speculative
  plan, graphdef, state = _sharded_model(cfg, mesh, kernels)
  req, steps, _ = plain.prepare(cfg, [[7] * prompt_len] * batch, max_new_tokens=64)
  rows = plan.batch_axis(batch)
  req = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=(
      NamedSharding(mesh, PartitionSpec(rows, *[None] * (np.ndim(x) - 1))) if np.ndim(x)
      else NamedSharding(mesh, PartitionSpec()))), req)
  t = time.perf_counter()
  if not spec:
    lowered = plain.generate_jit.lower(graphdef, state, req, steps=steps, capacity=context,
                                       pad_id=0)
  else:
    _, dgraph, dstate = _sharded_model(cfg, mesh, kernels, memory_plan.nvidia_eagle3(cfg))
    lowered = speculative.spec_generate_jit.lower(graphdef, state, dgraph, dstate, req, k=3,
                                                  steps=steps, capacity=context, pad_id=0)
  lowered_s = time.perf_counter() - t
  return lowered.compile(), time.perf_counter() - t, lowered_s


def compile_decode_step(cfg, mesh, batch: int, context: int, kernels: str, tokens_per_row: int = 1):
  """One decode step as its own program (one token per row, the KV cache an argument, donated),
  as the serving engine's step programs are: its cache keeps the default layout at the program's
  boundary. `tokens_per_row` K+1: the speculative verify step (the EAGLE-3 features captured).
  Returns (compiled, seconds in all, seconds of those spent in JAX's lowering)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from maverick import memory_plan
  from maverick import model as model_lib
  from maverick import sharding
  plan, graphdef, state = _sharded_model(cfg, mesh, kernels)
  cache = memory_plan._cache_sds(cfg, plan, batch, context)
  tokens = jax.ShapeDtypeStruct((batch, tokens_per_row), jnp.int32, sharding=NamedSharding(
      mesh, PartitionSpec(plan.batch_axis(batch), None)))
  verify = tokens_per_row > 1
  capture = memory_plan.nvidia_eagle3(cfg).aux_layer_ids if verify else ()

  def decode_step(state, tokens, cache):
    out = model_lib.apply(graphdef, state, tokens, cache=sharding.constrain_cache(cache, plan),
                          capture_layers=capture)
    picked = jnp.argmax(out.logits, -1)
    return picked, out.hidden, sharding.constrain_cache(out.cache, plan)

  def verify_step(state, tokens, cache):  # its own name: the launch count finds its dump by it
    return decode_step(state, tokens, cache)

  t = time.perf_counter()
  lowered = jax.jit(verify_step if verify else decode_step, donate_argnums=2).lower(
      state, tokens, cache)
  lowered_s = time.perf_counter() - t
  return lowered.compile(), time.perf_counter() - t, lowered_s


def compile_draft_step(cfg, mesh, batch: int, context: int, kernels: str):
  """One chained step of NVIDIA's EAGLE-3 head (one token per row: the previous step's hidden
  state, the target's embedding table, the draft's own KV cache), as spec_decode's draft chain
  runs it K times a round. Returns (compiled, seconds in all, seconds spent lowering)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  from maverick import memory_plan
  from maverick import sharding
  dcfg = memory_plan.nvidia_eagle3(cfg)
  plan, tgraph, tstate = _sharded_model(cfg, mesh, kernels)
  embed = nnx.to_flat_state(tstate)
  embed = next(v for path, v in embed if path == ("embed",)).value
  _, dgraph, dstate = _sharded_model(cfg, mesh, kernels, dcfg)
  dcache = memory_plan._cache_sds(dcfg.layer, plan, batch, context, num_layers=1)
  rows = plan.batch_axis(batch)
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                                sharding=NamedSharding(mesh, PartitionSpec(rows, None)))
  hidden = jax.ShapeDtypeStruct((batch, 1, dcfg.hidden_size), jnp.dtype(dcfg.layer.dtype),
                                sharding=NamedSharding(mesh, PartitionSpec(rows, None, None)))

  def draft_step(dstate, embed, tokens, hidden, dcache):
    draft = nnx.merge(dgraph, dstate)
    out = draft(tokens, hidden, embed, cache=sharding.constrain_cache(dcache, plan))
    return jnp.argmax(out.logits[:, -1], -1), out.hidden, sharding.constrain_cache(out.cache, plan)

  t = time.perf_counter()
  lowered = jax.jit(draft_step, donate_argnums=4).lower(dstate, embed, tokens, hidden, dcache)
  lowered_s = time.perf_counter() - t
  return lowered.compile(), time.perf_counter() - t, lowered_s


def program_launches(dump_dir: str, module: str, hlo_text: str, layers: int,
                     loop: bool = False) -> dict:
  """The launch columns of a compiled program (maverick.launches): one run of it, or with `loop`
  one iteration of its main loop (a generate program's decode step)."""
  from maverick import launches
  seq = thunk_text(dump_dir, module)
  meta = thunk_text(dump_dir, module, "thunk_metadata.txt")
  trips = launches.trip_counts(meta, hlo_text)
  got = launches.count(seq, trips, launches.main_loop(seq) if loop else None)
  return {"launches": got.total, "launches_largest": got.largest,
          "launches_per_layer": round(got.per_layer(layers), 1),
          "launches_by_kind": got.by_kind, "unknown_trip_whiles": got.unknown_trip_whiles}


def modeled_step(cfg, mesh, kernels: str, program: str, batch: int, context: int, gpu: str,
                 launches: int) -> dict:
  """maverick.step_model's modeled time of a step program from its launches and the bytes its
  weights and KV cache make one device read (a model, not a measurement: see that module)."""
  import jax.numpy as jnp
  from flax import nnx

  from maverick import memory_plan
  from maverick import step_model
  draft = memory_plan.nvidia_eagle3(cfg) if program == "draft" else None
  _, _, state = _sharded_model(cfg, mesh, kernels, draft)
  layer_cfg = draft.layer if draft is not None else cfg
  k0 = memory_plan._cache_sds(layer_cfg, sharding_plan(mesh), batch, 64, num_layers=1).k[0]
  tokens = SPEC_K + 1 if program == "verify" else 1
  flat = [(path, v.get_value()) for path, v in nnx.to_flat_state(state)]
  read = step_model.step_bytes(flat, layer_cfg, batch=batch, tokens_per_row=tokens,
                               context=context, kv_bytes_per_value=jnp.dtype(k0.dtype).itemsize,
                               kv_heads_local=k0.sharding.shard_shape(k0.shape)[2],
                               shard_shape=lambda x: x.sharding.shard_shape(x.shape))
  flops = 2.0 * read.weights * batch * tokens  # ~one multiply-add per weight byte (FP8) per row
  ms = lambda us: round(1e3 * step_model.step_seconds(launches, read.total, flops, gpu, us), 3)
  return {"bytes_read_GB": round(read.total / 1e9, 3), "modeled_ms": ms(step_model.LAUNCH_US),
          "modeled_ms_pdl": ms(step_model.PDL_LAUNCH_US)}


def sharding_plan(mesh):
  from maverick import sharding
  return sharding.Plan(mesh, "tp")


def kv_shard(cfg, mesh, batch: int, context: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """One layer's K (or V) cache shard dims on a device, and its HLO dtype names."""
  import jax.numpy as jnp

  from maverick import memory_plan
  from maverick import sharding
  k0 = memory_plan._cache_sds(cfg, sharding.Plan(mesh, "tp"), batch, context).k[0]
  name = {"bfloat16": "bf16", "float8_e4m3fn": "f8e4m3fn"}.get(jnp.dtype(k0.dtype).name)
  return tuple(k0.sharding.shard_shape(k0.shape)), (name,)


def decode_check(args, gpu: str, dump_dir: str) -> list[dict]:
  import numpy as np
  from jax.sharding import Mesh

  from maverick import sharding
  rows = []
  cfg = maverick_fp8(args.layers)
  devices = gpu_devices(gpu, 8)
  mesh = Mesh(np.asarray(devices).reshape(1, 1, 8), sharding.AXES)
  names = {"loop": "maverick fp8 tp8 generate (decode loop)",
           "spec": "maverick fp8 tp8 spec generate (K=3 rounds)",
           "step": "maverick fp8 tp8 decode step (own program)",
           "verify": f"maverick fp8 tp8 verify step (T={SPEC_K + 1}, own program)",
           "draft": "EAGLE-3 draft step (NVIDIA's head, own program)"}
  modules = {"loop": "jit__generate", "spec": "jit__spec_generate", "step": "jit_decode_step",
             "verify": "jit_verify_step", "draft": "jit_draft_step"}
  programs = [p for p in names if p in args.programs.split(",")]
  for kernels, program in [(k, p) for k in args.kernels.split(",") for p in programs]:
    name = names[program]
    row = {"gpu": gpu, "program": name, "kernels": kernels}
    try:
      with pinned_arch(GPUS[gpu][1]), captured_fds() as fds:
        if program in ("step", "verify"):
          compiled, seconds, lowered_s = compile_decode_step(
              cfg, mesh, args.batch, args.context, kernels,
              tokens_per_row=SPEC_K + 1 if program == "verify" else 1)
        elif program == "draft":
          compiled, seconds, lowered_s = compile_draft_step(cfg, mesh, args.batch, args.context,
                                                            kernels)
        else:
          compiled, seconds, lowered_s = compile_generate_loop(
              cfg, mesh, args.batch, args.context, kernels, spec=program == "spec",
              prompt_len=args.prompt_len)
      shard, dtypes = kv_shard(cfg, mesh, args.batch, args.context)
      text = compiled.as_text()
      if program in ("loop", "spec"):
        row.update(loop_placement(thunk_text(dump_dir, modules[program])))
      # Launches per step: the draft has 1 layer; a generate loop is counted per iteration of
      # its decode loop (the spec loop's is a whole round: verify + draft chain).
      row.update(program_launches(dump_dir, modules[program], text,
                                  1 if program == "draft" else args.layers,
                                  loop=program in ("loop", "spec")))
      if program in ("step", "verify", "draft"):
        row.update(program_key=program, **modeled_step(
            cfg, mesh, kernels, program, args.batch, args.context, gpu, row["launches"]))
      moves = whole_buffer_moves(text, shard, dtypes)
      mem = compiled.memory_analysis()
      row.update(compile_s=round(seconds, 1), lowering_s=round(lowered_s, 1), kv_shard=list(shard), whole_kv_moves=len(moves),
                 moves_sample=moves[:4], mosaic_kernels=mosaic_kernels(text),
                 xla_collectives={k: v for k, v in xla_collectives(text).items() if v},
                 xla_temp_GB=mem.temp_size_in_bytes / 1e9,
                 xla_argument_GB=mem.argument_size_in_bytes / 1e9,
                 xla_alias_GB=mem.alias_size_in_bytes / 1e9, **ptxas_summary(fds[0]),
                 status="ok")
    except Exception as e:  # recorded: the other checks still run
      row["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(_row_line(row), flush=True)
  return rows


def loops_check(args, gpu: str, dump_dir: str) -> list[dict]:
  """generate / spec generate of the embedded pair on one compile-only device."""
  import jax
  from flax import nnx
  from jax.sharding import SingleDeviceSharding

  from maverick import loading
  import spec_decode
  from maverick import generation as plain
  from spec_decode import speculative
  (device,) = gpu_devices(gpu, 1)
  sds = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)), tree)
  loaded = loading.load()
  draft = spec_decode.load_draft("tiny", loaded.model)
  prompts = [loaded.tokenizer.encode("def f(x):")]
  rows = []
  for name in ("generate", "spec_generate"):
    row = {"gpu": gpu, "program": f"{name} (embedded pair)", "kernels": "xla"}
    try:
      req, steps, cap = plain.prepare(loaded.model.config, prompts, max_new_tokens=64)
      g, s = nnx.split(loaded.model)
      with pinned_arch(GPUS[gpu][1]):
        if name == "generate":
          lowered = plain.generate_jit.lower(g, sds(s), sds(req), steps=steps, capacity=cap,
                                             pad_id=plain.resolve_pad_id(loaded.model.config, None))
        else:
          dg, ds = nnx.split(draft)
          lowered = speculative.spec_generate_jit.lower(
              g, sds(s), dg, sds(ds), sds(req), k=3, steps=steps, capacity=cap + 4,
              pad_id=plain.resolve_pad_id(loaded.model.config, None))
        t = time.perf_counter()
        lowered.compile()
        row["compile_s"] = round(time.perf_counter() - t, 1)
      # The dump of the module just compiled: the newest one of that jit's name.
      hint = "jit__generate" if name == "generate" else "jit__spec_generate"
      row.update(loop_placement(thunk_text(dump_dir, hint)), status="ok")
    except Exception as e:
      row["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(_row_line(row), flush=True)
  return rows


def kernels_check(args, gpu: str) -> list[dict]:
  """One row per op: its distinct sweep configurations compiled for `gpu`, through ptxas."""
  import jax
  from jax.sharding import SingleDeviceSharding

  from maverick import kernel_sweep as ks
  (device,) = gpu_devices(gpu, 1)
  arch = GPUS[gpu][1]
  reps: dict = {}
  for case in ks.cases(archs=(arch,)):
    plan = ks.plan(case)
    if plan.supported:
      reps.setdefault(ks.config_key(case, plan), case)
  rows = []
  for op in ("gemm", "grouped_gemm", "prefill_attention", "decode_attention"):
    cases = [c for c in reps.values() if c.op == op]
    row = {"gpu": gpu, "program": f"{op}: {len(cases)} kernel configs", "kernels": "pallas"}
    kernels, spilling, failed = [], [], []
    t = time.perf_counter()
    for case in cases:
      fn, sds = ks.call(case)
      sds = [None if a is None else jax.ShapeDtypeStruct(
          a.shape, a.dtype, sharding=SingleDeviceSharding(device)) for a in sds]
      try:
        with pinned_arch(arch), captured_fds() as fds:
          jax.jit(fn).lower(*sds).compile()
      except Exception as e:  # recorded with its case: the other configs still compile
        failed.append(f"{case.describe()}: {type(e).__name__}: {str(e)[:200]}")
        continue
      found = ptxas_kernels(fds[0])
      kernels += found
      spilling += [f"{case.describe()} ({k['spill_store_bytes']} B)" for k in found
                   if k["spill_store_bytes"]]
    row.update(compile_s=round(time.perf_counter() - t, 1), ptxas_kernels=len(kernels),
               max_registers=max((k["registers"] for k in kernels), default=0),
               spill_store_bytes=sum(k["spill_store_bytes"] for k in kernels),
               setmaxnreg_ignored=sum(k["setmaxnreg_ignored"] for k in kernels),
               spilling=spilling, status="ok" if not failed else f"failed: {failed[:3]}")
    rows.append(row)
    print(_row_line(row), flush=True)
  return rows


def _row_line(row: dict) -> str:
  return " | ".join(f"{k}={v}" for k, v in row.items())


def plan_memory_cpu(args) -> str:
  """plan_memory.py's own numbers for the same step (8 CPU devices, its model of FP8)."""
  import subprocess
  env = cli.child_env(dict(os.environ, JAX_PLATFORMS="cpu",
                           XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  env.pop("MOSAIC_GPU_DUMP_PTXAS", None)
  cmd = [*cli.command_argv("plan_memory"), "--config", "maverick", "--quant", "fp8", "--mesh", "8",
         "--context", str(args.context), "--batch", str(args.batch)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
  return (proc.stdout or proc.stderr).strip()


def _collectives_cell(row: dict) -> str:
  if "xla_collectives" not in row:
    return "-"
  return ", ".join(f"{len(shapes)} {k}" for k, shapes in row["xla_collectives"].items()) or "none"


def report(rows: list[dict], plan_text: str, argv) -> str:
  lines = ["# GPU programs compiled without a GPU", "",
           f"`python scripts/gpu_compile_check.py {' '.join(argv)}`", "",
           "| gpu | program | kernels | compile s (of which lowering) | whole-KV copies/transposes | Mosaic kernels | "
           "XLA collectives | ptxas kernels / max regs / spill bytes | XLA temp GB | "
           "while in command buffer | host-driven while | host transfers | status |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ptx = (f"{r['ptxas_kernels']} / {r['max_registers']} / {r['spill_store_bytes']}"
           if "max_registers" in r else "-")
    lines.append(
        f"| {r['gpu']} | {r['program']} | {r.get('kernels', '-')} | {r.get('compile_s', '-')} "
        f"({r.get('lowering_s', '-')}) | {r.get('whole_kv_moves', '-')} | {r.get('mosaic_kernels', '-')} | "
        f"{_collectives_cell(r)} | {ptx} | {r['xla_temp_GB']:.2f} |" if "xla_temp_GB" in r else
        f"| {r['gpu']} | {r['program']} | {r.get('kernels', '-')} | {r.get('compile_s', '-')} | "
        f"- | - | - | {ptx} | - |")
    lines[-1] += (f" {r.get('while_in_command_buffer', '-')} | {r.get('while_host_driven', '-')} | "
                  f"{r.get('host_transfers', '-')} | {str(r['status'])[:120]} |")
  counted = [r for r in rows if "launches" in r]
  if counted:
    lines += ["", "Kernel launches (maverick.launches: every kernel node of XLA's thunk sequence, "
              "a `while` body times its trip count; a generate loop per iteration of its decode "
              "loop; each `conditional` at its smallest branch (greedy skips the sampling "
              "filters), and in the next column at its largest; per layer = launches / decoder "
              "layers, embedding and head included):", "",
              "| gpu | program | kernels | launches | largest branches | per layer | "
              "by kind (top 8) |",
              "|---|---|---|---|---|---|---|"]
    for r in counted:
      kinds = ", ".join(f"{k} {n}" for k, n in list(r["launches_by_kind"].items())[:8])
      unknown = (f" ({r['unknown_trip_whiles']} loops of unknown trip count counted once)"
                 if r["unknown_trip_whiles"] else "")
      lines.append(f"| {r['gpu']} | {r['program']} | {r['kernels']} | {r['launches']}{unknown} | "
                   f"{r['launches_largest']} | {r['launches_per_layer']} | {kinds} |")
  lines += modeled_table(rows)
  spilling = [f"- {r['gpu']}: {c}" for r in rows for c in r.get("spilling", [])]
  if spilling:
    lines += ["", "Kernel configurations that spill registers (ptxas):", "", *spilling]
  if plan_text:
    lines += ["", "plan_memory.py (8 CPU devices, same batch and context):", "", "```", plan_text,
              "```"]
  return "\n".join(lines) + "\n"


ACCEPTANCE = 3.0  # the modeled K=3 round's mean accepted length (bonus token included): stated


def modeled_table(rows: list[dict]) -> list[str]:
  """Modeled step times and tokens/s per user (maverick.step_model), per GPU and kernel path."""
  from maverick import step_model
  steps = {(r["gpu"], r["kernels"], r["program_key"]): r for r in rows if "modeled_ms" in r}
  if not steps:
    return []
  out = ["", "Modeled, NOT measured (maverick.step_model): step = max(bytes read / HBM bandwidth, "
         "flops / FP8 peak) + launches x per-launch cost; "
         f"{step_model.LAUNCH_US:.2f} us a launch (calibrated once on an H200), "
         f"{step_model.PDL_LAUNCH_US} us with PDL (an assumption); K=3 rounds = verify + 3 draft "
         f"steps emitting {ACCEPTANCE} tokens (an assumed acceptance length):", "",
         "| gpu | kernels | program | launches | GB read / device | ms | ms with PDL |",
         "|---|---|---|---|---|---|---|"]
  for (gpu, kernels, program), r in steps.items():
    out.append(f"| {gpu} | {kernels} | {program} | {r['launches']} | {r['bytes_read_GB']} | "
               f"{r['modeled_ms']} | {r['modeled_ms_pdl']} |")
  out += ["", "| gpu | kernels | plain tokens/s/user | with PDL | K=3 tokens/s/user | with PDL |",
          "|---|---|---|---|---|---|"]
  for gpu, kernels in dict.fromkeys((g, k) for g, k, _ in steps):
    get = lambda p, key: steps.get((gpu, kernels, p), {}).get(key)
    cells = []
    for key in ("modeled_ms", "modeled_ms_pdl"):
      step = get("step", key)
      cells.append(f"{1e3 / step:.0f}" if step else "-")
    for key in ("modeled_ms", "modeled_ms_pdl"):
      verify, draft = get("verify", key), get("draft", key)
      cells.append(f"{step_model.spec_tokens_per_s(verify / 1e3, draft / 1e3, SPEC_K, ACCEPTANCE):.0f}"
                   if verify and draft else "-")
    out.append(f"| {gpu} | {kernels} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
  return out


def child_argv(argv: list[str], gpu: str, rows_json: str) -> list[str]:
  """`argv` for one GPU's child: the same checks, `--gpus` replaced, rows written as JSON."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a in ("--gpus", "--rows_json"):
      skip = True
      continue
    if a.startswith(("--gpus=", "--rows_json=")):
      continue
    out.append(a)
  return out + ["--gpus", gpu, "--rows_json", rows_json]


def _gpu_in_child(argv: list[str], gpu: str) -> list[dict]:
  import subprocess
  with tempfile.TemporaryDirectory() as tmp:
    rows_json = os.path.join(tmp, "rows.json")
    cmd = [*cli.command_argv("gpu_compile_check"), *child_argv(argv, gpu, rows_json)]
    proc = subprocess.run(cmd, env=cli.child_env())
    if proc.returncode != 0 or not os.path.exists(rows_json):
      return [dict(gpu=gpu, program="(all)", status=f"failed: the {gpu} child process exited "
                   f"{proc.returncode}")]
    return json.loads(pathlib.Path(rows_json).read_text())


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = _parse(argv)
  # MAVERICK_GPU_DUMP_DIR: keep XLA's dumps (thunk sequences, HLO) there to read them afterwards.
  dump_dir = os.environ.get("MAVERICK_GPU_DUMP_DIR") or tempfile.mkdtemp(prefix="gpu_compile_check-")
  _environment(dump_dir)
  gpus = args.gpus.split(",")
  if len(gpus) > 1:
    # One process per GPU: after compiling for H200, Mosaic's kernels for B200 failed ptxas in the
    # same process ("SM version specified by .target is higher than default SM version").
    rows = [row for gpu in gpus for row in _gpu_in_child(argv, gpu)]
  else:
    rows = []
    if "decode" in args.checks:
      rows += decode_check(args, gpus[0], dump_dir)
    if "loops" in args.checks:
      rows += loops_check(args, gpus[0], dump_dir)
    if "kernels" in args.checks:
      rows += kernels_check(args, gpus[0])
  if args.rows_json:
    pathlib.Path(args.rows_json).write_text(json.dumps(rows))
    return 0
  plan_text = plan_memory_cpu(args) if "decode" in args.checks else ""
  text = report(rows, plan_text, argv)
  print(text)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  tmp.write_text(text)
  os.replace(tmp, out)
  return 0


def console_main() -> None:
  """The console entry point `maverick-gpu-compile-check`."""
  sys.exit(main())


if __name__ == "__main__":
  console_main()
