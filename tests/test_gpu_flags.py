"""maverick.gpu_flags: merging rules for the on-device while-loop XLA flags (no GPU needed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maverick import gpu_flags

ROOT = Path(__file__).resolve().parents[1]
OURS = ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+COLLECTIVES "
        "--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_cub_radix_sort=false "
        "--xla_gpu_enable_dynamic_slice_fusion=false")


def test_merge_appends_to_empty_and_to_other_flags():
  assert gpu_flags.merge(None) == OURS
  assert gpu_flags.merge("--xla_dump_to=/tmp/x") == f"--xla_dump_to=/tmp/x {OURS}"


def test_user_flag_wins():
  user = "--xla_gpu_enable_command_buffer= --xla_foo=1"  # the user turned command buffers off
  merged = gpu_flags.merge(user)
  assert merged == (f"{user} --xla_gpu_graph_min_graph_size=1 "
                    "--xla_gpu_enable_cub_radix_sort=false "
                    "--xla_gpu_enable_dynamic_slice_fusion=false")
  assert merged.count("xla_gpu_enable_command_buffer") == 1
  assert gpu_flags.merge("--xla_gpu_graph_min_graph_size=7") == (
      "--xla_gpu_graph_min_graph_size=7 --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,"
      "+COLLECTIVES --xla_gpu_enable_cub_radix_sort=false "
      "--xla_gpu_enable_dynamic_slice_fusion=false")


def test_merge_is_idempotent():
  once = gpu_flags.merge("--a=1")
  assert gpu_flags.merge(once) == once


def test_configure_rules(monkeypatch):
  monkeypatch.setattr(gpu_flags, "backends_started", lambda: False)
  env = {"XLA_FLAGS": "--xla_foo=1"}
  assert gpu_flags.configure(env, force=True) == "set"
  assert env["XLA_FLAGS"] == f"--xla_foo=1 {OURS}"
  assert gpu_flags.configure(env, force=True) == "already-set"  # idempotent
  assert env["XLA_FLAGS"] == f"--xla_foo=1 {OURS}"
  assert gpu_flags.active_flags(env) == {"xla_gpu_enable_command_buffer":
                                         "+WHILE,+CONDITIONAL,+COLLECTIVES",
                                         "xla_gpu_graph_min_graph_size": "1",
                                         "xla_gpu_enable_cub_radix_sort": "false",
                                         "xla_gpu_enable_dynamic_slice_fusion": "false"}
  for off in ("0", "off", "False"):
    env = {gpu_flags.ENV_SWITCH: off}
    assert gpu_flags.configure(env, force=True) == "disabled" and "XLA_FLAGS" not in env


def test_no_effect_on_cpu_only(monkeypatch):
  monkeypatch.setattr(gpu_flags, "backends_started", lambda: False)
  env = {"JAX_PLATFORMS": "cpu"}
  assert gpu_flags.configure(env) == "not-gpu" and "XLA_FLAGS" not in env
  monkeypatch.setattr(gpu_flags.importlib.util, "find_spec", lambda name: None)
  env = {}
  assert gpu_flags.configure(env) == "not-gpu" and "XLA_FLAGS" not in env


def test_cuda_expected_when_a_plugin_is_installed(monkeypatch):
  monkeypatch.setattr(gpu_flags.importlib.util, "find_spec",
                      lambda name: object() if name == "jax_plugins.xla_cuda12" else None)
  assert gpu_flags.cuda_expected({})
  assert gpu_flags.cuda_expected({"JAX_PLATFORMS": "cuda,cpu"})
  assert not gpu_flags.cuda_expected({"JAX_PLATFORMS": "cpu"})


def test_no_effect_after_the_backend_started(monkeypatch):
  import jax
  jax.devices()  # this test process has a CPU backend running
  assert gpu_flags.backends_started()
  env = {"XLA_FLAGS": "--xla_foo=1"}
  assert gpu_flags.configure(env, force=True) == "backend-started"
  assert env["XLA_FLAGS"] == "--xla_foo=1"


def test_import_maverick_neither_imports_jax_nor_touches_cpu_flags():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  code = ("import os, sys, maverick; print('jax' in sys.modules, repr(os.environ.get('XLA_FLAGS')))")
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout.split()
  assert out == ["False", "None"]


def test_flags_parse_in_this_jaxlib():
  """XLA aborts on an unknown flag or command-buffer type: start a CPU backend with ours (the
  DebugOptions parser is shared by every backend) and read them back."""
  env = dict(os.environ, XLA_FLAGS=OURS, JAX_PLATFORMS="cpu")
  code = ("from jax._src.lib import _jax\n"
          "options = _jax.CompileOptions()  # kept alive: debug_options is a view into it\n"
          "print(options.executable_build_options.debug_options)")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout
  assert "xla_gpu_enable_command_buffer: WHILE" in out
  assert "xla_gpu_enable_command_buffer: COLLECTIVES\n" in out
  assert "xla_gpu_enable_command_buffer: FUSION" in out  # "+" kept XLA's defaults
  assert "xla_gpu_graph_min_graph_size: 1" in out
  assert "xla_gpu_enable_cub_radix_sort: false" in out
  assert "xla_gpu_enable_dynamic_slice_fusion: false" in out
