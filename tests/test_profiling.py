"""maverick.profiling: counting device-to-host copies in small synthetic trace files."""

import gzip
import json

from maverick import profiling

XSPACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines {
    id: 1
    name: "Stream #13(MemcpyD2H)"
    events { metadata_id: 1 offset_ps: 1000 duration_ps: 500 }
    events { metadata_id: 1 offset_ps: 9000 duration_ps: 500 }
    events { metadata_id: 2 offset_ps: 3000 duration_ps: 500 }
    events { metadata_id: 3 offset_ps: 5000 duration_ps: 500 }
  }
  event_metadata { key: 1 value { id: 1 name: "MemcpyD2H" } }
  event_metadata { key: 2 value { id: 2 name: "MemcpyH2D" } }
  event_metadata { key: 3 value { id: 3 name: "loop_fusion_3" } }
}
planes {
  id: 2
  name: "/host:CPU"
  lines { id: 1 name: "python" events { metadata_id: 1 offset_ps: 10 duration_ps: 5 } }
  event_metadata { key: 1 value { id: 1 name: "MemcpyD2H" } }
}
"""


def test_names():
  for name in ("MemcpyD2H", "MemcpyDtoH", "Memcpy DtoH (Device -> Pinned)", "memcpy_d2h"):
    assert profiling.is_device_to_host(name), name
  for name in ("MemcpyH2D", "MemcpyD2D", "cuMemcpyDtoHAsync_v2", "fusion.3", ""):
    assert not profiling.is_device_to_host(name), name


def test_xplane_file(tmp_path):
  from jax._src.lib import _profile_data
  # A real .xplane.pb: the synthetic XSpace serialized exactly as the profiler writes it.
  raw = _profile_data.ProfileData.text_proto_to_serialized_xspace(XSPACE)
  path = tmp_path / "plugins" / "profile" / "run1" / "host.xplane.pb"
  path.parent.mkdir(parents=True)
  path.write_bytes(raw)
  assert profiling.trace_files(tmp_path) == [path]
  assert profiling.memcpy_counts(path) == {"MemcpyD2H": 2, "MemcpyH2D": 1}  # host plane skipped
  assert profiling.count_device_to_host(path) == 2


def test_chrome_json_trace(tmp_path):
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "tid": 7, "name": "MemcpyD2H", "ts": 1, "dur": 1},
      {"ph": "X", "pid": 1, "tid": 7, "name": "Memcpy DtoH (Device -> Pinned)", "ts": 3, "dur": 1},
      {"ph": "X", "pid": 1, "tid": 7, "name": "MemcpyH2D", "ts": 5, "dur": 1},
      {"ph": "X", "pid": 2, "tid": 1, "name": "MemcpyD2H", "ts": 5, "dur": 1},  # host: ignored
      {"ph": "X", "pid": 2, "tid": 1, "name": "cuMemcpyDtoHAsync_v2", "ts": 5, "dur": 1},
      {"ph": "i", "pid": 1, "tid": 7, "name": "MemcpyD2H", "ts": 9},  # not a complete event
  ]
  path = tmp_path / "host.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert profiling.count_device_to_host(path) == 2
  plain = tmp_path / "t.trace.json"
  plain.write_text(json.dumps(events))  # a bare event list is valid Chrome trace JSON too
  assert profiling.count_device_to_host(plain) == 2
