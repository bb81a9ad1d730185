"""OpenAI-compatible server: continuous batching with EAGLE-3 speculative decoding.

Examples:
  python scripts/serve.py                                  # embedded model + draft, port 8000
  python scripts/serve.py --checkpoint /ckpt/maverick --draft /ckpt/eagle3 --mesh tensor=8 \\
      --slots 32 --max_seq_len 4096 --spec_k 3
  python scripts/serve.py --spec_k 0                       # plain decoding
Then: curl localhost:8000/v1/completions -d '{"prompt": "def f(x):", "max_tokens": 32}'
  or  openai.OpenAI(base_url="http://localhost:8000/v1", api_key="none").completions.create(...)

Compiles the step and every prompt-length bucket at start-up (progress on stderr); GET /health
returns 503 until then, 200 after. If a compile fails, /health answers 500 with the error and the
process exits with status 1 (for a supervisor to restart it). GET /metrics: Prometheus; --api_key:
a bearer key. Needs the serve extra: pip install 'maverick-jax[serve]'.

Run as `maverick-serve` (an installed maverick-jax's console script), as
`python -m maverick.commands.serve`, or from a source checkout as
`python scripts/serve.py`.
"""

import errno
import logging
import os
import socket
import sys

from absl import flags

from maverick import gpu_flags

gpu_flags.configure()  # before anything starts a jax backend (XLA reads XLA_FLAGS once)

from maverick import cli  # noqa: E402
from maverick import mesh_flags  # noqa: E402  (defines --mesh, --layout, multi-host flags)

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "tiny", "'tiny' (the embedded model), a converted checkpoint, a Hugging Face "
    "Llama 4 directory or repo id, or random:<preset> (as scripts/generate.py).")
_DRAFT = flags.DEFINE_string(
    "draft", None, "EAGLE-3 draft head (as scripts/generate.py). Default: the embedded draft for "
    "the embedded model, else none (plain decoding).")
_SPEC_K = flags.DEFINE_integer("spec_k", 3, "Draft tokens per speculative round (0 = plain).")
_TREE_DEPTH = flags.DEFINE_integer("tree_depth", None, "EAGLE-2 tree drafting: levels (with "
                                   "--tree_topk, --tree_nodes; replaces --spec_k).")
_TREE_TOPK = flags.DEFINE_integer("tree_topk", None, "Tree drafting: children per expanded node.")
_TREE_NODES = flags.DEFINE_integer("tree_nodes", None, "Tree drafting: nodes verified per round.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Compute/parameter dtype. Default: the checkpoint's.")
_KERNELS = cli.define_kernels_flag()
_CHECK_FINITE = cli.define_check_finite_flag()
_KV_CACHE = cli.define_kv_cache_flag()
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: all).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on, 1..65535 (0: a free one, printed "
                             "in the ready line).")
_MAX_REQUEST_BYTES = flags.DEFINE_integer(
    "max_request_bytes", None, "Largest request body taken (413 past it). Default: 32 bytes per "
    "token of --max_seq_len, at least 4 MiB.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Concurrent requests on the device (the batch).")
_MAX_SEQ_LEN = flags.DEFINE_integer(
    "max_seq_len", None, "Prompt + generated tokens per request. Default: min(model context, 2048).")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 8, "Decode steps / speculative rounds per device call at most (a call also ends when "
    "a request finishes): more = less host overhead, fewer = faster admission and streaming.")
_BATCH_BUCKETS = flags.DEFINE_list(
    "batch_buckets", None, "Batch sizes with a compiled step program (a step runs the smallest one "
    "that holds every busy slot; --slots is always one). Default: powers of two below --slots. "
    "Fewer = faster start-up, more = less work at low load.")
_MIN_BUCKET = flags.DEFINE_integer("min_bucket", 16, "Smallest prompt-length bucket (powers of "
                                   "two from it up to --max_seq_len are compiled at start-up).")
_KV_LAYOUT = flags.DEFINE_enum(
    "kv_layout", "contiguous", ["contiguous", "paged"], "KV cache layout: 'contiguous' (a "
    "--max_seq_len row per slot) or 'paged' (blocks from a shared pool, admission by free blocks; "
    "see docs/guides/paged-kv.md). The flags below need --kv_layout=paged.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", None, "Paged: KV blocks in the global pool (and "
                                   "the chunk-local one unless --num_chunked_blocks). Default: "
                                   "--slots x the blocks of a row (the contiguous layout's memory).")
