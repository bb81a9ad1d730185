"""Logical-axis sharding: every weight declares logical axes (model.weight), rules map them to mesh axes.

Only the single-device layout is used so far; the multi-device layouts (TP, EP) are rule tables over
the same logical names, so enabling them does not touch the model.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

# logical axis -> mesh axis (or None = replicated)
Rules = Mapping[str, str | tuple[str, ...] | None]

REPLICATED: Rules = {}


def logical_to_spec(axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  return PartitionSpec(*(None if a is None else rules.get(a) for a in axes))


def state_shardings(abstract_state: nnx.State, mesh: Mesh | None = None,
                    rules: Rules = REPLICATED):
  """A sharding per parameter (same tree as the state), from each Param's `logical_axes`."""
  def one(var):
    if mesh is None:
      return SingleDeviceSharding(jax.devices()[0])
    axes = var.get_metadata().get("logical_axes", (None,) * len(var.shape))
    return NamedSharding(mesh, logical_to_spec(axes, rules))
  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
