"""Reproducible seeds through the OpenAI server (issue 28's acceptance): the same seeded, sampled
request gives the same text and token ids sent alone and sent among 31 other concurrent requests
(other prompts, seeds, greedy rows, penalties, chat, streaming, stop strings), with plain decoding,
K=3 and a tree; and echo's prompt logprobs equal a full-sequence forward's. The real engine
(embedded model + draft) serves on a uvicorn socket in this process; the official `openai` client
sends the request when it is installed. The engine-level version of this test is in
test_sampling_options.py; the fast test here checks the HTTP layer's part with
test_serving_http's stub engine."""

import concurrent.futures
import contextlib
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import maverick  # noqa: E402
import spec_decode  # noqa: E402
from maverick import model as model_lib  # noqa: E402
from maverick.serving import Engine  # noqa: E402
from maverick.serving.server import Server, create_app  # noqa: E402
from test_serving_http import _post, app_server  # noqa: E402

assert app_server  # imported for pytest: the stub engine's server, for the fast test

try:
  import openai
except ImportError:  # plain HTTP only
  openai = None

WAIT_S = 300  # a request on a slow, shared CPU, behind a batch of 32
MAX_TOKENS = 24
MINE = {"prompt": "def add(a, b):", "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.9,
        "seed": 1234, "ignore_eos": True, "return_token_ids": True}
MINE_AT = 16  # others sent (and queued) before it: it does not get slot 0 in the mixed run
TEXTS = ["import os\n", "class Stack:", "for i in range(10):", "x = [", "with open(", "return ",
         "The cat sat on", "Once upon a time", "SELECT * FROM", "#include <stdio.h>\n",
         "def fibonacci(n):", "while True:"]


def _others(n=31, seed=0):
  """n request bodies (path, body): completions and chat, greedy and sampled, with and without
  penalties and stop strings, some streamed, with lengths that free slots at other times."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    body = {"max_tokens": int(rng.integers(12, MAX_TOKENS + 1)),
            "seed": int(rng.integers(0, 2**31)),
            "temperature": 0.0 if i % 3 == 0 else float(rng.choice([0.7, 1.0, 1.3])),
            "stream": i % 4 == 1}
    if i % 5 == 2:
      body.update(presence_penalty=0.5, frequency_penalty=0.3)
    if i % 7 == 3:
      body.update(repetition_penalty=1.3, top_k=20)
    if i % 6 == 4:
      body["stop"] = ["\n"]
    text = TEXTS[i % len(TEXTS)]
    if i % 4 == 3:
      out.append(("/v1/chat/completions", dict(body, messages=[{"role": "user",
                                                                  "content": text}])))
    else:
      out.append(("/v1/completions", dict(body, prompt=text)))
  return out


def _send(base, path, body):
  """One request over plain HTTP; the answer's status (the text is not compared)."""
  if not body.get("stream"):
    return httpx.post(base + path, json=body, timeout=WAIT_S).status_code
  with httpx.stream("POST", base + path, json=body, timeout=WAIT_S) as r:
    lines = [line for line in r.iter_lines() if line]
  assert lines[-1] == "data: [DONE]", lines[-3:]
  return r.status_code


def _mine(base, via_openai):
  """MINE's (text, token ids), through the official client or plain HTTP."""
  if via_openai:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=WAIT_S,
                           max_retries=0)
    extra = {k: MINE[k] for k in ("ignore_eos", "return_token_ids")}
    c = client.completions.create(model="tiny", extra_body=extra, **{
        k: v for k, v in MINE.items() if k not in extra}).choices[0]
    return c.text, c.token_ids
  r = httpx.post(f"{base}/v1/completions", json=MINE, timeout=WAIT_S)
  assert r.status_code == 200, r.text
  c = r.json()["choices"][0]
  return c["text"], c["token_ids"]


def _mixed(base, server, send_mine):
  """Sends MINE_AT others, waits until the engine holds them, then MINE (with send_mine), then
  the rest, all concurrent; MINE's answer."""
  others = _others()
  with concurrent.futures.ThreadPoolExecutor(len(others) + 1) as pool:
    first = [pool.submit(_send, base, *o) for o in others[:MINE_AT]]
    deadline = time.monotonic() + WAIT_S
    while len(server.open_handles) < MINE_AT and time.monotonic() < deadline:
      time.sleep(0.005)
    mine = pool.submit(send_mine)
    rest = [pool.submit(_send, base, *o) for o in others[MINE_AT:]]
    statuses = [f.result(timeout=WAIT_S * 2) for f in first + rest]
    mine = mine.result(timeout=WAIT_S * 2)
  assert statuses == [200] * len(others), statuses
  return mine