_NUM_CHUNKED_BLOCKS = flags.DEFINE_integer(
    "num_chunked_blocks", None, "Paged: KV blocks in the chunk-local layers' pool, which a request "
    "holds about a chunk of (a whole prompt while it prefills). Default: --num_blocks.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 64, "Paged: positions per KV block.")
_PREFIX_CACHE = flags.DEFINE_boolean("prefix_cache", False, "Paged: keep full blocks of committed "
                                     "tokens and share them with later prompts that start alike.")
_PREEMPTION = flags.DEFINE_boolean("preemption", False, "Paged: admit by prompt + first call "
                                   "and preempt the youngest request when the pool runs dry "
                                   "(default: admit by each request's worst case, never preempt).")
_CHUNK_LOCAL = flags.DEFINE_boolean("chunk_local", True, "Paged: release chunk-local layers' "
                                    "blocks before the current chunk (--nochunk_local keeps them).")
_TABLE_WIDTHS = flags.DEFINE_list(
    "table_widths", [], "Paged: block-table widths (blocks per row) to compile step programs for "
    "besides the whole row; each call runs the narrowest holding its rows' blocks (the XLA path "
    "then attends over the longest running row, not --max_seq_len). More start-up compiles.")
PAGED_FLAGS = ("num_blocks", "num_chunked_blocks", "block_size", "prefix_cache", "preemption", "chunk_local",
               "table_widths")
_COMPACTION = flags.DEFINE_boolean(
    "compaction", None, "Move a request left alone in a high slot down so a smaller batch program "
    "runs it (maverick/serving/compaction.py). Default: on for the CPU backend, off on a GPU, "
    "where it has not run yet.")
_API_KEY = flags.DEFINE_string(
    "api_key", None, "Require 'Authorization: Bearer <key>' on every path but /health (401 with "
    "OpenAI's error body otherwise). Default: the MAVERICK_API_KEY environment variable, else none.")
_ACCESS_LOG = flags.DEFINE_boolean("access_log", True, "One line per request on stderr (method, "
                                   "path, status, prompt/completion tokens, latency).")
_NAME = flags.DEFINE_string("served_model_name", None, "Model id in the API (default: the "
                            "--checkpoint value).")
_VISION = flags.DEFINE_boolean("vision", False, "Load the checkpoint's vision tower: chat messages "
                               "may then hold image_url parts (data: URLs).")
_MEDIA_PATH = flags.DEFINE_string(
    "allowed_local_media_path", None, "With --vision: image_url parts may also name files "
    "(file:// or a path) under this directory. Default: data: URLs only. Never the network.")


def listen_socket(host: str, port: int) -> socket.socket:
  """A TCP socket bound to host:port (port 0: a free one), for uvicorn to serve on. Bound before
  the model loads and compiles, so a bad --host or --port fails at once; the OSError says what to
  change."""
  if not 0 <= port <= 65535:  # uvicorn took 70000 as 70000 mod 65536 = 4464
    raise OSError(f"--port {port} is not a TCP port: pass 1..65535 (or 0 for a free one)")
  try:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
  except (socket.gaierror, UnicodeError) as e:
    raise OSError(f"--host {host!r} is not an address of this machine ({e}): pass an IP "
                  "address such as 127.0.0.1 or 0.0.0.0") from None
  sock = socket.socket(family, kind, proto)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart after a stop
  try:
    sock.bind(address)
  except OSError as e:
    sock.close()
    fix = ("another process listens there: stop it or pass another --port"
           if e.errno == errno.EADDRINUSE else
           "ports below 1024 need root: pass another --port" if e.errno == errno.EACCES else
           "pass an address of this machine with --host (127.0.0.1, 0.0.0.0) or another --port")
    raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}") from None
  return sock


def _batch_buckets():
  if _BATCH_BUCKETS.value is None:
    return None
  try:
    sizes = [int(v) for v in _BATCH_BUCKETS.value]
  except ValueError:
    raise cli.UsageError(f"--batch_buckets: {_BATCH_BUCKETS.value} are not all integers") from None
  bad = [n for n in sizes if not 1 <= n <= _SLOTS.value]
  if bad:
    raise cli.UsageError(f"--batch_buckets: {bad} are outside [1, --slots={_SLOTS.value}]")
  return sizes


