"""Benchmark entries for `benchmarks/kernels.py`: decode / verify attention over a KV cache.

Maverick decode shapes: B=8, H=40, K=8, Dh=128, T=1 (decode) and 4 (EAGLE-3 verify), contexts
of 8k and 128k tokens (the whole cache visible: NoPE-layer global attention), bf16 and fp8 KV,
plus a 128k chunked layer (chunk 8192: only the last chunk is read). Decode attention is memory
bound: `bytes` is the visible K/V cache (and fp8 scales) read once; goal >= 70% of HBM bandwidth
at 8k. Baseline: cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`)
with key_value_seq_lengths, bf16 only (it reads the same cache; for T=4 it skips the causal mask
among the 4 new tokens, which costs it nothing).

Paged (decode_attention_paged): the same verify shapes over 64-slot blocks scattered through a
pool by a shuffled block table; baseline "gather+kernel" is what the model ran before the paged
kernel (kv_cache.gather's copy of the contiguous view, then the contiguous kernel). Goal: the
paged kernel within a few % of the contiguous one (same bytes, one TMA copy per tile either
way)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.decode_attention import api, reference

FP8 = jnp.float8_e4m3fn


def _cudnn(q, k, v, q_positions):
  lengths = jnp.max(q_positions, axis=1) + 1
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation="cudnn")


def _make(key, B, T, H, K, Dh, S, fp8):
  kq, kk, kv, ks, kvs = jax.random.split(key, 5)
  q = jax.random.normal(kq, (B, T, H, Dh), jnp.bfloat16)
  k = jax.random.normal(kk, (B, S, K, Dh), jnp.bfloat16)
  v = jax.random.normal(kv, (B, S, K, Dh), jnp.bfloat16)
  if not fp8:
    return q, k, v, ()
  scales = tuple(jax.random.uniform(x, (B, S, K), jnp.float32, 0.01, 0.02) for x in (ks, kvs))
  return q, k.astype(FP8), v.astype(FP8), scales


def benchmark_cases(toy: bool) -> list[common.BenchCase]:
  if toy:
    B, H, K, Dh = 1, 4, 1, 64
    configs = [(4, 128, 64, True)]  # (T, S, chunk, fp8): one case, interpret mode is slow
  else:
    B, H, K, Dh = 8, 40, 8, 128
    configs = [(T, S, None, fp8) for fp8 in (False, True) for S in (8192, 131072)
               for T in (1, 4)] + [(4, 131072, 8192, False)]
  cases = []
  caches = {}
  for T, S, chunk, fp8 in configs:
    if (S, fp8) not in caches:  # T=1 and T=4 share one cache
      caches[(S, fp8)] = _make(jax.random.key(S + fp8), B, 4, H, K, Dh, S, fp8)
    q4, k, v, scales = caches[(S, fp8)]
    q = q4[:, :T]
    q_positions = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))
    args = (q, k, v, q_positions, *scales)
    visible = S if chunk is None else chunk  # last position S-1 sits at the end of a chunk
    kv_bytes = 2 * B * visible * K * Dh * jnp.dtype(k.dtype).itemsize
    if fp8:
      kv_bytes += 2 * B * visible * K * 4

    def call(q, k, v, pos, *sc, impl, chunk=chunk):
      kw = dict(zip(("k_scale", "v_scale"), sc))
      return api.decode_attention(q, k, v, pos, chunk_size=chunk, implementation=impl, **kw)

    baselines = {}
    if not fp8 and chunk is None and not toy:
      baselines["cudnn"] = _cudnn
    name = (f"{'toy ' if toy else ''}{'verify' if T > 1 else 'decode'} B={B} T={T} H={H} K={K} "
            f"Dh={Dh} ctx={S}{f' chunk={chunk}' if chunk else ''} {'fp8' if fp8 else 'bf16'} KV")
    cases.append(common.BenchCase(
        op="decode_attention", name=name, args=args,
        kernel=functools.partial(call, impl="pallas"),
        reference=functools.partial(call, impl="xla"),
        baselines=baselines, flops=4.0 * B * T * H * visible * Dh, bytes=float(kv_bytes),
        max_rel_error=2e-2, goal=">= 70% of HBM bandwidth" if S == 8192 else ""))
  if not toy:
    cases += _paged_cases(B, H, K, Dh)
  return cases


def _paged_cases(B, H, K, Dh, bs=api.BLOCK_KV, T=4) -> list[common.BenchCase]:
  cases = []
  for S, fp8 in ((8192, False), (131072, False), (8192, True)):
    q, k, v, scales = _make(jax.random.key(S + fp8 + 7), B, T, H, K, Dh, S, fp8)
    M = S // bs
    # Row b's blocks: a random permutation of the pool (no two rows share a block).
    table = jax.random.permutation(jax.random.key(S), B * M).astype(jnp.int32).reshape(B, M)
    to_pool = lambda x: jnp.zeros((B * M, bs) + x.shape[2:], x.dtype).at[table.reshape(-1)].set(
        x.reshape((B * M, bs) + x.shape[2:]))
    pools = tuple(to_pool(x) for x in (k, v, *scales))
    q_positions = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))
    args = (q, pools[0], pools[1], table, q_positions, *pools[2:])
    kv_bytes = 2 * B * S * K * Dh * jnp.dtype(k.dtype).itemsize + (2 * B * S * K * 4 if fp8 else 0)

    def call(q, kp, vp, table, pos, *sc, impl):
      kw = dict(zip(("k_scale", "v_scale"), sc))
      return api.decode_attention_paged(q, kp, vp, table, pos, implementation=impl, **kw)

    def gather_then_kernel(q, kp, vp, table, pos, *sc):
      g = lambda x: reference.gather_pages(x, table)
      kw = dict(zip(("k_scale", "v_scale"), (g(x) for x in sc)))
      return api.decode_attention(q, g(kp), g(vp), pos, implementation="pallas", **kw)

    cases.append(common.BenchCase(
        op="decode_attention", name=f"paged verify B={B} T={T} H={H} K={K} Dh={Dh} ctx={S} "
        f"block={bs} {'fp8' if fp8 else 'bf16'} KV", args=args,
        kernel=functools.partial(call, impl="pallas"),
        reference=functools.partial(call, impl="xla"),
        baselines={"gather+kernel": gather_then_kernel}, flops=4.0 * B * T * H * S * Dh,
        bytes=float(kv_bytes), max_rel_error=2e-2, goal="within a few % of the contiguous kernel"))
  return cases


__all__ = ["benchmark_cases", "reference"]
