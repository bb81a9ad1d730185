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


def __getattr__(name):
  # Loaded on first use: importing any maverick.quant submodule runs this file, and these sit in
  # higher layers (ARCHITECTURE.md): `einsum` dispatches to maverick.kernels, the conversions
  # import the model and the checkpoint code. Only config and ops load eagerly.
  if name == "einsum":
    from maverick.quant import contraction
    return contraction.einsum
  if name in ("quantize_model", "dequantize_model", "quantize_checkpoint"):
    from maverick.quant import convert
    return getattr(convert, name)
  raise AttributeError(name)
