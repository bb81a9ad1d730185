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
pytest.importorskip("prometheus_client")

from maverick import loading  # noqa: E402
from maverick import tokenizer as tokenizer_lib  # noqa: E402
from maverick.serving.engine import Event, RequestError  # noqa: E402
from maverick.serving.server import (INLINE_TOKENIZE_BYTES, Detokenizer, Server,  # noqa: E402
                                     create_app)
from param_utils import http_exchange, http_head  # noqa: E402
import maverick  # noqa: E402
import spec_decode  # noqa: E402
from maverick.serving import Engine  # noqa: E402
from test_sampling_options import _host_greedy  # noqa: E402

LIMIT = 100_000  # --max_request_bytes of the app under test
CONTEXT = 64
HANG = 40  # requests with max_tokens from this on run until cancelled
STEP = 3  # tokens per stub event (the engine's steps return several tokens too)
WAIT_S = 10


def stub_logprob(t):
  """The stub's logprob of token t, and its alternatives': simple formulas the tests share."""
  return -0.5 - (t % 11) / 4


def stub_entry(t, top):
  """(logprob of t, its top alternatives): ids t+1, t+2, ... at -0.125, -0.25, then -inf (an
  alternative the filters removed)."""
  alts = [(t + 1 + j, -0.125 * (j + 1) if j < 2 else float("-inf")) for j in range(top)]
  return stub_logprob(t), alts


class StubEngine:
  """What the app uses of an Engine. A request's output is its prompt's tokens (repeated), in
  events of STEP tokens, up to max_tokens or a stop id (included, as the engine does). One with
  max_tokens >= HANG runs until cancelled (`submitted`, then `cancelled` is set). `calls` keeps
  every submit's prompt and keywords. With logprobs=N each token has stub_entry(t, N); with
  prompt_logprobs the first event has [None] + those of the prompt's other tokens."""

  max_seq_len = CONTEXT
  error = None
  slots, active, steps, spec_rounds, spec_accepted, released, finished = 4, 0, 0, 0, 0, 0, 0
  steps_by_batch: dict = {}

  def __init__(self, eos):
    self.default_stop = [eos]
    self.submitted, self.cancelled = threading.Event(), threading.Event()
    self.calls = []

  def submit(self, prompt, callback, *, max_tokens, stop_tokens=None, **kw):
    self.calls.append(dict(kw, prompt=list(prompt), max_tokens=max_tokens,
                           stop_tokens=stop_tokens))
    if max_tokens > CONTEXT:  # as the engine: the field at fault is named
      raise RequestError(f"max_tokens ({max_tokens}) does not fit the context", "max_tokens",
                         "context_length_exceeded")
    stops = frozenset(self.default_stop if stop_tokens is None else stop_tokens)
    handle = types.SimpleNamespace(stop_ids=stops, finished=max_tokens < HANG, admitted=0.0)
    if not handle.finished:
      self.submitted.set()
      return handle
    out = [prompt[i % len(prompt)] for i in range(max_tokens)]
    end = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))
    top = kw.get("logprobs")
    entries = lambda toks: None if top is None else [stub_entry(t, top) for t in toks]
    first = [None] + [stub_entry(t, top or 0) for t in prompt[1:]] \
        if kw.get("prompt_logprobs") else None
    for i in range(0, end, STEP):
      done = i + STEP >= end
      reason = ("stop" if out[end - 1] in stops else "length") if done else None
      toks = out[i:min(i + STEP, end)]
      callback(Event(toks, done, reason, logprobs=entries(toks),
                     prompt_logprobs=first if i == 0 else None))
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


# ------------------------------------------------------------------------------------------------
# Usage, stop strings, stop ids, n and prompt lists. The stub returns the prompt's own tokens, so
# the expected output and counts come from the tokenizer alone, not from the server's code.
# ------------------------------------------------------------------------------------------------
CODE = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"


def _post(app, body, path="/v1/completions", **kw):
  return httpx.post(app.base + path, json=body, timeout=WAIT_S, **kw)


def _stream(app, body, path="/v1/completions"):
  """The parsed chunks of a streamed answer (up to `data: [DONE]`, which must come last)."""
  with httpx.stream("POST", app.base + path, json=dict(body, stream=True), timeout=WAIT_S) as r:
    assert r.status_code == 200, r.read()
    lines = [line[len("data: "):] for line in r.iter_lines() if line]
  assert lines[-1] == "[DONE]", lines
  return [json.loads(line) for line in lines[:-1]]


