"""scripts/serve.py end to end: a real server subprocess (embedded model + draft, K=3) and the
official `openai` client. Every wait is bounded in count and time."""

import concurrent.futures
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import maverick  # noqa: E402
from param_utils import http_exchange, http_head, single_device_env  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_SEQ_LEN = 64
SLOTS = 4
MAX_REQUEST_BYTES = 100_000
START_TIMEOUT_S = 600  # load + compile the step and 3 prefill buckets on a slow, shared CPU
REQUEST_TIMEOUT_S = 120


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  port = _free_port()
  log = tmp_path_factory.mktemp("serve") / "server.log"
  env = single_device_env()
  env.setdefault("MAVERICK_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
  with open(log, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "serve.py"), f"--port={port}", "--spec_k=3",
         f"--slots={SLOTS}", f"--max_seq_len={MAX_SEQ_LEN}", "--rounds=2", "--min_bucket=16",
         f"--max_request_bytes={MAX_REQUEST_BYTES}"],
        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  try:
    deadline, status = time.monotonic() + START_TIMEOUT_S, None
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        r = httpx.get(f"{base}/health", timeout=5)
        status = r.status_code
        if status == 200:
          break
        assert status == 503 and r.json()["status"] == "starting"  # not ready while compiling
      except httpx.TransportError:
        pass
      time.sleep(1)
    assert status == 200, f"server not ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}"
    yield base
  finally:
    proc.terminate()
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      proc.kill()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S,
                       max_retries=0)


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


@pytest.mark.slow
def test_models_and_health(server, client):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  h = httpx.get(f"{server}/health", timeout=10).json()
  assert h["status"] == "ok" and h["slots"] == SLOTS and h["kv_layout"] == "contiguous"


@pytest.mark.slow
def test_sixteen_concurrent_requests(client, loaded):
  """Greedy and sampled, chat and completion, streaming and not, different lengths and stop
  sequences, all at once; greedy token-id completions equal maverick.generate's."""
  tok = loaded.tokenizer
  texts = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):",
           "def add(a, b):", "x = [", "with open(", "return "]
  greedy_prompts = [tok.encode(t) for t in texts]
  lengths = [4, 9, 14, 20, 6, 11, 17, 24]

  def completion_ids(i):
    stream = i % 2 == 1
    kw = dict(model="tiny", prompt=greedy_prompts[i], max_tokens=lengths[i], temperature=0.0,
              extra_body={"return_token_ids": True})
    if not stream:
      c = client.completions.create(**kw).choices[0]
      return c.token_ids, c.text, c.finish_reason
    ids, text, reason = [], "", None
    for chunk in client.completions.create(stream=True, **kw):
      ids += chunk.choices[0].token_ids
      text += chunk.choices[0].text
      reason = chunk.choices[0].finish_reason or reason
    return ids, text, reason

  def other(i):
    stream = i % 2 == 0
    if i < 4:  # chat, sampled
      kw = dict(model="tiny", messages=[{"role": "user", "content": texts[i]}], max_tokens=8 + i,
                temperature=0.8, top_p=0.9, seed=i)
      if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
      text, reason = "", None
      for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
          text += chunk.choices[0].delta.content or ""
          reason = chunk.choices[0].finish_reason or reason
      return text, reason
    # completions with stop sequences (sampled and greedy)
    kw = dict(model="tiny", prompt=texts[i], max_tokens=12 + i, stop=["\n", "):"],
              temperature=0.7 if i % 2 else 0.0)
    if not stream:
      c = client.completions.create(**kw).choices[0]
      return c.text, c.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
      text += chunk.choices[0].text
      reason = chunk.choices[0].finish_reason or reason
    return text, reason

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    greedy = [pool.submit(completion_ids, i) for i in range(8)]
    others = [pool.submit(other, i) for i in range(8)]
    greedy = [f.result(timeout=REQUEST_TIMEOUT_S * 2) for f in greedy]
    others = [f.result(timeout=REQUEST_TIMEOUT_S * 2) for f in others]

  ref = maverick.generate(loaded.model, greedy_prompts, max_new_tokens=lengths,
                          stop_tokens=loaded.stop_tokens)
  stops = set(loaded.stop_tokens)
  for i, (ids, text, reason) in enumerate(greedy):
    assert ids == ref.tokens[i], (i, texts[i])
    assert text == tok.decode([t for t in ids if t not in stops])
    assert reason == ("stop" if ids[-1] in stops else "length")
    assert reason == "stop" or len(ids) == lengths[i]
  for i, (text, reason) in enumerate(others):
    assert reason in ("stop", "length"), (i, reason)
    if i >= 4:
      assert "\n" not in text and "):" not in text, (i, text)


