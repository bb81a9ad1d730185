"""Per-device memory of the full-size decode step and speculative round, from compiled executables.

Nothing is allocated: every input is a `ShapeDtypeStruct` carrying its `NamedSharding`, the step is
lowered and compiled for the mesh (8 fake CPU devices do), and the sizes come from the shard shapes
(weights, KV) and from the executable's memory analysis (temporaries). The KV cache is donated, as
in the generate loop, so it is counted once.

FP8 (`quant="fp8"`): the linears and experts are float8_e4m3fn with a float32 scale per output
channel; embeddings, lm_head, router and norms stay in the model dtype. Each layer dequantizes its
own weights just before use (`quantized_weight` is the one place that decides what is quantized, so
it can later point at the real quantization config). On GPU an FP8 GEMM reads the fp8 weights
directly; on CPU XLA materialises one layer's dequantized copy, so CPU temp bytes over-count that.

FP8 ModelOpt (`quant="fp8-modelopt"`, NVIDIA's record checkpoint as maverick imports it): the same
FP8 weights (the per-tensor weight scale is broadcast to our per-output-channel f32 scales), plus one
static f32 input scale per quantized weight; router, lm_head and embeddings stay BF16.

KV cache (`kv_cache`): "bf16" (or None) counts it unquantized, in the model dtype; "fp8" in e4m3
plus an f32 scale per token and kv head; "fp8_static" in e4m3 alone, with two f32 scalars per layer
in the weights (ModelOpt's k/v scales; what maverick loads a ModelOpt checkpoint with
`kv_cache_quant_algo: FP8` as). The draft head's cache stays in the model dtype.

Draft (`nvidia_eagle3(cfg)`): NVIDIA's EAGLE-3 head for Maverick as published facts describe it
(research/nvidia_checkpoints.md): BF16, fc 3*hidden -> hidden, one decoder layer with the target's
heads / KV heads / head_dim, its own lm_head over the full target vocabulary, the target's embedding
shared; its MLP width is not published and is assumed to be the target's dense MLP width.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick import sampling
from maverick import sharding
from maverick.config import Config
from maverick.quant import config as quant_config
from maverick.vision import model as vision_lib
from spec_decode import draft as draft_lib
from spec_decode import speculative
from spec_decode.verify import Candidates, chain_parents, verify_chain

GB = 1e9
# Usable HBM per device (decimal GB): DGX B200 lists 180 GB per GPU, H200 141 GB.
DEVICES_HBM = {"B200": 180 * GB, "H200": 141 * GB}
QUANTS = ("bf16", "fp8", "fp8-modelopt")
FP8_QUANTS = ("fp8", "fp8-modelopt")
DRAFTS = ("nvidia-eagle3",)
FP8 = jnp.float8_e4m3fn
SCALE_DTYPE = jnp.float32


def quantized_weight(path: tuple, axes: tuple) -> tuple[int, ...] | None:
  """For a weight quantized to FP8, the dims its per-output-channel scale reduces over (the
  contracting dims); None when the weight stays in the model dtype."""
  name = str(path[-1])
  if not axes:  # scalars (static KV-cache scales) are never quantized
    return None
  if "attn" in map(str, path) or (len(path) >= 2 and str(path[-2]) in ("ffn", "shared")
                                  and name in ("gate", "up", "down")):
    if axes[-1] == "embed":  # output projections: contract everything but experts and D
      return tuple(i for i, a in enumerate(axes[:-1]) if a != "experts")
    return tuple(i for i, a in enumerate(axes) if a == "embed")
  return None


@dataclasses.dataclass
class Report:
  name: str  # "decode step" or "speculative round"
  weight_bytes: int  # per device: parameters (+ FP8 scales), target and draft
  kv_bytes: int  # per device: target + draft KV caches
  temp_bytes: int  # per device: XLA temporaries of the compiled step
  argument_bytes: int  # per device, from the executable (weights + caches + small inputs)
  output_bytes: int
  alias_bytes: int  # outputs written in place of donated inputs (the caches)
  # fp8-modelopt: the static input scales (f32 scalars, replicated). Counted in weight_bytes; added
  # to the total here because the compiled step does not read them (XLA prunes unused inputs).
  static_scale_bytes: int = 0

  @property
  def total_bytes(self) -> int:
    return (self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes
            + self.static_scale_bytes)

  def fits(self, hbm: float) -> bool:
    return self.total_bytes <= hbm


def _key(path) -> str:
  return "/".join(map(str, path))


def _shard_bytes(sds: jax.ShapeDtypeStruct) -> int:
  shape = sds.sharding.shard_shape(sds.shape) if sds.sharding is not None else sds.shape
  return math.prod(shape) * jnp.dtype(sds.dtype).itemsize


def abstract_state(module, plan: sharding.Plan, quant: str):
  """(graphdef, state of sharded ShapeDtypeStructs, scales {path: sds}) for an abstract module."""
  graphdef, state = nnx.split(module)
  flat, scales = [], {}
  for path, var in nnx.to_flat_state(state):
    axes = var.get_metadata().get("logical_axes", (None,) * len(var.shape))
    spec = plan.spec(axes)
    sharding._check_param(path, var.shape, spec, plan)
    dtype = var.dtype
    reduce = quantized_weight(path, axes) if quant in FP8_QUANTS else None
    if reduce is not None:
      dtype = FP8
      keep = [i for i in range(len(var.shape)) if i not in reduce]
      scales[_key(path)] = jax.ShapeDtypeStruct(
          tuple(var.shape[i] for i in keep), SCALE_DTYPE,
          sharding=NamedSharding(plan.mesh, PartitionSpec(*(spec[i] for i in keep))))
    sds = jax.ShapeDtypeStruct(var.shape, dtype, sharding=NamedSharding(plan.mesh, spec))
    flat.append((path, var.replace(value=sds)))
  return graphdef, nnx.from_flat_state(flat), scales


def _dequantized(w, scale, path, axes, dtype):
  shape = list(w.shape)
  for i in quantized_weight(path, axes):
    shape[i] = 1
  return w.astype(dtype) * scale.reshape(shape).astype(dtype)


def merge_quantized(graphdef, state, scales: dict, dtype):
  """nnx.merge, then each decoder layer dequantizes its own FP8 weights when it runs. An
  optimization barrier ties them to the layer's input, so XLA cannot dequantize every layer up front
  (which would count a full model-dtype copy of the weights as temporaries)."""
  model = nnx.merge(graphdef, state)
  if not scales:
    return model
  pending: dict[int, list] = {}
  for path, var in nnx.to_flat_state(state):
    if _key(path) in scales:
      layer = model.layers[int(path[1])]
      node = layer
      for p in path[2:]:
        node = getattr(node, str(p))
      pending.setdefault(id(layer), []).append(
          (node, scales[_key(path)], path, var.get_metadata()["logical_axes"]))

  base = type(model.layers[0])

  class DequantizingLayer(base):
    def __call__(self, x, *args, **kw):
      entries = pending.pop(id(self), [])
      if entries:
        x, *ws = jax.lax.optimization_barrier((x, *[e[0].get_value() for e in entries]))
        for (var, scale, path, axes), w in zip(entries, ws):
          var.set_value(_dequantized(w, scale, path, axes, dtype))
      return super().__call__(x, *args, **kw)

  for layer in model.layers:
    layer.__class__ = DequantizingLayer
  return model


def with_kv_cache(cfg: Config, kv_cache: str | None) -> Config:
  """`cfg` whose KV cache (and static KV scales) follow `kv_cache`; weights are planned apart."""
  if kv_cache in (None, quant_config.UNQUANTIZED_KV):
    return cfg
  if kv_cache not in quant_config.KV_FORMATS:
    raise ValueError(f"kv_cache {kv_cache!r}: use one of {quant_config.KV_CHOICES} or None")
  return cfg.replace(quant=quant_config.QuantConfig(weights=None, kv_cache=kv_cache))


def _cache_sds(cfg: Config, plan: sharding.Plan, batch: int, capacity: int, num_layers=None,
               dtype=None):
  abstract = jax.eval_shape(lambda: kvc.KVCache.init(cfg, batch, capacity, dtype=dtype,
                                                     num_layers=num_layers))
  row = plan.batch_axis(batch)
  kv = NamedSharding(plan.mesh, PartitionSpec(row, None, plan.rules["kv_heads"], None))
  per_token = NamedSharding(plan.mesh, PartitionSpec(row, None, plan.rules["kv_heads"]))
  lengths = NamedSharding(plan.mesh, PartitionSpec(row))
  sds = lambda xs, sh: None if xs is None else tuple(
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x in xs)
  return kvc.KVCache(
      k=sds(abstract.k, kv), v=sds(abstract.v, kv),
      lengths=jax.ShapeDtypeStruct(abstract.lengths.shape, jnp.int32, sharding=lengths),
      k_scale=sds(abstract.k_scale, per_token), v_scale=sds(abstract.v_scale, per_token))


def _tree_bytes(tree) -> int:
  return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


def _state_bytes(state) -> int:
  return sum(_shard_bytes(v.get_value()) for _, v in nnx.to_flat_state(state))


def static_scale_bytes(scales: dict, quant: str) -> int:
  """fp8-modelopt: one f32 static input scale per FP8 weight (each a replicated scalar)."""
  return 4 * len(scales) if quant == "fp8-modelopt" else 0


def nvidia_eagle3(cfg: Config):
  """NVIDIA's EAGLE-3 head for `cfg` (see the module docstring; MLP width assumed)."""
  return draft_lib.Eagle3Config.for_target(cfg, draft_vocab_size=cfg.vocab_size,
                                           dtype="bfloat16")