def _joined(chunks, field="text"):
  """Per choice index: (concatenated text, token ids, last finish reason)."""
  out = {}
  for chunk in chunks:
    for c in chunk["choices"]:
      text, ids, reason = out.get(c["index"], ("", [], None))
      piece = c["delta"].get("content") or "" if "delta" in c else c[field]
      out[c["index"]] = (text + piece, ids + c.get("token_ids", []), c["finish_reason"] or reason)
  return out


def _prefix_with(tok, ids, words):
  """The fewest leading tokens of ids whose text holds `words`."""
  return next(k for k in range(1, len(ids) + 1) if words in tok.decode(ids[:k]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop"])
def test_usage_and_token_ids_end_at_the_token_that_completes_the_stop_string(app_server, stream,
                                                                             include):
  """Tokens past the stop string arrive in the same engine event; they are neither returned nor
  counted (before: completion_tokens counted every token of the event)."""
  tok = app_server.tok.tok
  ids = tok.encode(CODE)
  k = _prefix_with(tok, ids, "return")
  assert k % STEP and k < len(ids)  # the stop's event holds tokens past it
  text = tok.decode(ids[:k])
  want = text if include else text[:text.index("return")]
  body = {"prompt": CODE, "max_tokens": len(ids), "stop": ["zzz", "return"],
          "return_token_ids": True, "include_stop_str_in_output": include}
  if stream:
    chunks = _stream(app_server, dict(body, stream_options={"include_usage": True}))
    got, usage = _joined(chunks)[0], chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
  else:
    answer = _post(app_server, body).json()
    c, usage = answer["choices"][0], answer["usage"]
    got = (c["text"], c["token_ids"], c["finish_reason"])
  assert got == (want, ids[:k], "stop")
  assert usage == {"prompt_tokens": len(ids), "completion_tokens": k,
                   "total_tokens": len(ids) + k}


def test_any_number_of_stop_strings_the_earliest_wins(app_server):
  tok = app_server.tok.tok
  ids = tok.encode(CODE)
  stops = ["never1", "never2", "print", "never3", "+ b", "never4", "never5"]  # before: at most 4
  c = _post(app_server, {"prompt": CODE, "max_tokens": len(ids), "stop": stops}).json()
  text = tok.decode(ids[:_prefix_with(tok, ids, "+ b")])
  assert c["choices"][0]["text"] == text[:text.index("+ b")], c


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_join_the_end_of_sequence_ids(app_server, ignore_eos):
  tok, engine = app_server.tok.tok, app_server.engine
  ids = tok.encode(CODE)
  stop_id = ids[7]  # " +" ... any id past the start
  k = ids.index(stop_id) + 1
  answer = _post(app_server, {"prompt": CODE, "max_tokens": len(ids), "stop_token_ids": [stop_id],
                              "ignore_eos": ignore_eos, "return_token_ids": True}).json()
  assert engine.calls[-1]["stop_tokens"] == ([] if ignore_eos else [tok.eos_ids[0]]) + [stop_id]
  c = answer["choices"][0]
  assert (c["text"], c["token_ids"], c["finish_reason"]) == (tok.decode(ids[:k - 1]), ids[:k],
                                                             "stop")
  assert answer["usage"]["completion_tokens"] == k


# min_tokens and stop strings (vLLM's rule): an occurrence counts only if it ends after the text of
# the first min_tokens tokens; one that starts inside that text and ends after it counts. The stub
# repeats REPEAT's three tokens "import", " sys", "\n" (events of STEP = 3 tokens), so the expected
# cut points below are read off "import sys\nimport sys\nimport sys\n..." by hand.
REPEAT = "import sys\n"
MIN_TOKENS_CASES = [  # (stop, min_tokens, include_stop_str_in_output, text, completion tokens)
    # " sys" is token 2 (< 4): ordinary text; the one token 5 completes stops.
    ("sys", 4, False, "import sys\nimport ", 5),
    ("sys", 4, True, "import sys\nimport sys", 5),
    # "sys" ends exactly with the first 2 tokens' text: not after it, so it does not count.
    ("sys", 2, False, "import sys\nimport ", 5),
    ("sys", 1, False, "import ", 2),  # token 2 is past min_tokens 1
    # Starts in token 5 (" sys"), ends in token 7 ("import"): counts, token 7 ends the output.
    ("s\nim", 5, False, "import sys\nimport sy", 7),
    ("s\nim", 5, True, "import sys\nimport sys\nim", 7),
    # Every occurrence before max_tokens (9) ends within the first 9 tokens: "length", all text.
    ("sys", 9, False, "import sys\n" * 3, 9),
]


def _repeat_ids(tok):
  ids = tok.encode(REPEAT, add_bos=False)
  assert [tok.decode([t]) for t in ids] == ["import", " sys", "\n"]
  return ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("stop,min_tokens,include,want,k", MIN_TOKENS_CASES, ids=[
    f"{s!r}-min{m}{'-include' if i else ''}" for s, m, i, _, _ in MIN_TOKENS_CASES])
def test_min_tokens_holds_back_stop_strings(app_server, stream, stop, min_tokens, include, want,
                                            k):
  """Before: the first occurrence stopped the output whatever min_tokens said ("sys", 4 gave
  "import ", 2 tokens)."""
  ids = _repeat_ids(app_server.tok.tok) * 3
  body = {"prompt": ids[:3], "max_tokens": 9, "stop": stop, "min_tokens": min_tokens,
          "include_stop_str_in_output": include, "return_token_ids": True}
  if stream:
    chunks = _stream(app_server, dict(body, stream_options={"include_usage": True}))
    got, usage = _joined(chunks)[0], chunks[-1]["usage"]
  else:
    answer = _post(app_server, body).json()
    c, usage = answer["choices"][0], answer["usage"]
    got = (c["text"], c["token_ids"], c["finish_reason"])
  assert got == (want, ids[:k], "stop" if k < 9 else "length")
  assert usage == {"prompt_tokens": 3, "completion_tokens": k, "total_tokens": 3 + k}


@pytest.mark.parametrize("chunk", [1, 2, 4, 9], ids=lambda n: f"{n}_per_push")
def test_detokenizer_min_tokens_whatever_the_pushes(app_server, chunk):
  """Speculative rounds hand the detokenizer 1 to K+1 tokens at a time: the cut is the same.
  The text shown along the way never holds what the final answer drops."""
  tok = app_server.tok.tok
  ids = _repeat_ids(tok) * 3
  for stop, min_tokens, include, want, k in MIN_TOKENS_CASES:
    d = Detokenizer(tok, frozenset(tok.eos_ids), [stop], include, min_tokens=min_tokens)
    text, toks = "", []
    for i in range(0, len(ids), chunk):
      piece, taken = d.push(ids[i:i + chunk], i + chunk >= len(ids))
      assert want.startswith(text + piece), (stop, min_tokens, text + piece)
      text, toks = text + piece, toks + taken
      if d.stopped:
        break
    assert (text, toks, d.stopped) == (want, ids[:k], k < 9), (stop, min_tokens, include)



@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_times_a_list_of_prompts(app_server, stream):
  """Choice index = prompt * n + j, drawn with seed + index; usage counts each prompt once and
  every choice's tokens."""
  tok, engine = app_server.tok.tok, app_server.engine
  prompts = ["x = 1\n", "import os\n"]
  ids = [tok.encode(p) for p in prompts]
  body = {"prompt": prompts, "n": 2, "seed": 7, "max_tokens": 5, "return_token_ids": True}
  before = len(engine.calls)
  if stream:
    chunks = _stream(app_server, dict(body, stream_options={"include_usage": True}))
    got, usage = _joined(chunks), chunks[-1]["usage"]
  else:
    answer = _post(app_server, body).json()
    got = {c["index"]: (c["text"], c["token_ids"], c["finish_reason"]) for c in answer["choices"]}
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    usage = answer["usage"]
  want = [(ids[p] * 2)[:5] for p in (0, 0, 1, 1)]
  assert got == {i: (tok.decode(w[1:]) if w[0] == tok.bos_id else tok.decode(w), w, "length")
                 for i, w in enumerate(want)}
  assert [c["seed"] for c in engine.calls[before:]] == [7, 8, 9, 10]
  assert [c["prompt"] for c in engine.calls[before:]] == [ids[0], ids[0], ids[1], ids[1]]
  assert usage == {"prompt_tokens": len(ids[0]) + len(ids[1]), "completion_tokens": 20,
                   "total_tokens": len(ids[0]) + len(ids[1]) + 20}


def test_chat_with_n_streams_a_role_chunk_per_choice(app_server):
  chunks = _stream(app_server, {"messages": [{"role": "user", "content": "hi"}], "n": 3,
                                "max_tokens": 4}, "/v1/chat/completions")
  roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
  assert roles == [0, 1, 2]
  assert sorted(_joined(chunks)) == [0, 1, 2]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": CONTEXT + 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "user": "u",
                              "max_completion_tokens": CONTEXT + 1}, "max_completion_tokens"),
], ids=["completions", "chat", "chat_completion_tokens"])
def test_the_engines_refusal_names_the_field_sent(app_server, path, body, param):
  r = _post(app_server, body, path)
  assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
  assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ok \ud800 no"}),
    ("/v1/completions", {"prompt": ["fine", "bad \udfff"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}),
    ("/tokenize", {"prompt": "\ud800"}),
], ids=["completion", "completion_list", "chat", "tokenize"])
def test_a_lone_surrogate_is_a_400_and_the_connection_lives_on(app_server, path, body):
  """Before: HTTP 500 in plain text (the tokenizer's TypeError) and a broken kept-alive
  connection. json.dumps writes the surrogate as the escape \\ud800, as a client would."""
  with httpx.Client(base_url=app_server.base, timeout=WAIT_S) as client:
    r = client.post(path, content=json.dumps(body).encode(),  # ASCII: "\\ud800" escaped
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    param = "messages" if "messages" in body else "prompt"
    assert err["param"] == param and "lone surrogate" in err["message"], err
    assert err["type"] == "invalid_request_error"
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------------
# Every parameter of vLLM's request schemas (vllm/entrypoints/openai/protocol.py, CompletionRequest
# and ChatCompletionRequest) is honoured (a behavioural check below) or refused with 400 naming it.
# ------------------------------------------------------------------------------------------------
VLLM_COMPLETION = """model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs
max_tokens n presence_penalty seed stop stream stream_options suffix temperature top_p user
use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
truncate_prompt_tokens allowed_token_ids prompt_logprobs add_special_tokens response_format
guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids
cache_salt kv_transfer_params vllm_xargs""".split()
VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
max_completion_tokens n presence_penalty response_format seed stop stream stream_options
temperature top_p tools tool_choice reasoning_effort include_reasoning parallel_tool_calls user
best_of use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
truncate_prompt_tokens prompt_logprobs allowed_token_ids bad_words echo add_generation_prompt
continue_final_message add_special_tokens documents chat_template chat_template_kwargs
mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar structural_tag
guided_decoding_backend guided_whitespace_pattern priority request_id logits_processors
return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs""".split()

# Refused: a value that would change the output (their neutral values are taken, see below).
REFUSED = {
    "prompt_embeds": "AAAA", "best_of": 3, "suffix": "tail", "use_beam_search": True,
    "length_penalty": 0.5, "spaces_between_special_tokens": False,
    "allowed_token_ids": [1, 2], "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"],
    "guided_grammar": "root ::= 'a'", "structural_tag": "{}", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "priority": 1, "logits_processors": ["x.y"],
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
    "reasoning_effort": "low", "bad_words": ["a"], "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1}}
CHAT_REFUSED = {"add_special_tokens": True, "echo": True}
# Every refused name at its neutral value: taken (clients that send defaults keep working).
NEUTRAL = {
    "best_of": 1, "echo": False, "frequency_penalty": 0, "logit_bias": {}, "logprobs": None,
    "presence_penalty": 0.0, "suffix": None, "use_beam_search": False, "min_p": 0,
    "repetition_penalty": 1.0, "length_penalty": 1, "min_tokens": 0, "prompt_logprobs": None,
    "spaces_between_special_tokens": True, "response_format": {"type": "text"}, "priority": 0,
    "guided_json": None, "return_tokens_as_token_ids": False, "tools": [], "tool_choice": "none",
    "bad_words": [], "logits_processors": None, "vllm_xargs": {}}


def _eq(got, want):
  assert got == want


def _honoured_checks(app, chat):
  """name -> a check of what the parameter does (the stub echoes the prompt)."""
  tok, engine = app.tok.tok, app.engine
  path = "/v1/chat/completions" if chat else "/v1/completions"
  base = ({"messages": [{"role": "user", "content": "x = 1"}]} if chat else
          {"prompt": "\nx = 1"})
  base_ids = (tok.apply_chat_template(base["messages"]) if chat else tok.encode(base["prompt"]))

  def run(**kw):
    r = _post(app, dict(base, **dict({"max_tokens": 4}, **kw)), path)
    assert r.status_code == 200, r.text
    return r.json()

  def text(answer, i=0):
    c = answer["choices"][i]
    return c["message"]["content"] if chat else c["text"]  # chat: "user\n\n" + the message

  def engine_got(key, value, **kw):
    run(**kw)
    assert engine.calls[-1][key] == value, (key, engine.calls[-1])

  def stream_usage():
    chunks = _stream(app, dict(base, max_tokens=3, stream_options={"include_usage": True}), path)
    assert chunks[-1]["usage"]["completion_tokens"] == 3

  def log_has_user():
    answer = run(user="alice@example")
    assert answer["choices"]  # the access-log line is checked in test_access_log_line

  def lp_tokens(**kw):
    lp = run(**dict({"logprobs": True} if chat else {"logprobs": 1}, **kw))["choices"][0]
    return [c["token"] for c in lp["logprobs"]["content"]] if chat else lp["logprobs"]["tokens"]

  def prompt_lp():
    answer = run(prompt_logprobs=1)
    got = answer["prompt_logprobs"] if chat else answer["choices"][0]["prompt_logprobs"]
    assert len(got) == len(base_ids) and got[0] is None and got[1], got

  def unknown_model():
    r = _post(app, dict(base, model="gpt-9"), path)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"

  checks = {
      "model": unknown_model,
      "max_tokens": lambda: _eq(run()["usage"]["completion_tokens"], 4),
      "n": lambda: _eq([c["index"] for c in run(n=3)["choices"]], [0, 1, 2]),
      "seed": lambda: engine_got("seed", 123, seed=123),
      "temperature": lambda: engine_got("temperature", 0.25, temperature=0.25),
      "top_p": lambda: engine_got("top_p", 0.5, top_p=0.5),
      "top_k": lambda: engine_got("top_k", 7, top_k=7),
      "ignore_eos": lambda: engine_got("stop_tokens", [], ignore_eos=True),
      "stop_token_ids": lambda: engine_got("stop_tokens", [tok.eos_ids[0], 5], stop_token_ids=[5]),
      "stop": lambda: _eq(text(run(stop="=", max_tokens=len(base_ids)))[-3:], "\nx "),
      "include_stop_str_in_output": lambda: _eq(text(run(
          stop="=", include_stop_str_in_output=True, max_tokens=len(base_ids)))[-4:], "\nx ="),
      "stream": lambda: _stream(app, dict(base, max_tokens=2), path),
      "stream_options": stream_usage,
      "user": log_has_user,
      "request_id": lambda: _eq(run(request_id="abc")["id"][-4:], "-abc"),
      "skip_special_tokens": lambda: _eq(text(run(skip_special_tokens=False))[:17],
                                         "<|begin_of_text|>"),
      "truncate_prompt_tokens": lambda: engine_got("prompt", base_ids[-2:],
                                                   truncate_prompt_tokens=2),
      "cache_salt": lambda: run(cache_salt="s"),  # no prefix cache: nothing to salt
      # Sampling options: passed to the engine, which applies them on the device
      # (tests/test_sampling_options.py checks what they do).
      "presence_penalty": lambda: engine_got("presence_penalty", 0.5, presence_penalty=0.5),
      "frequency_penalty": lambda: engine_got("frequency_penalty", -0.5, frequency_penalty=-0.5),
      "repetition_penalty": lambda: engine_got("repetition_penalty", 1.2, repetition_penalty=1.2),
      "min_p": lambda: engine_got("min_p", 0.1, min_p=0.1),
      "min_tokens": lambda: engine_got("min_tokens", 2, min_tokens=2),
      "logit_bias": lambda: engine_got("logit_bias", {11: 5.0}, logit_bias={"11": 5}),
      # Logprobs: the formats are checked in the tests above.
      "logprobs": lambda: _eq(lp_tokens(), [tok.decode([t], skip_special_tokens=False)
                                            for t in base_ids[:4]]),
      "prompt_logprobs": prompt_lp,
      "return_tokens_as_token_ids": lambda: _eq(lp_tokens(return_tokens_as_token_ids=True)[0],
                                                f"token_id:{base_ids[0]}"),
  }
  if chat:
    no_gen = tok.apply_chat_template(base["messages"], add_generation_prompt=False)
    checks.update(
        messages=lambda: engine_got("prompt", base_ids),
        max_completion_tokens=lambda: engine_got("max_tokens", 2, max_completion_tokens=2),
        add_generation_prompt=lambda: engine_got("prompt", no_gen, add_generation_prompt=False),
        continue_final_message=lambda: engine_got("prompt", no_gen[:-1],
                                                  continue_final_message=True),
        include_reasoning=lambda: run(include_reasoning=False),  # never any reasoning content
        parallel_tool_calls=lambda: run(parallel_tool_calls=False),  # no tools to call
        tool_choice=lambda: run(tool_choice="none"),
        top_logprobs=lambda: _eq(len(run(logprobs=True, top_logprobs=2)["choices"][0][
            "logprobs"]["content"][0]["top_logprobs"]), 2))
  else:
    checks.update(
        prompt=lambda: engine_got("prompt", base_ids),
        add_special_tokens=lambda: engine_got("prompt", base_ids[1:], add_special_tokens=False),
        echo=lambda: _eq(text(run(echo=True)), base["prompt"] + tok.decode(base_ids[:4])))
  return checks


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_vllm_parameter_is_honoured_or_refused_by_name(app_server, chat):
  names = VLLM_CHAT if chat else VLLM_COMPLETION
  path = "/v1/chat/completions" if chat else "/v1/completions"
  base = ({"messages": [{"role": "user", "content": "x = 1"}]} if chat else {"prompt": "x = 1"})
  checks = _honoured_checks(app_server, chat)
  refused = dict(REFUSED, **(CHAT_REFUSED if chat else {}))
  untested = [n for n in names if n not in checks and n not in refused]
  assert not untested, f"neither honoured nor refused: {untested}"
  for name in names:
    if name in checks:
      checks[name]()
      continue
    r = _post(app_server, dict(base, **{name: refused[name]}), path)
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == name and f"'{name}'" in err["message"], (name, err)
    assert err["type"] == "invalid_request_error"


def test_mm_processor_kwargs_refusal_says_why_not_text_only(app_server):
  """The server takes images (image_url parts); the refusal names what it does not take."""
  body = {"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": {"a": 1}}
  r = _post(app_server, body, "/v1/chat/completions")
  assert r.status_code == 400, r.text
  message = r.json()["error"]["message"]
  assert "text-only" not in message and "image processor" in message, message


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_neutral_values_and_unknown_names(app_server, chat):
  path = "/v1/chat/completions" if chat else "/v1/completions"
  base = ({"messages": [{"role": "user", "content": "x = 1"}]} if chat else {"prompt": "x = 1"})
  r = _post(app_server, dict(base, max_tokens=2, **NEUTRAL), path)
  assert r.status_code == 200, r.text
  for body, name in [({"frobnicate": 1}, "frobnicate"),
                     ({"messages" if not chat else "prompt": "x"}, "messages" if not chat else
                      "prompt"),
                     ({"stream_options": {"include_usage": True}}, "stream_options")]:
    r = _post(app_server, dict(base, **body), path)
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


# ------------------------------------------------------------------------------------------------
# /metrics, --api_key, the access log, /tokenize and /detokenize
# ------------------------------------------------------------------------------------------------
def _scrape(app) -> dict:
  """{(sample name, labels): value} of /metrics, parsed by prometheus_client's own parser."""
  from prometheus_client.parser import text_string_to_metric_families
  r = httpx.get(app.base + "/metrics", timeout=WAIT_S)
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_parse_and_move_as_requests_are_served(app_server):
  tok = app_server.tok.tok
  ids = tok.encode(CODE)
  k = _prefix_with(tok, ids, "return")
  before = _scrape(app_server)
  ok = (("path", "/v1/completions"), ("status", "200"))
  for stream in (False, True):
    body = {"prompt": [CODE, CODE], "max_tokens": len(ids), "stop": "return", "stream": stream}
    assert _post(app_server, body).status_code == 200
  after = _scrape(app_server)
  moved = lambda name, labels=(): after[name, labels] - before.get((name, labels), 0)
  assert moved("maverick_requests_total", ok) == 2
  assert moved("maverick_prompt_tokens_total") == 4 * len(ids)
  assert moved("maverick_generation_tokens_total") == 4 * k  # what usage counts
  assert moved("maverick_request_finished_total", (("reason", "stop"),)) == 4
  assert moved("maverick_time_to_first_token_seconds_count") == 4
  assert moved("maverick_inter_token_latency_seconds_count") == 4 * (k - STEP)  # after event 1
  assert after["maverick_slots", ()] == StubEngine.slots
  assert after["maverick_queue_length", ()] == 0
  for name in ("maverick_slots_busy", "maverick_spec_acceptance_length_count",
               "maverick_spec_rounds_total", "maverick_spec_accepted_tokens_total",
               "maverick_engine_steps_total"):
    assert (name, ()) in after, name


@pytest.fixture
def with_api_key(app_server):
  app_server.server.api_key = "sekrit-key"
  try:
    yield app_server
  finally:
    app_server.server.api_key = None


@pytest.mark.parametrize("header,status", [
    (None, 401), ("Bearer wrong", 401), ("sekrit-key", 401), ("Basic sekrit-key", 401),
    ("Bearer sekrit-key", 200), ("bearer  sekrit-key", 200)],
    ids=["none", "wrong", "no_scheme", "basic", "right", "case_and_spaces"])
def test_api_key(with_api_key, header, status):
  headers = {} if header is None else {"authorization": header}
  r = _post(with_api_key, {"prompt": "x", "max_tokens": 1}, headers=headers)
  assert r.status_code == status, r.text
  if status == 401:
    assert r.json()["error"]["code"] == "invalid_api_key" and "--api_key" in r.text
    assert r.headers["www-authenticate"] == "Bearer"
  for path in ("/v1/models", "/metrics"):  # every path needs it ...
    assert httpx.get(with_api_key.base + path, headers=headers).status_code == status
  assert httpx.get(with_api_key.base + "/health").status_code == 200  # ... but /health


def test_access_log_line(app_server, caplog):
  caplog.set_level(logging.INFO, logger="maverick.access")
  _post(app_server, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "user": "alice"})
  _post(app_server, {"prompt": "x", "temperature": -1})
  lines = [r.getMessage() for r in caplog.records if r.name == "maverick.access"]
  assert len(lines) == 2, lines
  assert lines[0].startswith('POST /v1/completions 200 prompt_tokens=5 completion_tokens=4 '
                             'latency=') and lines[0].endswith('s user="alice"'), lines
  assert lines[1].startswith("POST /v1/completions 400 prompt_tokens=- completion_tokens=- "), lines


