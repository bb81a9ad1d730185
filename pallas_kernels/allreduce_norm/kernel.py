"""The Mosaic GPU kernel: one warpgroup per row of [M, D].

Each block loads its row of the partial sums summed over every device of the tensor axis with
one NVLink multimem `ld_reduce` per vector (`plgpu.multimem_load_reduce`: the switch adds the
peers' copies, no staging buffer, no second kernel), adds the residual in f32, rounds it to the
residual dtype (the new residual, as the model's `x + a`), and writes it and its RMSNorm. The
row's mean square is a warpgroup reduction of the strided fragments: D = 5120 is 40 elements per
thread, so a whole row sits in registers and the norm needs no second pass over memory.

`multimem=False` swaps the multimem load for a plain load of an already summed row: the same
body on one device, which GPU interpret mode can run (multi-device kernels cannot), so the
residual + norm math is tested on CPU. The reduce is the only difference between the two.

Synchronisation (multimem reads the peers' buffers): every block signals a `ready` semaphore on
all devices before it reads and waits until every device did, so no device reads a peer's input
before that peer's kernel started (its input is then written); after reading, a `done` barrier
keeps every device's input alive until all peers finished reading it (as jax's
`reduce_scatter_mgpu` does). Each block has its own pair, and every wait takes back what it waited
for, so a kernel leaves its semaphores at zero: one buffer (`semaphores`, from
`new_semaphores`) can then serve every fused site of a forward. Per-kernel scratch semaphores
would be a fresh zeroed buffer in collective memory each: XLA copies one in before every kernel,
a launch per site (97 in the 48-layer decode step). A peer's signal for the next kernel cannot
land early: it sends it only after this kernel's `done`, which every block here has signalled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.quantize_rows import kernel as quantize_kernel
from pallas_kernels.quantize_rows.reference import FP8, FP8_MAX

# multimem ld_reduce works on 32-bit words at least: 2 bf16 per vector minimum; 8 bf16 = 16 B.
VEC_SIZES = (8, 4, 2)
WARPGROUP = 128


def vec_size(d: int, widest: int = VEC_SIZES[0]) -> int | None:
  """The widest vector (of at most `widest`) that tiles a row of `d` over one warpgroup."""
  return next((v for v in VEC_SIZES if v <= widest and d % (WARPGROUP * v) == 0), None)


def row_vec_size(partials, d: int) -> int | None:
  """The vector of a row that takes every term: 16 B loads, so 4 elements with an f32 term."""
  wide = max(jnp.dtype(p.dtype).itemsize for p in partials)
  return vec_size(d, 16 // wide)


def shared_semaphores_supported() -> bool:
  """Whether this jax can allocate a semaphore buffer outside a kernel (jax 0.12; 0.11.2 cannot,
  and its kernels keep scratch semaphores)."""
  return hasattr(plgpu, "alloc_semaphore")


def new_semaphores(rows: int):
  """A zeroed semaphore buffer for fused kernels of `rows` rows (a mutable jax Ref: kernels that
  take it update it in place), or None where this jax lacks them. Call outside shard_map."""
  if not shared_semaphores_supported():
    return None
  return plgpu.alloc_semaphore((2 * rows,))


def fused(partials, residual, weight, eps: float, *, collective_axes=None, num_devices: int = 1,
          semaphores=None, quantize: tuple[int, float | None] | None = None):
  """(new residual, normed), both [M, D] in residual.dtype, of the sum of `partials`: terms
  [R >= M, D] (rows past M are not read: a GEMM's tile padding needs no slice) or [S, R, D] (a
  GEMM's S split-K f32 partials, each scaled: their sum is its product), each reduced over the
  devices and summed in f32 (so a K-split GEMM's sum, and a second term such as the routed
  experts beside the shared one, need no XLA fusion before the kernel).

  `collective_axes`: the mesh axes the multimem load reduces over (inside shard_map;
  `num_devices` devices in all), or None for the single-device body (`partials` already summed
  over the devices). `semaphores`: a buffer from `new_semaphores(M)` shared with other fused
  kernels (zero between them), or None for the kernel's own. `quantize` (rows_out >= M, ub):
  the normed rows come as [rows_out, D] (rows M.. zero), and also in e4m3 [rows_out, D] with
  their f32 scales [rows_out], exactly as pallas_kernels.quantize_rows quantizes them (per row,
  max |y| floored at 1/512 and capped at ub, to 448; rows M.. zero rows): the next GEMM's FP8
  input without a quantize launch of its own. The row is in registers already, so its max is
  one more warpgroup reduction."""
  partials = tuple(partials)
  m, d = residual.shape
  rows_out = m if quantize is None else quantize[0]
  ub = None if quantize is None else quantize[1]
  layout = plgpu.Layout.WG_STRIDED((d,), vec_size=row_vec_size(partials, d))
  multimem = collective_axes is not None

  shared = multimem and semaphores is not None

  def body(*refs):
    common.pdl_prologue()
    row = lax.axis_index("rows")
    n = len(partials)
    x_refs, (r_ref, w_ref), refs = refs[:n], refs[n:n + 2], refs[n + 2:]
    if shared:
      sem_ref, *refs = refs
    outs, sems = refs[:4 if quantize else 2], refs[4 if quantize else 2:]
    h_ref, y_ref = outs[:2]
    q_ref, s_ref = outs[2:] if quantize else (None, None)
    if shared:
      sems = (sem_ref.at[2 * row], sem_ref.at[2 * row + 1])
    if quantize is None:
      row_body(row, x_refs, r_ref, w_ref, h_ref, y_ref, None, None, *sems)
      return

    @pl.when(row < m)
    def _():
      row_body(row, x_refs, r_ref, w_ref, h_ref, y_ref, q_ref, s_ref, *sems)

    @pl.when(row >= m)
    def _():  # the GEMM's tile padding: what quantizing a zero row gives
      zero = plgpu.layout_cast(jnp.zeros((d,), jnp.float32), layout)
      q_ref[row] = zero.astype(q_ref.dtype)
      s_ref[row] = quantize_kernel.row_scale(jnp.float32(0.0), ub)
      y_ref[row] = zero.astype(y_ref.dtype)

  def row_body(row, x_refs, r_ref, w_ref, h_ref, y_ref, q_ref, s_ref, *sems):
    if multimem:
      ready, done = sems
      plgpu.semaphore_signal_multicast(ready, collective_axes=collective_axes)
      pl.semaphore_wait(ready, num_devices)
    total = None
    for x_ref, p in zip(x_refs, partials):
      for view in ([x_ref.at[k, row] for k in range(p.shape[0])] if p.ndim == 3
                   else [x_ref.at[row]]):
        if multimem:
          v = plgpu.multimem_load_reduce(view, collective_axes=collective_axes,
                                         reduction_op="add")
        else:
          v = view[...]
        v = plgpu.layout_cast(v, layout).astype(jnp.float32)
        total = v if total is None else total + v
    r = plgpu.layout_cast(r_ref[row], layout)
    h = (r.astype(jnp.float32) + total).astype(h_ref.dtype)
    hf = h.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(hf * hf) * (1.0 / d) + eps)
    w = plgpu.layout_cast(w_ref[...], layout)
    h_ref[row] = h
    y = (hf * inv).astype(y_ref.dtype) * w
    y_ref[row] = y
    if q_ref is not None:
      yf = y.astype(jnp.float32)
      scale = quantize_kernel.row_scale(jnp.max(jnp.abs(yf)), ub)
      q_ref[row] = jnp.clip(yf / scale, -FP8_MAX, FP8_MAX).astype(q_ref.dtype)
      s_ref[row] = scale
    if multimem:
      plgpu.semaphore_signal_multicast(done, collective_axes=collective_axes)
      pl.semaphore_wait(done, num_devices)

  # With `quantize` the normed rows come padded like the FP8 rows (zero rows past M): a bf16
  # GEMM on them (the MoE router) then pads nothing.
  out_types = (jax.ShapeDtypeStruct((m, d), residual.dtype),
               jax.ShapeDtypeStruct((rows_out, d), residual.dtype))
  if quantize is not None:
    out_types += (jax.ShapeDtypeStruct((rows_out, d), FP8),
                  jax.ShapeDtypeStruct((rows_out,), jnp.float32))
  sems = [plgpu.SemaphoreType.REGULAR] * 2 if multimem and not shared else []
  args = (*partials, residual, weight) + ((semaphores,) if shared else ())
  return plgpu.kernel(body, out_type=out_types, grid=(rows_out,), grid_names=("rows",),
                      scratch_types=sems)(*args)
