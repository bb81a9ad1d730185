"""maverick.serving.Engine in process (no HTTP): batch buckets and a K=1 chain. Greedy outputs are
compared with maverick.generate / spec_decode.generate on the same prompts; every wait is bounded."""

import threading

import pytest

import maverick
import spec_decode
from maverick.serving import Engine

WAIT_S = 300


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


def _run(engine, prompts, max_tokens):
  """Submits every prompt at once; returns each request's tokens (all events joined)."""
  out = [[] for _ in prompts]
  done = [threading.Event() for _ in prompts]

  def callback(i):
    def on_event(event):
      out[i].extend(event.tokens)
      if event.done:
        done[i].set()
    return on_event

  for i, (p, n) in enumerate(zip(prompts, max_tokens)):
    engine.submit(p, callback(i), max_tokens=n)
  for i, d in enumerate(done):
    assert d.wait(WAIT_S), f"request {i} did not finish in {WAIT_S} s (engine error: {engine.error})"
  return out


def test_a_lone_request_runs_the_batch_one_step_and_more_grow_the_batch(loaded):
  tok = loaded.tokenizer
  engine = Engine(loaded.model, slots=4, max_seq_len=32, rounds=2, min_bucket=16,
                  stop_tokens=loaded.stop_tokens)
  assert engine.batch_buckets == [1, 2, 4]
  engine.start()
  try:
    prompts = [tok.encode(t) for t in ("def fibonacci(n):", "import os\n", "class Stack:")]
    lone = _run(engine, prompts[:1], [12])
    assert engine.steps_by_batch[1] > 0 and engine.steps_by_batch[2] == 0 == \
        engine.steps_by_batch[4], engine.steps_by_batch
    ref = maverick.generate(loaded.model, prompts[:1], max_new_tokens=12,
                            stop_tokens=loaded.stop_tokens)
    assert lone == ref.tokens
    # Three at once take slots 0-2: the batch-4 program, and the rows carried between programs
    # of different sizes (a request starts in one and finishes in another) keep their state.
    lengths = [10, 7, 14]
    many = _run(engine, prompts, lengths)
    assert engine.steps_by_batch[4] > 0, engine.steps_by_batch
    ref = maverick.generate(loaded.model, prompts, max_new_tokens=lengths,
                            stop_tokens=loaded.stop_tokens)
    assert many == ref.tokens
    assert engine.error is None and engine.active == 0
  finally:
    engine.shutdown()


def test_speculative_k1_chain(loaded):
  """K=1: the chain's parents [1] are the same for every slot, not a per-slot row."""
  tok = loaded.tokenizer
  draft = spec_decode.load_draft("tiny", loaded.model)
  engine = Engine(loaded.model, draft, k=1, slots=2, max_seq_len=32, rounds=2, min_bucket=16,
                  stop_tokens=loaded.stop_tokens)
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
