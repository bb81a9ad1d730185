"""The HTTP layer (maverick/serving/server.py) in process: the app on a real uvicorn socket in a
thread, the embedded model's tokenizer, and a stub engine, so nothing compiles and every test takes
about a second. What only a stub can make deterministic lives here: a request that never finishes
until cancelled, a tokenizer that holds a long prompt until the test lets it go, raw sockets that
stop mid-body. The end-to-end tests with the real engine are in test_serving.py."""

import concurrent.futures
import json
import logging
import socket
import threading
import time
import types

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from maverick import loading  # noqa: E402
from maverick import tokenizer as tokenizer_lib  # noqa: E402
from maverick.serving.engine import Event  # noqa: E402
from maverick.serving.server import INLINE_TOKENIZE_BYTES, Server, create_app  # noqa: E402
from param_utils import http_exchange, http_head  # noqa: E402

LIMIT = 100_000  # --max_request_bytes of the app under test
CONTEXT = 64
HANG = 40  # requests with max_tokens from this on run until cancelled
STEP = 3  # tokens per stub event (the engine's steps return several tokens too)
WAIT_S = 10


class StubEngine:
  """What the app uses of an Engine. A request's output is its prompt's tokens (repeated), in
  events of STEP tokens, up to max_tokens or a stop id (included, as the engine does). One with
  max_tokens >= HANG runs until cancelled (`submitted`, then `cancelled` is set). `calls` keeps
  every submit's prompt and keywords."""

  max_seq_len = CONTEXT
  error = None
  slots, active, steps, spec_rounds, spec_accepted = 4, 0, 0, 0, 0

  def __init__(self, eos):
    self.default_stop = [eos]
    self.submitted, self.cancelled = threading.Event(), threading.Event()
    self.calls = []

  def submit(self, prompt, callback, *, max_tokens, stop_tokens=None, **kw):
    self.calls.append(dict(kw, prompt=list(prompt), max_tokens=max_tokens,
                           stop_tokens=stop_tokens))
    stops = frozenset(self.default_stop if stop_tokens is None else stop_tokens)
    handle = types.SimpleNamespace(stop_ids=stops, finished=max_tokens < HANG, admitted=0.0)
    if not handle.finished:
      self.submitted.set()
      return handle
    out = [prompt[i % len(prompt)] for i in range(max_tokens)]
    end = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))
    for i in range(0, end, STEP):
      done = i + STEP >= end
      reason = ("stop" if out[end - 1] in stops else "length") if done else None
      callback(Event(out[i:i + STEP], done, reason))
    return handle

  def cancel(self, handle):
    self.cancelled.set()


class HeldTokenizer:
  """The real tokenizer, except that a text past INLINE_TOKENIZE_BYTES waits in `encode` (the
  thread it runs on) until the test sets `release`; `started` says it got there."""

  def __init__(self, tok):
    self.tok = tok
    self.started, self.release = threading.Event(), threading.Event()

  def encode(self, text, **kw):
    if len(text) > INLINE_TOKENIZE_BYTES:
      self.started.set()
      self.release.wait(WAIT_S * 3)
    return self.tok.encode(text, **kw)

  def __getattr__(self, name):
    return getattr(self.tok, name)


@pytest.fixture(scope="module")
def app_server():
  tok = HeldTokenizer(tokenizer_lib.load_tokenizer(loading.EMBEDDED["tiny"]))
  engine = StubEngine(tok.eos_ids[0])
  server = Server(engine, tok, "tiny", max_request_bytes=LIMIT)
  server.ready = True
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  # log_config=None: uvicorn's loggers propagate to the root logger, where caplog sees them.
  uv = uvicorn.Server(uvicorn.Config(create_app(server), log_config=None, log_level="info",
                                     lifespan="off"))
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + WAIT_S
  while not uv.started and time.monotonic() < deadline:
    time.sleep(0.02)
  assert uv.started
  try:
    yield types.SimpleNamespace(port=sock.getsockname()[1], engine=engine, tok=tok, server=server,
                                base=f"http://127.0.0.1:{sock.getsockname()[1]}")
  finally:
    uv.should_exit = True
    thread.join(WAIT_S)


