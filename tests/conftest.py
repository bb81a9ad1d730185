"""Test setup: 8 fake CPU devices (set before jax is imported) and shared fixtures."""

import os

# The test models are tiny, so a test's time is mostly XLA compiling; LLVM at -O0 cuts CPU codegen
# time by about 40 % and leaves results alone (XLA's CPU backend keeps fast-math off either way).
# Subprocesses inherit it; those that want one device drop only the device count (single_device_env).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit
import pathlib
import shutil
import tempfile

# One persistent compilation cache per test session, shared by the xdist workers and the CLI /
# notebook subprocesses they start (they inherit the environment): the scripts compile the same
# programs as the in-process tests. Made fresh per session and removed at exit, so a run never
# depends on an earlier one. MAVERICK_TEST_JAX_CACHE=0 turns it off.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("MAVERICK_TEST_JAX_CACHE") != "0":
  _cache = tempfile.mkdtemp(prefix="maverick-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Scripts keep their compilation cache and kernel self-check results under MAVERICK_CACHE_DIR
# (default ~/.cache/maverick-jax): tests never write to the user's home.
if "MAVERICK_CACHE_DIR" not in os.environ:
  _home = tempfile.mkdtemp(prefix="maverick-tests-cache-")
  os.environ["MAVERICK_CACHE_DIR"] = _home
  atexit.register(shutil.rmtree, _home, ignore_errors=True)

import numpy as np
import pytest

FIXTURE_DIR = pathlib.Path(__file__).parent / "fixtures" / "hf_llama4_tiny"


@pytest.fixture(scope="session")
def hf_fixture_dir() -> pathlib.Path:
  return FIXTURE_DIR


@pytest.fixture(scope="session")
def hf_fixture():
  """The HF transformers golden outputs of the tiny random Llama 4 (see tests/fixtures/README)."""
  return {name: np.load(FIXTURE_DIR / f"{name}.npy")
          for name in ("inputs", "logits", "greedy", "greedy_logits", "hidden_states",
                       "router_logits", "rope_inv_freq")}


@pytest.fixture(scope="session")
def fixture_model():
  from maverick.checkpoint import load_hf
  return load_hf(str(FIXTURE_DIR), dtype="float32")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's caches of compiled programs after each test module. XLA maps every CPU
  executable's code separately and a long-lived xdist worker otherwise accumulates tens of
  thousands of mappings: past vm.max_map_count (65530) the next compile segfaults."""
  yield
  import gc
  import sys
  for name in ("maverick.generation", "spec_decode.speculative"):
    if name in sys.modules:
      sys.modules[name]._EXECUTABLES.clear()
  if "jax" in sys.modules:  # a module that never imported jax has nothing to drop
    sys.modules["jax"].clear_caches()
  gc.collect()
