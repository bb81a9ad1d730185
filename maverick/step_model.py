"""A modeled decode-step time: what a step's launches and bytes would cost on a GPU. A MODEL, never
a measurement: every constant below is stated, and only the per-launch cost was ever measured
(once, on an H200).

  step time = max(bytes read / HBM bandwidth, flops / tensor peak) + launches x per-launch cost

At batch 1 the step is launch-bound, so the second term decides it. The per-launch cost was
calibrated on the one GPU measurement the project has: the XLA-path decode step of one TP8 rank
shard on an H200 (loop flags off, no all-reduces: ~1,670 launches) took 3.164 ms while its bytes
needed ~0.46 ms at 4.8 TB/s: (3.164 - 0.46) ms / 1,670 = ~1.62 us a launch on top of the bytes
(~1.9 us a launch with the bytes folded in). With programmatic dependent launch (PDL) a kernel's
prologue overlaps its predecessor's tail; how much of the launch cost that hides is NOT measured
here: `PDL_LAUNCH_US` is an assumption, shown beside the plain figure, never alone.

Bytes read per device per step: every weight shard a token touches (the embedding table is a
gather of a few rows, not read; of the routed experts only the ones the step's rows can select,
min(E, rows x top-k)), plus each layer's visible KV cache (chunked layers see at most their chunk).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  name: str
  hbm_bytes_per_s: float  # the datasheet's HBM bandwidth
  fp8_flops_per_s: float  # dense FP8 tensor peak (datasheet, no sparsity)


GPUS = {"h200": GpuSpec("H200", 4.8e12, 1.979e15), "b200": GpuSpec("B200", 8.0e12, 4.5e15)}
LAUNCH_US = (3.164e3 - 0.46e3) / 1670  # ~1.62: calibrated once (H200, XLA path), see above
PDL_LAUNCH_US = 1.0  # an ASSUMPTION (not measured): the launch cost left with PDL on every kernel


@dataclasses.dataclass(frozen=True)
class StepBytes:
  weights: int
  kv: int

  @property
  def total(self) -> int:
    return self.weights + self.kv


def _is_routed_expert(path: tuple, shape: tuple, num_experts: int) -> bool:
  return ("ffn" in path and "shared" not in path and len(shape) >= 2
          and shape[0] == num_experts and path[-1] not in ("router",))


def step_bytes(flat_state, cfg, *, batch: int, tokens_per_row: int, context: int,
               kv_bytes_per_value: float = 2.0, kv_heads_local: int | None = None,
               shard_shape=None) -> StepBytes:
  """Bytes one device reads in a step of `batch` rows x `tokens_per_row` new tokens, each row
  over a cache of `context` positions.

  flat_state: (path, array-like with .shape/.dtype) pairs of the model's state (nnx.to_flat_state
  values); shard_shape(x) -> the device's shard shape (default: unsharded). The KV term uses the
  config's layers and chunking, and `kv_heads_local` KV heads (the device's cache shard; default
  all of them)."""
  import numpy as np
  shard_shape = shard_shape or (lambda x: x.shape)
  rows = batch * tokens_per_row
  weights = 0
  kv_heads_local = kv_heads_local or cfg.num_key_value_heads
  for path, x in flat_state:
    if path and path[0] == "embed":
      continue
    shape = tuple(shard_shape(x))
    n = math.prod(shape) * np.dtype(x.dtype).itemsize
    if _is_routed_expert(path, tuple(x.shape), cfg.num_local_experts):
      n = n * min(cfg.num_local_experts, rows * cfg.num_experts_per_tok) // cfg.num_local_experts
    weights += n
  kv = 0
  for layer in range(cfg.num_hidden_layers):
    chunked = cfg.layer_types is not None and cfg.layer_types[layer] == "chunked_attention"
    visible = min(context, cfg.attention_chunk_size) if chunked else context
    kv += int(2 * visible * kv_heads_local * cfg.head_dim * kv_bytes_per_value)
  return StepBytes(weights, kv * batch)


def step_seconds(launches: int, bytes_read: int, flops: float, gpu: str,
                 launch_us: float = LAUNCH_US) -> float:
  spec = GPUS[gpu]
  return (max(bytes_read / spec.hbm_bytes_per_s, flops / spec.fp8_flops_per_s)
          + launches * launch_us * 1e-6)


def tokens_per_s(step_s: float) -> float:
  """Plain decoding: one token per row per step."""
  return 1.0 / step_s


def spec_tokens_per_s(verify_s: float, draft_s: float, k: int, acceptance: float) -> float:
  """EAGLE-3 chain: a round is one verify step and k draft steps, and emits `acceptance` tokens
  (the mean accepted length, bonus token included)."""
  return acceptance / (verify_s + k * draft_s)
