"""Prefill attention's resource planner: the only place that decides whether the Pallas kernel
takes a call and with which config (see pallas_kernels/resources.py).

Per CTA: the Q tiles of its compute warpgroups (reused to stage the output), their P tiles, a
`num_stages`-deep ring of K and V tiles, and on sm_100 the S and O accumulators in TMEM. The
architecture's default config comes first; when it does not fit, the ring gets shallower, then
(sm_100) 128-key blocks fall back to 64; nothing fits: unsupported.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import common, resources
from pallas_kernels.prefill_attention import sm90, sm100

OP = "prefill_attention"
SUPPORTED_HEAD_DIMS = (64, 128)


def usage(cfg, arch: str, Dh: int, dtype=jnp.bfloat16) -> resources.Usage:
  """What sm90/sm100.prefill_attention allocates for `cfg`, buffer by buffer."""
  u = resources.Usage().reduction_scratch()  # the softmax's row max and sum
  if arch == "sm90":
    wgs, bq, bkv = cfg.num_compute_wgs, cfg.block_q, cfg.block_kv
    u.smem("K stages", (cfg.num_stages, bkv, Dh), dtype)
    u.smem("V stages", (cfg.num_stages, bkv, Dh), dtype)
    u.barrier(4 * cfg.num_stages)  # per input: slot loaded / slot consumed
    u.smem("Q (and output) tiles", (wgs, bq, Dh), dtype)
    u.smem("P tiles", (wgs, bq, bkv), dtype)
    u.barrier(wgs + 1)
  else:
    C, bq, bkv = cfg.num_compute_wgs, sm100.BLOCK_Q, cfg.block_kv
    u.smem("Q (and output) tiles", (C, bq, Dh), dtype)
    u.smem("K stages", (cfg.num_stages, bkv, Dh), dtype)
    u.smem("V stages", (cfg.num_stages, bkv, Dh), dtype)
    u.smem("P tiles", (C, bq, bkv), dtype)
    u.tmem(C * bkv)  # S
    u.tmem(C * Dh)  # O
    u.barrier(C + 4 * cfg.num_stages + C + (1 if cfg.ping_pong and C == 2 else 0))
  return u


def plan(T: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16, *,
         arch: str | None = None, interpreting: bool | None = None) -> resources.Plan:
  """Causal prefill of T tokens, num_heads query heads over num_kv_heads kv heads."""
  arch = resources.plan_arch(arch)
  no = lambda why: resources.Plan.unsupported(OP, arch, why)
  if jnp.dtype(dtype) != jnp.bfloat16:
    return no(f"dtype {jnp.dtype(dtype)}: the kernel takes bfloat16 q, k, v")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return no(f"head_dim={head_dim}: the kernel takes {SUPPORTED_HEAD_DIMS}")
  if num_kv_heads <= 0 or num_heads % num_kv_heads:
    return no(f"{num_heads} query heads over {num_kv_heads} kv heads: not whole GQA groups")
  if interpreting is None:
    interpreting = common.interpreting()
  if arch == "sm90":
    base = sm90.default_config(head_dim, T)
    fallbacks = [dataclasses.replace(base, num_stages=s) for s in range(base.num_stages, 0, -1)]
  else:
    base = sm100.default_config(head_dim, T)
    if interpreting:
      base = dataclasses.replace(base, num_compute_wgs=sm100.INTERPRET_COMPUTE_WGS)
    fallbacks = []
    for bkv in dict.fromkeys((base.block_kv, 64)):
      fallbacks += [dataclasses.replace(base, block_kv=bkv, num_stages=s)
                    for s in range(base.num_stages, 0, -1)]
  last = None
  for cfg in fallbacks:
    last = usage(cfg, arch, head_dim, dtype)
    if not last.over(arch):
      return resources.Plan.of(OP, arch, cfg, last)
  return resources.Plan.unsupported(OP, arch, f"no config fits: {last.over(arch)}", last)