def describe_draft(dcfg) -> str:
  c = dcfg.layer
  return (f"draft: NVIDIA EAGLE-3 head, bf16: fc {3 * dcfg.target_hidden_size} -> "
          f"{dcfg.hidden_size}, 1 decoder layer ({c.num_attention_heads} heads, "
          f"{c.num_key_value_heads} KV heads, head_dim {c.head_dim}, MLP {c.intermediate_size_mlp}"
          f" - assumed: the target's dense MLP width, NVIDIA's is not published), own lm_head over "
          f"{dcfg.draft_vocab_size} tokens, embedding shared with the target, its own KV cache")


def _report(name, compiled, weight_bytes, kv_bytes, static=0) -> Report:
  m = compiled.memory_analysis()
  return Report(name, weight_bytes + static, kv_bytes, int(m.temp_size_in_bytes),
                int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                int(m.alias_size_in_bytes), static)


def plan_decode_step(cfg: Config, plan: sharding.Plan, *, batch: int, context: int,
                     quant: str = "bf16", kv_cache: str | None = None) -> Report:
  """One greedy decode step (T=1) against a KV cache of `context` positions."""
  cfg = with_kv_cache(cfg, kv_cache)
  target = model_lib.abstract_model(cfg)
  sharding.check_model_fits(cfg, plan)
  sharding.attach_plan(target, plan)
  graphdef, state, scales = abstract_state(target, plan, quant)
  cache = _cache_sds(cfg, plan, batch, context)
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                                sharding=NamedSharding(plan.mesh, PartitionSpec(
                                    plan.batch_axis(batch), None)))
  dt = jnp.dtype(cfg.dtype)

  def step(state, scales, tokens, cache):
    model = merge_quantized(graphdef, state, scales, dt)
    out = model(tokens, cache=sharding.constrain_cache(cache, plan))
    return jnp.argmax(out.logits[:, -1], -1), sharding.constrain_cache(out.cache, plan)

  compiled = jax.jit(step, donate_argnums=3).lower(state, scales, tokens, cache).compile()
  return _report("decode step", compiled, _state_bytes(state) + _tree_bytes(scales),
                 _tree_bytes(cache), static_scale_bytes(scales, quant))


