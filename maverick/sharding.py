"""Sharding: one mesh ("data", "expert", "tensor"), logical-axis rules per layout, sharded MoE.

Every weight declares logical axes (`model.weight`); a layout is a rule table from those names to
mesh axes, so sharding a model never names a tensor. Two layouts:

  "tp" (min latency, NVIDIA's record layout): attention heads, KV heads, MLP width, every expert's
       width and the vocab split over `tensor`; each device holds a slice of EVERY expert. A decode
       step then has exactly two all-reduces per layer (attention output, FFN output) and no
       weight all-gather.
  "ep" (throughput): experts spread over `expert` (E/expert whole experts per device), their width
       over `tensor`; attention, dense MLP and vocab over `tensor`.

Rows are over `data` (tp) or `data` x `expert` (ep: data-parallel attention, so the KV cache splits
over expert groups too) whenever they divide it. The MoE runs inside `shard_map` when the model is
sharded: each device routes its tokens, runs its local experts (an assignment to another device's
expert gets score 0, so it contributes exactly nothing) and the shared expert's slice, then ONE psum
over tensor (tp), or an all-gather of the rows before routing and a reduce-scatter after (ep), ends
the layer (maverick.moe.sharded_moe). Attention and the dense MLP are left to GSPMD, which emits
one all-reduce after each output projection. Where a Pallas kernel runs (maverick.kernels), the call sits in its own
shard_map on the local shards instead (row-parallel projections end with the psum GSPMD would
emit), so the collectives per layer stay the same.

A sharded model carries its `Plan` (mesh + layout; maverick.sharding_plan, below the model, which
reads it) as a static attribute, so `generate` and the speculative loop place requests and caches
from it without new arguments.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from maverick.model import MoE
# The plan's names live below the model (which reads the plan); maverick.sharding re-exports them.
from maverick.sharding_plan import (AXES, LAYOUT_RULES, LAYOUTS, PLAN_ATTR, REPLICATED, Plan, Rules,
                                    ShardingError, logical_to_spec, plan_of)


def state_shardings(abstract_state: nnx.State, mesh: Mesh | None = None,
                    rules: Rules = REPLICATED):
  """A sharding per parameter (same tree as the state), from each Param's `logical_axes`."""
  def one(var):
    if mesh is None:
      return SingleDeviceSharding(jax.devices()[0])
    axes = var.get_metadata().get("logical_axes", (None,) * len(var.shape))
    return NamedSharding(mesh, logical_to_spec(axes, rules))
  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# ----------------------------------------------------------------------------------------------