def kv_args() -> dict:
  """Engine's KV layout arguments from the flags; paged-only flags need --kv_layout=paged."""
  given = [f"--{n}" for n in PAGED_FLAGS if flags.FLAGS[n].present]
  if _KV_LAYOUT.value != "paged":
    if given:
      raise cli.UsageError(f"{', '.join(given)}: only for the paged KV layout; add "
                           "--kv_layout=paged")
    return {}
  try:
    widths = tuple(int(w) for w in _TABLE_WIDTHS.value)
  except ValueError:
    raise cli.UsageError(f"--table_widths: {','.join(_TABLE_WIDTHS.value)} are not all integers "
                         "(block counts, e.g. --table_widths=4,8,16)") from None
  return dict(kv_layout="paged", num_blocks=_NUM_BLOCKS.value,
              num_chunked_blocks=_NUM_CHUNKED_BLOCKS.value, block_size=_BLOCK_SIZE.value,
              prefix_cache=_PREFIX_CACHE.value, preemption=_PREEMPTION.value,
              chunk_local=_CHUNK_LOCAL.value, table_widths=widths)


def _tree_shape():
  values = (_TREE_DEPTH.value, _TREE_TOPK.value, _TREE_NODES.value)
  if all(v is None for v in values):
    return None
  if any(v is None for v in values):
    raise ValueError("tree drafting needs all of --tree_depth, --tree_topk and --tree_nodes")
  from spec_decode import TreeShape
  return TreeShape(*values)


def build_server():
  """Loads the model (and draft) and builds the engine and the app's state from the flags."""
  from maverick import loading
  import spec_decode
  from maverick import sharding
  from maverick import kernels as kernels_lib
  from maverick.serving.engine import Engine
  from maverick.serving.server import Server

  mesh = mesh_flags.mesh_from_flags()
  loaded = loading.load(_CHECKPOINT.value, dtype=_DTYPE.value, mesh=mesh,
                        layout=mesh_flags.LAYOUT.value, kernels=cli.kernels_value(_KERNELS),
                        check_finite=_CHECK_FINITE.value, kv_cache=_KV_CACHE.value,
                        vision=_VISION.value)
  if loaded.tokenizer is None:
    raise ValueError(f"{_CHECKPOINT.value} has no tokenizer.json; the server needs one")
  if _SPEC_K.value < 0:
    raise ValueError(f"--spec_k must be >= 0 (0 = plain decoding), got {_SPEC_K.value}")
  tree = _tree_shape()
  draft = None
  if _SPEC_K.value > 0 or tree is not None:
    source = _DRAFT.value or (_CHECKPOINT.value if _CHECKPOINT.value in spec_decode.EMBEDDED_DRAFTS
                              else None)
    if source is not None:
      draft = spec_decode.load_draft(source, loaded.model)
      if mesh is not None:
        draft = sharding.shard_model(draft, mesh, mesh_flags.LAYOUT.value)
      kernels_lib.set_kernels(draft, cli.kernels_value(_KERNELS))
  context = loaded.config.max_position_embeddings
  engine = Engine(loaded.model, draft, k=_SPEC_K.value, tree=tree, slots=_SLOTS.value,
                  max_seq_len=_MAX_SEQ_LEN.value or min(context, 2048), rounds=_ROUNDS.value,
                  stop_tokens=loaded.stop_tokens, min_bucket=_MIN_BUCKET.value,
                  batch_buckets=_batch_buckets(), compaction=_COMPACTION.value, **kv_args())
  return Server(engine, loaded.tokenizer, _NAME.value or _CHECKPOINT.value,
                max_request_bytes=_MAX_REQUEST_BYTES.value, api_key=_api_key(),
                allowed_local_media_path=_MEDIA_PATH.value)


def _api_key():
  """--api_key, else $MAVERICK_API_KEY (kept out of `ps` listings), else None."""
  key = _API_KEY.value if _API_KEY.value is not None else os.environ.get("MAVERICK_API_KEY")
  if key is not None and (not key or key.strip() != key):
    raise cli.UsageError("--api_key / MAVERICK_API_KEY must be non-empty, without surrounding "
                         "spaces")
  return key


