"""maverick.serving.Engine in process (no HTTP): batch buckets and a K=1 chain. Greedy outputs are
compared with maverick.generate / spec_decode.generate on the same prompts; every wait is bounded."""

import threading
import time

import pytest

import maverick
import spec_decode
from maverick.serving import Engine

WAIT_S = 300
HOST_TRAFFIC = ("xla_ffi_python_cpu_callback", "xla_python_cpu_callback", " send(", " recv(",
                " infeed(", " outfeed(")


def _assert_on_device(engine):
  """Every step program is one while loop with nothing going back to the host inside it."""
  for n in engine.batch_buckets:
    hlo = engine._exes["step", n].as_text()
    assert "while" in hlo.split("ENTRY")[1], n
    for f in HOST_TRAFFIC:
      assert f not in hlo, (n, f)


def _record_order(engine):
  """Logs ("dispatch", t) when step t is called and ("process", t) when its results are read."""
  log = []
  for key, exe in list(engine._exes.items()):
    if isinstance(key, tuple) and key[0] == "step":
      def step(*args, exe=exe):
        out = exe(*args)
        log.append(("dispatch", len([e for e in log if e[0] == "dispatch"]) + 1))
        out[1]["_step"] = log[-1][1]  # rides along in the report
        return out
      engine._exes[key] = step
  process = engine._process

  def recorded(report, owners):
    log.append(("process", report.pop("_step")))
    return process(report, owners)
  engine._process = recorded
  return log


def _wait_idle(engine, timeout_s=60):
  """Waits (bounded) until no request runs or waits for KV blocks, then for the last step's
  results to be read."""
  deadline = time.monotonic() + timeout_s
  while (engine.active or engine._head is not None) and time.monotonic() < deadline:
    time.sleep(0.05)
  time.sleep(0.5)


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


def _run(engine, prompts, max_tokens, options=None, events=None):
  """Submits every prompt at once; returns each request's tokens (all events joined).
  options: per request, more submit arguments; events: a list that collects each one's events."""
  out = [[] for _ in prompts]
  done = [threading.Event() for _ in prompts]

  def callback(i):
    def on_event(event):
      out[i].extend(event.tokens)
      if events is not None:
        events[i].append(event)
      if event.done:
        done[i].set()
    return on_event

  for i, (p, n) in enumerate(zip(prompts, max_tokens)):
    engine.submit(p, callback(i), max_tokens=n, **(options[i] if options else {}))
  for i, d in enumerate(done):
    assert d.wait(WAIT_S), f"request {i} did not finish in {WAIT_S} s"
  assert engine.error is None, engine.error  # a failed engine ends every request with an error
  return out


