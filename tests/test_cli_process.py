"""The scripts as processes: Ctrl-C in the middle of an XLA compile stops them at once (one line,
status 130)."""

import logging
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from maverick import cli
from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]
# JAX_LOG_COMPILES=1 logs this as XLA starts compiling a program (after tracing and lowering,
# which are Python and stopped by Ctrl-C either way): a generate loop's takes over 10 s on CPU.
LOOP_COMPILE = re.compile(r"Finished jaxpr to MLIR module conversion jit\(\w*generate\w*\)")
STOP_S = 5  # SIGINT to exit; the compile alone takes several times this


def _interrupt_mid_compile(args, trigger, tmp_path, settle=1.0):
  """Starts a script with nothing in its compile cache, waits for stderr to show `trigger`
  (XLA compiling), sends SIGINT `settle` s later: (status, seconds from SIGINT to exit, stderr
  after the signal)."""
  env = dict(single_device_env(), MAVERICK_CACHE_DIR=str(tmp_path / "cache"), JAX_LOG_COMPILES="1")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = subprocess.Popen([sys.executable, *args, f"--compile_cache_dir={tmp_path / 'jax'}"],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  try:
    seen = []
    for line in proc.stderr:
      seen.append(line)
      if trigger.search(line):
        break
    else:
      pytest.fail(f"{args} ended (status {proc.wait()}) before compiling: {''.join(seen)}")
    time.sleep(settle)  # inside XLA's C++ compile, where the old scripts did not see SIGINT
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=300)[1]
    return proc.returncode, time.monotonic() - sent, rest
  finally:
    proc.kill()


def _assert_one_interrupted_line(prog, rest):
  lines = [l for l in rest.replace("\r", "\n").splitlines() if l.strip()]
  assert lines and lines[-1] == f"{prog}: interrupted", rest[-3000:]
  assert sum("interrupted" in l for l in lines) == 1, rest[-3000:]
  assert not [l for l in lines if "Traceback" in l or "Fatal" in l or "Segmentation" in l], lines


def test_ctrl_c_during_the_compile_stops_generate_at_once(tmp_path):
  """The embedded model's speculative loop compiles for 10-20 s on CPU; before the fix Ctrl-C
  waited for all of it (Python runs a signal handler only in the main thread, between bytecodes,
  and the compile was one C++ call there)."""
  status, took, rest = _interrupt_mid_compile(
      [str(REPO / "scripts" / "generate.py"), "--prompt=def f(x):"], LOOP_COMPILE, tmp_path)
  assert status == cli.INTERRUPTED_STATUS, rest[-3000:]
  assert took < STOP_S, f"exited {took:.1f} s after SIGINT"
  _assert_one_interrupted_line("generate", rest)


def test_call_interruptibly_returns_raises_and_exits_as_the_function():
  assert cli.call_interruptibly(lambda a, b=0: a + b, 2, b=3) == 5
  with pytest.raises(ValueError, match="bad flag"):
    cli.call_interruptibly(lambda: (_ for _ in ()).throw(ValueError("bad flag")))
  with pytest.raises(SystemExit) as e:
    cli.call_interruptibly(sys.exit, "a message")
  assert e.value.code == "a message"
  assert cli.run_interruptibly("prog", lambda argv: len(argv), ["prog", "x"]) == 2


SERVE = str(REPO / "scripts" / "serve.py")


# A load that compiles a long program (the embedded speculative loop), as loading a large or sharded
# checkpoint may: then scripts/serve.py, patched here only, is run as a user runs it.
SLOW_LOAD = """
import runpy, sys
import maverick, spec_decode
load = maverick.load
def load_and_compile(*args, **kwargs):
  loaded = load(*args, **kwargs)
  draft = spec_decode.load_draft("tiny", loaded.model)
  spec_decode.generate(loaded.model, draft, [[1, 2, 3]], k=3, max_new_tokens=4)
  return loaded
maverick.load = load_and_compile
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("where", ["loading", "compiling"])
def test_ctrl_c_during_a_compile_stops_serve_at_once(tmp_path, where):
  """serve.py compiles its programs in a thread (uvicorn, in the main thread, takes the signal);
  a compile while the model loads now runs in a worker thread too (cli.call_interruptibly)."""
  serve = [SERVE, "--port=0", "--spec_k=0", "--slots=2", "--max_seq_len=64"]
  args, trigger = ((["-c", SLOW_LOAD, *serve], LOOP_COMPILE) if where == "loading" else
                   (serve, re.compile(r"Finished jaxpr to MLIR module conversion jit\(_step\)")))
  status, took, rest = _interrupt_mid_compile(args, trigger, tmp_path)
  assert status == cli.INTERRUPTED_STATUS, rest[-3000:]
  assert took < STOP_S, f"exited {took:.1f} s after SIGINT"
  _assert_one_interrupted_line("serve", rest)
