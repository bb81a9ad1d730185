"""What to quantize: one frozen, hashable config chosen at model construction (`Config.quant`).

Every quantizable weight has a dotted name: `embed`, `lm_head`, `layers.{i}.attn.{q,k,v,o}`,
`layers.{i}.mlp.{gate,up,down}` (dense layers), `layers.{i}.router`, `layers.{i}.shared.{gate,up,down}`
and `layers.{i}.experts.{gate,up,down}`. A `skip` entry matches a name when it equals one of its
dot-separated parts ("router", "attn", "experts") or glob-matches the whole name ("layers.47.experts.*").
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any

WEIGHT_FORMATS = ("fp8",)
ACTIVATION_MODES = ("none", "dynamic_per_token", "static_per_tensor")
# "fp8": e4m3 with a scale per token and kv head, computed as entries are written (dynamic);
# "fp8_static": e4m3 with one calibrated scale per layer for K and one for V (ModelOpt's k_scale /
# v_scale, as TensorRT-LLM and vLLM run them), no per-token scale arrays in the cache.
KV_FORMATS = ("fp8", "fp8_static")
# The unquantized cache where a KV cache is chosen (maverick.load, --kv_cache, QuantConfig): K/V in
# the model's dtype (bf16 for every released checkpoint; float32 if the model is loaded in float32),
# no scales. A QuantConfig records it as kv_cache None. vLLM's `--kv-cache-dtype bfloat16`.
UNQUANTIZED_KV = "bf16"
KV_CHOICES = (UNQUANTIZED_KV,) + KV_FORMATS
DEFAULT_SKIP = ("embed", "lm_head", "router")


class QuantConfigError(ValueError):
  """A quantization config that names an unknown format or mode."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """weights: "fp8" (e4m3, per-output-channel f32 scales) or None (all weights in the model dtype).
  activations: "dynamic_per_token" (each token's input row to an FP8 linear is quantized to e4m3 with
  its own scale, computed at run time), "static_per_tensor" (each FP8 linear's input is quantized
  with one calibrated scale stored next to its weight as `{weight}_input_scale`, as NVIDIA ModelOpt
  FP8 checkpoints do; such a model comes from a checkpoint, never from `quantize_model`) or "none"
  (weight-only: bf16 activations times FP8 weights).
  kv_cache: "fp8" (e4m3 with a scale per token and kv head, computed at run time), "fp8_static"
  (e4m3 with one scalar scale per layer for K and one for V, stored as the attention's
  `k_cache_scale` / `v_cache_scale`; such a model comes from a ModelOpt checkpoint, never from
  `quantize_model`) or None (unquantized, in the model dtype; "bf16" is accepted as its name and
  stored as None).
  activation_scale_ub: optional upper bound on a row's max |x| before scaling (fbgemm uses 1200).
  """

  weights: str | None = "fp8"
  activations: str = "dynamic_per_token"
  kv_cache: str | None = None
  skip: tuple[str, ...] = DEFAULT_SKIP
  activation_scale_ub: float | None = None

  def __post_init__(self):
    if self.weights is not None and self.weights not in WEIGHT_FORMATS:
      raise QuantConfigError(f"quant weights {self.weights!r} is not supported; use one of "
                             f"{WEIGHT_FORMATS} or None")
    if self.activations not in ACTIVATION_MODES:
      raise QuantConfigError(f"quant activations {self.activations!r} is not supported; use one "
                             f"of {ACTIVATION_MODES}")
    if self.kv_cache == UNQUANTIZED_KV:
      object.__setattr__(self, "kv_cache", None)
    if self.kv_cache is not None and self.kv_cache not in KV_FORMATS:
      raise QuantConfigError(f"quant kv_cache {self.kv_cache!r} is not supported; use one of "
                             f"{KV_CHOICES} or None")
    if isinstance(self.skip, str):
      raise QuantConfigError(f"quant skip must be a list of names, got the string {self.skip!r}")
    object.__setattr__(self, "skip", tuple(str(s) for s in self.skip))
    ub = self.activation_scale_ub
    if ub is not None and not (isinstance(ub, (int, float)) and ub > 0):
      raise QuantConfigError(f"activation_scale_ub must be a positive number or None, got {ub!r}")

  def quantizes(self, name: str) -> bool:
    """Whether the weight called `name` is stored in FP8."""
    if self.weights is None:
      return False
    parts = name.split(".")
    return not any(s in parts or fnmatch.fnmatchcase(name, s) for s in self.skip)

  @property
  def quantize_activations(self) -> bool:
    """Dynamic per-token activation quantization (the static mode is `static_activations`)."""
    return self.weights is not None and self.activations == "dynamic_per_token"

  @property
  def static_activations(self) -> bool:
    return self.weights is not None and self.activations == "static_per_tensor"

  @property
  def static_kv(self) -> bool:
    """FP8 KV cache with per-layer calibrated scalar scales (no per-token scale arrays)."""
    return self.kv_cache == "fp8_static"

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["skip"] = list(self.skip)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> QuantConfig:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise QuantConfigError(f"unknown quant config fields {unknown}; known: {sorted(names)}")
    d = dict(d)
    if "skip" in d:
      d["skip"] = tuple(d["skip"])
    return cls(**d)