def test_requests_are_admitted_while_others_generate(server, client):
  """A request sent while long ones stream gets its tokens before they finish: admitted into a
  free slot at the next step, not after the batch drains."""
  import threading
  events, long_streaming = {}, threading.Event()

  def stream(name, max_tokens, prompt):
    times = []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0.0, stream=True,
                                           extra_body={"return_token_ids": True,
                                                       "ignore_eos": True}):
      if chunk.choices and chunk.choices[0].token_ids:
        times.append(time.monotonic())
        if name.startswith("long"):
          long_streaming.set()
    events[name] = times

  long_prompt = [1] + [400 + i for i in range(10)]
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    longs = [pool.submit(stream, f"long{i}", MAX_SEQ_LEN - 12, long_prompt) for i in range(2)]
    # Sent on the longs' first streamed tokens, not after a fixed sleep: the longs' whole run takes
    # ~0.3 s on a 2-core CPU, so the old 0.3 s sleep raced them (it failed once in CI).
    assert long_streaming.wait(REQUEST_TIMEOUT_S), "the long requests never streamed a token"
    late = pool.submit(stream, "late", 3, [1, 500, 501])
    for f in longs + [late]:
      f.result(timeout=REQUEST_TIMEOUT_S)
  first_long_end = min(events["long0"][-1], events["long1"][-1])
  assert len(events["late"]) >= 1
  assert events["late"][0] > min(events["long0"][0], events["long1"][0])  # sent mid-generation
  assert events["late"][0] < first_long_end, "the late request waited for the batch to drain"


def test_disconnect_frees_the_slot(server, client):
  before = httpx.get(f"{server}/health").json()["released"]
  body = {"model": "tiny", "prompt": [1] + [600 + i for i in range(8)], "max_tokens": 50,
          "temperature": 0.0, "stream": True, "ignore_eos": True}
  with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    lines = r.iter_lines()
    got = [line for _, line in zip(range(3), lines) if line]
    assert got and got[0].startswith("data: ")
  deadline, h = time.monotonic() + 60, None
  while time.monotonic() < deadline:
    h = httpx.get(f"{server}/health").json()
    if h["active"] == 0 and h["released"] > before:
      break
    time.sleep(0.1)
  assert h["released"] == before + 1 and h["active"] == 0, h
  c = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
  assert c.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_n_prompt_lists_usage_and_metrics_with_the_engine(server, loaded):
  """Real engine handles: n x a prompt list, usage equal to the returned ids, /metrics moving by
  them, and stop-string output that ends where its text does."""
  from prometheus_client.parser import text_string_to_metric_families

  def scrape():
    text = httpx.get(f"{server}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}

  tok, stops = loaded.tokenizer, set(loaded.stop_tokens)
  before = scrape()
  prompts = ["def fibonacci(n):", [1, 500, 501, 502]]
  r = httpx.post(f"{server}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
      "model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 12, "temperature": 0.9,
      "seed": 3, "stop": [" ", "\n"], "return_token_ids": True})
  assert r.status_code == 200, r.text
  answer = r.json()
  assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
  prompt_tokens = len(tok.encode(prompts[0])) + len(prompts[1])
  completion = sum(len(c["token_ids"]) for c in answer["choices"])
  assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                             "total_tokens": prompt_tokens + completion}
  for c in answer["choices"]:
    text = tok.decode([t for t in c["token_ids"] if t not in stops])
    if c["finish_reason"] == "stop" and c["token_ids"][-1] not in stops:  # a stop string
      cut = min(i for i in (text.find(" "), text.find("\n")) if i >= 0)
      assert c["text"] == text[:cut], c
      shorter = tok.decode([t for t in c["token_ids"][:-1] if t not in stops])
      assert " " not in shorter and "\n" not in shorter, c  # its last token completes it
    else:
      assert c["text"] == text, c
  after = scrape()
  assert after["maverick_generation_tokens_total"] - before["maverick_generation_tokens_total"] \
      == completion
  assert after["maverick_prompt_tokens_total"] - before["maverick_prompt_tokens_total"] \
      == prompt_tokens
  assert after["maverick_time_to_first_token_seconds_count"] - \
      before["maverick_time_to_first_token_seconds_count"] == 4
  assert after["maverick_queue_length"] == 0 and after["maverick_slots"] == SLOTS