def plan_spec_round(cfg: Config, plan: sharding.Plan, *, batch: int, context: int, k: int = 3,
                    quant: str = "bf16", draft_config=None, kv_cache: str | None = None) -> Report:
  """One EAGLE-3 round: target verify over K+1 tokens (capturing the aux features), draft extend
  over the verified positions, K chained draft steps; greedy."""
  k = speculative.check_chain_k(k)  # generation's limit: a deeper chain is never run
  dcfg = draft_config or nvidia_eagle3(cfg)
  cfg = with_kv_cache(cfg, kv_cache)
  target = model_lib.abstract_model(cfg)
  draft = draft_lib.abstract_draft(dcfg)
  sharding.check_model_fits(cfg, plan)
  sharding.check_model_fits(dcfg.layer, plan, "draft")
  sharding.attach_plan(target, plan)
  sharding.attach_plan(draft, plan)
  tg, ts, tscales = abstract_state(target, plan, quant)
  dg, ds, _ = abstract_state(draft, plan, "bf16")  # the draft head stays in the model dtype
  cache = _cache_sds(cfg, plan, batch, context)
  dcache = _cache_sds(dcfg.layer, plan, batch, context, num_layers=1)
  rows = NamedSharding(plan.mesh, PartitionSpec(plan.batch_axis(batch)))
  x0 = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
  cand_tokens = jax.ShapeDtypeStruct((batch, k), jnp.int32, sharding=NamedSharding(
      plan.mesh, PartitionSpec(plan.batch_axis(batch), None)))
  dt = jnp.dtype(cfg.dtype)
  V = cfg.vocab_size

  def round_(ts, tscales, ds, x0, cand_tokens, cache, dcache):
    target = merge_quantized(tg, ts, tscales, dt)
    draft = nnx.merge(dg, ds)
    params = sampling.default_params(batch)
    history = sampling.empty_output(batch, V)
    stop_ids = jnp.full((batch, 1), -1, jnp.int32)
    L = cache.lengths
    # Greedy candidates are one-hot: their probabilities only matter through the token ids.
    cand = Candidates(cand_tokens, jax.nn.one_hot(cand_tokens, V, dtype=jnp.float32),
                           chain_parents(k))
    tokens = jnp.concatenate([x0[:, None], cand_tokens], axis=1)
    out = target(tokens, cache=sharding.constrain_cache(cache, plan),
                 capture_layers=dcfg.aux_layer_ids)
    n, nxt = verify_chain(out.logits, cand, params, history, stop_ids)
    emitted = jnp.concatenate([cand_tokens, nxt[:, None]], axis=1)
    dout = draft(emitted, draft.fuse(speculative._features(out.hidden)), target.embed[...],
                 cache=sharding.constrain_cache(dcache, plan).with_lengths(L), logits_at=n)
    new, dcache = speculative.draft_chain(draft, dout.logits, dout.hidden, dout.cache, L + n + 1,
                                          target.embed[...], params, history, stop_ids, k=k,
                                          vocab=V)
    return (n, nxt, new.tokens, sharding.constrain_cache(out.cache, plan),
            sharding.constrain_cache(dcache, plan))

  compiled = jax.jit(round_, donate_argnums=(5, 6)).lower(
      ts, tscales, ds, x0, cand_tokens, cache, dcache).compile()
  weights = _state_bytes(ts) + _tree_bytes(tscales) + _state_bytes(ds)
  return _report("speculative round", compiled, weights, _tree_bytes(cache) + _tree_bytes(dcache),
                 static_scale_bytes(tscales, quant))


