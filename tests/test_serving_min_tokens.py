"""min_tokens through the OpenAI server over the real engine (embedded model; its draft at K=3 and
as a tree), streamed and not: stop strings are held back by vLLM's rule (one counts only if it
ends after the text of the first min_tokens tokens, and may start inside it), stop_token_ids are
masked on device for the first min_tokens tokens, also at the accepted drafts of a speculative
round, and usage counts the returned tokens. Expected outputs come from a plain greedy
maverick.generate run without stop strings (cut by hand) and, where a mask changes the tokens,
from test_sampling_options' host loop of full forwards with NumPy masking. The stub-engine
versions, fast, are in test_serving_http.py."""

import json

import pytest

httpx = pytest.importorskip("httpx")

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import maverick  # noqa: E402
import spec_decode  # noqa: E402
from maverick.serving import Engine  # noqa: E402
from test_sampling_options import _host_greedy  # noqa: E402
from test_serving_seeds import _serving  # noqa: E402

WAIT_S = 300
PROMPT = "import os\n"
MAX_TOKENS = 12
# The embedded model's greedy continuation of PROMPT: "import sys\n" over and over.
PIECES = ["import", " sys", "\n"] * 4


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


@pytest.fixture(scope="module")
def reference(loaded):
  """The plain greedy tokens of PROMPT, no stop strings (the end-of-sequence id never comes)."""
  ids = loaded.tokenizer.encode(PROMPT)
  ref = maverick.generate(loaded.model, [ids], max_new_tokens=MAX_TOKENS,
                          stop_tokens=loaded.stop_tokens).tokens[0]
  assert [loaded.tokenizer.decode([t]) for t in ref] == PIECES
  return ids, ref


def _cases(loaded, ids, ref):
  """(request fields, expected text, expected token ids, finish reason)."""
  newline = ref[2]
  masked = _host_greedy(loaded.model, ids, MAX_TOKENS, [newline] + loaded.stop_tokens,
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


def _complete(base, body, stream):
  """(text, token ids, finish reason, usage) of a completion, streamed or not."""
  if not stream:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["token_ids"], c["finish_reason"], r.json()["usage"]
  text, ids, reason, usage = "", [], None, None
  body = dict(body, stream=True, stream_options={"include_usage": True})
  with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=WAIT_S) as r:
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
  ids, ref = reference
  draft = None if shape == "plain" else spec_decode.load_draft("tiny", loaded.model)
  extra = {"plain": {}, "k3": dict(k=3), "tree": dict(tree=spec_decode.TreeShape(3, 2, 5))}
  engine = Engine(loaded.model, draft, slots=1, max_seq_len=32, rounds=2, min_bucket=16,
                  batch_buckets=[], stop_tokens=loaded.stop_tokens, **extra[shape])
  cases = _cases(loaded, ids, ref)
  got, want = [], []
  with _serving(engine, loaded.tokenizer) as (base, _):
    for fields, text, tokens, reason in cases:
      body = dict(fields, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                  return_token_ids=True)
      usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
               "total_tokens": len(ids) + len(tokens)}
      for stream in (False, True):
        got.append((fields, stream, _complete(base, body, stream)))
        want.append((fields, stream, (text, tokens, reason, usage)))
  assert got == want
  if shape != "plain":
    assert engine.spec_accepted > engine.spec_rounds  # drafts were accepted