@pytest.mark.parametrize("body,status,words,param", [
    (b"{not json", 400, "not valid JSON", None),
    ({"model": "gpt-5", "prompt": "x"}, 404, "does not exist", "model"),
    ({"model": "tiny", "prompt": "x", "max_tokens": MAX_SEQ_LEN}, 400, "context", "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"model": "tiny", "messages": []}, 400, "messages", "messages"),
    ({"model": "tiny", "prompt": [10**9]}, 400, "vocabulary", "prompt"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "'n' must be in [1, 128], got 0", "n"),
    # A prompt that fills the context leaves no max_tokens to lower: the prompt is named.
    ({"model": "tiny", "prompt": [1] * MAX_SEQ_LEN, "max_tokens": 1}, 400,
     f"the prompt has {MAX_SEQ_LEN} tokens and this server's context of {MAX_SEQ_LEN} tokens must "
     f"hold the prompt and at least one new token: shorten the prompt to at most "
     f"{MAX_SEQ_LEN - 1} tokens", "prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "def f(x): return x\n" * 40}]},
     400, "shorten the prompt", "messages"),
    ({"model": "tiny", "prompt": "x", "return_token_ids": "false"}, 400,
     "'return_token_ids' must be true or false, got 'false'", "return_token_ids"),
    ({"model": "tiny", "prompt": "x", "stream": 1}, 400, "'stream' must be true or false",
     "stream"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0] has the role 'wizard'; the roles are 'system', 'user', 'assistant'",
     "messages"),
], ids=["json", "model", "context", "temperature", "top_p", "messages", "token", "n",
        "prompt_at_context", "chat_past_context", "bool_string", "bool_number", "role"])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, words, param):
  path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else \
      "/v1/completions"
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  r = httpx.post(f"{server}{path}", content=content, timeout=30,
                 headers={"content-type": "application/json"})
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert words in err["message"] and err["type"], err
  assert err["param"] == param, err
  ok = httpx.post(f"{server}/v1/completions", timeout=60,
                  json={"model": "tiny", "prompt": "x", "max_tokens": 1})
  assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_a_body_past_max_request_bytes_is_refused(server):
  """--max_request_bytes reaches the app: a body declared past it gets 413 at once (none of it
  is sent; test_serving_http.py has the chunked case)."""
  port = int(server.rsplit(":", 1)[1])
  status, body = http_exchange(port, http_head(content_length=10**9))
  assert status == 413 and body["error"]["code"] == "request_too_large", body
  assert f"limit of {MAX_REQUEST_BYTES} bytes" in body["error"]["message"]


@pytest.mark.parametrize("args,words", [
    (["--port=70000"], "--port 70000 is not a TCP port: pass 1..65535"),
    (["--port=-1"], "--port -1 is not a TCP port"),
    (["--host=192.0.2.1"], "cannot listen on 192.0.2.1:"),  # TEST-NET: no machine's address
    (["--port={busy}"], "cannot listen on 127.0.0.1:{busy}: Address already in use; another "
     "process listens there"),
    (["--max_request_bytes=0"], "--max_request_bytes must be >= 1"),
    (["--api_key= key"], "--api_key / MAVERICK_API_KEY must be non-empty, without surrounding "
     "spaces"),
    (["--allowed_local_media_path=/nonexistent/media"], "--allowed_local_media_path "
     "'/nonexistent/media' needs --vision and an existing directory"),
], ids=["port_too_big", "port_negative", "host", "port_in_use", "max_request_bytes", "api_key",
        "media_path"])
