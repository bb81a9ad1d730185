"""`gemm`: x @ w.T with optional per-row (token) and per-column (output channel) scales, f32
accumulation, the scales applied to the accumulator in the epilogue. bf16 x bf16, or e4m3 x e4m3
(the FP8 path of quantized layers). Weights are (N, K): K-major, as FP8 tensor cores need."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check
from pallas_kernels.gemm import plan as plan_lib
from pallas_kernels.gemm import reference, sm90, sm100

FP8 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
_KERNELS = {arch: common.lowered_once(m.gemm_many, ("cfg", "out_dtype", "scale_partials"))
            for arch, m in (("sm90", sm90), ("sm100", sm100))}
TILE_K_BYTES = plan_lib.TILE_K_BYTES


def _validate(x, w, x_scale, w_scale, out_dtype, w_layout):
  check(w_layout in ("nk", "kn"), f"gemm: w_layout={w_layout!r}; use 'nk' (K-major) or 'kn'")
  check(x.ndim >= 1 and w.ndim == 2,
        f"gemm takes x [..., K] and w [N, K] (w_layout='nk') or [K, N] ('kn'); got x {x.shape}, "
        f"w {w.shape}")
  k_axis = 1 if w_layout == "nk" else 0
  check(x.shape[-1] == w.shape[k_axis],
        f"gemm: x {x.shape} and w {w.shape} disagree on K (x's last axis, w's axis {k_axis} for "
        f"w_layout={w_layout!r})")
  if x_scale is not None:
    check(x_scale.shape == x.shape[:-1],
          f"gemm: x_scale has shape {x_scale.shape}; it must be one scale per row of x, shape "
          f"{x.shape[:-1]}")
  if w_scale is not None:
    n = w.shape[0] if w_layout == "nk" else w.shape[1]
    check(w_scale.shape == (n,),
          f"gemm: w_scale has shape {w_scale.shape}; it must be one scale per output channel, "
          f"shape ({n},)")
  check(jnp.dtype(out_dtype) in (BF16, jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)),
        f"gemm: out_dtype={jnp.dtype(out_dtype)}; use bfloat16, float16 or float32")
  for name, a in (("x", x), ("w", w)):
    check(jnp.issubdtype(a.dtype, jnp.floating),
          f"gemm: {name} has dtype {a.dtype}; it must be a float (bf16 or float8_e4m3fn)")



def pallas_support(x_dtype, w_dtype, n: int, k: int, w_layout: str = "nk", *, m: int,
                   out_dtype=jnp.bfloat16, arch: str | None = None) -> tuple[bool, str]:
  """(supported, why not) for the Pallas kernel on x [m, k] and w (n, k): the planner's answer
  (`plan.plan`), so a supported call lowers. `arch`: default the one a kernel would run on."""
  p = plan_lib.plan(m, n, k, x_dtype, w_dtype, w_layout=w_layout, out_dtype=out_dtype, arch=arch)
  return p.supported, p.why


def row_tile(m: int, n: int, k: int, x_dtype, w_dtype, w_layout: str = "nk", *,
             out_dtype=jnp.bfloat16, arch: str | None = None) -> int:
  """The rows the kernel pads x to a multiple of (its CTA's M; 1 when it does not take the call):
  a caller that pads before quantizing x makes the padded rows and their scales in the
  quantization's own launches (the kernel then pads nothing)."""
  p = plan_lib.plan(m, n, k, x_dtype, w_dtype, w_layout=w_layout, out_dtype=out_dtype, arch=arch)
  return p.config.cta_m if p.supported else 1


def default_config(m: int, n: int, k: int, dtype, w_layout: str = "nk",
                   arch: str | None = None) -> sm90.Config | None:
  """The planner's config (None when nothing fits)."""
  return plan_lib.plan(m, n, k, dtype, dtype, w_layout=w_layout, arch=arch).config


def gemm(x: jax.Array, w: jax.Array, x_scale: jax.Array | None = None,
         w_scale: jax.Array | None = None, *, out_dtype=jnp.bfloat16,
         w_layout: str = "nk", implementation: str | None = None,
         config: sm90.Config | None = None, keep_row_padding: bool = False) -> jax.Array:
  """(x @ w.T) * x_scale[..., None] * w_scale -> [..., N] out_dtype, accumulated in f32.

  x [..., K] (bf16, or e4m3 quantized per row with f32 `x_scale` [...]); w [N, K] (bf16, or e4m3
  with f32 `w_scale` [N]); bf16 weights may also be stored [K, N] (`w_layout="kn"`, computing
  x @ w). A missing scale is 1. Any number of rows (padded to the tile inside).

  `keep_row_padding`: return the kernel's [M_pad, N] rows as they are (rows past M unspecified),
  for a consumer that reads only the first M (the fused all-reduce + norm): the slice would be a
  launch of its own. The XLA path returns [M, N] then; M_pad >= M either way."""
  return gemm_many(x, (w,), x_scale, None if w_scale is None else (w_scale,),
                   out_dtype=out_dtype, w_layout=w_layout, implementation=implementation,
                   config=config, keep_row_padding=keep_row_padding)[0]


def pallas_support_many(x_dtype, w_dtype, ns, k: int, w_layout: str = "nk", *, m: int,
                        out_dtype=jnp.bfloat16, arch: str | None = None) -> tuple[bool, str]:
  """(supported, why not) for `gemm_many` over weights of N = ns."""
  p = plan_lib.plan_many(m, ns, k, x_dtype, w_dtype, w_layout=w_layout, out_dtype=out_dtype,
                         arch=arch)
  return p.supported, p.why


def gemm_many(x: jax.Array, ws, x_scale: jax.Array | None = None, w_scales=None, *,
              out_dtype=jnp.bfloat16, w_layout: str = "nk", implementation: str | None = None,
              config: sm90.Config | None = None,
              keep_row_padding: bool = False) -> tuple[jax.Array, ...]:
  """`gemm` of one x with each weight of `ws` (same K, layout and dtype; `w_scales` a tuple like
  `ws` or None): a tuple of products, in ONE kernel launch on the kernel path (q, k and v, or
  gate and up, of a decode step: the launch, not the bytes, is the cost there)."""
  return _gemm_many(x, ws, x_scale, w_scales, out_dtype=out_dtype, w_layout=w_layout,
                    implementation=implementation, config=config,
                    keep_row_padding=keep_row_padding)


def gemm_many_partials(x: jax.Array, ws, x_scale: jax.Array | None = None, w_scales=None, *,
                       out_dtype=jnp.bfloat16, w_layout: str = "nk",
                       implementation: str | None = None) -> tuple[jax.Array, ...]:
  """`gemm_many` for a consumer kernel that sums a K split itself (in its prologue, where XLA
  would take a fusion of its own): per weight [S, R >= M, N] whose sum over S is the product
  (rows past M padding): the kernel's S f32 partials, each scaled in its epilogue, or S = 1 and
  the finished out_dtype product (no split, and always on the XLA path)."""
  return _gemm_many(x, ws, x_scale, w_scales, out_dtype=out_dtype, w_layout=w_layout,
                    implementation=implementation, partials=True)


def _gemm_many(x, ws, x_scale, w_scales, *, out_dtype, w_layout, implementation, config=None,
               keep_row_padding=False, partials=False):
  ws = tuple(ws)
  check(len(ws) >= 1, "gemm_many: pass at least one weight")
  w_scales = (None,) * len(ws) if w_scales is None else tuple(w_scales)
  check(len(w_scales) == len(ws),
        f"gemm_many: {len(w_scales)} w_scales for {len(ws)} weights; pass one per weight or None")
  check(len({w.dtype for w in ws}) == 1 and len({(s is None) for s in w_scales}) == 1,
        "gemm_many: every weight must have the same dtype, and either all or none a scale")
  for w, s in zip(ws, w_scales):
    _validate(x, w, x_scale, s, out_dtype, w_layout)
  w = ws[0]
  ns = [v.shape[0] if w_layout == "nk" else v.shape[1] for v in ws]
  k = x.shape[-1]
  m = math.prod(x.shape[:-1])
  arch = common.runnable_arch()
  plan = plan_lib.plan_many(m, ns, k, x.dtype, w.dtype, w_layout=w_layout, out_dtype=out_dtype,
                            arch=arch)
  if config is not None and plan.supported:  # the caller's tiles: still only run what fits
    check(config.w_kn == (w_layout == "kn"),
          f"gemm: config.w_kn={config.w_kn} but w_layout={w_layout!r}")
    plan = plan_lib.check_config(config, plan.arch, x.dtype, out_dtype)
  ok, why = plan.supported, plan.why
  impl = common.resolve(implementation, supported=ok, why=why)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k)
  xs = None if x_scale is None else x_scale.reshape(-1).astype(jnp.float32)
  wss = [None if s is None else s.astype(jnp.float32) for s in w_scales]
  finish = lambda out, n: out if keep_row_padding else out[:m].reshape(*lead, n)
  if impl == "xla":
    outs = tuple(
        finish(reference.gemm(x2, v if w_layout == "nk" else v.T, xs, s, out_dtype=out_dtype), n)
        for v, s, n in zip(ws, wss, ns))
    return tuple(o.reshape(1, m, -1) for o in outs) if partials else outs
  if m == 0:
    return tuple(jnp.zeros((0, n) if keep_row_padding else (*lead, n), out_dtype) for n in ns)
  cfg = plan.config
  m_pad = -(-m // cfg.cta_m) * cfg.cta_m
  if (xs is None) != (wss[0] is None):  # the kernel's epilogue takes both or neither
    xs = jnp.ones((m,), jnp.float32) if xs is None else xs
    wss = [jnp.ones((n,), jnp.float32) if s is None else s for s, n in zip(wss, ns)]
  if m_pad != m:
    x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    xs = None if xs is None else jnp.pad(xs, (0, m_pad - m))
  outs = _KERNELS[arch](x2, ws, xs, None if xs is None else tuple(wss), cfg=cfg,
                        out_dtype=out_dtype, scale_partials=partials)
  if partials:
    return outs if cfg.k_splits > 1 else tuple(o[None] for o in outs)
  results = []
  for out, s, n in zip(outs, wss, ns):
    if cfg.k_splits > 1:  # f32 partials: reduce, then the epilogue XLA fuses into the reduction
      out = out.sum(0)
      if xs is not None:
        out = out * xs[:, None] * s[None, :]
      out = out.astype(out_dtype)
    results.append(finish(out, n))
  return tuple(results)