def _assert_too_large(status, body):
  assert status == 413, body
  err = body["error"]
  assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
  assert f"limit of {LIMIT} bytes" in err["message"] and "--max_request_bytes" in err["message"]


def test_a_body_declared_past_the_limit_is_refused_before_it_is_sent(app_server):
  """The answer comes with no byte of the body sent: the Content-Length alone decides."""
  _assert_too_large(*http_exchange(app_server.port, http_head(content_length=100 * LIMIT)))


def test_a_chunked_body_is_refused_once_its_running_size_passes_the_limit(app_server):
  """No terminating chunk is ever sent: the server answers as soon as the count passes the limit,
  without waiting for (or holding) the whole body."""
  piece = b"[" + b"1," * 8000  # 16 KB of a prompt
  chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (LIMIT // len(piece) + 1)
  head = http_head(transfer_encoding="chunked")
  _assert_too_large(*http_exchange(app_server.port, head, *chunks))


def test_a_body_under_the_limit_is_taken(app_server):
  body = json.dumps({"prompt": [1] + [7] * 10, "max_tokens": 2}).encode()
  status, answer = http_exchange(app_server.port, http_head(transfer_encoding="chunked"),
                             b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
  assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer


def test_a_short_request_is_answered_while_a_long_prompt_is_tokenized(app_server):
  """The long prompt's tokenizer call is held until the short request has its answer: on the
  event loop (as before), the short request would wait for it."""
  base, tok = f"http://127.0.0.1:{app_server.port}", app_server.tok
  long_prompt = "def f(x):\n  return x\n" * 2000  # 42 KB: allowed, tokenized in a thread
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    long = pool.submit(httpx.post, f"{base}/v1/completions", timeout=WAIT_S * 3,
                       json={"prompt": long_prompt, "max_tokens": 2})
    try:
      assert tok.started.wait(WAIT_S), "the long prompt never reached the tokenizer"
      short = httpx.post(f"{base}/v1/completions", timeout=WAIT_S,
                         json={"prompt": "x = 1", "max_tokens": 2, "return_token_ids": True})
      assert not tok.release.is_set()  # answered while the long prompt still tokenizes
    finally:
      tok.release.set()
    long = long.result(WAIT_S * 3)
  assert short.status_code == 200, short.text
  assert short.json()["choices"][0]["token_ids"] == tok.tok.encode("x = 1")[:2]
  assert long.status_code == 200, long.text
  assert long.json()["usage"]["prompt_tokens"] == len(tok.tok.encode(long_prompt))


def test_a_non_streaming_client_that_leaves_frees_its_slot(app_server):
  """The stub request never finishes on its own: only the disconnect can cancel it."""
  engine = app_server.engine
  body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 50}).encode()
  with socket.create_connection(("127.0.0.1", app_server.port), timeout=WAIT_S) as s:
    s.sendall(http_head(content_length=len(body)) + body)
    assert engine.submitted.wait(WAIT_S)  # it waits for tokens that never come
    time.sleep(0.1)  # the app is now waiting too: nothing cancels the request but the disconnect
    assert not engine.cancelled.is_set()
  assert engine.cancelled.wait(WAIT_S), "the request kept its slot after the client left"


def test_a_half_sent_body_is_one_quiet_line(app_server, caplog):
  """The client promises 1000 bytes, sends 10 and leaves: no traceback in the server's log."""
  caplog.set_level(logging.INFO)
  with socket.create_connection(("127.0.0.1", app_server.port), timeout=WAIT_S) as s:
    s.sendall(http_head(content_length=1000) + b'{"prompt":')
  deadline = time.monotonic() + WAIT_S
  while time.monotonic() < deadline and not any(
      "whole body" in r.getMessage() or r.levelno >= logging.ERROR for r in caplog.records):
    time.sleep(0.02)
  assert "Traceback" not in caplog.text and not [r for r in caplog.records
                                                 if r.levelno >= logging.WARNING], caplog.text
  assert [r.getMessage() for r in caplog.records if "whole body" in r.getMessage()] == [
      "POST /v1/completions: the client left before sending the whole body"]