# Mesh and plan
# ----------------------------------------------------------------------------------------------
def make_mesh(*, data: int = 1, expert: int = 1, tensor: int | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ("data", "expert", "tensor") mesh over `devices` (default: all devices of all processes).

  `tensor=None` takes the devices left over by data x expert. The sizes must multiply to the device
  count: a mesh never silently leaves devices idle."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  for name, size in (("data", data), ("expert", expert), ("tensor", tensor)):
    if size is not None and (not isinstance(size, (int, np.integer)) or size < 1):
      raise ShardingError(f"mesh axis {name} must be a positive integer, got {size!r}")
  if tensor is None:
    if n % (data * expert):
      raise ShardingError(f"data={data} x expert={expert} does not divide the {n} devices; "
                          "choose sizes whose product divides the device count")
    tensor = n // (data * expert)
  want = data * expert * tensor
  if want > n:
    raise ShardingError(
        f"the mesh data={data} x expert={expert} x tensor={tensor} needs {want} devices but only "
        f"{n} are present ({jax.default_backend()}); lower the sizes, or on CPU set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={want} before importing jax")
  if want < n:
    raise ShardingError(f"the mesh data={data} x expert={expert} x tensor={tensor} uses {want} of "
                        f"the {n} devices; make the sizes multiply to {n} or pass devices=")
  grid = np.asarray(devices, dtype=object).reshape(data, expert, tensor)
  return Mesh(grid, AXES)


def check_model_fits(cfg, plan: Plan, what: str = "model"):
  """Clear errors for head / KV-head / expert counts the mesh does not divide."""
  t, e = plan.size("tensor"), plan.size("expert")
  checks = [("num_attention_heads", cfg.num_attention_heads, "tensor", t),
            ("num_key_value_heads", cfg.num_key_value_heads, "tensor", t)]
  if plan.layout == "ep" and cfg.moe_layers:
    checks.append(("num_local_experts", cfg.num_local_experts, "expert", e))
  for field, value, axis, size in checks:
    if value % size:
      fix = ("KV heads are not replicated across devices in this version; keep tensor <= "
             "num_key_value_heads" if field == "num_key_value_heads" else
             f"choose {axis} among the divisors of {value}")
      raise ShardingError(f"{what}: {field}={value} is not divisible by the mesh axis {axis}={size}"
                          f"; {fix}")


def _check_param(path, shape, spec: PartitionSpec, plan: Plan):
  for dim, axis in zip(shape, spec):
    if axis is None:
      continue
    size = math.prod(plan.size(a) for a in ((axis,) if isinstance(axis, str) else axis))
    if dim % size:
      name = ".".join(str(p) for p in path)
      raise ShardingError(f"weight {name} {tuple(shape)}: dimension {dim} is not divisible by mesh "
                          f"axis {axis}={size} (layout {plan.layout!r}); choose a mesh whose "
                          "sizes divide the model's dimensions")


def put(value, sharding: NamedSharding) -> jax.Array:
  """Places a host or single-device value on a (possibly multi-process) global sharding; every
  process passes the same value."""
  if jax.process_count() == 1:
    return jax.device_put(value, sharding)
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(model, mesh: Mesh, layout: str = "tp"):
  """Returns `model` (a Llama4 or an Eagle3Draft) with its weights placed by the layout's rules and
  its plan attached, so generation and the MoE shard themselves. The module is changed in place."""
  plan = Plan(mesh, layout)
  cfg = getattr(model.config, "layer", model.config)  # the draft's layer config
  check_model_fits(cfg, plan, type(model).__name__)
  flat = nnx.to_flat_state(nnx.state(model))
  targets = param_shardings(nnx.state(model), plan)  # checks every weight before moving any
  placed = [(path, var.replace(value=put(var.get_value(), targets[path]))) for path, var in flat]
  nnx.update(model, nnx.from_flat_state(placed))
  attach_plan(model, plan)
  return model


def param_shardings(state: nnx.State, plan: Plan) -> dict[tuple, NamedSharding]:
  """path -> the layout's sharding of each parameter of a (possibly abstract) model state; a
  dimension the mesh does not divide is a ShardingError naming the weight."""
  out = {}
  for path, var in nnx.to_flat_state(state):
    axes = var.get_metadata().get("logical_axes", (None,) * len(var.shape))
    out[path] = NamedSharding(plan.mesh, plan.spec(axes))
    _check_param(path, var.shape, out[path].spec, plan)
  return out


def put_from_host(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array onto `sharding`: each device receives only its own slice (no device ever holds
  the whole array; across processes each process copies only its addressable shards)."""
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def attach_plan(model, plan: Plan | None):
  """Marks the model and its layers (every module with a `kernels` switch, and the MoE) with the
  plan: a static attribute, part of the graphdef. The MoE shards itself from it and the kernel
  calls run per shard under shard_map from it (maverick.kernels); `kernels` is left as set."""
  setattr(model, PLAN_ATTR, plan)
  for _, m in nnx.iter_graph(model):
    if isinstance(m, MoE) or hasattr(m, "kernels"):
      setattr(m, PLAN_ATTR, plan)


# ----------------------------------------------------------------------------------------------
# Activations, caches, requests
# ----------------------------------------------------------------------------------------------
def constrain_cache(cache, plan: Plan | None):
  """KV cache [B, S, K, Dh] per layer: KV heads over tensor, rows over data."""
  if plan is None:
    return cache
  spec = PartitionSpec(plan.batch_axis(cache.batch_size), None, plan.rules["kv_heads"], None)
  if getattr(cache, "tables", None) is not None:  # paged: pools [N, bs, K, Dh] have no row axis
    spec = PartitionSpec(None, None, plan.rules["kv_heads"], None)
  sh = NamedSharding(plan.mesh, spec)
  c = lambda xs: tuple(jax.lax.with_sharding_constraint(x, sh) for x in xs)
  lengths = jax.lax.with_sharding_constraint(
      cache.lengths, NamedSharding(plan.mesh, PartitionSpec(spec[0])))
  return dataclasses.replace(cache, k=c(cache.k), v=c(cache.v), lengths=lengths)


def place_request(req, plan: Plan | None):
  """Puts every request array on the mesh: [B, ...] rows over data, scalars replicated."""
  if plan is None:
    return req
  batch = req.prompt.shape[0]
  def one(x):
    axis = plan.batch_axis(batch) if x.ndim else None
    spec = PartitionSpec(axis, *([None] * max(x.ndim - 1, 0))) if x.ndim else PartitionSpec()
    return put(np.asarray(x), NamedSharding(plan.mesh, spec))
  return jax.tree.map(one, req)


def to_host(x) -> np.ndarray:
  """np.asarray that also works for arrays spanning several processes (replicated or not)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ----------------------------------------------------------------------------------------------
# Multi-host
# ----------------------------------------------------------------------------------------------
def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           local_device_ids: Sequence[int] | None = None):
  """`jax.distributed.initialize` (auto-detects Slurm / Open MPI / Kubernetes when no argument is
  given). Call it before any other JAX call; on CPU it also selects gloo collectives."""
  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise ShardingError("pass all of coordinator_address, num_processes and process_id "
                        "(--coordinator_address/--num_processes/--process_id), or none of them "
                        "to auto-detect the cluster")
  if all(given) and not 0 <= process_id < num_processes:
    raise ShardingError(f"process_id {process_id} outside [0, num_processes={num_processes})")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids)
