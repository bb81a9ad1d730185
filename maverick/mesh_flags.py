"""absl flags for running a script on a device mesh, on one host or many.

  --mesh data=2,tensor=4   --layout tp|ep
  --coordinator_address host:port --num_processes N --process_id i   (or --distributed to
  auto-detect Slurm / Open MPI / Kubernetes)
Importing this module defines the flags; `mesh_from_flags()` initializes JAX's distributed runtime
when asked (before any other JAX call) and returns the global mesh, or None without --mesh.
"""

from __future__ import annotations

from absl import flags

MESH = flags.DEFINE_string(
    "mesh", None, "Device mesh as axis=size pairs over data, expert, tensor, e.g. 'tensor=8' or "
    "'data=2,tensor=4' (sizes multiply to the device count; tensor may be left out to take the "
    "rest). Default: one device.")
LAYOUT = flags.DEFINE_enum("layout", "tp", ["tp", "ep"], "Sharding layout with --mesh: tp splits "
                           "every expert over tensor (min latency), ep spreads experts over "
                           "expert (throughput).")
COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process "
                                  "0's coordinator (with --num_processes and --process_id).")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Multi-host with the cluster auto-detected "
                                "(Slurm, Open MPI, Kubernetes).")


def parse_mesh(text: str) -> dict[str, int]:
  from maverick.sharding import AXES, ShardingError
  sizes = {}
  for part in text.split(","):
    name, _, value = part.strip().partition("=")
    if name not in AXES or not value.strip().isdigit():
      raise ShardingError(f"--mesh {text!r}: expected axis=size pairs over {AXES}, e.g. "
                          "'data=2,tensor=4'")
    if name in sizes:  # a later pair would silently replace the earlier one
      raise ShardingError(f"--mesh {text!r} gives {name} twice; give each axis once, e.g. "
                          "'data=2,tensor=4'")
    sizes[name] = int(value)
  return sizes


def mesh_from_flags():
  from maverick import sharding
  if DISTRIBUTED.value or COORDINATOR.value is not None or NUM_PROCESSES.value is not None \
      or PROCESS_ID.value is not None:
    sharding.initialize_distributed(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if MESH.value is None:
    return None
  return sharding.make_mesh(**parse_mesh(MESH.value))
