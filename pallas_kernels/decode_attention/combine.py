"""The split-KV combine as one Mosaic GPU kernel, writing the attention output in its final
[B, T, H, Dh] layout.

XLA spends four launches on it (the max over splits, the weights, the weighted sums, and the
slice + transpose back out of the packed rows, which feeds a custom call and so is a copy of its
own). Here one warpgroup per packed query row (kv head k, row m = t * G + g) streams the P split
partials once with an online log-sum-exp (as flash-decoding's reduce step does): Dh = 128 is one
element a thread, the split's lse a scalar, nothing in shared memory.

An empty split (lse = -inf, a split past the row's last visible slot) weighs 0; a row that sees
no slot at all (never produced by the model) comes out 0, as the XLA combine gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

WARPGROUP = 128
_FLOOR = -1e30  # the running max starts finite: exp2(-inf - floor) is 0, never NaN


def supported_head_dim(dh: int) -> bool:
  return dh % WARPGROUP == 0


def combine_rows(out, lse, *, batch: int, steps: int, groups: int, out_dtype):
  """out [P, B * K, Mpad, Dh] (each split's normalised partial), lse [P, B * K, Mpad] (log2
  units) -> [B, T=steps, H = K * groups, Dh] in out_dtype."""
  P, BK, _, dh = out.shape
  K, G, M = BK // batch, groups, steps * groups
  layout = plgpu.Layout.WG_STRIDED((dh,), vec_size=dh // WARPGROUP)

  def body(o_ref, lse_ref, y_ref):
    common.pdl_prologue()
    bk, m = lax.axis_index("bk"), lax.axis_index("m")

    def split(p, carry):
      mx, den, acc = carry
      l = lse_ref[p, bk, m]
      new = jnp.maximum(mx, l)
      keep, w = jnp.exp2(mx - new), jnp.exp2(l - new)
      o = plgpu.layout_cast(o_ref[p, bk, m], layout).astype(jnp.float32)
      return new, den * keep + w, acc * keep + o * w

    zeros = plgpu.layout_cast(jnp.zeros((dh,), jnp.float32), layout)
    _, den, acc = lax.fori_loop(0, P, split, (jnp.float32(_FLOOR), jnp.float32(0.0), zeros))
    inv = 1.0 / jnp.maximum(den, 1e-30)  # den == 0 only with acc == 0: the row comes out 0
    y_ref[bk // K, m // G, (bk % K) * G + m % G] = (acc * inv).astype(out_dtype)

  y = jax.ShapeDtypeStruct((batch, steps, K * G, dh), out_dtype)
  return plgpu.kernel(body, out_type=y, grid=(BK, M), grid_names=("bk", "m"))(out, lse)