def test_bad_listen_flags_are_one_line_before_anything_loads(args, words):
  """Refused before the model loads or compiles (so in seconds): one line, exit status 1."""
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    args = [a.format(busy=port) for a in args]
    # Before the fix, --port=70000 served on 4464 and never exited: the timeout catches that.
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "serve.py"), *args], cwd=REPO,
                       env=single_device_env(), capture_output=True, text=True, timeout=60)
  lines = r.stderr.splitlines()
  assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
  assert lines[0].startswith("serve: error: ") and words.format(busy=port) in lines[0], lines


def test_ctrl_c_while_starting_is_one_line(tmp_path):
  """Ctrl-C as the compile starts: a traceback before, or Python exiting under the running XLA
  compile crashed (a segfault, or exit status 0 by luck). Now one line and status 130."""
  env = dict(single_device_env(), MAVERICK_CACHE_DIR=str(tmp_path))  # nothing cached: it compiles
  proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve.py"), "--port=0",
                           "--spec_k=0", "--slots=2", f"--max_seq_len={MAX_SEQ_LEN}"], cwd=REPO,
                          env=env, stderr=subprocess.PIPE, text=True)
  try:
    seen = ""
    while "compiling" not in seen:  # tqdm's bar: the compile thread has started
      char = proc.stderr.read(1)
      assert char, f"serve.py ended before compiling: {seen}"
      seen += char
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=180)[1]
  finally:
    proc.kill()
  lines = [l for l in (seen + rest).replace("\r", "\n").splitlines() if l.strip()]
  assert proc.returncode == 130, seen + rest
  assert lines[-1] == "serve: interrupted", lines
  assert not [l for l in lines if "Fatal" in l or "Traceback" in l], lines


@pytest.mark.slow
def test_greedy_completion_logprobs_with_the_engine(server, loaded):
  """logprobs=2 at temperature 0 (speculative, K=3): each generated token is its own top-1
  alternative, every logprob is <= 0, and with echo the prompt's tokens come first (the first
  without a logprob), aligned with token_ids."""
  tok = loaded.tokenizer
  prompt = "def fibonacci(n):"
  ids = tok.encode(prompt)
  r = httpx.post(f"{server}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
      "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True,
      "return_token_ids": True, "ignore_eos": True})
  assert r.status_code == 200, r.text
  c = r.json()["choices"][0]
  lp, gen = c["logprobs"], c["token_ids"]
  assert c["text"].startswith(prompt) and len(gen) == 8
  text = lambda t: tok.decode([t], skip_special_tokens=False)
  assert lp["tokens"] == [text(t) for t in ids + gen]
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  assert all(v <= 0 for v in lp["token_logprobs"][1:])
  for t, v, top in zip(gen, lp["token_logprobs"][len(ids):], lp["top_logprobs"][len(ids):]):
    assert len(top) == 2 and max(top, key=top.get) == text(t), (t, top)
    assert top[text(t)] == v and all(x <= 0 for x in top.values())
  # Plain decoding's (another program: no draft, batch 1): same tokens and top-2; values differ by
  # up to ~2e-2 here (the bf16 model's logits differ by program, docs/concepts/generation.md, Sampling).
  ref = maverick.generate(loaded.model, [ids], max_new_tokens=8, stop_tokens=[], logprobs=2)
  assert gen == ref.tokens[0]
  for top, (_, alts) in zip(lp["top_logprobs"][len(ids):], ref.logprobs[0]):
    assert top.keys() == {text(a) for a, _ in alts}, (top, alts)
    assert all(abs(top[text(a)] - x) < 5e-2 for a, x in alts), (top, alts)
