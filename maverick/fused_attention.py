"""Decode / verify attention on the kernel path in four launches: q, k and v in one GEMM whose
split-K partials `qkv_finish` turns into the query packed for the decode kernel and the new cache
entries (written in place), then the decode kernel and its combine (which also writes the o
projection's FP8 rows).

The unfused kernel path spends three more: XLA fuses the GEMM's split-K sum, RoPE, QK norm and
temperature into the query's pad and one dynamic-update-slice per cache, three fusions that each
re-read the partials. Here the layer either runs whole or returns None, and the caller runs the
unfused path (its unused kernels are dead code XLA drops): every kernel declining its shapes,
and the self-check, decide for the layer as a whole.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maverick import kernel_attention
from maverick import kernels as k_lib
from maverick import multi_linear
from maverick import sharding_plan
from maverick.quant import ops as quant_ops
from pallas_kernels import decode_attention as decode
from pallas_kernels import qkv_finish as qf
from pallas_kernels import selfcheck

# The self-check's bound (max |kernel - XLA| / max |XLA| over the packed queries and the written
# cache entries): both sides round the same bf16 values, but XLA may contract RoPE's
# multiply-adds, flipping a bf16 (or an FP8 cache's e4m3) rounding here and there. A wrong sign,
# pair or slot is off by order one.
PROBE_TOL = 0.1
QKV_SPEC = "btd,dhk->bthk"


def layer_of(attn) -> qf.Layer:
  """The q / k treatment of a maverick.model.Attention layer."""
  return qf.Layer(attn.inv_freq if attn.use_rope else None, attn.qk_norm, attn.eps,
                  (attn.floor_scale, attn.attn_scale) if attn.temperature_tuning else None)


def decode_attention(attn, x_btd, positions_bt, layer_cache, cache_lengths, block_table, tree,
                     static_scales, placements, weights, scales, input_scales):
  """(attention output [B, T, H, Dh], the layer's new cache) of `attn` (maverick.model.Attention)
  for the new tokens x_btd at positions_bt over `layer_cache` (the tuple Attention takes), or
  None: run the unfused path. `static_scales`: the layer's static FP8 KV scales (k, v) or None;
  `placements`, `weights`, `scales`, `input_scales`: the q / k / v projections' as the layer
  passes them to its einsum."""
  kernels = attn.kernels
  B, T = positions_bt.shape
  if kernels == "xla" or B * T > qf.MAX_ROWS or any(s is not None for s in input_scales):
    return None
  quant = attn.quant
  spec = QKV_SPEC if scales[0] is None else quant_ops.kmajor_spec(QKV_SPEC, x_btd.ndim)
  parts = multi_linear.linear_many(spec, x_btd, weights, scales, quant, kernels, placements,
                                   partials=True)
  if parts is None:
    return None
  H, K, Dh = parts[0].shape[2], parts[1].shape[2], parts[0].shape[3]
  layer = layer_of(attn)
  mpad = decode.packed_rows(T, H, K)
  plan = sharding_plan.plan_of(attn)
  finished = _finish(parts, positions_bt, cache_lengths, layer_cache, block_table,
                     static_scales, layer, mpad, kernels, plan, (H, K))
  if finished is None:
    return None
  q_packed, new_cache = finished
  kv_scales = {}
  if len(new_cache) == 4:
    kv_scales = dict(k_scale=new_cache[2], v_scale=new_cache[3])
  elif static_scales is not None:
    kv_scales = dict(zip(("k_scale", "v_scale"), static_scales))
  q = jax.ShapeDtypeStruct((B, T, H, Dh), jnp.bfloat16)
  out = kernel_attention.cache_attention(q, new_cache[0], new_cache[1], positions_bt,
                                         attn.chunk_size, tree, kv_scales, kernels, plan,
                                         block_table, quantize_for=attn._o_quantize_for(),
                                         q_packed=q_packed)
  return None if out is None else (out, new_cache)


def _finish(parts, positions, starts, caches, block_table, static_scales, layer, mpad, kernels,
            plan, heads):
  """qkv_finish on every device's heads: (q packed [B, K, mpad, Dh], new caches) or None."""
  H, K = heads
  statics = None if static_scales is None else tuple(jnp.asarray(s, jnp.float32).reshape(())
                                                      for s in static_scales)
  if plan is None:
    out = _local(*parts, positions, starts, tuple(caches), block_table, statics, layer, mpad,
                 kernels, H, K)
    if out is None:
      return None
    q, new = out
    return q.reshape(positions.shape[0], K, mpad, -1), new
  q_spec, kv_spec = kernel_attention._head_specs(plan, positions.shape[0])
  if q_spec[0] is not None:  # rows split (EP attention): the unfused path
    return None
  q_heads, kv_heads = q_spec[2], kv_spec[2]
  paged = block_table is not None
  cache_spec = P(None, *kv_spec[1:]) if paged else kv_spec
  scale_spec = P(*cache_spec[:3])
  mesh_size = lambda e: math.prod(plan.mesh.shape[m] for m in k_lib._mesh_axes(e))
  H_l, K_l = H // mesh_size(q_heads), K // mesh_size(kv_heads)

  def local(q_p, k_p, v_p, pos, st, cs, table, stat):
    out = _local(q_p, k_p, v_p, pos, st, cs, table, stat, layer, mpad, kernels, H_l, K_l)
    if out is None:
      return None
    q, new = out
    return q.reshape(pos.shape[0], K_l, mpad, -1), new

  part_spec = lambda heads_axis: P(None, None, heads_axis, None)
  args = (*parts, positions, starts, tuple(caches), block_table, statics)
  specs = (part_spec(q_heads), part_spec(kv_heads), part_spec(kv_heads), P(None, None), P(None),
           tuple(cache_spec if i < 2 else scale_spec for i in range(len(caches))),
           P(None, None) if paged else None, None if statics is None else (P(), P()))
  out_spec = (P(None, kv_heads, None, None),
              tuple(cache_spec if i < 2 else scale_spec for i in range(len(caches))))
  return k_lib._on_shards(plan, local, args, specs, out_spec)


def _local(q_p, k_p, v_p, positions, starts, caches, block_table, statics, layer, mpad, kernels,
           H, K):
  """qkv_finish on one device: its partials [S, R, heads, Dh] -> (q [B*K, mpad, Dh], caches),
  or None where the kernel (or its self-check) declines."""
  flat = lambda p: p.reshape(*p.shape[:2], -1)
  q_p, k_p, v_p = flat(q_p), flat(k_p), flat(v_p)
  kw = dict(num_heads=H, num_kv_heads=K, layer=layer, mpad=mpad)
  paged = block_table is not None
  ok = (qf.pallas_support(q_p, caches, positions, **kw)[0]
        and (not paged or (caches[0].shape[0] >= positions.shape[0]
                           and caches[0].shape[1] >= positions.shape[1])))

  def run(implementation, q_p, k_p, v_p, positions, starts, *rest):
    cs, table = rest[:len(caches)], rest[len(caches)] if paged else None
    stat = rest[-1] if statics is not None else None
    q, new = qf.qkv_finish(q_p, k_p, v_p, positions, starts, cs, block_table=table,
                           static_scales=None if stat is None else (stat[0], stat[1]),
                           implementation=implementation, **kw)
    # the probe compares one array: the queries and every cache, dequantized where FP8
    flat_f32 = lambda a: a.astype(jnp.float32).reshape(-1)
    return jnp.concatenate([flat_f32(q)] + [flat_f32(c) for c in new])

  def make_args(rng):
    B, T = positions.shape
    shape = caches[0].shape
    if paged:  # each row's T new slots in one block of its own (bs >= T: pallas_support)
      M, bs = block_table.shape[1], shape[1]
      ids = rng.permutation(shape[0])[:B]
      table = jnp.asarray(np.repeat(ids[:, None], M, 1).astype(np.int32))
      st = rng.integers(0, M, B) * bs + rng.integers(0, bs - T + 1, B)
    else:
      table = None
      st = rng.integers(0, shape[1] - T + 1, B)
    cs = [k_lib._normal(rng, c.shape, c.dtype) for c in caches[:2]]
    cs += [k_lib._positive(rng, c.shape) for c in caches[2:]]
    args = [k_lib._normal(rng, p.shape, p.dtype) for p in (q_p, k_p, v_p)]
    args += [jnp.asarray((st[:, None] + np.arange(T)).astype(np.int32)),
             jnp.asarray(st.astype(np.int32)), *cs]
    if paged:
      args.append(table)
    if statics is not None:
      args.append(jnp.stack([k_lib._static_probe_scale(rng), k_lib._static_probe_scale(rng)]))
    return tuple(args)

  probe = selfcheck.Probe(
      "qkv_finish", f"q/k/v partials {k_lib._sig(q_p, k_p)} into caches "
      f"{k_lib._sig(*caches)}" + (" paged" if paged else ""),
      f"{k_lib._sig(q_p, k_p, v_p, positions, *caches)} paged={paged} "
      f"static={statics is not None} {layer} mpad={mpad}", make_args, run, PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  return qf.qkv_finish(q_p, k_p, v_p, positions, starts, caches, block_table=block_table,
                       static_scales=statics, implementation="pallas", **kw)
