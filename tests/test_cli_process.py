"""The scripts as processes: Ctrl-C in the middle of an XLA compile stops them at once (one line,
status 130), and a start-up compile that fails in scripts/serve.py is reported (log, /health) and
ends the process with status 1 instead of leaving it at 503 forever."""

import logging
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from maverick import cli
from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]
# JAX_LOG_COMPILES=1 logs this as XLA starts compiling a program (after tracing and lowering,
# which are Python and stopped by Ctrl-C either way).
LOOP_COMPILE = re.compile(r"Finished jaxpr to MLIR module conversion jit\(\w*generate\w*\)")
# The largest draft tree generate.py takes: with XLA's default optimization its loop compiles for
# 9 s on an idle CPU, longer on a loaded one (the default chain: 3-4 s).
TREE = (16, 16, 256)
STOP_S = 3  # SIGINT to exit (it takes ~0.2 s); the rest of the compile takes longer
START_TIMEOUT_S = 300  # load and compile on a slow, shared CPU


def _start(args, env):
  """A script whose stderr the test reads; killed after START_TIMEOUT_S whatever it does."""
  proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  watchdog = threading.Timer(START_TIMEOUT_S, proc.kill)
  watchdog.daemon = True
  watchdog.start()
  return proc


def _read_until(proc, pattern, what: str) -> list[str]:
  """stderr's lines up to the first that matches `pattern` (a failure if the process ends
  first). The caller then waits for the exit and reads the rest (it fits the pipe):
  communicate() would miss what this loop's reader has buffered."""
  seen = []
  for line in proc.stderr:
    seen.append(line)
    if pattern.search(line):
      return seen
  pytest.fail(f"the process ended (status {proc.wait()}) before {what}: {''.join(seen)[-3000:]}")


def _interrupt_mid_compile(args, trigger, tmp_path, settle=0.5):
  """Starts a script with nothing in its compile cache, waits for stderr to show `trigger`
  (XLA compiling), sends SIGINT `settle` s later: (status, seconds from SIGINT to exit, stderr
  after the signal)."""
  env = dict(single_device_env(), MAVERICK_CACHE_DIR=str(tmp_path / "cache"), JAX_LOG_COMPILES="1",
             XLA_FLAGS="")  # not the tests' fast compiles: the longer the compile, the clearer
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = _start([*args, f"--compile_cache_dir={tmp_path / 'jax'}"], env)
  try:
    _read_until(proc, trigger, "compiling")
    time.sleep(settle)  # inside XLA's C++ compile, where the old scripts did not see SIGINT
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=START_TIMEOUT_S)
    return proc.returncode, time.monotonic() - sent, proc.stderr.read()
  finally:
    proc.kill()
    proc.stderr.close()


def _assert_one_interrupted_line(prog, rest):
  lines = [l for l in rest.replace("\r", "\n").splitlines() if l.strip()]
  assert lines and lines[-1] == f"{prog}: interrupted", rest[-3000:]
  assert sum("interrupted" in l for l in lines) == 1, rest[-3000:]
  assert not [l for l in lines if "Traceback" in l or "Fatal" in l or "Segmentation" in l], lines


def test_ctrl_c_during_the_compile_stops_generate_at_once(tmp_path):
  """Before the fix Ctrl-C waited for the whole compile (Python runs a signal handler only in
  the main thread, between bytecodes, and the compile was one C++ call there)."""
  depth, topk, nodes = TREE
  status, took, rest = _interrupt_mid_compile(
      [str(REPO / "scripts" / "generate.py"), "--prompt=def f(x):", f"--tree_depth={depth}",
       f"--tree_topk={topk}", f"--tree_nodes={nodes}"], LOOP_COMPILE, tmp_path)
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


# --- serve.py: a start-up compile that fails -----------------------------------------------------

SERVE = str(REPO / "scripts" / "serve.py")
# A paged pool of 2^20 blocks of 2^20 positions: accepted by the flags, but a layer's pool is
# 2^48 bytes, past any machine's address space, so the first program fails (RESOURCE_EXHAUSTED).
HUGE_POOL = ["--kv_layout=paged", "--block_size=1048576", "--num_blocks=1048576"]


