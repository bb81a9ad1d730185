"""Where the model meets `pallas_kernels`: one switch per model, `kernels`.

  None      auto (the default): a Pallas kernel wherever one can run (a Hopper/Blackwell GPU, or
            inside `pallas_kernels.interpret()`) and takes the call's shapes/dtypes, and, on a GPU,
            only once that kernel config has passed its one-time on-device self-check
            (`pallas_kernels.selfcheck`: compiled, run on a probe of the call's shapes and
            compared with XLA; cached on disk). A config that fails runs on XLA, with one
            `KernelFallbackWarning` naming the op, the shapes and the reason. XLA elsewhere;
  "pallas"  the kernels wherever the planner takes the call, no self-check; an error when there is
            nothing to run kernels on;
  "xla"     the plain-jnp reference everywhere.

Set it with `set_kernels(model, ...)` (or `maverick.load(..., kernels=...)`, `--kernels`). Calls a
kernel does not take (weight-only FP8, a head_dim other than 64/128, ...) always fall back to
XLA, so one model mixes both. Each helper returns None when the caller should run its XLA
path; the callers keep their XLA code as the reference.

Sharded models: XLA cannot partition a Mosaic GPU custom call, so on a model carrying a sharding
plan (`sharding.shard_model`) each helper runs the kernel on every device's own shards inside
`jax.shard_map`, with specs from the plan's rules and the weights' logical axes, and decides
support on those LOCAL shapes: column-parallel projections produce their local output columns,
row-parallel ones (o, down) contract their local slice and end with one psum over the contracted
mesh axes (the layer's one all-reduce, as GSPMD emits on the XLA path), or, where the layer
fuses it (`Fuse`), with the fused all-reduce + residual + RMSNorm (`allreduce_norm`); attention
runs on the local q / KV heads and rows. The sharded MoE is already a shard_map: it calls these
helpers on local shapes with no plan (and `fused_allreduce_norm` at its end). `placement` / `plan` arguments are a `sharding_plan.Plan` (duck-typed:
only its mesh, rules, spec and batch_axis are used), passed in by the model.

The attention helpers are in maverick.kernel_attention, the MoE's in maverick.kernel_moe.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from maverick.quant import ops as quant_ops
from pallas_kernels import allreduce_norm
from pallas_kernels import common
from pallas_kernels import gemm as gemm_lib
from pallas_kernels import quantize_rows as quantize_lib
from pallas_kernels import selfcheck
from pallas_kernels.decode_attention import api as decode_api

# Probe tolerance (max |kernel - XLA| / max |XLA|): every kernel output is bf16 (2^-9 relative
# rounding per element) and both sides accumulate in f32 in different orders; 2e-2 leaves room
# for that and still catches a wrong tile, mask or scale (those are O(1) errors).
PROBE_TOL = 2e-2
# An FP8 epilogue's probe (the rows a kernel quantizes for the next GEMM, dequantized): one e4m3
# step (2^-3 of a value) may flip where the two paths round the row differently (and the scales
# differ by a bf16 step), so the bound is twice that step (a wrong scale or row is off by 50 %
# or more).
EPILOGUE_PROBE_TOL = 0.25

KERNELS = (None, "xla", "pallas")


def set_kernels(model, kernels: str | None) -> None:
  """Selects the implementation for every layer of `model` (target or draft), sharded or not."""
  if kernels not in KERNELS:
    raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS} (None = auto)")
  if kernels == "pallas":
    if common.runnable_arch() is None:
      device = jax.devices()[0]
      raise common.KernelInputError(
          f"kernels='pallas' needs a Hopper (sm_90) or Blackwell (sm_100) GPU; this backend is "
          f"{device.platform!r} ({device.device_kind}). Use kernels=None / --kernels auto (kernels "
          f"where they run, XLA elsewhere) or 'xla', or run inside pallas_kernels.interpret() "
          f"(GPU interpret mode, slow, for tests).")
  model.set_attributes(kernels=kernels, raise_if_not_found=False)


def kernels_of(model) -> str | None:
  """The switch `set_kernels` gave `model` (its first layer's; all layers share it)."""
  for _, node in nnx.iter_modules(model):
    if hasattr(node, "kernels"):
      return node.kernels
  return "xla"


def cache_capacity(capacity: int, *models) -> int:
  """`capacity` rounded up to the decode attention kernel's KV block when any of `models` may run
  that kernel here: the kernel takes only caches of whole blocks, and speculative capacities
  (prompt bucket + steps + K + 1 slack) never are. Unchanged where only XLA runs (a CPU), so
  CPU programs keep their shapes."""
  block = decode_api.BLOCK_KV
  if common.runnable_arch() is None or all(kernels_of(m) == "xla" for m in models):
    return capacity
  return -(-capacity // block) * block


def use_pallas(kernels: str | None, supported: bool,
               probe: selfcheck.Probe | None = None) -> bool:
  """Whether the call runs its Pallas kernel. Auto mode (None) also needs `probe` to pass its
  on-device self-check (a no-op off the GPU)."""
  if kernels == "xla":
    return False
  if kernels == "pallas":
    common.target_arch()
    return supported
  if kernels is None:
    return (supported and common.runnable_arch() is not None
            and (probe is None or selfcheck.passed(probe)))
  raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS} (None = auto)")


def _sig(*arrays) -> str:
  return " ".join("-" if a is None else f"{jnp.dtype(a.dtype).name}{list(a.shape)}"
                  for a in arrays)


def _normal(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> jax.Array:
  """Random probe values in `dtype` (FP8 too: N(0, 1) sits well inside e4m3's range)."""
  return jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(dtype)


def _positive(rng: np.random.Generator, shape) -> jax.Array:
  return jnp.asarray(rng.uniform(0.5, 2.0, shape).astype(np.float32))


def _static_probe_scale(rng: np.random.Generator) -> jax.Array:
  """A static activation scale for N(0, 1) probe inputs: a calibrated one is max |x| / 448; this
  one maps |x| = 1..4 to 448, so the probe uses the whole e4m3 range and also clips the tail."""
  return jnp.asarray(np.float32(rng.uniform(1.0, 4.0) / quant_ops.FP8_MAX))


# ----------------------------------------------------------------------------------------------
# Sharded models: the kernel on each device's shards
# ----------------------------------------------------------------------------------------------
def _mesh_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _local_struct(a, spec: P, mesh):
  """The per-device ShapeDtypeStruct of `a` split by `spec` over `mesh` (None stays None)."""
  if a is None:
    return None
  dims = list(a.shape)
  for i, entry in enumerate(spec):
    dims[i] //= math.prod(mesh.shape[m] for m in _mesh_axes(entry))
  return jax.ShapeDtypeStruct(tuple(dims), a.dtype)


def _rows(plan, batch: int, taken=()):
  """The mesh axes rows split over (the plan's), or None when the operand already uses them."""
  rows = plan.batch_axis(batch)
  return None if set(_mesh_axes(rows)) & set(taken) else rows


def _on_shards(plan, local_fn, args, in_specs, out_spec, reduce_axes=(), fuse=None):
  """`local_fn(*args)` on every device's shards under shard_map, then a psum over `reduce_axes`
  (a row-parallel product's partial sums). Returns None, emitting nothing, when `local_fn`
  (a helper above, which returns None to mean "use XLA") declines the LOCAL shapes. `fuse`
  (`local_fn` then never declines): the psum becomes `fused_allreduce_norm` with the residual
  split like the output; returns (new residual, normed)."""
  is_spec = lambda s: isinstance(s, P)
  local = jax.tree.map(lambda s, a: _local_struct(a, s, plan.mesh), tuple(in_specs), tuple(args),
                       is_leaf=is_spec)
  with selfcheck.on_mesh(plan.mesh):  # the kernel's self-check is keyed by the mesh it runs on
    if fuse is None and jax.eval_shape(local_fn, *local) is None:
      return None

    def body(*shards):
      if fuse is not None:
        *shards, r, w, sems = shards
        return fused_allreduce_norm(local_fn(*shards), r, w, fuse, reduce_axes, plan.mesh,
                                    semaphores=sems)
      y = local_fn(*shards)
      return jax.lax.psum(y, reduce_axes) if reduce_axes else y

    if fuse is not None:
      sems = site_semaphores(fuse.residual.shape)
      args = (*args, fuse.residual, fuse.weight, sems)
      in_specs = (*in_specs, out_spec, P(None), None if sems is None else P())
      out_spec, fuse = _fused_out_specs(fuse, out_spec)
    out = jax.shard_map(body, mesh=plan.mesh, in_specs=tuple(in_specs), out_specs=out_spec,
                        check_vma=False)(*args)
    return out if fuse is None else _remember_site(out, fuse)


# ----------------------------------------------------------------------------------------------
# Fused all-reduce + residual + RMSNorm (the row-parallel sites of a sharded layer)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fuse:
  """A fused site's epilogue: the residual stream [..., D] the all-reduced product is added to,
  and the RMSNorm (weight [D], eps) applied to the sum. `kernels`: the layer's switch.
  `quantize_ub`: the next GEMM quantizes the normed rows per token for FP8 with this cap (a float,
  or True for no cap): the site then quantizes them itself (`remember_quantized`); None: not."""
  residual: jax.Array
  weight: jax.Array
  eps: float
  kernels: str | None
  quantize_ub: float | bool | None = None


def fp8_input_ub(quant) -> float | bool | None:
  """Fuse.quantize_ub for a site whose next GEMMs run under `quant`: its cap (True: none) when
  they quantize their input per token, else None."""
  if quant is None or not quant.quantize_activations:
    return None
  return True if quant.activation_scale_ub is None else quant.activation_scale_ub


def _site_quantize(fuse: Fuse, residual_shape):
  """The (rows_out, ub) a fused site quantizes its normed rows with, or None: rows padded to the
  FP8 GEMM's row tile for [rows, D] x [D, D] (its CTA's M: 64 on Hopper, 128 on Blackwell; the
  consumers check theirs and quantize again where it differs)."""
  if fuse.quantize_ub is None:
    return None
  rows, d = math.prod(residual_shape[:-1]), residual_shape[-1]
  tile = 64
  if common.runnable_arch() is not None:
    tile = max(gemm_lib.row_tile(rows, d, d, quant_ops.FP8, quant_ops.FP8), 1)
  ub = None if fuse.quantize_ub is True else fuse.quantize_ub
  return rows + (-rows % tile), ub


def _fused_out_specs(fuse: Fuse, out_spec):
  """shard_map out_specs of a fused site: (new residual, normed) like `out_spec`, then the FP8
  rows and scales when it quantizes (whole rows on every device: only when `out_spec` does not
  split the rows, else the site does not quantize)."""
  if fuse.quantize_ub is None or out_spec[0] is not None:
    return (out_spec, out_spec), dataclasses.replace(fuse, quantize_ub=None)
  return (out_spec, out_spec, P(None, None), P(None), P(None, None)), fuse


def _remember_site(out, fuse: Fuse):
  """(new residual, normed) of a fused site's outputs, recording the normed rows' FP8 form and
  their tile-padded bf16 form (`fused_allreduce_norm`)."""
  if len(out) == 2:
    return out
  h, y, q, scale, padded = out
  remember_quantized(y, q, scale, _site_quantize(fuse, y.shape)[1])
  remember_padded(y, padded)
  return h, y


@dataclasses.dataclass
class _ForwardScope:
  """What the fused sites of one forward share (see `fused_forward`)."""
  semaphores: dict = dataclasses.field(default_factory=dict)  # rows -> semaphore buffer
  # (normed, e4m3 rows, scales, ub, their shard_map specs: whole rows, or split by columns)
  quantized: list = dataclasses.field(default_factory=list)
  padded: list = dataclasses.field(default_factory=list)  # (normed, its rows tile-padded)


_FORWARD: contextvars.ContextVar[_ForwardScope | None] = contextvars.ContextVar(
    "maverick_fused_forward", default=None)


@contextlib.contextmanager
def fused_forward():
  """One model forward (a decorator of its __call__). Within it the fused all-reduce sites
  share one semaphore buffer per row count (`allreduce_norm.new_semaphores`; each kernel leaves
  it zeroed) instead of a zeroed buffer each, which XLA copies into collective memory before
  every kernel (a launch a site); and a site that also quantized its normed rows for the next
  FP8 GEMM (`Fuse.quantize_ub`) leaves them here for that GEMM (`quantized_rows`)."""
  token = _FORWARD.set(_ForwardScope())
  try:
    yield
  finally:
    _FORWARD.reset(token)


WHOLE_ROWS = (P(None, None), P(None))


def remember_quantized(normed, q, scale, ub, specs=WHOLE_ROWS) -> None:
  """Records `normed`'s FP8 rows (e4m3 [rows_out, D], f32 scales [rows_out], quantized per row
  with cap `ub`) for the GEMMs that take `normed` next in this forward (or this shard_map).
  `specs`: how (q, scale) split over the mesh outside shard_map: whole rows on every device, or
  (P(None, axes), P(axes)) for rows each device quantized over its own columns (its heads of the
  attention output: a scale per device and row)."""
  scope = _FORWARD.get()
  if scope is not None:
    scope.quantized.append((normed, q, scale, ub, specs))


def carry_quantized(normed, reshaped) -> None:
  """`reshaped` (a free reshape of `normed`, same rows) has `normed`'s recorded FP8 rows (and
  padded rows)."""
  scope = _FORWARD.get()
  for memo in () if scope is None else (scope.quantized, scope.padded):
    for entry in list(memo):
      if entry[0] is normed:
        memo.append((reshaped, *entry[1:]))


def remember_padded(normed, padded) -> None:
  """Records `normed`'s rows [..., D] as [R >= rows, D] with zero rows past them (the fused site
  writes them so, beside its FP8 rows): a bf16 GEMM on `normed` takes them without a pad."""
  scope = _FORWARD.get()
  if scope is not None:
    scope.padded.append((normed, padded))


def padded_rows(x):
  """The rows recorded for this very array by `remember_padded`, or None."""
  scope = _FORWARD.get()
  return next((p for n, p in (() if scope is None else scope.padded) if n is x), None)


def quantized_rows(x, ub=None, rows_out: int | None = None, specs=WHOLE_ROWS):
  """(e4m3 rows, scales) recorded for this very array `x` (identity: the value a fused site
  returned, passed on unchanged), quantized with cap `ub` (and padded to `rows_out` rows when
  given) and split over the mesh as `specs` says, or None."""
  scope = _FORWARD.get()
  for normed, q, scale, cap, split in () if scope is None else scope.quantized:
    if (normed is x and cap == ub and (rows_out is None or q.shape[0] == rows_out)
        and split == specs):
      return q, scale
  return None


def site_semaphores(residual_shape):
  """Outside shard_map, at a fused site: the forward's shared semaphore buffer for these rows,
  or None (no `fused_forward` scope, nothing compiled for a GPU here, interpret mode, whose
  single-device body takes none, or a jax without them)."""
  scope = _FORWARD.get()
  pool = None if scope is None else scope.semaphores
  if (pool is None or common.interpreting() or common.runnable_arch() is None
      or not allreduce_norm.shared_semaphores_supported()):
    return None
  rows = math.prod(residual_shape[:-1])
  if rows > allreduce_norm.MAX_ROWS:  # prefill: XLA's all-reduce, no kernel to share it
    return None
  if rows not in pool:
    pool[rows] = allreduce_norm.new_semaphores(rows)
  return pool[rows]


def fuses_residual_norm(plan, kernels: str | None) -> bool:
  """Whether a layer's row-parallel sites (o, FFN down / MoE) end in the fused all-reduce +
  residual + norm: on a sharded model's kernel path (a kernel could run here, so a GPU or
  interpret mode). The XLA path (and auto off the GPU) keeps GSPMD's all-reduces."""
  return plan is not None and kernels != "xla" and common.runnable_arch() is not None


def _single_node(mesh) -> bool:
  """multimem needs every peer in one NVLink domain: taken to mean one process (one host)."""
  return len({d.process_index for d in mesh.devices.flat}) == 1


def fused_allreduce_norm(partial, residual, weight, fuse: Fuse, reduce_axes, mesh,
                         semaphores=None):
  """Inside shard_map: (residual + psum(partial), its RMSNorm) through the multimem kernel when it
  can run (the reduce covers every mesh axis of size > 1, as multimem reduces over the whole
  mesh; one host; shapes it takes; and, in auto mode, its self-check on this mesh passed), else
  psum of the bf16 payload + norm in XLA. `semaphores`: the local view of `site_semaphores`'s
  buffer (passed into shard_map replicated), or None. With `fuse.quantize_ub` set, also the
  normed rows' FP8 form (e4m3 [rows padded to the GEMM's row tile, D], f32 scales) and the
  normed rows padded alike: a 5-tuple."""
  reduce_axes = tuple(reduce_axes)
  quantize = _site_quantize(fuse, residual.shape)
  padded = quantize is not None
  if not reduce_axes:
    return allreduce_norm.residual_norm(partial, residual, weight, fuse.eps, implementation="xla",
                                        quantize=quantize, padded_normed=padded)
  whole = all(mesh.shape[a] == 1 for a in mesh.axis_names if a not in reduce_axes)
  ok = (whole and _single_node(mesh)
        and allreduce_norm.pallas_support(residual.shape, residual.dtype, weight.dtype)[0])
  axes = tuple(mesh.axis_names)  # the kernel's collective: the whole mesh (others are size 1)
  n = mesh.size
  eps = fuse.eps

  def run(implementation, partials, residual, weight, dequantized=False):
    """partials: one [..., D] per device. Two sites in a row, as in a layer: on the kernel path
    they share one semaphore buffer (fused_forward), which the first must leave zeroed for the
    second. `dequantized`: the second site's FP8 rows times their scales instead of (h, y)."""
    sems = None
    if implementation == "pallas" and allreduce_norm.shared_semaphores_supported():
      sems = allreduce_norm.new_semaphores(math.prod(residual.shape[:-1]))

    def body(p, r, w, s):
      p = tuple(t[0] for t in p)
      site = lambda r, quantize=None: allreduce_norm.allreduce_residual_norm(
          p if len(p) > 1 else p[0], r, w, eps, axes, implementation=implementation,
          semaphores=s, quantize=quantize)
      if not dequantized:
        return jnp.stack(site(site(r)[0]))
      _, _, q, scale = site(site(r)[0], quantize)
      return q.astype(jnp.float32) * scale[:, None]
    return jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(), P(), P()), out_specs=P(),
                         check_vma=False)(partials, residual, weight, sems)

  terms = tuple(partial) if isinstance(partial, (tuple, list)) else (partial,)

  def make_args(rng):  # split-K partials come scaled (O(1) each), as the GEMM writes them
    dtype = lambda t: t.dtype if t.dtype == jnp.float32 else allreduce_norm.PAYLOAD_DTYPE
    return (tuple(_normal(rng, (n, *t.shape), dtype(t)) for t in terms),
            _normal(rng, residual.shape, residual.dtype),
            _positive(rng, weight.shape).astype(weight.dtype))

  probe = selfcheck.Probe(
      "allreduce_norm", f"partial {_sig(*terms)} over {n} devices + residual {_sig(residual)}",
      f"{_sig(*terms, residual, weight)} eps={eps} axes={axes}", make_args, run, PROBE_TOL)
  # The FP8 epilogue has a probe of its own (EPILOGUE_PROBE_TOL).
  fp8_probe = None if quantize is None else selfcheck.Probe(
      "allreduce_norm FP8 epilogue", f"{_sig(residual)} rows to e4m3 [{quantize[0]}, D]",
      f"{_sig(*terms, residual, weight)} eps={eps} axes={axes} quantize={quantize}", make_args,
      lambda implementation, *args: run(implementation, *args, dequantized=True),
      EPILOGUE_PROBE_TOL)
  if use_pallas(fuse.kernels, ok, probe) and (
      fp8_probe is None or fuse.kernels == "pallas" or selfcheck.passed(fp8_probe)):
    if semaphores is not None and semaphores.shape != (2 * math.prod(residual.shape[:-1]),):
      semaphores = None  # rows split over devices: not the buffer's (the kernel's own then)
    return allreduce_norm.allreduce_residual_norm(partial, residual, weight, eps, axes,
                                                  implementation="pallas", semaphores=semaphores,
                                                  quantize=quantize, padded_normed=padded)
  return allreduce_norm.allreduce_residual_norm(partial, residual, weight, eps, reduce_axes,
                                                implementation="xla", quantize=quantize,
                                                padded_normed=padded)


