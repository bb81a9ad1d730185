"""prefill_attention: causal GQA self-attention over a prompt, global or Llama 4 chunked.

Semantics (reference.py and the kernels agree):
  q [B,T,H,Dh], k/v [B,T,K,Dh] (bf16); tokens sit at positions 0..T-1. Query head j uses kv head
  j // (H // K). Key s is visible to query t iff s <= t, s < lengths[b], and with `chunk_size` also
  s // chunk_size == t // chunk_size (chunks aligned to position 0, not a sliding window).
  Query rows t >= lengths[b] are padding: their output is 0 (so lengths[b] = 0 gives all zeros).
  lengths default to T; values above T act as T (below 0 as 0). Softmax in f32, P V with bf16
  probabilities and an f32 accumulator; output in q's dtype. sm_scale (default Dh**-0.5) and
  chunk_size are static Python numbers.

Kernels: sm90.py (Hopper: wgmma, TMA producer warpgroup + 2 ping-pong compute warpgroups) and
sm100.py (Blackwell: tcgen05 into TMEM, the same warpgroup layout). Both take bf16 with head_dim
64 or 128; anything else runs the XLA reference under implementation=None and raises under "pallas".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.prefill_attention import plan as plan_lib
from pallas_kernels.prefill_attention import reference

SUPPORTED_HEAD_DIMS = plan_lib.SUPPORTED_HEAD_DIMS


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                      lengths: jax.Array | None = None, chunk_size: int | None = None,
                      sm_scale: float | None = None,
                      implementation: str | None = None) -> jax.Array:
  """Causal (optionally chunked) GQA attention of T prompt tokens -> [B,T,H,Dh] in q's dtype."""
  _validate(q, k, v, lengths, chunk_size)
  B, T, H, Dh = q.shape
  if lengths is None:
    lengths = jnp.full((B,), T, jnp.int32)
  lengths = lengths.astype(jnp.int32)
  if sm_scale is None:
    sm_scale = Dh ** -0.5
  plan = plan_lib.plan(T, H, k.shape[2], Dh, q.dtype, arch=common.runnable_arch())
  impl = common.resolve(implementation, supported=plan.supported, why=plan.why)
  if impl == "xla":
    return reference.prefill_attention(q, k, v, lengths, chunk_size, float(sm_scale))
  return _kernel(common.target_arch())(q, k, v, lengths, chunk_size=chunk_size,
                                       sm_scale=float(sm_scale), config=plan.config)


@functools.cache
def _kernel(arch: str):
  if arch == "sm100":
    from pallas_kernels.prefill_attention import sm100 as kernel
  else:
    from pallas_kernels.prefill_attention import sm90 as kernel
  return common.lowered_once(kernel.prefill_attention, ("chunk_size", "sm_scale", "config"))


def pallas_support(q, k, v=None, *, arch: str | None = None) -> tuple[bool, str]:
  """(supported, why not) for the Pallas kernel on q [B,T,H,Dh], k [B,T,K,Dh] (arrays or
  ShapeDtypeStructs): the planner's answer, so a supported call lowers. `arch`: default the one a
  kernel would run on."""
  B, T, H, Dh = q.shape
  same = q.dtype == k.dtype and (v is None or v.dtype == k.dtype)
  dtype = q.dtype if same else jnp.float32  # mixed dtypes: unsupported
  p = plan_lib.plan(T, H, k.shape[2], Dh, dtype, arch=arch)
  return p.supported, p.why


def _validate(q, k, v, lengths, chunk_size) -> None:
  check = common.check
  check(q.ndim == 4, f"q must be [B,T,H,Dh]; got shape {q.shape}")
  B, T, H, Dh = q.shape
  check(k.ndim == 4 and k.shape[:2] == (B, T) and k.shape[3] == Dh,
        f"k must be [B,T,K,Dh] = [{B},{T},K,{Dh}] to match q {q.shape}; got {k.shape}")
  check(v.shape == k.shape, f"v must have k's shape {k.shape}; got {v.shape}")
  K = k.shape[2]
  check(K > 0 and H % K == 0,
        f"q heads H={H} must be a multiple of kv heads K={K} (q {q.shape}, k {k.shape}); "
        f"pass whole GQA groups")
  check(q.dtype == k.dtype == v.dtype and jnp.issubdtype(q.dtype, jnp.floating),
        f"q, k, v must share one float dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}: cast "
        f"them (bf16 for the kernel)")
  if lengths is not None:
    check(lengths.shape == (B,) and jnp.issubdtype(lengths.dtype, jnp.integer),
          f"lengths must be an integer array of shape [B] = ({B},); got {lengths.shape} "
          f"{lengths.dtype}")
  if chunk_size is not None:
    check(isinstance(chunk_size, int) and chunk_size > 0,
          f"chunk_size must be a positive int or None (global causal); got {chunk_size!r}")
