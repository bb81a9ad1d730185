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


def memcpy_counts(path: str | Path) -> collections.Counter:
  """{memcpy activity name: count} over the device planes of one trace file."""
  path = Path(path)
  if path.name.endswith(".xplane.pb"):
    from jax._src.lib import _profile_data  # local: only needed for xplane files
    return _xplane_counts(_profile_data.ProfileData.from_file(str(path)))
  opener = gzip.open if path.name.endswith(".gz") else open
  with opener(path, "rt") as f:
    return _json_counts(json.load(f))


def count_device_to_host(path: str | Path) -> int:
  """Device-to-host memcpy activities in one trace file."""
  return sum(n for name, n in memcpy_counts(path).items() if is_device_to_host(name))


def _xplane_counts(profile) -> collections.Counter:
  counts = collections.Counter()
  for plane in profile.planes:
    if not _is_device_plane(plane.name):
      continue
    for line in plane.lines:
      for event in line.events:
        if _MEMCPY.match(event.name):
          counts[event.name] += 1
  return counts


def _json_counts(trace: dict | list) -> collections.Counter:
  events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
  process_names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"}
  counts = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or not _MEMCPY.match(e.get("name", "")):
      continue
    pname = process_names.get(e.get("pid"))
    if pname is not None and not _is_device_plane(pname):
      continue  # a named host process: driver API calls, not copies
    counts[e["name"]] += 1
  return counts
