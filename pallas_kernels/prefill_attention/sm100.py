"""Blackwell (sm_100) prefill flash attention: the sm90 kernel's tiling (packed GQA rows, dynamic
causal / chunk / length KV bounds, mask only on boundary blocks) with tcgen05 MMAs into TMEM.

A CTA owns `num_compute_wgs` blocks of 128 packed rows (the tcgen05 M) of one (batch, kv head) and
walks the KV blocks any of its rows can see. Warp specialized, in the structure of the sm100
decode kernel (decode_attention/sm100.py):
  producer warpgroup (the last one, 40 registers): K and V tiles by TMA into a `num_stages`-deep
    ring of swizzled SMEM slots (decode_attention.stream.stream_kv); a slot is refilled once every
    compute warpgroup has released it (K and V have their own ready / free barriers).
  compute warpgroup w: its own 128 rows (Q in SMEM), its own TMEM columns (S: 128 x block_kv, O:
    128 x Dh, f32) and its own tensor-core barrier. Per KV block: S = Q K^T (tcgen05) -> the K slot
    goes back -> S to registers (one row per thread: row max / sum in-thread) -> scale (base 2),
    mask on boundary blocks only, online softmax in f32 -> P to SMEM as bf16; the running O is
    rescaled in TMEM by alpha (64-column chunks through registers, skipped on the first block),
    then O += P V (tcgen05, accumulating in TMEM) -> the V slot goes back. Every MMA is committed
    to the warpgroup's barrier and waited on before its result is read or its operands reused.
  With two compute warpgroups they take turns (FA3/FA4 ping-pong, as in sm90.py): one's softmax
  runs while the other's MMAs own the tensor core. The output is normalised on the way out and
  staged through the warpgroup's Q buffer.
GPU interpret mode runs one compute warpgroup by default (see INTERPRET_COMPUTE_WGS).
SMEM / TMEM: see `smem_bytes` / `default_config` (Dh=128: block_kv 64, 3 stages, 192 KiB SMEM and
384 TMEM columns with 2 compute warpgroups).
Not done yet (FA4): lazy O rescaling (skip when the row max barely moves), S/P aliasing in TMEM (P
goes through SMEM), a dedicated MMA warp and a correction warpgroup, exp2 emulation on the FMA
units.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.decode_attention import stream
from pallas_kernels.prefill_attention import tiling

BLOCK_Q = 128  # packed rows per compute warpgroup: the tcgen05 M
MAX_STAGES = 4
SMEM_BUDGET = 200 * 1024  # what default_config plans for
SMEM_LIMIT = 227 * 1024  # the most one CTA can have on sm_100
# The loop rescales O in 32-column chunks (o_chunk sets the epilogue's, which goes through the
# swizzled SMEM tile). Registers: see decode_attention/sm100.py's RESCALE_COLS (ptxas ignores
# setmaxnreg here, so a thread of the 3 warpgroups has 168).
RESCALE_COLS = 32
TMEM_COLUMNS = 512
# The CPU interpreter runs every warpgroup as a host thread blocked in XLA callbacks; on a small
# host three of them can starve XLA's CPU pool (see decode_attention/api.py), so interpret mode
# defaults to one compute warpgroup: the same code path, without the turn-taking.
INTERPRET_COMPUTE_WGS = 1


@dataclasses.dataclass(frozen=True)
class Config:
  block_kv: int = 64  # keys per pipeline step
  num_stages: int = 3  # K/V ring slots
  num_compute_wgs: int = 2  # 128-row Q blocks per CTA, one compute warpgroup each
  # With two compute warpgroups, alternate them on the tensor core (ping-pong).
  ping_pong: bool = True
  o_chunk: int = 64  # TMEM columns of O moved through registers at a time (register pressure)

  def __post_init__(self):
    if (self.block_kv % 64 or self.num_stages < 1 or self.num_compute_wgs not in (1, 2)
        or self.o_chunk % 16):
      raise ValueError(f"unsupported {self}")


def smem_bytes(Dh: int, block_kv: int, num_compute_wgs: int, num_stages: int) -> int:
  """SMEM of one CTA (barriers aside), bf16 throughout."""
  per_wg = BLOCK_Q * Dh * 2 + BLOCK_Q * block_kv * 2  # Q (then the output tile), P
  return num_compute_wgs * per_wg + num_stages * 2 * block_kv * Dh * 2  # + K and V per slot


def tmem_columns(Dh: int, block_kv: int, num_compute_wgs: int) -> int:
  return num_compute_wgs * (block_kv + Dh)  # S and O (f32, one column per element) per warpgroup


def default_config(head_dim: int, T: int) -> Config:
  # Short prompts and head_dim 128: 64-key blocks (less waste on the diagonal and padding; at
  # Dh=128 a 128-key block leaves room for one slot only). Then as many slots as fit the budget:
  # Dh=128 -> 2 x (32 + 16) KiB + 3 x 32 KiB = 192 KiB; Dh=64 -> 4 slots of 64 keys (128 KiB)
  # or 3 of 128 keys (192 KiB).
  block_kv = 64 if T <= 256 or head_dim > 64 else 128
  stages = MAX_STAGES
  while stages > 1 and smem_bytes(head_dim, block_kv, 2, stages) > SMEM_BUDGET:
    stages -= 1
  return Config(block_kv=block_kv, num_stages=stages)


def prefill_attention(q, k, v, lengths, *, chunk_size: int | None, sm_scale: float,
                      config: Config | None = None):
  """q [B,T,H,Dh], k/v [B,T,K,Dh] bf16, lengths [B] int32 -> [B,T,H,Dh] bf16 (validated by api)."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  if config is None:
    config = default_config(Dh, T)
    if common.interpreting():
      config = dataclasses.replace(config, num_compute_wgs=INTERPRET_COMPUTE_WGS)
  cfg = config
  bq, bkv, C, stages = BLOCK_Q, cfg.block_kv, cfg.num_compute_wgs, cfg.num_stages
  if (tmem_columns(Dh, bkv, C) > TMEM_COLUMNS
      or smem_bytes(Dh, bkv, C, stages) > SMEM_LIMIT):
    raise ValueError(f"{cfg} at head_dim {Dh} needs {smem_bytes(Dh, bkv, C, stages)} B of SMEM "
                     f"(max {SMEM_LIMIT}) and {tmem_columns(Dh, bkv, C)} TMEM columns (max "
                     f"{TMEM_COLUMNS})")
  o_chunk = min(cfg.o_chunk, Dh)
  rescale = min(o_chunk, RESCALE_COLS)  # O *= alpha in TMEM needs no SMEM tile
  ping_pong = cfg.ping_pong and C == 2
  cta_rows = C * bq
  dtype = q.dtype
  q_rows, k, v, lengths = tiling.pack(q, k, v, lengths, block_kv=bkv, cta_rows=cta_rows)
  rows = q_rows.shape[2]
  num_ctas_q = rows // cta_rows
  scale_log2 = sm_scale * tiling.LOG2E
  qkv_transforms = tiling.smem_transforms(Dh, dtype)
  p_transforms = tiling.smem_transforms(bkv, dtype)
  layout = plgpu.Layout.TCGEN05
  row_layout = layout.reduce(1)
  o_columns = [pl.ds(c, o_chunk) for c in range(0, Dh, o_chunk)]

  def kernel(lengths_gmem, q_gmem, k_gmem, v_gmem, o_gmem):
    cta = num_ctas_q - 1 - lax.axis_index("q")  # heaviest causal tiles first
    kvh, b = lax.axis_index("kv_head"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    length = lengths_gmem[b]
    cta_row0 = cta * cta_rows
    # Every warpgroup walks the CTA's blocks (the union over its rows), so the compute
    # warpgroups release each slot once and take the same number of turns.
    first_block, num_blocks = tiling.kv_blocks(cta_row0, cta_rows, G, length, chunk_size, bkv)

    def scoped(q_smem, k_smem, v_smem, p_smem, s_tmem, o_tmem, q_bar, k_bar, v_bar, k_free,
               v_free, mma_bar, turn_bar):
      def take_turns():
        # Both compute warpgroups pass here equally often, so it never deadlocks; warpgroup 1
        # starts one turn behind and warpgroup 0 catches up at the end (as in sm90.py).
        if ping_pong:
          plgpu.barrier_arrive(turn_bar)
          plgpu.barrier_wait(turn_bar)

      @pl.when(wg == C)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")
        stream.stream_kv((k_gmem, v_gmem, None, None), (k_smem, v_smem, None, None),
                         (k_bar, v_bar, None, None), (k_free, v_free), b=b, kh=kvh,
                         first_block=first_block, num_steps=num_blocks, block_kv=bkv,
                         stages=stages)

      @pl.when(wg < C)
      def _consumer():
        plgpu.set_max_registers(232, action="increase")
        row0 = cta_row0 + wg * bq
        my_q, my_p, my_bar = q_smem.at[wg], p_smem.at[wg], mma_bar.at[wg]
        my_s = s_tmem.at[:, pl.ds(wg * bkv, bkv)]
        my_o = o_tmem.at[:, pl.ds(wg * Dh, Dh)]
        plgpu.copy_gmem_to_smem(q_gmem.at[b, kvh, pl.ds(row0, bq)], my_q, q_bar.at[wg])
        tok = (plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_layout) + row0) // G
        lo, hi = tiling.row_key_bounds(tok, length, chunk_size)
        m0 = plgpu.layout_cast(jnp.full((bq,), tiling.M_INIT, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
        plgpu.barrier_wait(q_bar.at[wg])
        pl.when(wg == 1)(take_turns)

        def kv_step(j, carry):
          m_prev, l_prev = carry
          slot = lax.rem(j, jnp.int32(stages))
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.tcgen05_mma(my_s, my_q, k_smem.at[slot].T, accumulate=False)
          plgpu.tcgen05_commit_arrive(my_bar)
          take_turns()  # while S = Q K^T runs
          plgpu.barrier_wait(my_bar)
          plgpu.barrier_arrive(k_free.at[slot])  # the S MMA was K's only reader
          s = plgpu.async_load_tmem(my_s, layout=layout)
          kv0 = (first_block + j) * bkv

          def scale_and_mask(s):
            key = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=layout) + kv0
            visible = ((key >= lax.broadcast_in_dim(lo, (bq, bkv), [0]))
                       & (key <= lax.broadcast_in_dim(hi, (bq, bkv), [0])))
            return jnp.where(visible, s * scale_log2, -jnp.inf)

          # Blocks inside every row's visible range (most of a long prompt) skip the mask.
          needs_mask = tiling.block_needs_mask(kv0, bkv, row0, bq, G, length, chunk_size)
          s = lax.cond(needs_mask, scale_and_mask, lambda s: s * scale_log2, s)
          m_new = jnp.maximum(m_prev, s.max(axis=1))
          alpha = jnp.exp2(m_prev - m_new)
          p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, bkv), [0]))
          l_new = l_prev * alpha + p.sum(axis=1)
          plgpu.wait_load_tmem()  # S is in registers before the next step's MMA overwrites it
          # P is stored before O is rescaled, so P and an O chunk are never live together.
          my_p[...] = p.astype(dtype)  # the previous P V MMA, P's reader, has completed

          @pl.when(j > 0)
          def _rescale_o():  # O *= alpha in TMEM (the previous P V MMA has completed)
            alpha_b = lax.broadcast_in_dim(alpha, (bq, rescale), [0])
            for cols in [pl.ds(c, rescale) for c in range(0, Dh, rescale)]:
              o = plgpu.async_load_tmem(my_o.at[:, cols], layout=layout)
              plgpu.wait_load_tmem()  # read before overwritten
              plgpu.async_store_tmem(my_o.at[:, cols], o * alpha_b)
            plgpu.commit_tmem()

          plgpu.commit_smem()
          take_turns()  # softmax done: the other warpgroup's turn on the tensor core ends
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.tcgen05_mma(my_o, my_p, v_smem.at[slot], accumulate=j > 0)
          plgpu.tcgen05_commit_arrive(my_bar)
          plgpu.barrier_wait(my_bar)
          plgpu.barrier_arrive(v_free.at[slot])
          return m_new, l_new

        _, l = lax.fori_loop(0, num_blocks, kv_step, (m0, l0))
        pl.when(wg == 0)(take_turns)

        # l = 0: a row that saw no key (O in TMEM is then 0, or never written if no block ran).
        seen = lax.broadcast_in_dim(l > 0, (bq, o_chunk), [0])
        inv_l = lax.broadcast_in_dim(1.0 / jnp.where(l > 0, l, 1.0), (bq, o_chunk), [0])
        for cols in o_columns:
          o = plgpu.async_load_tmem(my_o.at[:, cols], layout=layout)
          my_q[:, cols] = jnp.where(seen, o * inv_l, 0.0).astype(dtype)  # Q's SMEM stages O
        plgpu.wait_load_tmem()
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, o_gmem.at[b, kvh, pl.ds(row0, bq)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((C, bq, Dh), dtype, transforms=qkv_transforms),
        plgpu.SMEM((stages, bkv, Dh), dtype, transforms=qkv_transforms),
        plgpu.SMEM((stages, bkv, Dh), dtype, transforms=qkv_transforms),
        plgpu.SMEM((C, bq, bkv), dtype, transforms=p_transforms),
        plgpu.TMEM((bq, C * bkv), jnp.float32),
        plgpu.TMEM((bq, C * Dh), jnp.float32),
        plgpu.Barrier(num_arrivals=1, num_barriers=C),  # Q of each compute warpgroup
        plgpu.Barrier(num_barriers=stages),  # K slot filled (one TMA arrival)
        plgpu.Barrier(num_barriers=stages),  # V slot filled
        plgpu.Barrier(num_arrivals=C, num_barriers=stages),  # K slot released by every consumer
        plgpu.Barrier(num_arrivals=C, num_barriers=stages),  # V slot released
        # One tensor-core barrier per compute warpgroup: its MMAs' completion.
        plgpu.Barrier(num_arrivals=1, num_barriers=C, orders_tensor_core=True),
        plgpu.Barrier(num_arrivals=C) if ping_pong else None,  # ping-pong turns
        collective_axes="wg",
    )

  out_rows = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((B, K, rows, Dh), dtype),
      grid=(num_ctas_q, K, B),
      grid_names=("q", "kv_head", "batch"),
      num_threads=C + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, q_rows, k, v)
  return tiling.unpack(out_rows, T, H)