def sharded_embed_norm(tokens, table, scale, weight, eps: float, kernels: str | None, plan,
                       table_axes, dtype, quantize_ub=None):
  """The vocab-split embedding lookup as one more fused site: each device gathers its vocab
  slice's rows (zero for a token another device holds) and `fused_allreduce_norm` sums them with
  a zero residual (exact: one nonzero term per element), giving (rows [B, T, D] in `dtype`, their
  RMSNorm by `weight`): the first layer's input norm, or the draft's embedding norm. Without it
  GSPMD partitions the gather with an all-reduce of its own. `scale` [V]: an FP8 table's row
  scales. None when the layout does not split the vocab alone (nothing to fuse). `quantize_ub`:
  see Fuse (the first layer's q/k/v take the normed rows in FP8)."""
  t_spec = plan.spec(table_axes)
  vocab = _mesh_axes(t_spec[0])
  if not vocab or _mesh_axes(t_spec[1]):
    return None
  rows = _rows(plan, tokens.shape[0], vocab)
  out_spec = P(rows, *([None] * tokens.ndim))
  fuse = Fuse(None, None, eps, kernels, quantize_ub)

  def body(tok, w, s, nw, sems):
    n = w.shape[0]
    local = tok - jax.lax.axis_index(vocab) * n
    mine = (local >= 0) & (local < n)
    at = jnp.clip(local, 0, n - 1)
    part = jnp.take(w, at, axis=0)
    if s is not None:
      part = part.astype(jnp.float32) * jnp.take(s, at, axis=0)[..., None]
    part = jnp.where(mine[..., None], part.astype(dtype), jnp.zeros((), dtype))
    return fused_allreduce_norm(part, jnp.zeros_like(part), nw, fuse, vocab, plan.mesh,
                                semaphores=sems)

  sems = site_semaphores((*tokens.shape, 1))
  out_specs, fuse = _fused_out_specs(fuse, out_spec)
  with selfcheck.on_mesh(plan.mesh):
    out = jax.shard_map(body, mesh=plan.mesh,
                        in_specs=(P(rows), t_spec, P(t_spec[0]), P(None),
                                  None if sems is None else P()),
                        out_specs=out_specs, check_vma=False)(tokens, table, scale, weight, sems)
  return _remember_site(out, fuse)


