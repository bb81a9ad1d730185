"""Plumbing shared by the absl command-line programs: the console commands (maverick/commands/,
run as `maverick-<name>`, `python -m maverick.commands.<name>` or `python scripts/<name>.py`) and
benchmarks/."""

from __future__ import annotations

import os
import sys
import threading

from absl import flags
from absl import logging


def default_cache_root() -> str:
  """$MAVERICK_CACHE_DIR, else $XDG_CACHE_HOME/maverick-jax, else ~/.cache/maverick-jax (the
  kernel self-check results live there too, pallas_kernels/selfcheck.py)."""
  root = os.environ.get("MAVERICK_CACHE_DIR")
  if not root:
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "maverick-jax")
  return root


def default_compile_cache_dir() -> str:
  """JAX_COMPILATION_CACHE_DIR when set (JAX's own variable wins), else <cache root>/jax_compile."""
  return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(default_cache_root(),
                                                                     "jax_compile")


# Every script that imports this module gets --compile_cache_dir; `start` applies it.
COMPILE_CACHE_DIR = flags.DEFINE_string(
    "compile_cache_dir", None,
    "JAX's persistent compilation cache: compiled programs are saved here and a later run with the "
    "same shapes loads them instead of compiling. Default: $JAX_COMPILATION_CACHE_DIR, else "
    "$MAVERICK_CACHE_DIR/jax_compile, else ~/.cache/maverick-jax/jax_compile. Empty = off.")


# What the persistent cache did in this process: programs compiled through it, and of those the
# ones loaded from disk (JAX's own monitoring events, counted from enable_compile_cache on).
_CACHE_STATS = {"dir": None, "requests": 0, "hits": 0, "listening": False}
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                 "/jax/compilation_cache/cache_hits": "hits"}


def _count_cache_event(event: str, **_) -> None:
  key = _CACHE_EVENTS.get(event)
  if key is not None:
    _CACHE_STATS[key] += 1


def enable_compile_cache(path: str | None) -> str | None:
  """Turns JAX's on-disk compilation cache on at `path` (None: the default, "": off). Every
  program is cached, however quick to compile: on a small model most compiles take under the
  1 s JAX caches by default. On CPU with one device the traced generate loops are kept too, in
  `<path>/exported` (maverick/program_cache.py), so a later run skips tracing them. Returns the
  directory used, or None when off (also when `path` cannot be made: warned, as are failed writes
  and entries that do not load, which are removed; a cache never stops a run)."""
  import jax  # noqa: PLC0415  (late: --help stays instant)
  path = default_compile_cache_dir() if path is None else path
  if not _CACHE_STATS["listening"]:
    jax.monitoring.register_event_listener(_count_cache_event)
    _CACHE_STATS["listening"] = True
  from maverick import program_cache  # noqa: PLC0415  (imports jax)
  if not path:
    jax.config.update("jax_enable_compilation_cache", False)
    _CACHE_STATS["dir"] = None
    program_cache.enable(None)
    return None
  path = os.path.expanduser(path)
  if not program_cache.make_dir(path):  # warned: a cache never stops a run
    return enable_compile_cache("")
  _guard_jax_cache()
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _CACHE_STATS["dir"] = path
  # Traced programs too (CPU, one device): a cache hit then skips tracing and lowering as well.
  program_cache.enable(os.path.join(path, "exported"))
  return path


def _guard_jax_cache() -> None:
  """Makes JAX's persistent cache safe to lose. JAX warns about an entry it cannot load and
  compiles anew, but never overwrites an entry, so a corrupt one is warned about and recompiled
  on every later run: it is deleted here instead, and this run saves it again. A failed write
  (read-only directory, full disk) is warned about once and its partial entry removed. Wraps
  jax._src.compilation_cache's entry get and put, as compiler.py calls them (private API: if they
  are gone, JAX's own handling stays)."""
  import jax  # noqa: PLC0415
  from jax._src import compilation_cache as jax_cache  # noqa: PLC0415
  from maverick import program_cache  # noqa: PLC0415
  get = getattr(jax_cache, "get_executable_and_time", None)
  put = getattr(jax_cache, "put_executable_and_time", None)
  if get is None or put is None or getattr(get, "maverick_guard", False):
    return

  def entry(cache_key: str) -> str:  # LRUCache's file for the key
    return os.path.join(jax.config.jax_compilation_cache_dir, f"{cache_key}-cache")

  def get_or_remove(cache_key, *args, **kwargs):
    try:
      return get(cache_key, *args, **kwargs)
    except Exception as e:  # noqa: BLE001  (truncated, corrupted, from another jaxlib)
      program_cache.remove_bad_entry(entry(cache_key), e)
      if jax.config.jax_raise_persistent_cache_errors:
        raise
      return None, None  # a miss: compiled, then saved again

  def put_or_warn(cache_key, *args, **kwargs):
    path = entry(cache_key)
    existed = os.path.lexists(path)
    try:
      put(cache_key, *args, **kwargs)
    except OSError as e:
      if not existed and os.path.lexists(path):  # half written: it would fail every later read
        program_cache.remove_quietly(path)
      program_cache.warn_unwritable(os.path.dirname(path), e)

  get_or_remove.maverick_guard = True
  jax_cache.get_executable_and_time = get_or_remove
  jax_cache.put_executable_and_time = put_or_warn


