"""Helpers shared by several test files."""

import json
import os
import re
import socket

import numpy as np
from flax import nnx


def flat_params(module) -> dict:
  _, state = nnx.split(module)
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def assert_same_params(a, b):
  """Same parameter paths, dtypes, shapes and values (bit for bit)."""
  fa, fb = flat_params(a), flat_params(b)
  assert fa.keys() == fb.keys()
  for p in fa:
    assert fa[p].dtype == fb[p].dtype and fa[p].shape == fb[p].shape, p
    np.testing.assert_array_equal(fa[p], fb[p], err_msg=str(p))


def single_device_env() -> dict:
  """This process's environment for a subprocess that runs on one CPU device, as a user's would:
  the fake device count is dropped from XLA_FLAGS, the other flags (fast test compiles) stay."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  return env


def http_exchange(port: int, *parts: bytes, timeout: float = 10) -> tuple[int, dict]:
  """Sends raw bytes to 127.0.0.1:port on a new connection (a request the test shapes itself:
  a Content-Length it never sends, chunks with no end), then reads one response: (status, JSON
  body)."""
  with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
    for p in parts:
      s.sendall(p)
    data, size = b"", None
    while size is None or len(data.split(b"\r\n\r\n", 1)[1]) < size:
      chunk = s.recv(65536)
      assert chunk, f"the server closed the connection without an answer: {data!r}"
      data += chunk
      if size is None and b"\r\n\r\n" in data:
        head = data.split(b"\r\n\r\n", 1)[0].decode().lower().split("\r\n")
        size = next(int(h.split(":")[1]) for h in head if h.startswith("content-length:"))
  head, body = data.split(b"\r\n\r\n", 1)
  return int(head.split()[1]), json.loads(body)


def http_head(path: str = "/v1/completions", **headers) -> bytes:
  """A POST's request line and headers (JSON content type); header_name=... as Header-Name."""
  lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
  lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
  return ("\r\n".join(lines) + "\r\n\r\n").encode()