def shard_specs(spec, x, plan, w_axes):
  """(x, w, w scale, output) PartitionSpecs of a projection run per shard, and the mesh axes its
  partial sums are reduced over (a row-parallel product): w split as the plan places it, x's
  contracted axes split like w's, x's rows over the plan's batch axes."""
  xs, ws, out = quant_ops._expand_ellipsis(spec, x.ndim)
  w_spec = plan.spec(w_axes)
  by_letter = dict(zip(ws, w_spec))
  contracted = [c for c in xs if c in ws and c not in out]
  taken = [m for e in w_spec for m in _mesh_axes(e)]
  rows = _rows(plan, x.shape[0], taken) if xs[0] not in contracted else None
  x_spec = P(*(by_letter[c] if c in contracted else rows if i == 0 else None
               for i, c in enumerate(xs)))
  by_letter_x = dict(zip(xs, x_spec))
  out_spec = P(*(by_letter[c] if c in ws else by_letter_x[c] for c in out))
  scale_spec = P(*(by_letter[c] for c in ws if c not in contracted))
  reduce_axes = tuple(m for c in contracted for m in _mesh_axes(by_letter[c]))
  return x_spec, w_spec, scale_spec, out_spec, reduce_axes


def _sharded_linear(spec, x, w, scale, quant, kernels, out_dtype, input_scale, plan, w_axes,
                    fuse=None, xla=None):
  """`linear` per shard: w split as the plan places it (its logical axes), x's contracted axes
  split like w's, x's rows over the plan's batch axes; a sharded contraction (row-parallel o,
  down) ends with one psum. Dynamic FP8 activations are then quantized per token over the LOCAL
  slice (a finer scale than the XLA path's whole-row one, as in the sharded MoE); a static
  `input_scale` is replicated (one scalar: every shard quantizes exactly as one device does).
  `fuse`: the psum is the fused all-reduce + residual + norm; a local GEMM the kernel declines
  then runs `xla` (the einsum's XLA path) on the shards, so the site always fuses."""
  x_spec, w_spec, scale_spec, out_spec, reduce_axes = shard_specs(spec, x, plan, w_axes)
  # x's FP8 rows from the kernel before, each device's over its slice of x's columns (the
  # decode attention's heads for o): the row-parallel GEMM quantizes exactly that slice.
  pre, pre_specs = None, None
  split = [e for e in x_spec[1:] if e is not None]
  if quant is not None and scale is not None and x_spec[0] is None and len(split) == 1:
    pre_specs = (P(None, split[0]), P(split[0]))
    pre = quantized_rows(x, quant.activation_scale_ub, specs=pre_specs)

  def local(x_, w_, s_, si_, pre_):
    if pre_ is not None:
      remember_quantized(x_, *pre_, quant.activation_scale_ub)
    # A fused site takes the GEMM's tile-padded rows as they are (no slice launch).
    y = linear(spec, x_, w_, s_, quant, kernels, out_dtype, input_scale=si_,
               keep_row_padding=fuse is not None and bool(reduce_axes))
    return y if y is not None or fuse is None else xla(x_, w_, s_, si_)

  return _on_shards(plan, local, (x, w, scale, input_scale, pre),
                    (x_spec, w_spec, scale_spec, P(), None if pre is None else pre_specs),
                    out_spec, reduce_axes, fuse if reduce_axes else None)


