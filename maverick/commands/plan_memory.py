"""Plans per-device memory of the full-size decode step and speculative round on a device mesh.

Lowers and compiles the real programs with ShapeDtypeStruct inputs (no weights allocated), on fake
CPU devices when no accelerator is present, and prints per-device weight, KV-cache and temporary
bytes and whether they fit a B200 (180 GB) / H200 (141 GB).

Examples:
  python scripts/plan_memory.py --config maverick --mesh 8 --quant fp8 --context 131072 --batch 8
  python scripts/plan_memory.py --config scout --mesh 4 --quant fp8 --context 131072 --batch 8
  python scripts/plan_memory.py --config maverick --quant fp8-modelopt --mesh 8 --draft nvidia-eagle3
  python scripts/plan_memory.py --config maverick --mesh 8 --layout ep --tensor 1 --quant bf16

Serving view (--serving; nothing compiled): KV bytes per token per device and how many requests
fit at once for a stated length mix, contiguous at --context vs paged vs paged + chunk-local:
  python scripts/plan_memory.py --config maverick --mesh 8 --quant fp8 --serving

Run as `maverick-plan-memory` (an installed maverick-jax's console script), as
`python -m maverick.commands.plan_memory`, or from a source checkout as
`python scripts/plan_memory.py`.
"""

import math
import os

import numpy as np

from absl import flags

from maverick import cli  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "maverick", "Model preset (maverick, scout, tiny, ...) or "
                              "a Hugging Face config.json / directory.")
_MESH = flags.DEFINE_integer("mesh", 8, "Model-parallel devices (tensor x expert).")
_DATA = flags.DEFINE_integer("data", 1, "Data-parallel replicas (batch split over them).")
_LAYOUT = flags.DEFINE_enum("layout", "tp", ["tp", "ep"], "tp: every expert split over all "
                            "devices (min latency); ep: experts spread over devices (throughput).")
_TENSOR = flags.DEFINE_integer("tensor", None, "With --layout ep: tensor-parallel size inside "
                               "each expert group (default 1: --mesh devices all on experts).")
_QUANT = flags.DEFINE_enum(
    "quant", "fp8", ["bf16", "fp8", "fp8-modelopt"],
    "Weight format of linears/experts. fp8-modelopt: NVIDIA's ModelOpt FP8 checkpoint as imported "
    "(FP8 weights, per-channel f32 scales, a static f32 input scale per weight; router, lm_head "
    "and embeddings BF16).")
_KV_CACHE = flags.DEFINE_enum(
    "kv_cache", "auto", ["auto", "bf16", "fp8", "fp8_static"],
    "KV cache format. auto: what maverick.load picks, fp8_static with --quant fp8-modelopt (a "
    "ModelOpt checkpoint with kv_cache_quant_algo FP8), bf16 otherwise. bf16: unquantized, in "
    "the model dtype (--dtype), no scales (generate.py --kv_cache bf16); fp8: e4m3 plus an f32 "
    "scale per token and KV head; fp8_static: e4m3 with per-layer scalar scales.")
_DRAFT = flags.DEFINE_enum(
    "draft", "nvidia-eagle3", ["nvidia-eagle3"],
    "Draft head of the speculative round: NVIDIA's EAGLE-3 head for the target (BF16, full "
    "vocabulary lm_head, one decoder layer shaped like the target's).")
_CONTEXT = flags.DEFINE_integer("context", 131072, "KV cache positions per sequence.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences decoded together.")
_SPEC_K = flags.DEFINE_integer("spec_k", 3, "Draft tokens per speculative round (0: no round).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(cli.DTYPE_CHOICES),
                           "Model (activation, KV, non-quantized) dtype.")
_JSON = flags.DEFINE_string("json_out", None, "Also write the numbers to this JSON file.")
_VISION_TILES = flags.DEFINE_integer(
    "vision_tiles", 0, "Also plan the vision tower (replicated on every device) over this many "
    "image tiles of one prefill (Maverick: up to 17 per image); 0: text only. Needs a preset with a "
    "tower (maverick, scout, tiny) or a multimodal config.json.")
_SERVING = flags.DEFINE_bool(
    "serving", False, "Serving view instead of the compiled programs: concurrent requests per "
    "device (B200, H200) for bf16 and fp8 KV under three layouts: contiguous rows of --context "
    "positions, paged (blocks for each request's length), paged + chunk-local (chunked layers "
    "hold only the current chunk). By formula; the output names the Engine options behind "
    "each column.")
