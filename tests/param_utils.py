"""Helpers shared by several test files."""

import os
import re

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