def test_tokenize_and_detokenize(app_server):
  tok, post = app_server.tok.tok, lambda path, body: _post(app_server, body, path)
  r = post("/tokenize", {"prompt": CODE, "return_token_strs": True}).json()
  ids = tok.encode(CODE)
  assert r == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
               "token_strs": [tok.hf_tokenizer.id_to_token(t) for t in ids]}
  assert post("/tokenize", {"prompt": CODE, "add_special_tokens": False}).json()["tokens"] == \
      tok.encode(CODE, add_bos=False)
  msgs = [{"role": "user", "content": "hi"}]
  r = post("/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
  assert r["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=False)
  assert r["token_strs"] is None
  assert post("/detokenize", {"tokens": ids}).json() == {"prompt": tok.decode(ids)}
  for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"),
                            ("/detokenize", {"tokens": "abc"}, "tokens"),
                            ("/tokenize", {"prompt": 5}, "prompt"),
                            ("/tokenize", {"prompt": "x", "extra": 1}, "extra")]:
    r = post(path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ----- min_tokens over the real engine (slow) -----
# min_tokens through the OpenAI server over the real engine (embedded model; its draft at K=3 and
# as a tree), streamed and not: stop strings are held back by vLLM's rule (one counts only if it
# ends after the text of the first min_tokens tokens, and may start inside it), stop_token_ids are
# masked on device for the first min_tokens tokens, also at the accepted drafts of a speculative
# round, and usage counts the returned tokens. Expected outputs come from a plain greedy
# maverick.generate run without stop strings (cut by hand) and, where a mask changes the tokens,
# from test_sampling_options' host loop of full forwards with NumPy masking. The stub-engine
# versions, fast, are above.

ENGINE_WAIT_S = 300
MIN_TOKENS_PROMPT = "import os\n"
MIN_TOKENS_MAX = 12
# The embedded model's greedy continuation of MIN_TOKENS_PROMPT: "import sys\n" over and over.
MIN_TOKENS_PIECES = ["import", " sys", "\n"] * 4


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


@pytest.fixture(scope="module")
def reference(loaded):
  """The plain greedy tokens of MIN_TOKENS_PROMPT, no stop strings (the end-of-sequence id never
  comes)."""
  ids = loaded.tokenizer.encode(MIN_TOKENS_PROMPT)
  ref = maverick.generate(loaded.model, [ids], max_new_tokens=MIN_TOKENS_MAX,
                          stop_tokens=loaded.stop_tokens).tokens[0]
  assert [loaded.tokenizer.decode([t]) for t in ref] == MIN_TOKENS_PIECES
  return ids, ref


def _min_tokens_cases(loaded, ids, ref):
  """(request fields, expected text, expected token ids, finish reason)."""
  newline = ref[2]
  masked = _host_greedy(loaded.model, ids, MIN_TOKENS_MAX, [newline] + loaded.stop_tokens,
                        min_tokens=3)
  assert masked[2] != newline and masked[-1] == newline  # the mask changed the text, then ended it
  return [
      # " sys" (token 2) is before min_tokens 4: the one token 5 completes stops.
      (dict(stop="sys", min_tokens=4), "import sys\nimport ", ref[:5], "stop"),
      # Starts in token 5 (" sys"), completed by token 7 ("import"): it counts.
      (dict(stop="s\nim", min_tokens=5), "import sys\nimport sy", ref[:7], "stop"),
      (dict(stop="s\nim", min_tokens=5, include_stop_str_in_output=True),
       "import sys\nimport sys\nim", ref[:7], "stop"),
      # "\n" is token 3, past min_tokens 2: it stops there.
      (dict(stop_token_ids=[newline], min_tokens=2), "import sys", ref[:3], "stop"),
      # Masked at token 3, not at token 4. A mask that does not count the drafts accepted earlier
      # in a round (sampling.adjust's `generated`) fails this case with the chain and the one
      # above with the tree (checked by breaking it).
      (dict(stop_token_ids=[newline], min_tokens=3),
       loaded.tokenizer.decode(masked[:-1]), masked, "stop"),
  ]


def _engine_complete(base, body, stream):
  """(text, token ids, finish reason, usage) of a completion, streamed or not."""
  if not stream:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=ENGINE_WAIT_S)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["token_ids"], c["finish_reason"], r.json()["usage"]
  text, ids, reason, usage = "", [], None, None
  body = dict(body, stream=True, stream_options={"include_usage": True})
  with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=ENGINE_WAIT_S) as r:
    assert r.status_code == 200, r.read()
    lines = [line[len("data: "):] for line in r.iter_lines() if line]
  assert lines[-1] == "[DONE]"
  for line in lines[:-1]:
    chunk = json.loads(line)
    if chunk["choices"]:
      c = chunk["choices"][0]
      text, ids = text + c["text"], ids + c["token_ids"]
      reason = c["finish_reason"] or reason
    else:
      usage = chunk["usage"]
  return text, ids, reason, usage


