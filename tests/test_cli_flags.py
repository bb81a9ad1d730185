"""Command-line mistakes and interruptions of the scripts end in one line, never a traceback or a
hang: a repeated --mesh axis, Ctrl-C in scripts/generate.py, and scripts/plan_memory.py's flags
(the limits generate.py applies). Every subprocess here stops before anything is compiled."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from maverick import cli
from maverick import config
from maverick import mesh_flags
from maverick.sharding import ShardingError
from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_dtype_flag_offers_the_dtypes_a_config_takes():
  assert cli.DTYPE_CHOICES == config.DTYPES


def test_mesh_flag_refuses_a_repeated_axis():
  assert mesh_flags.parse_mesh("data=2, tensor=4") == {"data": 2, "tensor": 4}
  with pytest.raises(ShardingError, match=r"'tensor=2,tensor=4' gives tensor twice"):
    mesh_flags.parse_mesh("tensor=2,tensor=4")


def _open_writer(fifo: pathlib.Path, proc: subprocess.Popen, timeout: float):
  """Opens `fifo` for writing once `proc` has opened it for reading (ENXIO until then)."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
      if proc.poll() is not None or time.monotonic() > deadline:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"generate.py never opened --batch_file: {err[-2000:]}")
      time.sleep(0.05)


def test_ctrl_c_in_generate_is_one_line_and_status_130(tmp_path):
  """generate.py blocks reading its --batch_file (a FIFO that gets no line): a SIGINT there, with
  jax and the compilation cache already set up, stops it with one line and the shell's 130."""
  fifo = tmp_path / "prompts"
  os.mkfifo(fifo)
  env = single_device_env()
  env["MAVERICK_CACHE_DIR"] = str(tmp_path / "cache")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "generate.py"),
                           f"--batch_file={fifo}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  writer = _open_writer(fifo, proc, timeout=120)
  try:
    time.sleep(0.2)  # the reader is now in read(); the signal interrupts it
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
  finally:
    os.close(writer)
  assert "Traceback" not in err, err
  assert err.splitlines() == ["generate: interrupted"], err
  assert proc.returncode == 130