def _static(scale, quant, input_scale) -> bool:
  """Whether an FP8 call quantizes its activations with a static per-tensor `input_scale`."""
  return (scale is not None and quant is not None and quant.static_activations
          and input_scale is not None)


def _quantize_static_rows(x2, input_scale):
  """(e4m3 x, per-row scales) of static quantization: the XLA static path's e4m3(clip(x / s)),
  with the scalar s broadcast to one scale per row, as the kernels' epilogue takes it."""
  s = jnp.asarray(input_scale, jnp.float32)
  return quant_ops.quantize_static(x2, s), jnp.broadcast_to(s, x2.shape[:1])


def _quantize_dynamic(x2, rows_out: int, ub, implementation: str):
  """Per-token FP8 rows of x2 [M, K] zero-padded to `rows_out` (a kernel's row tile), with their
  scales: on the kernel path one launch of the quantize kernel where it takes the shape (XLA
  takes two, the max reduction and the scaled convert), else maverick.quant's XLA ops."""
  if (implementation == "pallas"
      and quantize_lib.pallas_support(*x2.shape, rows_out, x2.dtype)[0]):
    return quantize_lib.quantize_rows(x2, rows_out, ub, implementation="pallas")
  x2 = jnp.pad(x2, ((0, rows_out - x2.shape[0]), (0, 0)))
  return quant_ops.quantize_rows(x2, (-1,), ub)


