"""Logprobs in the OpenAI server's answers (maverick/serving/logprobs.py), in process with
test_serving_http's stub engine: its values come from stub_entry (a formula of the token id) and
token texts from the tokenizer, so every expected value is built without the server's formatting
code. The real engine's are checked in test_serving.py."""

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from test_serving_http import (CODE, _joined, _post, _prefix_with, _stream,  # noqa: E402
                               app_server, stub_logprob)

assert app_server  # imported for pytest: a module-scoped server of this module's own

FLOOR = -9999.0  # JSON has no -inf: vLLM's value for a filtered-out alternative


def _tstr(tok, t):
  return tok.decode([t], skip_special_tokens=False)


def _want_completion(tok, ids, top, prompt_len=0):
  """The completions logprobs object of ids (the first prompt_len of them echoed prompt tokens,
  the first of which has no logprob)."""
  out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  offset = 0
  for n, t in enumerate(ids):
    out["tokens"].append(_tstr(tok, t))
    out["text_offset"].append(offset)
    offset += len(_tstr(tok, t))
    if n == 0 and prompt_len:
      out["token_logprobs"].append(None)
      out["top_logprobs"].append(None)
      continue
    out["token_logprobs"].append(stub_logprob(t))
    alts = {_tstr(tok, t + 1 + j): [-0.125, -0.25][j] if j < 2 else FLOOR for j in range(top)}
    out["top_logprobs"].append(dict(alts, **{_tstr(tok, t): stub_logprob(t)}))
  return out


def _joined_logprobs(chunks):
  """Per choice index: the completions logprobs of every chunk, concatenated."""
  out = {}
  for chunk in chunks:
    for c in chunk["choices"]:
      if c["logprobs"] is not None:
        got = out.setdefault(c["index"], {k: [] for k in c["logprobs"]})
        for k, v in c["logprobs"].items():
          got[k] += v
  return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_end_at_the_stop_string(app_server, stream):
  """Top 3 (the third is -inf: written as -9999.0); only the returned tokens have logprobs, so the
  tokens past the stop string in the same engine event have none."""
  tok = app_server.tok.tok
  ids = tok.encode(CODE)
  k = _prefix_with(tok, ids, "return")
  body = {"prompt": CODE, "max_tokens": len(ids), "stop": "return", "logprobs": 3,
          "return_token_ids": True}
  if stream:
    chunks = _stream(app_server, body)
    got = _joined_logprobs(chunks)[0]
    assert all(c["choices"][0]["logprobs"] is None or c["choices"][0]["token_ids"]
               for c in chunks)  # each chunk's logprobs are those of its tokens
    assert _joined(chunks)[0][1] == ids[:k]
  else:
    c = _post(app_server, body).json()["choices"][0]
    got = c["logprobs"]
    assert c["token_ids"] == ids[:k]
  assert app_server.engine.calls[-1]["logprobs"] == 3
  assert got == _want_completion(tok, ids[:k], 3)
  assert len(got["tokens"]) == k and FLOOR in got["top_logprobs"][0].values()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_with_n(app_server, stream):
  tok = app_server.tok.tok
  msgs = [{"role": "user", "content": "hi there"}]
  prompt = tok.apply_chat_template(msgs)
  body = {"messages": msgs, "n": 2, "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
          "return_token_ids": True}
  path = "/v1/chat/completions"
  if stream:
    got = {}
    for chunk in _stream(app_server, body, path):
      c = chunk["choices"][0]
      if c["logprobs"] is not None:
        assert len(c["logprobs"]["content"]) == len(c["token_ids"]) > 0
        got.setdefault(c["index"], []).extend(c["logprobs"]["content"])
  else:
    got = {c["index"]: c["logprobs"]["content"]
           for c in _post(app_server, body, path).json()["choices"]}
  item = lambda t, lp: {"token": _tstr(tok, t), "logprob": lp,
                        "bytes": list(_tstr(tok, t).encode("utf-8", "replace"))}
  want = [dict(item(t, stub_logprob(t)), top_logprobs=[item(t + 1, -0.125), item(t + 2, -0.25)])
          for t in (prompt * 5)[:5]]
  assert got == {0: want, 1: want}


def test_chat_without_logprobs_has_null_logprobs(app_server):
  c = _post(app_server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/v1/chat/completions").json()["choices"][0]
  assert c["logprobs"] is None and app_server.engine.calls[-1]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_puts_the_prompt_and_its_logprobs_first(app_server, stream):
  tok = app_server.tok.tok
  prompt = "x = 1\ny = 2\n"
  ids = tok.encode(prompt)
  body = {"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 1, "n": 2}
  if stream:
    chunks = _stream(app_server, body)
    got = {i: (text, lp) for (i, (text, _, _)), lp in zip(sorted(_joined(chunks).items()),
                                                           _joined_logprobs(chunks).values())}
  else:
    got = {c["index"]: (c["text"], c["logprobs"])
           for c in _post(app_server, body).json()["choices"]}
  assert app_server.engine.calls[-1]["prompt_logprobs"] is True
  assert tok.decode(ids) == prompt  # the echoed text: the prompt, BOS not shown
  want = (prompt + tok.decode(ids[:4]), _want_completion(tok, ids + ids[:4], 1, len(ids)))
  assert got == {0: want, 1: want}


def test_echo_without_logprobs_is_the_text_only(app_server):
  tok = app_server.tok.tok
  c = _post(app_server, {"prompt": "a = 3", "max_tokens": 3, "echo": True}).json()["choices"][0]
  assert c["text"] == "a = 3" + tok.decode(tok.encode("a = 3")[:3]) and c["logprobs"] is None
  assert app_server.engine.calls[-1]["prompt_logprobs"] is False


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_prompt_logprobs_vllms_shape(app_server, chat):
  """vLLM's extension: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}
  of the N best and the token itself (rank null: outside the N best); completions per choice,
  chat on the response. The engine's one top-N is the larger of logprobs and prompt_logprobs."""
  tok = app_server.tok.tok
  msgs = [{"role": "user", "content": "x = 1"}]
  ids = tok.apply_chat_template(msgs) if chat else tok.encode("x = 1")
  body = dict({"messages": msgs} if chat else {"prompt": "x = 1"}, max_tokens=2, prompt_logprobs=2)
  answer = _post(app_server, body, "/v1/chat/completions" if chat else "/v1/completions").json()
  got = answer["prompt_logprobs"] if chat else answer["choices"][0]["prompt_logprobs"]
  entry = lambda t, lp, rank: {"logprob": lp, "rank": rank, "decoded_token": _tstr(tok, t)}
  want = [None] + [{str(t + 1): entry(t + 1, -0.125, 1), str(t + 2): entry(t + 2, -0.25, 2),
                    str(t): entry(t, stub_logprob(t), None)} for t in ids[1:]]
  assert got == want
  assert answer["choices"][0]["logprobs"] is None  # not asked for the generated tokens
  assert app_server.engine.calls[-1]["logprobs"] == 2


def test_prompt_logprobs_with_stream_is_refused(app_server):
  r = _post(app_server, {"prompt": "x", "prompt_logprobs": 1, "stream": True})
  assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_return_tokens_as_token_ids(app_server):
  tok = app_server.tok.tok
  ids = tok.encode("x = 1")
  c = _post(app_server, {"prompt": "x = 1", "max_tokens": 2, "logprobs": 1,
                         "return_tokens_as_token_ids": True}).json()["choices"][0]
  assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids[:2]]
  assert c["logprobs"]["top_logprobs"][0] == {f"token_id:{ids[0] + 1}": -0.125,
                                              f"token_id:{ids[0]}": stub_logprob(ids[0])}