@contextlib.contextmanager
def _serving(engine, tokenizer):
  """The app over `engine` on a free port, in a thread; yields (base URL, Server)."""
  server = Server(engine, tokenizer, "tiny")
  server.compile_and_start()
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  uv = uvicorn.Server(uvicorn.Config(create_app(server), log_config=None, lifespan="off"))
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
      time.sleep(0.02)
    assert uv.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
  finally:
    uv.should_exit = True
    thread.join(30)
    engine.shutdown()


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["plain", "k3", "tree"])
def test_a_seeded_request_alone_and_among_31_others_over_http(loaded, shape):
  """Batch-1 step programs alone, batch-32 ones mixed (slots 0..31, so the row differs too):
  identical text and token ids, and the text is sampled (it is not the greedy text)."""
  model = loaded.model
  draft = None if shape == "plain" else spec_decode.load_draft("tiny", model)
  extra = {"plain": dict(k=0), "k3": dict(k=3), "tree": dict(tree=spec_decode.TreeShape(3, 2, 5))}
  engine = Engine(model, draft, slots=32, max_seq_len=48, rounds=2, min_bucket=48,
                  batch_buckets=[1], stop_tokens=loaded.stop_tokens, **extra[shape])
  with _serving(engine, loaded.tokenizer) as (base, server):
    alone = _mine(base, via_openai=False)
    greedy = httpx.post(f"{base}/v1/completions", json=dict(MINE, temperature=0.0),
                        timeout=WAIT_S).json()["choices"][0]["token_ids"]
    steps_1 = engine.steps_by_batch[1]
    mixed = _mixed(base, server, lambda: _mine(base, via_openai=openai is not None))
    steps_32 = engine.steps_by_batch[32]
    again = _mine(base, via_openai=openai is not None)  # alone once more, after the batch
    if shape == "plain":  # this engine also answers the echo check (no other compile)
      echo = httpx.post(f"{base}/v1/completions", timeout=WAIT_S, json={
          "prompt": MINE["prompt"], "max_tokens": 1, "echo": True, "logprobs": 2,
          "temperature": 0.0}).json()["choices"][0]["logprobs"]
  if shape == "plain":
    _check_echo_against_a_forward(loaded, echo)
  assert steps_1 > 0 and steps_32 > 0, engine.steps_by_batch
  assert engine.steps_by_batch[1] > steps_1  # `again` ran alone
  assert len(alone[1]) == MAX_TOKENS and alone[1] != greedy
  assert mixed == alone, shape
  assert again == alone, shape


def _check_echo_against_a_forward(loaded, lp):
  """echo + logprobs=2: the prompt's token logprobs and their top-2 values equal a float64
  log-softmax of one full-sequence forward's f32 logits (the raw model distribution)."""
  ids = loaded.tokenizer.encode(MINE["prompt"])
  logits = model_lib.apply(*nnx.split(loaded.model), jnp.asarray([ids])).logits[0]
  x = np.asarray(logits, np.float64)
  want = x - x.max(-1, keepdims=True)
  want -= np.log(np.exp(want).sum(-1, keepdims=True))
  assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
  got = lp["token_logprobs"][1:len(ids)]
  np.testing.assert_allclose(got, [want[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4)
  for t in range(1, len(ids)):
    top = sorted(lp["top_logprobs"][t].values(), reverse=True)[:2]
    np.testing.assert_allclose(top, np.sort(want[t - 1])[::-1][:2], atol=1e-4)


def test_the_server_hands_the_engine_the_same_request_alone_and_among_others(app_server):
  """The HTTP layer's part: MINE reaches the engine with the same prompt, seed and options alone
  and among 31 concurrent requests (nothing taken from the load, the arrival order or a global
  random state), and its text is the same (the stub's output is a function of the prompt)."""
  engine, base = app_server.engine, app_server.base
  body = dict(MINE, max_tokens=6)
  keep = ("prompt", "seed", "temperature", "top_p", "top_k", "max_tokens", "stop_tokens",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias")
  mine = lambda call: {k: call.get(k) for k in keep}
  before = len(engine.calls)
  alone = _post(app_server, body).json()["choices"][0]
  want = mine(engine.calls[before])
  assert want["seed"] == MINE["seed"] and want["temperature"] == MINE["temperature"]

  others = [(p, dict(b, max_tokens=min(b["max_tokens"], 6))) for p, b in _others()]
  before = len(engine.calls)
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    futures = [pool.submit(_send, base, *o) for o in others[:MINE_AT]]
    got = pool.submit(lambda: _post(app_server, body).json()["choices"][0])
    futures += [pool.submit(_send, base, *o) for o in others[MINE_AT:]]
    assert [f.result(timeout=60) for f in futures] == [200] * len(others)
    got = got.result(timeout=60)
  calls = engine.calls[before:]
  assert len(calls) == len(others) + 1
  assert [mine(c) for c in calls if c["seed"] == MINE["seed"]] == [want]
  assert (got["text"], got["token_ids"]) == (alone["text"], alone["token_ids"])
  # The unseeded requests' seeds are drawn afresh (two identical ones do not share a stream).
  unseeded = dict(MINE, max_tokens=2, seed=None)
  before = len(engine.calls)
  _post(app_server, unseeded), _post(app_server, unseeded)
  assert engine.calls[before]["seed"] != engine.calls[before + 1]["seed"]