def _activation_mode(quant, static: bool) -> str:
  """The probe key's activation part: static and dynamic quantization are different programs."""
  if static:
    return "acts=static_per_tensor"
  return f"acts={quant and quant.activations} ub={quant and quant.activation_scale_ub}"


def gemm_shape(spec: str, x, w):
  """(w layout "kn" / "nk", w's output shape, K, N, number of contracted axes) when `spec` is
  x[batch..., C...] . w[C..., O...] or w[O..., C...] -> [batch..., O...] (a GEMM after free
  reshapes), else None."""
  xs, ws, out = quant_ops._expand_ellipsis(spec, x.ndim)
  contracted = "".join(c for c in xs if c in ws and c not in out)
  n_c = len(contracted)
  if not contracted or xs[-n_c:] != contracted:
    return None
  if ws[:n_c] == contracted and out == xs[:-n_c] + ws[n_c:]:
    layout, w_out = "kn", w.shape[n_c:]
  elif ws[-n_c:] == contracted and out == xs[:-n_c] + ws[:-n_c]:
    layout, w_out = "nk", w.shape[:-n_c]
  else:
    return None
  return layout, w_out, math.prod(x.shape[-n_c:]), math.prod(w_out), n_c


def linear(spec: str, x: jax.Array, w: jax.Array, scale, quant, kernels: str | None,
           out_dtype=None, placement=None, input_scale=None, fuse: Fuse | None = None, xla=None,
           keep_row_padding: bool = False):
  """`maverick.quant.einsum` through the Pallas GEMM when the spec is x[batch..., C...] .
  w[C..., O...] (stored K-by-N) or w[O..., C...] (K-major) -> [batch..., O...], which covers every
  projection in the model: the operands then reshape for free into x [M, K] and w [K, N] / [N, K].
  FP8 weights (with `scale`) need the K-major layout; activations are quantized first exactly as
  the XLA path does: per token when `quant` says so, or, in the static mode, with the scalar
  `input_scale` (passed to the kernel as that scalar on every row). `placement` = (plan, w's
  logical axes as stored) on a sharded model: the GEMM runs per shard (`_sharded_linear`), and
  with `fuse` (a row-parallel site) returns (new residual, normed) (`xla(x, w, scale,
  input_scale)`: the XLA product, for shards the GEMM kernel declines). `keep_row_padding`: the
  kernel's product comes back as [S, rows padded to its tile, N], S split-K partials (each
  scaled; S = 1: the product) for the fused all-reduce + norm, which reads the first rows and
  sums the partials (a slice, or XLA's sum, would be a launch)."""
  if kernels == "xla":
    return None
  if placement is not None:
    return _sharded_linear(spec, x, w, scale, quant, kernels, out_dtype, input_scale, *placement,
                           fuse=fuse, xla=xla)
  shape = gemm_shape(spec, x, w)
  if shape is None:
    return None
  layout, w_out, k, n, n_c = shape
  static = _static(scale, quant, input_scale)
  quantize_x = scale is not None and quant is not None and quant.quantize_activations
  x_dtype = quant_ops.FP8 if quantize_x or static else x.dtype
  ok, _ = gemm_lib.pallas_support(x_dtype, w.dtype, n, k, layout, m=math.prod(x.shape[:-n_c]),
                                  out_dtype=out_dtype or x.dtype)
  batch = x.shape[:-n_c]
  x2 = x.reshape(-1, k)
  w2 = w.reshape((k, n) if layout == "kn" else (n, k))
  w_scale = None if scale is None else scale.reshape(n)
  out_dtype = out_dtype or x.dtype

  def run(implementation, x2, w2, w_scale, input_scale, keep_row_padding=False, pre=None):
    """pre: x's FP8 rows made by the kernel before (`quantized_rows`)."""
    x_scale = None
    rows = x2.shape[0]
    if static or quantize_x:
      # Padded to the kernel's row tile while quantizing: the pad fuses into the quantization,
      # where padding the FP8 rows and their scales after took two more launches.
      tile = gemm_lib.row_tile(rows, n, k, quant_ops.FP8, w2.dtype, layout, out_dtype=out_dtype)
      rows_out = rows + (-rows % tile)
    if static:
      x2, x_scale = _quantize_static_rows(jnp.pad(x2, ((0, rows_out - rows), (0, 0))),
                                          input_scale)
    elif quantize_x and pre is not None and pre[0].shape == (rows_out, k):
      x2, x_scale = pre
    elif quantize_x:
      x2, x_scale = _quantize_dynamic(x2, rows_out, quant.activation_scale_ub, implementation)
    if keep_row_padding:  # for the fused site, which sums a K split's partials itself
      return gemm_lib.gemm_many_partials(
          x2, (w2,), x_scale, None if w_scale is None else (w_scale,), w_layout=layout,
          out_dtype=out_dtype, implementation=implementation)[0]
    out = gemm_lib.gemm(x2, w2, x_scale, w_scale, w_layout=layout, out_dtype=out_dtype,
                        implementation=implementation)
    return out[:rows]

  def make_args(rng):
    return (_normal(rng, x2.shape, x2.dtype), _normal(rng, w2.shape, w2.dtype, 1 / math.sqrt(k)),
            None if w_scale is None else _positive(rng, w_scale.shape),
            _static_probe_scale(rng) if static else None)

  probe = selfcheck.Probe(
      "gemm", f"x {_sig(x2)} @ w {_sig(w2)} (w_layout={layout!r})",
      f"{_sig(x2, w2, w_scale)} {layout} quantize_x={quantize_x} {_activation_mode(quant, static)}"
      f" out={jnp.dtype(out_dtype).name}", make_args, run, PROBE_TOL)
  if not use_pallas(kernels, ok, probe):
    return None
  pre = quantized_rows(x, quant.activation_scale_ub) if quantize_x else None
  out = run("pallas", x2, w2, w_scale, input_scale if static else None,
            keep_row_padding=keep_row_padding and len(w_out) == 1, pre=pre)
  return out if keep_row_padding and len(w_out) == 1 else out.reshape(*batch, *w_out)
