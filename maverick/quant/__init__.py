"""FP8 quantization: config, primitives, the quantized contraction, and model/checkpoint conversion.

    import maverick
    from maverick import quant
    bf16 = maverick.load().model
    fp8 = quant.quantize_model(bf16, quant.QuantConfig(kv_cache="fp8"))
"""

from maverick.quant.config import (
  ACTIVATION_MODES,
  DEFAULT_SKIP,
  KV_FORMATS,
  QuantConfig,
  QuantConfigError,
)
from maverick.quant.ops import (
  FP8,
  FP8_MAX,
  MIN_ROW_AMAX,
  QuantError,
  check_finite,
  dequantize,
  einsum,
  from_kmajor,
  kmajor_order,
  quantize_kv,
  quantize_rows,
  quantize_static,
  quantize_weight,
  to_kmajor,
)

__all__ = [
  "ACTIVATION_MODES",
  "DEFAULT_SKIP",
  "FP8",
  "FP8_MAX",
  "KV_FORMATS",
  "MIN_ROW_AMAX",
  "QuantConfig",
  "QuantConfigError",
  "QuantError",
  "check_finite",
  "dequantize",
  "dequantize_model",
  "einsum",
  "from_kmajor",
  "kmajor_order",
  "quantize_checkpoint",
  "quantize_kv",
  "quantize_model",
  "quantize_rows",
  "quantize_static",
  "quantize_weight",
  "to_kmajor",
]


def __getattr__(name):  # model-level helpers import the model: load them on first use
  if name in ("quantize_model", "dequantize_model", "quantize_checkpoint"):
    from maverick.quant import convert
    return getattr(convert, name)
  raise AttributeError(name)
