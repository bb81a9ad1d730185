"""Counting device-to-host copies in a `jax.profiler` trace.

`generate` promises no host round trip inside a call; on XLA:GPU a `while` loop outside a command
buffer copies its predicate to the host every iteration (see maverick/gpu_flags.py). A trace of one
call shows those copies as CUPTI memcpy activities on the GPU planes ("MemcpyD2H"); this module
counts them in either trace format `jax.profiler.trace` writes:

  * `<log_dir>/plugins/profile/<run>/<host>.xplane.pb` (always written; read with jaxlib's
    ProfileData), and
  * `<host>.trace.json.gz` (Chrome trace JSON, with `create_perfetto_trace=True`).

Only device-side activities count: host-side driver calls (cuMemcpyDtoHAsync, ...) and
host-to-device / device-to-device copies do not.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

# CUPTI activity names for device -> host copies across XLA/TSL versions: "MemcpyD2H",
# "MemcpyDtoH", "Memcpy DtoH (Device -> Pinned)", ...
_D2H = re.compile(r"^\s*memcpy\s*[-_ ]?\s*(d2h|dtoh|device\s*(to|->)\s*(host|pinned|pageable))",
                  re.IGNORECASE)
_MEMCPY = re.compile(r"^\s*memcpy", re.IGNORECASE)


def is_device_to_host(name: str) -> bool:
  return bool(_D2H.match(name or ""))


def _is_device_plane(name: str) -> bool:
  lower = name.lower()
  return "/device:" in lower and "/device:cpu" not in lower


def trace_files(log_dir: str | Path) -> list[Path]:
  """The trace files under a `jax.profiler.trace` log dir, newest run first."""
  root = Path(log_dir)
  found = [p for p in root.rglob("*") if p.name.endswith((".xplane.pb", ".trace.json.gz",
                                                          ".trace.json"))]
  return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


class NoDeviceActivity(RuntimeError):
  """The trace recorded nothing on any GPU: a copy count from it would be a false zero."""


def memcpy_counts(path: str | Path) -> collections.Counter:
  """{memcpy activity name: count} over the device planes of one trace file."""
  return _device_counts(path)[0]


def device_event_count(path: str | Path) -> int:
  """Every activity (kernel, memcpy, ...) recorded on the device planes of one trace file."""
  return _device_counts(path)[1]


def count_device_to_host(path: str | Path, *, require_device_activity: bool = False) -> int:
  """Device-to-host memcpy activities in one trace file. With `require_device_activity`, a trace
  with no GPU activity at all (no CUPTI: a CPU-only run, a profiler that did not attach) raises
  NoDeviceActivity instead of reporting 0 copies."""
  copies, events = _device_counts(path)
  if require_device_activity and events == 0:
    raise NoDeviceActivity(f"{path} has no activity on any GPU plane (CUPTI recorded nothing): "
                           "its device-to-host copy count would be a false 0")
  return sum(n for name, n in copies.items() if is_device_to_host(name))


def _device_counts(path: str | Path) -> tuple[collections.Counter, int]:
  path = Path(path)
  if path.name.endswith(".xplane.pb"):
    from jax._src.lib import _profile_data  # local: only needed for xplane files
    return _xplane_counts(_profile_data.ProfileData.from_file(str(path)))
  opener = gzip.open if path.name.endswith(".gz") else open
  with opener(path, "rt") as f:
    return _json_counts(json.load(f))


def _xplane_counts(profile) -> tuple[collections.Counter, int]:
  counts, events = collections.Counter(), 0
  for plane in profile.planes:
    if not _is_device_plane(plane.name):
      continue
    for line in plane.lines:
      for event in line.events:
        events += 1
        if _MEMCPY.match(event.name):
          counts[event.name] += 1
  return counts, events


def _json_counts(trace: dict | list) -> tuple[collections.Counter, int]:
  events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
  process_names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"}
  counts, device_events = collections.Counter(), 0
  for e in events:
    if e.get("ph") != "X":
      continue
    pname = process_names.get(e.get("pid"))
    if pname is not None and not _is_device_plane(pname):
      continue  # a named host process: driver API calls, not copies
    device_events += pname is not None
    if _MEMCPY.match(e.get("name", "")):
      counts[e["name"]] += 1
  return counts, device_events


# ----------------------------------------------------------------------------------------------
# Op time by named scope: where a compiled program spends its time
# ----------------------------------------------------------------------------------------------
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)|"
                     r"branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+)|"
                     r"false_computation=%([\w.\-]+)")


def op_scopes(hlo_text: str) -> dict[str, str]:
  """{instruction name: op_name} for every instruction of a compiled HLO module's text.

  XLA drops the metadata of some ops it creates (loop bodies it rewrites, sunk constants): those
  inherit the op_name of the instruction whose called computation holds them, so every op of a
  `jax.named_scope` lands in that scope."""
  own, computation_of, caller = {}, {}, {}
  comp = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      comp = m.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name = m.group(1)
    computation_of[name] = comp
    op = _OP_NAME.search(line)
    if op:
      own[name] = op.group(1)
    for c in _CALLED.finditer(line):
      for called in filter(None, c.groups()):
        for callee in called.replace("%", "").split(","):
          caller.setdefault(callee.strip(), name)

  def scope(name, depth=0):
    if name in own or depth > 64:
      return own.get(name, "")
    parent = caller.get(computation_of.get(name))
    return scope(parent, depth + 1) if parent else ""

  return {name: scope(name) for name in computation_of}


def host_op_times(path: str | Path) -> collections.Counter:
  """{event name: summed nanoseconds} on the XLA:CPU threads of one xplane trace (recorded with
  XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true): each thunk is an event named after its HLO
  instruction, on the executing thread (tf_XLAExecute or an intra-op tf_XLAEigen thread). Other
  runtime events come along; `time_by_scope` keeps only the program's instruction names."""
  from jax._src.lib import _profile_data
  profile = _profile_data.ProfileData.from_file(str(path))
  times = collections.Counter()
  for plane in profile.planes:
    if not plane.name.startswith("/host"):
      continue
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for event in line.events:
        times[event.name] += event.duration_ns
  return times


def time_by_scope(op_times: collections.Counter, scopes: dict[str, str],
                  pieces: dict[str, str]) -> dict[str, float]:
  """Sums op times per piece: {piece: ns} where an op belongs to the first piece whose scope
  string is in its op_name; the program's other ops go to "other". Events that are not one of
  the program's instructions (`scopes`' keys) and control ops (while, conditional, call: their
  time is their callees' ops, already counted) are skipped."""
  out = collections.Counter({piece: 0 for piece in pieces} | {"other": 0})
  for op, ns in op_times.items():
    if op not in scopes or op.split(".")[0] in ("while", "conditional", "call"):
      continue
    op_name = scopes.get(op, "")
    piece = next((p for p, s in pieces.items() if s in op_name), "other")
    out[piece] += ns
  return dict(out)