def plan_vision_prefill(vcfg, plan: sharding.Plan, *, tiles: int) -> Report:
  """The vision tower over `tiles` tiles (all of a prefill's images): its weights (replicated on
  every device, maverick/vision/model.py) and the temporaries of its forward. The tower runs
  inside the image prefill, so these weights add to the decode step's on each device and its
  temporaries come on top of the text prefill's only while the features are made."""
  graphdef, state, _ = abstract_state(vision_lib.abstract_tower(vcfg), plan, "bf16")
  pixels = jax.ShapeDtypeStruct((tiles, vcfg.num_channels, vcfg.image_size, vcfg.image_size),
                                jnp.float32, sharding=NamedSharding(plan.mesh, PartitionSpec()))
  run = lambda state, pixels: nnx.merge(graphdef, state)(pixels)
  compiled = jax.jit(run).lower(state, pixels).compile()
  return _report(f"vision ({tiles} tiles)", compiled, _state_bytes(state), 0)


def format_reports(title: str, reports, hbm=DEVICES_HBM) -> str:
  gb = lambda b: f"{b / GB:8.2f}"
  lines = [title,
           f"{'program':<18} {'weights GB':>10} {'KV GB':>8} {'temp GB':>8} {'total GB':>9}  "
           + "  ".join(f"fits {d} ({h / GB:.0f} GB)" for d, h in hbm.items())]
  for r in reports:
    fits = "  ".join(f"{('yes' if r.fits(h) else 'NO'):>{len(f'fits {d} ({h / GB:.0f} GB)')}}"
                     for d, h in hbm.items())
    lines.append(f"{r.name:<18} {gb(r.weight_bytes):>10} {gb(r.kv_bytes):>8} "
                 f"{gb(r.temp_bytes):>8} {gb(r.total_bytes):>9}  {fits}")
  return "\n".join(lines)


