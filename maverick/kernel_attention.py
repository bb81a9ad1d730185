"""Attention on the kernel path: prefill attention over the new tokens, and decode / verify /
tree-verify attention over the KV cache (contiguous or paged), whose split-KV combine may also
write the FP8 o projection's input rows. Each helper returns None when the caller should run
its XLA path (see maverick.kernels: the switch, the self-check probes, the sharded runs)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maverick import kernels as k_lib
from maverick.quant import ops as quant_ops
from pallas_kernels import decode_attention as decode
from pallas_kernels import gemm as gemm_lib
from pallas_kernels import prefill_attention as prefill
from pallas_kernels import selfcheck


def _head_specs(plan, batch: int):
  """(q spec, kv spec) of [B, T|S, heads, Dh] attention operands: rows over the batch axes,
  q / KV heads as the plan splits the projections (and the KV cache)."""
  heads = k_lib._mesh_axes(plan.rules["q_heads"]) + k_lib._mesh_axes(plan.rules["kv_heads"])
  rows = k_lib._rows(plan, batch, heads)
  return (P(rows, None, plan.rules["q_heads"], None), P(rows, None, plan.rules["kv_heads"], None))


def prefill_attention(q, k, v, chunk_size: int | None, kernels: str | None, plan=None):
  """Causal (chunked) self-attention of a prompt at positions 0..T-1, or None. `plan`: a sharded
  model's; the kernel runs on each device's rows and heads."""
  if kernels == "xla":
    return None
  if plan is not None:
    q_spec, kv_spec = _head_specs(plan, q.shape[0])
    local = lambda q_, k_, v_: prefill_attention(q_, k_, v_, chunk_size, kernels)
    return k_lib._on_shards(plan, local, (q, k, v), (q_spec, kv_spec, kv_spec), q_spec)
  ok = prefill.pallas_support(q, k, v)[0]

  def run(implementation, q, k, v):
    return prefill.prefill_attention(q, k, v, chunk_size=chunk_size,
                                     implementation=implementation)

  def make_args(rng):
    return tuple(k_lib._normal(rng, a.shape, a.dtype) for a in (q, k, v))

  probe = selfcheck.Probe("prefill_attention", f"q {k_lib._sig(q)}, k/v {k_lib._sig(k)}",
                          f"{k_lib._sig(q, k, v)} chunk={chunk_size}", make_args, run,
                          k_lib.PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  return run("pallas", q, k, v)


def cache_attention(q, k_cache, v_cache, q_positions, chunk_size: int | None, tree,
                    kv_scales: dict, kernels: str | None, plan=None, block_table=None,
                    quantize_for: tuple[int, float | bool] | None = None, q_packed=None):
  """Decode / verify / tree-verify attention of T new queries over the KV cache, or None.
  `block_table` [B, M]: the cache is paged, k_cache/v_cache (and any kv_scales) are the layer's
  pools [N, bs, K, ...] and the kernel reads them through the table (no gather); a None return
  leaves the gather to the caller's XLA path. `plan`: a sharded model's; the kernel runs on
  each device's rows and heads of q and the cache (sharded by KV heads,
  `sharding.constrain_cache`; paged pools have no row axis and go whole to every row shard).
  `quantize_for` = (N, ub as `Fuse.quantize_ub`): the output feeds an FP8 GEMM to N features
  that quantizes its input per token (o): the combine kernel also writes those FP8 rows
  (`k_lib.remember_quantized`; on a sharded model each device's over its heads), saving that GEMM
  its quantize launch. `q_packed` [B, K, Mpad, Dh]: the queries already packed for the kernel
  (`maverick.fused_attention`; `q` then gives only the shape [B, T, H, Dh])."""
  if kernels == "xla":
    return None
  if plan is not None and quantize_for is not None:
    q_spec = _head_specs(plan, q.shape[0])[0]
    heads = q_spec[2]
    if q_spec[0] is not None or heads is None:  # rows split (EP attention), or heads not
      quantize_for = None
  paged = block_table is not None
  # Static FP8 KV: the kernel reads a scale per slot, so it gets the layer's scalar broadcast to
  # [B, S, K] (paged: [N, bs, K]), built per call (the bytes the dynamic mode's scales cost).
  kv_scales = {n: jnp.broadcast_to(s, k_cache.shape[:3]) for n, s in kv_scales.items()}
  if plan is not None:
    q_spec, kv_spec = _head_specs(plan, q.shape[0])
    rows = q_spec[0]
    tree_leaves, treedef = jax.tree.flatten(tree)
    names = sorted(kv_scales)
    if paged:
      kv_spec = P(None, *kv_spec[1:])

    def local(q_, kc, vc, pos, scales, leaves, table):
      tree_ = None if tree is None else jax.tree.unflatten(treedef, leaves)
      packed = None
      if q_packed is not None:  # q_ is the packed shard [B, K, Mpad, Dh]
        b, k, _, dh = q_.shape
        packed = q_.reshape(b * k, -1, dh)
        q_ = jax.ShapeDtypeStruct((b, q.shape[1], k * (q.shape[2] // k_cache.shape[2]), dh),
                                  q_.dtype)
      return _local_cache_attention(q_, kc, vc, pos, chunk_size, tree_,
                                    dict(zip(names, scales)), kernels, table, quantize_for,
                                    packed)

    args = (q if q_packed is None else q_packed, k_cache, v_cache, q_positions,
            [kv_scales[n] for n in names], tree_leaves, block_table)
    # KV scales [B, S, K] split like the cache; tree leaves ([B], [B, R], [B, T, R]) by rows.
    packed_spec = P(rows, kv_spec[2], None, None)
    specs = (q_spec if q_packed is None else packed_spec, kv_spec, kv_spec, P(rows, None),
             [P(kv_spec[0], None, kv_spec[2])] * len(names),
             [P(rows, *([None] * (a.ndim - 1))) for a in tree_leaves],
             P(rows, None) if paged else None)
    out_spec = q_spec
    if quantize_for is not None:
      struct = lambda spec, a: k_lib._local_struct(a, spec, plan.mesh)
      local_args = jax.tree.map(struct, specs, args, is_leaf=lambda x: isinstance(x, P))
      with selfcheck.on_mesh(plan.mesh):
        shapes = jax.eval_shape(local, *local_args)
      if not isinstance(shapes, tuple):  # the kernel did not quantize these shards
        quantize_for = None
      else:
        out_spec = (q_spec, P(None, heads), P(heads))
    out = k_lib._on_shards(plan, local, args, specs, out_spec)
    if out is None or quantize_for is None:
      return out
    y, rows, row_scales = out
    k_lib.remember_quantized(y, rows, row_scales, _ub(quantize_for[1]), specs=out_spec[1:])
    return y
  packed = None if q_packed is None else q_packed.reshape(-1, *q_packed.shape[2:])
  out = _local_cache_attention(q, k_cache, v_cache, q_positions, chunk_size, tree, kv_scales,
                               kernels, block_table, quantize_for, packed)
  if not isinstance(out, tuple):
    return out
  y, rows, row_scales = out
  k_lib.remember_quantized(y, rows, row_scales, _ub(quantize_for[1]))
  return y


def _ub(quantize_ub):
  """A `Fuse.quantize_ub` as the cap quantize_rows takes (True: none)."""
  return None if quantize_ub is True else quantize_ub


def _local_cache_attention(q, k_cache, v_cache, q_positions, chunk_size, tree, kv_scales,
                           kernels, block_table, quantize_for, q_packed=None):
  """`cache_attention` on one device's shards: its output, None (XLA), or with `quantize_for`
  where the combine kernel takes it, (output, e4m3 rows, scales). `q_packed` [B*K, Mpad, Dh]:
  the packed queries (q a ShapeDtypeStruct)."""
  paged = block_table is not None
  tree_size = None if tree is None else tree.positions.shape[1]
  if paged:
    ok = decode.pallas_support_paged(q, k_cache, block_table, tree_size)[0]
  else:
    ok = decode.pallas_support(q, k_cache, tree_size)[0]
  ok = ok and q.shape[1] <= 64
  names = ["k_scale", "v_scale"] if kv_scales else []
  extras = [kv_scales[n] for n in names]
  if tree is not None:
    names += ["tree_start", "tree_positions", "tree_visible"]
    extras += [tree.start, tree.positions, tree.visible]
  lead = (q, k_cache, v_cache) + ((block_table,) if paged else ())

  def run(implementation, q, k_cache, v_cache, *rest, quantize=None, packed=None):
    kw = dict(chunk_size=chunk_size, implementation=implementation, quantize=quantize,
              q_packed=packed)
    if paged:
      return decode.decode_attention_paged(q, k_cache, v_cache, *rest[:2], **kw,
                                           **dict(zip(names, rest[2:])))
    return decode.decode_attention(q, k_cache, v_cache, rest[0], **kw,
                                   **dict(zip(names, rest[1:])))

  def make_args(rng):
    B, T = q_positions.shape
    args = [k_lib._normal(rng, q.shape, q.dtype), k_lib._normal(rng, k_cache.shape, k_cache.dtype),
            k_lib._normal(rng, v_cache.shape, v_cache.dtype)]
    if paged:  # every row's blocks: distinct pool blocks in a random order
      N, M = k_cache.shape[0], block_table.shape[1]
      ids = np.stack([rng.permutation(max(N, M))[:M] % N for _ in range(B)])
      args.append(jnp.asarray(ids.astype(np.int32)))
      S = M * k_cache.shape[1]
    else:
      S = k_cache.shape[1]
    if tree is None:  # T new tokens at the end of a random prefix
      ends = rng.integers(T, S + 1, B)
      args.append(jnp.asarray((ends[:, None] - T + np.arange(T)).astype(np.int32)))
    else:  # a tree block at a random offset; queries at tree depths; random visibility
      R = tree.positions.shape[1]
      start = rng.integers(0, S - R + 1, B)
      depth = np.sort(rng.integers(0, R, (B, R)), axis=1)
      args.append(jnp.asarray((start[:, None] + rng.integers(0, R, (B, T))).astype(np.int32)))
    if kv_scales:
      args += [k_lib._positive(rng, kv_scales[n].shape) for n in ("k_scale", "v_scale")]
    if tree is not None:
      args += [jnp.asarray(start.astype(np.int32)),
               jnp.asarray((start[:, None] + depth).astype(np.int32)),
               jnp.asarray(rng.random((B, T, R)) < 0.5)]
    return tuple(args)

  cache_desc = (f"cache {k_lib._sig(k_cache)}"
                + (f" paged by {k_lib._sig(block_table)}" if paged else ""))
  probe = selfcheck.Probe(
      "decode_attention_paged" if paged else "decode_attention",
      f"q {k_lib._sig(q)} over {cache_desc}"
      + (f" with a {tree.positions.shape[1]}-slot tree" if tree is not None else ""),
      f"{k_lib._sig(*lead, q_positions, *extras)} chunk={chunk_size}",
      make_args, run, k_lib.PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  quantize = _attention_quantize(q, quantize_for, kernels, probe, run)
  return run("pallas", *lead, q_positions, *extras, quantize=quantize, packed=q_packed)


def _attention_quantize(q, quantize_for, kernels, probe, run):
  """decode_attention's `quantize` for an FP8 o projection (rows padded to its GEMM's row tile),
  or None: no consumer, the combine kernel does not take the token rows, or (auto) the epilogue's
  own self-check failed (the attention then runs without it, the GEMM quantizes)."""
  if quantize_for is None:
    return None
  B, T, H, Dh = q.shape
  n, ub = quantize_for[0], _ub(quantize_for[1])
  rows, k = B * T, H * Dh
  tile = gemm_lib.row_tile(rows, n, k, quant_ops.FP8, quant_ops.FP8)
  if tile <= 1 or not decode.supports_quantize(H, Dh):
    return None
  quantize = (rows + (-rows % tile), ub)

  def dequantized(implementation, *args):  # the probe compares one array: the rows' values
    _, rows_q, scales = run(implementation, *args, quantize=quantize)
    return rows_q.astype(jnp.float32) * scales[:, None]

  epilogue = dataclasses.replace(probe, op=probe.op + " FP8 epilogue",
                                 key=f"{probe.key} quantize={quantize}", run=dequantized,
                                 tol=k_lib.EPILOGUE_PROBE_TOL)
  return quantize if k_lib.use_pallas(kernels, True, epilogue) else None
