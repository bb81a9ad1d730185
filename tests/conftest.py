"""Test setup: 8 fake CPU devices (set before jax is imported) and shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib

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