# --- Serving view (issue 29): concurrent requests per device under three KV layouts -------------
# By formula. Engine(kv_layout="paged", preemption=True) realises the paged column; with
# num_chunked_blocks (a smaller chunk-local pool) the chunk-local column's memory, but Engine
# prefills a prompt whole where this plan assumes a chunk at a time. scripts/plan_memory.py
# --serving prints this per column.


@dataclasses.dataclass(frozen=True)
class LengthMix:
  """Request lengths of the concurrency plan: prompt and output tokens each lognormal (median,
  sigma of the log), their sum capped at `cap` (max_seq_len); `samples` draws with `seed`."""
  prompt_median: float = 2048
  prompt_sigma: float = 1.0  # p99 = median * e^(2.33 sigma): ~21k tokens at the defaults
  output_median: float = 512
  output_sigma: float = 0.7
  cap: int = 131072
  samples: int = 100_000
  seed: int = 0

  def __post_init__(self):
    if min(self.prompt_median, self.output_median, self.cap, self.samples) < 1 or min(
        self.prompt_sigma, self.output_sigma) < 0:
      raise ValueError(f"length mix needs medians, cap and samples >= 1 and sigmas >= 0: {self}")

  def sample(self):
    """(prompt tokens, final lengths) of `samples` requests, int64: prompts capped at cap - 1 so
    every request generates at least one token, prompt + output capped at `cap`."""
    rng = np.random.default_rng(self.seed)
    p = np.ceil(rng.lognormal(math.log(self.prompt_median), self.prompt_sigma, self.samples))
    o = np.ceil(rng.lognormal(math.log(self.output_median), self.output_sigma, self.samples))
    p = np.minimum(p, self.cap - 1)
    return p.astype(np.int64), np.minimum(p + o, self.cap).astype(np.int64)

  def describe(self) -> str:
    return (f"prompt lognormal(median {self.prompt_median:g}, sigma {self.prompt_sigma:g}) + output "
            f"lognormal(median {self.output_median:g}, sigma {self.output_sigma:g}) tokens, capped "
            f"at {self.cap}; {self.samples} draws, seed {self.seed}")


def kv_token_bytes(cfg: Config, tensor: int, kv_cache: str | None) -> int:
  """Bytes one layer's K and V take per token on one device, KV heads split over `tensor`: the
  model dtype ("bf16" or None), or e4m3 plus an f32 scale per KV head ("fp8"), or e4m3 alone
  ("fp8_static")."""
  heads = cfg.num_key_value_heads // tensor
  if kv_cache in (None, quant_config.UNQUANTIZED_KV):
    return 2 * heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  if kv_cache not in quant_config.KV_FORMATS:
    raise ValueError(f"kv_cache {kv_cache!r}: use one of {quant_config.KV_CHOICES} or None")
  return 2 * heads * (cfg.head_dim + (4 if kv_cache == "fp8" else 0))


