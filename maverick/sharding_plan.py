"""The sharding plan: mesh axes, each layout's rules from logical axes to mesh axes, and `Plan`
(mesh + layout), which a sharded model carries as a static attribute (`plan_of`).

Below the model (which runs its kernel calls and its MoE per shard from the plan) and below
maverick.sharding (which places a model's weights by it and attaches it). See maverick.sharding for
the layouts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (or None = replicated)
Rules = Mapping[str, str | tuple[str, ...] | None]

REPLICATED: Rules = {}
AXES = ("data", "expert", "tensor")
LAYOUTS = ("tp", "ep")
PLAN_ATTR = "sharding_plan"

_COMMON = {"batch": "data", "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
           "vocab": "tensor", "expert_mlp": "tensor"}
LAYOUT_RULES: dict[str, Rules] = {
    "tp": dict(_COMMON, experts=None),
    # Data-parallel attention: rows over data AND expert, gathered into the MoE and scattered back.
    "ep": dict(_COMMON, experts="expert", batch=("data", "expert")),
}


class ShardingError(ValueError):
  """A mesh or layout that does not fit the devices or the model."""


def logical_to_spec(axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  return PartitionSpec(*(None if a is None else rules.get(a) for a in axes))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Mesh + layout: hashable, so it can sit in a module's static graph definition."""
  mesh: Mesh
  layout: str = "tp"

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ShardingError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS}")
    if tuple(self.mesh.axis_names) != AXES:
      raise ShardingError(f"mesh axes must be {AXES} (use sharding.make_mesh), got "
                          f"{tuple(self.mesh.axis_names)}")
    if self.layout == "tp" and self.size("expert") > 1:
      raise ShardingError(f"layout 'tp' splits every expert over 'tensor' and has no use for an "
                          f"expert axis of size {self.size('expert')}; use layout='ep' or put "
                          "those devices on tensor/data")

  @property
  def rules(self) -> Rules:
    return LAYOUT_RULES[self.layout]

  def size(self, axis: str) -> int:
    return int(self.mesh.shape[axis])

  def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
    return logical_to_spec(logical_axes, self.rules)

  def named(self, logical_axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(logical_axes))

  def batch_axis(self, batch: int) -> str | tuple[str, ...] | None:
    """The mesh axes rows are split over: the layout's batch axes (ep: data x expert, so attention
    runs data-parallel across expert groups) when their size divides the rows, else `data` when it
    does, else none (every device runs all rows: correct, only slower)."""
    rule = self.rules["batch"]
    for axes in ((rule,) if isinstance(rule, str) else tuple(rule), ("data",)):
      axes = tuple(a for a in axes if self.size(a) > 1)
      if axes and batch % math.prod(self.size(a) for a in axes) == 0:
        return axes[0] if len(axes) == 1 else axes
    return None


def plan_of(module) -> Plan | None:
  return getattr(module, PLAN_ATTR, None)