_PROMPT_MEDIAN = flags.DEFINE_float("prompt_median", 2048, "--serving: median prompt tokens.")
_PROMPT_SIGMA = flags.DEFINE_float("prompt_sigma", 1.0, "--serving: sigma of log prompt length.")
_OUTPUT_MEDIAN = flags.DEFINE_float("output_median", 512, "--serving: median output tokens.")
_OUTPUT_SIGMA = flags.DEFINE_float("output_sigma", 0.7, "--serving: sigma of log output length.")
_RESERVE_GB = flags.DEFINE_float(
    "reserve_gb", 8.0, "--serving: HBM per device kept for activations, XLA temporaries and "
    "workspace (stated, not measured; the compiled speculative round's temporaries are ~2 GB "
    "at batch 8 on CPU).")
_BLOCK = flags.DEFINE_integer("block_size", 64, "--serving: KV block positions (the decode "
                              "attention kernel's BLOCK_KV).")


def _config():
  from maverick import config as config_lib
  name = _CONFIG.value
  if name in config_lib.PRESETS:
    return config_lib.preset(name).replace(dtype=_DTYPE.value)
  if os.path.exists(name):
    return config_lib.from_hf(name, dtype=_DTYPE.value)
  raise cli.UsageError(f"--config {name!r} is neither a preset ({', '.join(config_lib.PRESETS)}) "
                       "nor a Hugging Face config path")


def _vision_config():
  import json

  from maverick.vision import model as vision_lib
  name = _CONFIG.value
  vcfg = None
  if name in ("maverick", "scout"):
    vcfg = vision_lib.maverick()  # the same published tower
  elif name == "tiny":
    vcfg = vision_lib.tiny()
  elif os.path.exists(name):
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    with open(path) as f:
      vcfg = vision_lib.from_hf(json.load(f))
  if vcfg is None:
    raise cli.UsageError(f"--vision_tiles: --config {name!r} has no vision tower")
  return vcfg.replace(dtype=_DTYPE.value)


# Fake CPU devices take XLA's CPU client long to make (4096: 20 s, 100000: over 5 minutes) and no
# NVLink domain comes near this many.
MAX_DEVICES = 1024