def expected_blocks(prompts, lengths, *, slack: int, block: int, chunk: int | None = None) -> float:
  """Mean of the most blocks each request holds at once, as serving/blocks.py allocates them: the
  prompt prefilled in pieces that stop at chunk boundaries (`admit(..., prefill=chunk)`), then a
  round at each committed length l in [prompt, length - 1] reserving positions < l + slack.
  Global layers: the last round's ceil((length - 1 + slack) / block). Chunk-local layers
  (`release_invisible` after each commit): [l // chunk * chunk, l + slack) at round l, largest
  where l % chunk is largest over the decode, or a whole chunk's prefill piece."""
  p, last = np.asarray(prompts, np.int64), np.asarray(lengths, np.int64) - 1
  if (p < 1).any() or (last < p).any():
    raise ValueError("expected_blocks needs 1 <= prompt < length for every request")
  if chunk is None:
    return float(np.mean(-(-(last + slack) // block)))
  if chunk % block:
    raise ValueError(f"chunk {chunk} must be a multiple of the block {block}")
  offset = np.where(p // chunk == last // chunk, last % chunk, chunk - 1)
  decode = -(-(offset + slack) // block)
  prefill = -(-np.minimum(p, chunk) // block)
  return float(np.mean(np.maximum(decode, prefill)))


@dataclasses.dataclass
class ServingRow:
  device: str
  kv_cache: str  # "bf16", "fp8", "fp8_static"
  hbm: float
  weight_bytes: int  # target + draft, per device
  reserve_bytes: float  # activations / temporaries / workspace, stated
  global_token_bytes: int  # per token per device: every global layer + the draft's layer
  chunked_token_bytes: int  # per token per device: every chunk-local layer
  contiguous: int  # concurrent requests: every slot max_seq_len + slack positions on every layer
  paged: int  # blocks for the expected length on every layer
  paged_chunked: int  # blocks for the expected length on global layers, the chunk on the others

  @property
  def free_bytes(self) -> float:
    return self.hbm - self.weight_bytes - self.reserve_bytes


def serving_weight_bytes(cfg: Config, plan: sharding.Plan, quant: str, draft_config=None) -> int:
  """Per-device weights of the target (`quant`) and, if given, the bf16 draft: shard sizes of the
  abstract models, nothing compiled."""
  target = model_lib.abstract_model(cfg)
  sharding.check_model_fits(cfg, plan)
  sharding.attach_plan(target, plan)
  _, state, scales = abstract_state(target, plan, quant)
  total = _state_bytes(state) + _tree_bytes(scales) + static_scale_bytes(scales, quant)
  if draft_config is not None:
    draft = draft_lib.abstract_draft(draft_config)
    sharding.check_model_fits(draft_config.layer, plan, "draft")
    sharding.attach_plan(draft, plan)
    total += _state_bytes(abstract_state(draft, plan, "bf16")[1])
  return total


def plan_serving(cfg: Config, *, tensor: int, weight_bytes: int, mix: LengthMix, slack: int,
                 draft_config=None, block: int = 64, reserve_bytes: float = 8 * GB,
                 kv_caches=("bf16", "fp8"), hbm=DEVICES_HBM) -> list[ServingRow]:
  """Concurrent requests that fit the HBM left after weights and `reserve_bytes`, per device and
  KV format, for the contiguous (max_seq_len = mix.cap), paged and paged + chunk-local layouts.
  `slack`: positions a round writes past the committed length (K + 1, a tree's cache slack). The
  draft's one layer is global attention, in the model dtype whatever the target's KV format."""
  chunked = [i for i in range(cfg.num_hidden_layers) if cfg.is_chunked(i)]
  n_chunked, n_global = len(chunked), cfg.num_hidden_layers - len(chunked)
  draft_tok = 0 if draft_config is None else kv_token_bytes(draft_config.layer, tensor, None)
  prompts, lengths = mix.sample()
  paged_blocks = expected_blocks(prompts, lengths, slack=slack, block=block)
  local_blocks = expected_blocks(prompts, lengths, slack=slack, block=block,
                                 chunk=cfg.attention_chunk_size)
  contiguous_len = -(-(mix.cap + slack) // block) * block  # the engine's capacity on a GPU
  rows = []
  for kv in kv_caches:
    per_layer = kv_token_bytes(cfg, tensor, kv)
    unquantized = kv in (None, quant_config.UNQUANTIZED_KV)
    kv_label = cfg.dtype.replace("bfloat16", "bf16") if unquantized else kv
    g, c = n_global * per_layer + draft_tok, n_chunked * per_layer
    for device, h in hbm.items():
      free = h - weight_bytes - reserve_bytes
      fit = lambda per_request: max(int(free // per_request), 0)
      rows.append(ServingRow(
          device, kv_label, h, weight_bytes, reserve_bytes,
          g, c, fit(contiguous_len * (g + c)), fit(paged_blocks * block * (g + c)),
          fit(block * (paged_blocks * g + local_blocks * c))))
  return rows


def format_serving(title: str, rows: list[ServingRow]) -> str:
  lines = [title, f"{'device':<6} {'KV':<10} {'weights GB':>10} {'free GB':>8} {'global B/tok':>12} "
           f"{'chunked B/tok':>13} {'contiguous':>10} {'paged':>7} {'paged+chunk-local':>17}"]
  for r in rows:
    lines.append(f"{r.device:<6} {r.kv_cache:<10} {r.weight_bytes / GB:>10.2f} "
                 f"{r.free_bytes / GB:>8.2f} {r.global_token_bytes:>12} {r.chunked_token_bytes:>13} "
                 f"{r.contiguous:>10} {r.paged:>7} {r.paged_chunked:>17}")
  return "\n".join(lines)
