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


def test_trace_without_gpu_activity_is_not_a_zero(tmp_path):
  """A trace in which CUPTI recorded nothing on a GPU (a CPU run, a profiler that did not attach)
  must not read as "0 device-to-host copies": gpu_check's zero-copy goal would pass on it."""
  import pytest
  from jax._src.lib import _profile_data
  host_only = XSPACE[XSPACE.index("planes {\n  id: 2"):]
  path = tmp_path / "host.xplane.pb"
  path.write_bytes(_profile_data.ProfileData.text_proto_to_serialized_xspace(host_only))
  assert profiling.device_event_count(path) == 0
  assert profiling.count_device_to_host(path) == 0  # the plain count cannot tell
  with pytest.raises(profiling.NoDeviceActivity, match="no activity on any GPU plane"):
    profiling.count_device_to_host(path, require_device_activity=True)
  # A GPU trace with activity but no device-to-host copy is a real 0.
  no_copy = XSPACE.replace("events { metadata_id: 1 offset_ps: 1000 duration_ps: 500 }", "")
  no_copy = no_copy.replace("events { metadata_id: 1 offset_ps: 9000 duration_ps: 500 }", "")
  gpu = tmp_path / "gpu.xplane.pb"
  gpu.write_bytes(_profile_data.ProfileData.text_proto_to_serialized_xspace(no_copy))
  assert profiling.device_event_count(gpu) == 2
  assert profiling.count_device_to_host(gpu, require_device_activity=True) == 0
  # Chrome JSON: the same rule.
  events = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 2, "tid": 1, "name": "MemcpyD2H", "ts": 5, "dur": 1}]
  js = tmp_path / "host.trace.json"
  js.write_text(json.dumps(events))
  with pytest.raises(profiling.NoDeviceActivity):
    profiling.count_device_to_host(js, require_device_activity=True)


# ----------------------------------------------------------------------------------------------
# Op time by named scope
# ----------------------------------------------------------------------------------------------
def test_op_scopes_inherit_the_scope_of_the_loop_that_holds_them():
  """Ops inside a while body whose metadata XLA dropped still land in the body's scope: every
  op of the compiled loop body maps to a scope string that names the body's named_scope."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  def f(x, w):
    with jax.named_scope("heavy_part"):
      def body(i, acc):
        return jnp.tanh(acc @ w) + i
      y = jax.lax.fori_loop(0, 3, body, x)
    with jax.named_scope("light_part"):
      return jnp.sum(y * 2.0)

  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 32)).astype(np.float32)
  w = rng.standard_normal((32, 32)).astype(np.float32)
  hlo = jax.jit(f).lower(x, w).compile().as_text()
  scopes = profiling.op_scopes(hlo)
  dots = [name for name in scopes if name.startswith(("dot", "ynn_fusion", "custom-call"))
          or "dot" in name]
  assert dots, "the compiled loop has no dot op"
  assert all("heavy_part" in scopes[d] for d in dots), {d: scopes[d] for d in dots}
  assert any("light_part" in s for s in scopes.values())


def test_time_by_scope_sums_ops_per_piece_and_skips_control_ops():
  import collections
  times = collections.Counter({"fusion.1": 300, "fusion.2": 100, "while.7": 10_000,
                               "copy.3": 50, "conditional.2": 999,
                               "ThreadpoolListener::Record": 777})
  scopes = {"fusion.1": "jit(f)/while/body/spec_verify/dot", "fusion.2": "jit(f)/spec_draft/add",
            "copy.3": "", "while.7": "jit(f)/while", "conditional.2": "jit(f)/spec_verify/cond"}
  by = profiling.time_by_scope(times, scopes, {"verify": "spec_verify", "draft": "spec_draft",
                                               "accept": "spec_accept"})
  assert by == {"verify": 300, "draft": 100, "accept": 0, "other": 50}


_TRACE_SCRIPT = r"""
import glob, json, os, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from maverick import profiling

def f(x, w):
  with jax.named_scope("big_matmuls"):
    for _ in range(4):
      x = jnp.tanh(x @ w)
  with jax.named_scope("tiny_add"):
    return x[:1, :1] + 1.0

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
w = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
g = jax.jit(f)
exe = g.lower(x, w).compile()
g(x, w).block_until_ready()
with tempfile.TemporaryDirectory() as d:
  jax.profiler.start_trace(d)
  for _ in range(5):
    g(x, w).block_until_ready()
  jax.profiler.stop_trace()
  times = profiling.host_op_times(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
by = profiling.time_by_scope(times, profiling.op_scopes(exe.as_text()),
                             {"big": "big_matmuls", "tiny": "tiny_add"})
print(json.dumps(by))
"""


def test_host_op_times_attribute_a_real_cpu_trace(tmp_path):
  """A real XLA:CPU trace (traceme on): the four 256^3 matmuls' scope gets far more op time than
  the one-element add's."""
  import os
  import subprocess
  import sys
  script = tmp_path / "trace.py"
  script.write_text(_TRACE_SCRIPT)
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_enable_xprof_traceme=true", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  by = json.loads(r.stdout.strip().splitlines()[-1])
  assert by["big"] > 0, by
  assert by["big"] > 5 * by["tiny"], by