def compile_cache_summary() -> str:
  """One line on what the persistent cache did so far: how many of the programs compiled were
  loaded from it (a second identical run should load them all)."""
  if _CACHE_STATS["dir"] is None:
    return "compilation cache off"
  from maverick import program_cache  # noqa: PLC0415
  line = (f"{_CACHE_STATS['hits']} of {_CACHE_STATS['requests']} programs loaded from the "
          "compilation cache")
  _, looked_up, exported = program_cache.stats()
  if looked_up:
    line += f", {exported} of {looked_up} loops without tracing"
  return line


class UsageError(ValueError):
  """A user mistake on the command line: reported in one line, without a traceback."""


def start(argv) -> None:
  """Quiets absl/orbax INFO logs unless -v/--verbosity was given; rejects positional arguments;
  turns on the persistent compilation cache (--compile_cache_dir)."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments {argv[1:]}; all options are --flags (see --help)")
  enable_compile_cache(COMPILE_CACHE_DIR.value)


def fail(prog: str, error: BaseException | str) -> int:
  """Prints `prog: error: ...` as one line on stderr and returns the exit status 1."""
  print(f"{prog}: error: {str(error).replace(chr(10), ' ')}", file=sys.stderr)
  return 1


# 128 + SIGINT: the status a shell reports for a command stopped by Ctrl-C.
INTERRUPTED_STATUS = 130


def interrupted(prog: str) -> int:
  """Ctrl-C: prints `prog: interrupted` as one line on stderr (not a traceback) and returns 130."""
  print(f"{prog}: interrupted", file=sys.stderr)
  return INTERRUPTED_STATUS


# How often the main thread wakes while a worker runs: a signal that lands on another thread (the
# kernel picks any) is handled at the next wake-up, so Ctrl-C takes effect within this.
_WAIT_S = 0.1


def call_interruptibly(fn, *args, **kwargs):
  """fn(*args, **kwargs) in a worker thread while the main thread waits: Python runs a signal
  handler only in the main thread, between bytecodes, so a long XLA compile there (one C++ call)
  would hold Ctrl-C back until it ends. Returns fn's result or raises its exception here (its
  traceback kept). KeyboardInterrupt is raised here at once and fn keeps running: the caller
  leaves with `exit_now`. fn must not install signal handlers (only the main thread may)."""
  box = {}

  def work():
    try:
      box["result"] = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001  (SystemExit too: raised again in the main thread)
      box["error"] = e

  worker = threading.Thread(target=work, name="maverick-main", daemon=True)
  worker.start()
  while worker.is_alive():
    worker.join(_WAIT_S)
  if "error" in box:
    raise box.pop("error")
  return box["result"]


def exit_now(status: int) -> None:
  """Flushes stdout and stderr and ends the process with `status` without the interpreter's
  shutdown: an XLA compile cannot be stopped, and Python exiting under one (or under JAX's
  threads mid-way through start-up) may crash with a segfault or wait for it to end."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed pipe: nothing more to say there
      pass
  os._exit(status)


def run_interruptibly(prog: str, main, argv) -> int:
  """A script's absl main: main(argv) in a worker thread (call_interruptibly), so Ctrl-C stops the
  script within a fraction of a second even mid-compile, with `prog: interrupted` and the
  status 130. Its other results (a status, SystemExit, an exception) are as if it ran here."""
  try:
    return call_interruptibly(main, argv)
  except KeyboardInterrupt:
    if sys.stderr.isatty():  # on a line of its own, not after a progress bar or the echoed ^C
      print(file=sys.stderr)
    exit_now(interrupted(prog))