def test_a_failed_start_up_compile_ends_serve_with_status_1(tmp_path):
  """Before the fix the error died with the compile thread and the server answered 503
  "starting" forever (here: never logged, killed by the watchdog, a failure)."""
  env = dict(single_device_env(), MAVERICK_CACHE_DIR=str(tmp_path))
  proc = _start([SERVE, "--port=0", "--spec_k=0", "--slots=2", "--max_seq_len=64", *HUGE_POOL],
                env)
  try:
    seen = _read_until(proc, re.compile(r"\] start-up compile failed at init"), "failing")
    failed = time.monotonic()  # the log's line comes as the compile thread ends
    proc.wait(timeout=START_TIMEOUT_S)
    took = time.monotonic() - failed
    rest = proc.stderr.read()
  finally:
    proc.kill()
    proc.stderr.close()
  lines = [l for l in "".join([*seen, rest]).replace("\r", "\n").splitlines() if l.strip()]
  assert proc.returncode == 1, lines[-30:]
  assert took < STOP_S, f"exited {took:.1f} s after the failure"
  assert lines[-1].startswith("serve: error: start-up compile failed at init: JaxRuntimeError: "
                              "RESOURCE_EXHAUSTED: Out of memory allocating 281474976710656 bytes")
  assert "lower --slots or --max_seq_len (paged: --num_blocks, --block_size)" in lines[-1]
  # The log: the error's line at level E, then its traceback (to the engine's first program).
  at = [n for n, l in enumerate(lines) if "] start-up compile failed at init" in l]
  assert len(at) == 1 and lines[at[0]].startswith("E"), lines
  assert lines[at[0] + 1] == "Traceback (most recent call last):", lines
  assert any("in compile" in l for l in lines[at[0]:]), lines
  assert not [l for l in lines if "Fatal" in l or "Segmentation" in l], lines


class FailingEngine:
  """What the app reads of an Engine, with a compile that fails at its second program."""

  max_seq_len, error = 64, None

  def compile(self, note):
    note("init")
    note("step batch 2")
    raise RuntimeError("XLA compile failed:\nout of registers")

  def start(self):
    raise AssertionError("started after a failed compile")


def test_a_failed_compile_is_kept_logged_and_answered_by_health(caplog):
  """A library user of Server / start_compiling sees the failure in `compile_error` and
  on_error; /health and the generation POSTs answer 500 with it in OpenAI's error body."""
  pytest.importorskip("fastapi")
  from fastapi.testclient import TestClient
  from maverick import loading
  from maverick import tokenizer as tokenizer_lib
  from maverick.serving.server import Server, create_app, start_compiling

  server = Server(FailingEngine(), tokenizer_lib.load_tokenizer(loading.EMBEDDED["tiny"]), "tiny")
  seen, called = [], threading.Event()
  on_error = lambda e: (seen.append(e), called.set())
  with caplog.at_level(logging.ERROR, logger="maverick.serving.server"):
    start_compiling(server, on_error=on_error).join(30)
  assert called.is_set() and seen == [server.compile_error]
  assert isinstance(server.compile_error, RuntimeError) and not server.ready
  message = ("start-up compile failed at step batch 2: RuntimeError: XLA compile failed: out of "
             "registers")
  [record] = [r for r in caplog.records if r.name == "maverick.serving.server"]
  assert record.getMessage() == message and record.exc_info[1] is server.compile_error
  client = TestClient(create_app(server))
  error = {"message": message, "type": "server_error", "param": None, "code": None}
  r = client.get("/health")
  assert r.status_code == 500 and r.json() == {"error": error}
  r = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4})
  assert r.status_code == 500 and r.json() == {"error": error}


# A load that compiles a long program (the embedded speculative loop), as loading a large or sharded
# checkpoint may: then scripts/serve.py, patched here only, is run as a user runs it.
SLOW_LOAD = """
import runpy, sys
import spec_decode
from maverick import loading
load = loading.load
def load_and_compile(*args, **kwargs):
  loaded = load(*args, **kwargs)
  draft = spec_decode.load_draft("tiny", loaded.model)
  tree = spec_decode.TreeShape(*%r)
  spec_decode.generate(loaded.model, draft, [[1, 2, 3]], tree=tree, max_new_tokens=4)
  return loaded
loading.load = load_and_compile  # the commands call loading.load
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
""" % (TREE,)


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