def main(argv):
  compiling = []  # the compile thread, once started
  try:
    status = _main(argv, compiling)
    if not (compiling and compiling[0].is_alive()):
      return status
  except KeyboardInterrupt:  # Ctrl-C before uvicorn handles it (loading, starting up)
    pass
  print(file=sys.stderr)  # after tqdm's bar, not on it
  status = cli.interrupted("serve")
  # An XLA compile cannot be stopped, and Python exiting under it (or under JAX's threads mid-way
  # through start-up) crashes with a segfault: leave without the interpreter's shutdown. Nothing
  # is lost: the server keeps no state to save.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _main(argv, compiling: list):
  try:
    cli.start(argv)
    if _MAX_REQUEST_BYTES.value is not None and _MAX_REQUEST_BYTES.value < 1:
      raise cli.UsageError(f"--max_request_bytes must be >= 1, got {_MAX_REQUEST_BYTES.value}")
    _api_key()
    kv_args()
    if _MEDIA_PATH.value is not None and not (_VISION.value and os.path.isdir(_MEDIA_PATH.value)):
      raise cli.UsageError(f"--allowed_local_media_path {_MEDIA_PATH.value!r} needs --vision and "
                           "an existing directory")
    if _ACCESS_LOG.value:  # absl's handler prints it; absl's own INFO lines stay quiet
      logging.getLogger("maverick.access").setLevel(logging.INFO)
  except cli.UsageError as e:
    return cli.fail("serve", e)
  # Before the model loads and compiles: a port in use or a bad --host is an error at once, and
  # never reaches a compiling thread (uvicorn's own bind failure exited under it and crashed).
  try:
    sock = listen_socket(_HOST.value, _PORT.value)
  except OSError as e:
    return cli.fail("serve", e)
  port = sock.getsockname()[1]
  try:
    import uvicorn
    from maverick.serving.server import create_app, start_compiling, startup_failure
  except ImportError as e:
    return cli.fail("serve", f"{e}: install the serve extra: pip install 'maverick-jax[serve]'")
  from maverick.checkpoint import CheckpointError
  from maverick.config import ConfigError
  from maverick import sharding
  from spec_decode.draft import DraftConfigError
  from tqdm import tqdm

  try:
    server = cli.call_interruptibly(build_server)  # Ctrl-C stops loading at once, mid-compile too
  except (ValueError, FileNotFoundError, CheckpointError, ConfigError, DraftConfigError,
          NotImplementedError, sharding.ShardingError) as e:
    return cli.fail("serve", e)
  eng = server.engine
  mode = ("plain decoding" if eng.draft is None else
          f"tree {eng.tree}" if eng.tree is not None else f"speculative K={eng.k}")
  bar = tqdm(total=len(eng.buckets) + len(eng.batch_buckets) + 1, desc="compiling",
             unit="program", file=sys.stderr)

  started = False

  def progress(what):  # called before each program compiles, with None once all have
    nonlocal started
    if started:
      bar.update(1)  # the previous program is compiled
    started = True
    if what is not None:
      bar.set_postfix_str(what)
      return
    bar.close()
    host = f"[{_HOST.value}]" if ":" in _HOST.value else _HOST.value
    print(f"serve: ready on http://{host}:{port}/v1 ({server.model_name}, {mode}, "
          f"{eng.slots} slots x {eng.max_seq_len} tokens, compiled in "
          f"{server.compile_seconds:.1f} s; {cli.compile_cache_summary()})", file=sys.stderr,
          flush=True)

  uv = uvicorn.Server(uvicorn.Config(create_app(server), host=_HOST.value, port=port,
                                     log_level="warning"))

  def failed(error):  # in the compile thread, before it logs the error
    bar.close()
    uv.should_exit = True  # uvicorn stops serving (within 0.1 s) and run() returns

  compiling.append(start_compiling(server, progress, on_error=failed))
  # Ctrl-C stops uvicorn, which returns (main then sees the compile thread still running) or
  # raises it again.
  uv.run(sockets=[sock])
  if server.compile_error is not None:
    compiling[0].join()  # it has stopped uvicorn: logging the traceback is all it has left
    hint = ("; lower --slots or --max_seq_len (paged: --num_blocks, --block_size) to fit the "
            "device's memory" if "RESOURCE_EXHAUSTED" in str(server.compile_error) else "")
    return cli.fail("serve", startup_failure(server).rstrip(".") + hint)
  eng.shutdown()
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-serve`

if __name__ == "__main__":
  console_main()
