"""`qkv_finish`: everything between an attention layer's q / k / v GEMM and its decode kernel in
one launch: the split-K sum, RoPE, QK norm, temperature, the KV-cache append (contiguous or
paged; bf16, FP8 per-token or FP8 static) and the query packed for the decode kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.common import check
from pallas_kernels.qkv_finish import kernel, reference

Layer = reference.Layer
FP8 = reference.FP8
# Decode / verify / tree rows; prefill keeps XLA (its launches are nothing next to its GEMMs).
MAX_ROWS = 64
_KERNEL = common.lowered_once(
    kernel.finish, ("num_heads", "num_kv_heads", "batch", "steps", "mpad", "layer"))


def _shape(x):
  return None if x is None else tuple(x.shape)


def pallas_support(q_p, caches, positions, *, num_heads: int, num_kv_heads: int, layer: Layer,
                   mpad: int) -> tuple[bool, str]:
  """(supported, why not) for the kernel (arrays or ShapeDtypeStructs)."""
  B, T = positions.shape
  dh = q_p.shape[-1] // num_heads
  if not hasattr(jax, "new_ref"):
    return False, "this jax has no jax.new_ref (the in-place cache write)"
  if dh % kernel.WARPGROUP:
    return False, f"head_dim {dh}: the kernel takes a multiple of {kernel.WARPGROUP}"
  if B * T > MAX_ROWS:
    return False, f"{B * T} token rows; the kernel takes at most {MAX_ROWS} (prefill: XLA)"
  if layer.temperature is not None and layer.temperature[0] != int(layer.temperature[0]):
    return False, f"floor_scale {layer.temperature[0]}: the kernel takes an integral one"
  if caches[0].dtype not in (jnp.dtype(jnp.bfloat16), FP8):
    return False, f"cache dtype {caches[0].dtype}; the kernel writes bf16 or float8_e4m3fn"
  if mpad % 8:
    return False, f"mpad={mpad}: pass the decode kernel's padded query rows (a multiple of 8)"
  return True, ""


def _validate(q_p, k_p, v_p, positions, starts, caches, num_heads, num_kv_heads, layer, mpad,
              block_table, static_scales):
  check(q_p.ndim == 3 and k_p.ndim == 3 and v_p.shape == k_p.shape,
        f"qkv_finish: q_p {_shape(q_p)}, k_p {_shape(k_p)}, v_p {_shape(v_p)}; expected GEMM "
        "outputs [S, R, N] with k_p and v_p alike")
  check(num_kv_heads >= 1 and num_heads % num_kv_heads == 0,
        f"qkv_finish: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
  S, R, nq = q_p.shape
  check(nq % num_heads == 0 and k_p.shape[:2] == (S, R)
        and k_p.shape[2] == num_kv_heads * (nq // num_heads),
        f"qkv_finish: q_p {_shape(q_p)} / k_p {_shape(k_p)} do not hold {num_heads} query and "
        f"{num_kv_heads} KV heads of one head_dim")
  dh = nq // num_heads
  check(positions.ndim == 2 and starts.shape == positions.shape[:1]
        and positions.shape[0] * positions.shape[1] <= R,
        f"qkv_finish: positions {_shape(positions)}, starts {_shape(starts)}; expected [B, T] "
        f"and [B] with B * T <= the GEMM's {R} rows")
  check(len(caches) in (2, 4), f"qkv_finish: {len(caches)} caches; pass (k, v) or (k, v, "
        "k_scale, v_scale)")
  k_cache = caches[0]
  check(k_cache.ndim == 4 and k_cache.shape[2:] == (num_kv_heads, dh)
        and all(c.shape == k_cache.shape for c in caches[1:2]),
        f"qkv_finish: caches {[_shape(c) for c in caches[:2]]}; expected [B|N, S|bs, "
        f"{num_kv_heads}, {dh}] each")
  if len(caches) == 4:
    check(all(c.shape == k_cache.shape[:3] for c in caches[2:]) and k_cache.dtype == FP8,
          f"qkv_finish: scale caches {[_shape(c) for c in caches[2:]]}; an FP8 cache's "
          f"per-token scales are {tuple(k_cache.shape[:3])}")
  check((static_scales is not None) == (len(caches) == 2 and k_cache.dtype == FP8),
        "qkv_finish: pass static_scales (k, v) exactly when the cache is FP8 without per-token "
        "scales")
  check(block_table is None or (block_table.ndim == 2
                                and block_table.shape[0] == positions.shape[0]),
        f"qkv_finish: block_table {_shape(block_table)}; expected [B, M]")
  if block_table is None:
    check(k_cache.shape[0] == positions.shape[0],
          f"qkv_finish: cache rows {k_cache.shape[0]} != batch {positions.shape[0]}")
  check(layer.inv_freq is None or len(layer.inv_freq) == dh // 2,
        f"qkv_finish: {None if layer.inv_freq is None else len(layer.inv_freq)} RoPE "
        f"frequencies for head_dim {dh}; pass head_dim / 2")
  G = num_heads // num_kv_heads
  check(mpad >= positions.shape[1] * G,
        f"qkv_finish: mpad={mpad} < T * G = {positions.shape[1] * G} packed query rows")


def qkv_finish(q_p, k_p, v_p, positions, starts, caches, *, num_heads: int, num_kv_heads: int,
               layer: Layer, mpad: int, block_table=None, static_scales=None,
               implementation: str | None = None):
  """q_p [S, R, H*Dh] and k_p / v_p [S, R, K*Dh]: a q / k / v GEMM's outputs (S scaled f32 split-K
  partials, or S = 1 and the finished product; `gemm.gemm_many_partials`), rows b * T + t for
  positions [B, T] (RoPE and temperature) and R >= B * T. The new K / V go to slots starts[b] + t
  of `caches`: (k, v) [B, S_max, K, Dh] bf16, or FP8 with `static_scales` (k, v scalars), or
  (k, v, k_scale, v_scale) FP8 with per-token-per-head scales [B, S_max, K]; with `block_table`
  [B, M] the caches are pools [N, bs, K, Dh] ([N, bs, K]) and slot s of row b lives at
  pool[block_table[b, s // bs], s % bs]. Returns (q [B*K, mpad, Dh] bf16 packed for the decode
  kernel: kv head k of row b at [b*K + k], query head g of its group at row t * G + g, rows
  T * G.. zero; the caches with the new entries), the values `reference.qkv_finish` gives. On the
  kernel the caches are written in place (no copy, given XLA can donate them)."""
  _validate(q_p, k_p, v_p, positions, starts, caches, num_heads, num_kv_heads, layer, mpad,
            block_table, static_scales)
  ok, why = pallas_support(q_p, caches, positions, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, layer=layer, mpad=mpad)
  kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, layer=layer, mpad=mpad)
  if common.resolve(implementation, supported=ok, why=why) == "xla":
    return reference.qkv_finish(q_p, k_p, v_p, positions, starts, caches,
                                block_table=block_table, static_scales=static_scales, **kw)
  B, T = positions.shape
  dh = q_p.shape[-1] // num_heads
  pairs = lambda x, heads: x.reshape(x.shape[:2] + (heads, dh // 2, 2))
  # A NumPy constant: no broadcast launch (NoPE layers read ones they do not use).
  freq = np.ones(dh // 2, np.float32) if layer.inv_freq is None else np.asarray(layer.inv_freq,
                                                                                np.float32)
  caches = tuple(c.reshape(c.shape[:3] + (dh // 2, 2)) if i < 2 else c
                 for i, c in enumerate(caches))
  statics = None if static_scales is None else jnp.stack(
      [jnp.asarray(s, jnp.float32).reshape(()) for s in static_scales])
  q, out = _KERNEL(
      pairs(q_p, num_heads), pairs(k_p, num_kv_heads), pairs(v_p, num_kv_heads),
      positions.astype(jnp.int32).reshape(B * T), starts.astype(jnp.int32),
      jnp.asarray(np.ascontiguousarray(np.broadcast_to(freq, (2, dh // 2)))), caches,
      None if block_table is None else block_table.astype(jnp.int32), statics,
      batch=B, steps=T, **kw)
  out = tuple(c.reshape(c.shape[:3] + (dh,)) if i < 2 else c for i, c in enumerate(out))
  return q.reshape(q.shape[0], mpad, dh), out

