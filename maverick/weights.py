"""The description of the model's weights that checkpoint code reads: every parameter's path and
shape, which weights are FP8 and over which axes each is contracted, and how a weight's scale is
named. All of it comes from the model's own declarations (`maverick.model.weight` /
`linear_weight`), so the checkpoint importers and the FP8 conversion know no layer structure.
"""

from __future__ import annotations

import jax
from flax import nnx

from maverick import config as config_lib
from maverick import model as model_lib


def param_paths(cfg: config_lib.Config) -> dict[tuple, jax.ShapeDtypeStruct]:
  """{path: shape and dtype} of every parameter of the model `cfg` describes."""
  _, abstract = nnx.split(model_lib.abstract_model(cfg))
  return {p: v.get_value() for p, v in nnx.to_flat_state(abstract)}


def fp8_declarations(cfg: config_lib.Config, moe_impl: str = "tiles") -> dict[tuple, tuple]:
  """{weight path: contracted (input) axes of its declared layout} for every weight that
  `cfg.quant` stores in FP8."""
  _, abstract = nnx.split(model_lib.abstract_model(cfg, moe_impl=moe_impl))
  return {p: tuple(v.get_metadata()["fp8_in_axes"]) for p, v in nnx.to_flat_state(abstract)
          if "fp8_in_axes" in v.get_metadata()}


def scale_path(path: tuple) -> tuple:
  return path[:-1] + (f"{path[-1]}_scale",)