@pytest.mark.parametrize("kw,words,param", [
    (dict(prompt=[]), "the prompt is empty", "prompt"),
    (dict(prompt=[1, 10**6]), "outside the vocabulary", "prompt"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1", "max_tokens"),
    (dict(max_tokens=30), "the prompt (3 tokens) + max_tokens (30) = 33 tokens does not fit this "
     "server's context of 32 tokens; lower max_tokens to at most 29", "max_tokens"),
    # A prompt at the context leaves no room for any max_tokens: the prompt is named, not them.
    (dict(prompt=[1] * 32, max_tokens=1), "the prompt has 32 tokens and this server's context of "
     "32 tokens must hold the prompt and at least one new token: shorten the prompt to at most 31 "
     "tokens", "prompt"),
    (dict(prompt=[1] * 100), "the prompt has 100 tokens", "prompt"),
    (dict(temperature=-0.5), "temperature", "temperature"),
    (dict(top_p=1.5), "top_p", "top_p"),
    (dict(seed=-1), "seed must be an integer", "seed"),
    (dict(stop_tokens=list(range(20))), "at most 8 stop token ids", None),
    (dict(presence_penalty=3.0), "presence_penalty must be a number in [-2, 2]",
     "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be", "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in (0, 10]", "repetition_penalty"),
    (dict(min_p=1.5), "min_p must be in [0, 1]", "min_p"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0", "min_tokens"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias token id 1000000 is outside the vocabulary",
     "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids", "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias values must be in [-100, 100]", "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias has 301 entries, at most 300",
     "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a map of token id to bias", "logit_bias"),
], ids=["empty", "vocab", "max_tokens", "context", "prompt_at_context", "prompt_past_context",
        "temperature", "top_p", "seed", "stops", "presence", "frequency", "repetition", "min_p",
        "min_tokens", "bias_id", "bias_key", "bias_value", "bias_size", "bias_type"])
def test_bad_requests_are_refused_before_they_touch_a_slot(loaded, kw, words, param):
  """Checked in submit, on the caller's thread: nothing is queued or compiled, no slot taken. The
  error names the field at fault (the server's "param")."""
  engine = Engine(loaded.model, slots=2, max_seq_len=32, stop_tokens=loaded.stop_tokens)
  args = {"prompt": [1, 2, 3], "max_tokens": 4, **kw}
  with pytest.raises(ValueError) as e:
    engine.submit(args.pop("prompt"), lambda event: None, **args)
  assert words in str(e.value)
  assert getattr(e.value, "param", None) == param
  assert engine._waiting.empty() and engine.active == 0 and not engine._exes


@pytest.mark.slow
def test_a_lone_request_runs_the_batch_one_step_and_more_grow_the_batch(loaded):
  tok = loaded.tokenizer
  engine = Engine(loaded.model, slots=4, max_seq_len=32, rounds=2, min_bucket=16,
                  stop_tokens=loaded.stop_tokens)
  assert engine.batch_buckets == [1, 2, 4]
  engine.compile()
  _assert_on_device(engine)
  order = _record_order(engine)
  engine.start()
  try:
    prompts = [tok.encode(t) for t in ("def fibonacci(n):", "import os\n", "class Stack:")]
    lone = _run(engine, prompts[:1], [12])
    assert engine.steps_by_batch[1] > 0 and engine.steps_by_batch[2] == 0 == \
        engine.steps_by_batch[4], engine.steps_by_batch
    ref = maverick.generate(loaded.model, prompts[:1], max_new_tokens=12,
                            stop_tokens=loaded.stop_tokens)
    assert lone == ref.tokens
    # The host reads step t's tokens only after step t+1 is queued: the device never waits for it.
    processed = [t for what, t in order if what == "process"]
    assert len(processed) >= 3, order
    for t in processed[:-1]:
      assert order.index(("dispatch", t + 1)) < order.index(("process", t)), order
    # Three at once take slots 0-2: the batch-4 program, and the rows carried between programs
    # of different sizes (a request starts in one and finishes in another) keep their state.
    lengths = [10, 7, 14]
    many = _run(engine, prompts, lengths)
    assert engine.steps_by_batch[4] > 0, engine.steps_by_batch
    ref = maverick.generate(loaded.model, prompts, max_new_tokens=lengths,
                            stop_tokens=loaded.stop_tokens)
    assert many == ref.tokens
    assert engine.error is None and engine.active == 0
    # A device call that fails ends the running and the waiting requests with an error event
    # (none hangs), and the engine refuses new ones with the reason.
    # The failing step waits until both requests are in (the first running, the second waiting):
    # without that, the first could fail the engine before the second is submitted.
    both_submitted = threading.Event()

    def broken(*args):
      both_submitted.wait(WAIT_S)
      raise RuntimeError("device lost")
    for n in engine.batch_buckets:
      engine._exes["step", n] = broken
    events = []
    finished = threading.Event()

    def on_event(event):
      events.append(event)
      if len(events) == 2:
        finished.set()
    for p in prompts[:2]:
      engine.submit(p, on_event, max_tokens=4)
    both_submitted.set()
    assert finished.wait(WAIT_S)
    assert [e.finish_reason for e in events] == ["error", "error"]
    assert "device lost" in repr(engine.error)
    with pytest.raises(RuntimeError, match="device lost"):
      engine.submit(prompts[0], on_event)
  finally:
    engine.shutdown()


@pytest.mark.slow
def test_speculative_k1_chain(loaded):
  """K=1: the chain's parents [1] are the same for every slot, not a per-slot row."""
  tok = loaded.tokenizer
  draft = spec_decode.load_draft("tiny", loaded.model)
  engine = Engine(loaded.model, draft, k=1, slots=2, max_seq_len=32, rounds=2, min_bucket=16,
                  stop_tokens=loaded.stop_tokens)
  engine.compile()
  _assert_on_device(engine)
  engine.start()
  try:
    prompts = [tok.encode(t) for t in ("def add(a, b):", "for i in range(10):")]
    got = _run(engine, prompts, [9, 13])
    ref = spec_decode.generate(loaded.model, draft, prompts, k=1, max_new_tokens=[9, 13],
                               stop_tokens=loaded.stop_tokens)
    assert got == ref.tokens
    assert engine.spec_rounds > 0 and engine.error is None
  finally:
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", [("ep", dict(expert=4, tensor=2))])
def test_sharded_speculative_engine(loaded, layout, mesh_kw):
  """A model and draft sharded on a mesh of 8 serve unchanged (slot rows over the batch axes where
  a bucket divides them, replicated where not): greedy tokens equal single-device plain decoding."""
  from maverick import sharding
  tok = loaded.tokenizer
  mesh = sharding.make_mesh(**mesh_kw)
  sharded = maverick.load("tiny", mesh=mesh, layout=layout)
  draft = sharding.shard_model(spec_decode.load_draft("tiny", sharded.model), mesh, layout)
  engine = Engine(sharded.model, draft, k=3, slots=4, max_seq_len=32, rounds=2, min_bucket=16,
                  batch_buckets=[1], stop_tokens=loaded.stop_tokens)
  engine.start()
  try:
    prompts = [tok.encode(t) for t in ("def add(a, b):", "import os\n", "class Stack:")]
    lone = _run(engine, prompts[:1], [8])
    many = _run(engine, prompts, [11, 6, 9])
    assert sorted(engine.steps_by_batch) == [1, 4]
    assert engine.steps_by_batch[1] > 0 and engine.steps_by_batch[4] > 0, engine.steps_by_batch
  finally:
    engine.shutdown()
  assert engine.error is None
  ref = maverick.generate(loaded.model, prompts, max_new_tokens=[11, 6, 9],
                          stop_tokens=loaded.stop_tokens)
  assert many == ref.tokens
  ref = maverick.generate(loaded.model, prompts[:1], max_new_tokens=8,
                          stop_tokens=loaded.stop_tokens)
  assert lone == ref.tokens