def _mesh_sizes() -> dict[str, int]:
  """The mesh the flags ask for, as axis sizes."""
  for name, v in (("mesh", _MESH.value), ("data", _DATA.value), ("context", _CONTEXT.value),
                  ("batch", _BATCH.value)):
    if v < 1:
      raise cli.UsageError(f"--{name} must be >= 1, got {v}")
  if _SPEC_K.value < 0:
    raise cli.UsageError(f"--spec_k must be >= 0, got {_SPEC_K.value}")
  n = _MESH.value
  if _LAYOUT.value == "tp":
    if _TENSOR.value not in (None, n):
      raise cli.UsageError("--tensor is for --layout ep; with tp all --mesh devices are tensor")
    return dict(data=_DATA.value, expert=1, tensor=n)
  t = _TENSOR.value or 1
  if n % t:
    raise cli.UsageError(f"--tensor {t} does not divide --mesh {n}")
  return dict(data=_DATA.value, expert=n // t, tensor=t)


def _check(cfg, sizes: dict[str, int]) -> None:
  """Refuses before any device is made what the plan would refuse after making them all (the
  same checks as generation: the mesh must divide the model, --spec_k stays within its limit)."""
  from jax.sharding import AbstractMesh

  from maverick import memory_plan
  from maverick import sharding
  from spec_decode import speculative

  if _SPEC_K.value:
    speculative.check_chain_k(_SPEC_K.value)
  plan = sharding.Plan(AbstractMesh(tuple(sizes[a] for a in sharding.AXES), sharding.AXES),
                       _LAYOUT.value)
  sharding.check_model_fits(cfg, plan)
  if _SPEC_K.value:
    sharding.check_model_fits(memory_plan.nvidia_eagle3(cfg).layer, plan, "draft")
  if _BATCH.value % _DATA.value:
    raise cli.UsageError(f"--data {_DATA.value} does not divide --batch {_BATCH.value}: each "
                         "replica decodes batch/data sequences; choose a divisor of --batch")
  needed = math.prod(sizes.values())
  if needed > MAX_DEVICES:
    raise cli.UsageError(f"the mesh needs {needed} devices, past the {MAX_DEVICES} this plan "
                         "makes; lower --mesh / --data")


def _request_cpu_devices(n: int) -> None:
  """Fake CPU devices for the mesh when no accelerator is present: set before jax starts its
  backend (XLA reads XLA_FLAGS once); a device count already in XLA_FLAGS wins."""
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={n}").strip()


def run(cfg, sizes: dict[str, int]) -> str:
  import dataclasses
  import json

  import jax

  from maverick import memory_plan
  from maverick import sharding

  needed = math.prod(sizes.values())
  if needed > jax.device_count():
    raise cli.UsageError(f"the mesh needs {needed} devices, {jax.device_count()} are present")
  mesh = sharding.make_mesh(devices=jax.devices()[:needed], **sizes)
  plan = sharding.Plan(mesh, _LAYOUT.value)
  kv_cache = _KV_CACHE.value
  if kv_cache == "auto":
    kv_cache = "fp8_static" if _QUANT.value == "fp8-modelopt" else "bf16"
  kw = dict(batch=_BATCH.value, context=_CONTEXT.value, quant=_QUANT.value, kv_cache=kv_cache)
  reports = [memory_plan.plan_decode_step(cfg, plan, **kw)]
  if _SPEC_K.value:
    reports.append(memory_plan.plan_spec_round(cfg, plan, k=_SPEC_K.value,
                                               draft_config=memory_plan.nvidia_eagle3(cfg), **kw))
  if _VISION_TILES.value:
    reports.append(memory_plan.plan_vision_prefill(_vision_config(), plan,
                                                   tiles=_VISION_TILES.value))
  mesh_desc = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
  kv_desc = f"unquantized {cfg.dtype}" if kv_cache == "bf16" else kv_cache
  title = (f"{_CONFIG.value} {_QUANT.value}, KV cache {kv_desc}, layout {_LAYOUT.value} "
           f"({mesh_desc}), context {_CONTEXT.value} x batch {_BATCH.value}, per device:")
  text = memory_plan.format_reports(title, reports)
  if _SPEC_K.value:
    text += "\n" + memory_plan.describe_draft(memory_plan.nvidia_eagle3(cfg))
  if _QUANT.value == "fp8-modelopt":
    text += "\nstatic input scales included in weights"
  if kv_cache == "fp8_static":
    text += "\nKV cache e4m3 with per-layer scalar scales (in weights), no per-token scales"
  if _JSON.value:
    cli.write_atomic(_JSON.value, json.dumps({
        "config": _CONFIG.value, "layout": _LAYOUT.value, "mesh": dict(mesh.shape),
        "quant": _QUANT.value, "kv_cache": kv_cache, "context": _CONTEXT.value,
        "batch": _BATCH.value,
        "draft": _DRAFT.value if _SPEC_K.value else None,
        "reports": [dict(dataclasses.asdict(r), total_bytes=r.total_bytes) for r in reports]},
        indent=1))
  return text


def _length_mix():
  from maverick import memory_plan
  return memory_plan.LengthMix(_PROMPT_MEDIAN.value, _PROMPT_SIGMA.value, _OUTPUT_MEDIAN.value,
                               _OUTPUT_SIGMA.value, cap=_CONTEXT.value)


def _check_serving(cfg) -> None:
  """--serving's own flags, refused before any device is made."""
  if _VISION_TILES.value:  # the serving view is text KV by formula; the tower is a program
    raise cli.UsageError("--vision_tiles plans the vision tower's compiled prefill; it does not "
                         "apply to --serving (run without --serving to plan it)")
  if _BLOCK.value < 1 or cfg.attention_chunk_size % _BLOCK.value:
    raise cli.UsageError(f"--block_size {_BLOCK.value} must be >= 1 and divide the chunk size "
                         f"{cfg.attention_chunk_size} (a block never straddles a chunk)")
  if _RESERVE_GB.value < 0:
    raise cli.UsageError(f"--reserve_gb must be >= 0, got {_RESERVE_GB.value}")
  try:
    _length_mix()
  except ValueError as e:
    raise cli.UsageError(f"--prompt_median/--prompt_sigma/--output_median/--output_sigma: {e}")


def run_serving(cfg, sizes: dict[str, int]) -> str:
  import dataclasses
  import json

  import jax

  from maverick import memory_plan
  from maverick import sharding

  mix = _length_mix()
  needed = math.prod(sizes.values())
  mesh = sharding.make_mesh(devices=jax.devices()[:needed], **sizes)
  plan = sharding.Plan(mesh, _LAYOUT.value)
  dcfg = memory_plan.nvidia_eagle3(cfg) if _SPEC_K.value else None
  weights = memory_plan.serving_weight_bytes(cfg, plan, _QUANT.value, dcfg)
  slack = _SPEC_K.value + 1  # a round writes K+1 positions past the committed length
  rows = memory_plan.plan_serving(cfg, tensor=sizes["tensor"], weight_bytes=weights, mix=mix,
                                  slack=slack, draft_config=dcfg, block=_BLOCK.value,
                                  reserve_bytes=_RESERVE_GB.value * memory_plan.GB)
  prompts, lengths = mix.sample()
  n_chunked = sum(cfg.is_chunked(i) for i in range(cfg.num_hidden_layers))
  blocks = memory_plan.expected_blocks(prompts, lengths, slack=slack, block=_BLOCK.value)
  local = memory_plan.expected_blocks(prompts, lengths, slack=slack, block=_BLOCK.value,
                                      chunk=cfg.attention_chunk_size)
  mesh_desc = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
  draft = f"EAGLE-3 K={_SPEC_K.value}" if _SPEC_K.value else "no draft"
  title = (f"SERVING PLAN (by formula, not measured): {_CONFIG.value} {_QUANT.value}, "
           f"layout {_LAYOUT.value} ({mesh_desc}), {draft}, per device\n"
           f"layers: {cfg.num_hidden_layers - n_chunked} global + "
           f"{'1 draft (bf16) ' if dcfg else ''}| {n_chunked} chunk-local (chunk "
           f"{cfg.attention_chunk_size}); block {_BLOCK.value} positions; round window {slack}\n"
           f"length mix: {mix.describe()}\n"
           f"  lengths: mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, p99 "
           f"{np.percentile(lengths, 99):.0f}; expected blocks per request: {blocks:.2f} "
           f"(global), {local:.2f} (chunk-local) vs "
           f"{-(-(_CONTEXT.value + slack) // _BLOCK.value)} contiguous\n"
           f"free = HBM - weights - {_RESERVE_GB.value:g} GB reserve (activations, temporaries); "
           f"columns contiguous / paged / paged+chunk-local: concurrent requests\n"
           f"  contiguous = Engine() (max_seq_len {_CONTEXT.value}); paged = Engine(kv_layout="
           f"'paged', block_size={_BLOCK.value}, num_blocks=requests x expected global blocks, "
           f"preemption=True: blocks grow with each request); paged+chunk-local = the same + "
           f"num_chunked_blocks=requests x expected chunk-local blocks (Engine prefills a "
           f"prompt whole, so a prompt briefly holds all its chunked blocks: the plan assumes a "
           f"chunk at a time)")
  text = memory_plan.format_serving(title, rows)
  if _JSON.value:
    cli.write_atomic(_JSON.value, json.dumps({
        "config": _CONFIG.value, "quant": _QUANT.value, "mesh": dict(mesh.shape),
        "mix": dataclasses.asdict(mix), "slack": slack, "block_size": _BLOCK.value,
        "expected_blocks": blocks, "expected_chunk_local_blocks": local,
        "rows": [dict(dataclasses.asdict(r), free_bytes=r.free_bytes) for r in rows]}, indent=1))
  return text


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("plan_memory.py", _main, argv)


def _main(argv):
  from maverick.sharding_plan import ShardingError
  try:  # the flags, checked before any device is made: each error names its flag
    cfg = _config()
    sizes = _mesh_sizes()
    _check(cfg, sizes)
    if _SERVING.value:
      _check_serving(cfg)
  except ValueError as e:  # UsageError, ConfigError, ShardingError, a draft depth past the limit
    return cli.fail("plan_memory.py", e)
  _request_cpu_devices(math.prod(sizes.values()))
  try:
    cli.start(argv)
    print(run_serving(cfg, sizes) if _SERVING.value else run(cfg, sizes))
  except (cli.UsageError, ShardingError) as e:
    return cli.fail("plan_memory.py", e)
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-plan-memory`

if __name__ == "__main__":
  console_main()