def run_app(main, module_name: str) -> None:
  """A command's console entry point: absl's app.run(main), with --help showing the command's
  docstring and its flags whichever file started the process (the console script, the thin
  scripts/<name>.py, or `python -m`): absl's --help shows the __main__ module's docstring and the
  flags of the module named by sys.argv[0], and the flags live in `module_name`."""
  from absl import app  # noqa: PLC0415
  module = sys.modules[module_name]
  main_module = sys.modules["__main__"]
  if main_module is not module:
    main_module.__doc__ = module.__doc__
    for flag in flags.FLAGS.get_key_flags_for_module(module.__name__):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main)


def console_main(main, module_name: str):
  """The console entry point (pyproject.toml's [project.scripts]) of the command `main` of the
  module `module_name`: a function of no arguments that runs it under absl (`run_app`)."""
  return lambda: run_app(main, module_name)


def source_checkout() -> str | None:
  """The repository root when this package runs from a source checkout (an editable install, or
  scripts/ on sys.path), else None (an installed wheel)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  marks = ("pyproject.toml", "scripts", "benchmarks")
  return root if all(os.path.exists(os.path.join(root, m)) for m in marks) else None


def default_path(*parts: str) -> str:
  """A default output path: under the repository root in a source checkout (where the project
  keeps its results and embedded model), else under the current directory."""
  root = source_checkout()
  return os.path.join(root, *parts) if root else os.path.join(*parts)


def command_argv(name: str) -> list[str]:
  """The argv that runs the command maverick/commands/<name>.py in a child Python process (the
  same interpreter, `-m`); start it with `child_env()` so it imports this same package."""
  return [sys.executable, "-m", f"maverick.commands.{name}"]


def child_env(env: dict | None = None) -> dict:
  """`env` (default: os.environ) with this package's root first on PYTHONPATH, so a child started
  with `command_argv` imports the same maverick (a source checkout run without an install too)."""
  env = dict(os.environ if env is None else env)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  return env


def write_atomic(path: str, text: str) -> None:
  """Writes a text file so that readers see the old or the new content, never a partial one."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


# --dtype's choices: maverick.config.DTYPES, repeated here because importing maverick.config
# imports jax (through maverick.quant) and --help must stay instant; a test keeps them equal.
DTYPE_CHOICES = ("float32", "bfloat16", "float16")

KERNEL_CHOICES = ("auto", "xla", "pallas")


def define_kernels_flag():
  """--kernels for scripts that build a model (see maverick/kernels.py)."""
  return flags.DEFINE_enum(
      "kernels", "auto", list(KERNEL_CHOICES),
      "Pallas kernels: auto = on a Hopper/Blackwell GPU for calls whose kernel config passed its "
      "one-time on-device self-check (else XLA, with one warning); xla = never; pallas = always "
      "where the kernel takes the shapes (an error without a GPU).")


def kernels_value(flag) -> str | None:
  """The flag's value as `maverick.load(kernels=...)` takes it (auto -> None)."""
  return None if flag.value == "auto" else flag.value


def define_kv_cache_flag():
  """--kv_cache of the scripts that read checkpoints: the KV cache of a ModelOpt checkpoint."""
  return flags.DEFINE_enum(
      "kv_cache", None, ["fp8_static", "fp8", "bf16"],
      "KV cache of an NVIDIA ModelOpt FP8 checkpoint (default: fp8_static when it sets "
      "kv_cache_quant_algo FP8, as TensorRT-LLM and vLLM run it by default). fp8_static: e4m3 "
      "with the checkpoint's per-layer k/v scales, no per-token scale arrays; fp8: e4m3 with a "
      "scale per token and KV head computed at run time; bf16: unquantized, in the model dtype "
      "(--dtype; vLLM's --kv-cache-dtype bfloat16), for accuracy comparisons. fp8 and bf16 drop "
      "the checkpoint's k/v scales. Other sources take bf16 as what they are; a converted "
      "checkpoint keeps the cache it was converted with.")


def define_check_finite_flag():
  """--check_finite for scripts that read Hugging Face checkpoints."""
  return flags.DEFINE_bool(
      "check_finite", True,
      "Scan every tensor read from a Hugging Face checkpoint for NaN/inf and stop with an error "
      "naming it; --nocheck_finite skips the scan for a trusted checkpoint.")