@pytest.mark.slow  # an engine compile per shape: 30 s or more on a shared 2-core CPU
@pytest.mark.parametrize("shape", ["plain", "k3", "tree"])
def test_min_tokens_with_stop_strings_and_stop_ids(loaded, reference, shape):
  from test_serving_seeds import _serving  # noqa: PLC0415  (it imports this module)
  ids, ref = reference
  draft = None if shape == "plain" else spec_decode.load_draft("tiny", loaded.model)
  extra = {"plain": {}, "k3": dict(k=3), "tree": dict(tree=spec_decode.TreeShape(3, 2, 5))}
  engine = Engine(loaded.model, draft, slots=1, max_seq_len=32, rounds=2, min_bucket=16,
                  batch_buckets=[], stop_tokens=loaded.stop_tokens, **extra[shape])
  cases = _min_tokens_cases(loaded, ids, ref)
  got, want = [], []
  with _serving(engine, loaded.tokenizer) as (base, _):
    for fields, text, tokens, reason in cases:
      body = dict(fields, prompt=MIN_TOKENS_PROMPT, max_tokens=MIN_TOKENS_MAX, temperature=0.0,
                  return_token_ids=True)
      usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
               "total_tokens": len(ids) + len(tokens)}
      for stream in (False, True):
        got.append((fields, stream, _engine_complete(base, body, stream)))
        want.append((fields, stream, (text, tokens, reason, usage)))
  assert got == want
  if shape != "plain":
    assert engine.spec_accepted > engine.spec_rounds  # drafts were accepted
