"""Image requests in the serving engine (maverick/serving/images.py) on the multimodal tiny fixture
tests/fixtures/hf_llama4_mm_tiny: greedy text equals Hugging Face's (outputs.npz) with plain
decoding, EAGLE-3 K=3 and a tree, contiguous and paged; the paged prefix cache never serves one
image's K/V to another; bad images are refused before they touch a slot."""

import os
import threading

import numpy as np
import pytest

import maverick
from maverick.checkpoint import store
from maverick.serving.engine import Engine, RequestError

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_llama4_mm_tiny")
WAIT_S = 300
NEW = 20


@pytest.fixture(scope="module")
def outputs():
  return dict(np.load(os.path.join(FIXTURE, "outputs.npz")))


@pytest.fixture(scope="module")
def model():
  return store.load_hf(FIXTURE, dtype="float32", vision=True)


def images_of(case, n):
  return [np.asarray(Image.open(os.path.join(FIXTURE, f"{case}_{k}.png")).convert("RGB"))
          for k in range(n)]


def run(engine, requests):
  """requests: [(prompt, submit kwargs)], all submitted at once; each one's tokens."""
  out = [[] for _ in requests]
  done = [threading.Event() for _ in requests]

  def callback(i):
    def on_event(event):
      out[i].extend(event.tokens)
      if event.done:
        done[i].set()
    return on_event

  for i, (prompt, kw) in enumerate(requests):
    engine.submit(prompt, callback(i), **kw)
  for i, d in enumerate(done):
    assert d.wait(WAIT_S), f"request {i} did not finish"
  assert engine.error is None, engine.error
  return out


def _engine(model, draft=None, **kw):
  # one prompt bucket and one step program: few compiles
  kw = dict(dict(slots=2, max_seq_len=64, rounds=4, min_bucket=64, batch_buckets=[],
                 stop_tokens=[]), **kw)
  return Engine(model, draft, **kw)


def _requests(outputs):
  return [(outputs["one_image.input_ids"].tolist(),
           dict(images=images_of("one_image", 1), max_tiles=4, max_tokens=NEW)),
          (outputs["two_images.input_ids"].tolist(),
           dict(images=images_of("two_images", 2), max_tiles=4, max_tokens=NEW))]


def _draft(model):
  from spec_decode import draft as draft_lib
  return draft_lib.init_draft(draft_lib.Eagle3Config.for_target(model.config), seed=1)


def test_engine_image_requests_equal_hf_greedy(model, outputs):
  """Two image requests side by side (the same tile count: one insert program) and a text one:
  each image request's tokens are HF's greedy ones."""
  engine = _engine(model, slots=4)
  engine.compile()
  engine.start()
  try:
    text = [5, 17, 42, 99, 7]
    got = run(engine, _requests(outputs) + [(text, dict(max_tokens=8))])
  finally:
    engine.shutdown()
  assert got[0] == outputs["one_image.greedy"].tolist()
  assert got[1] == outputs["two_images.greedy"].tolist()
  assert got[2] == maverick.generate(model, [text], max_new_tokens=8, stop_tokens=[]).tokens[0]
  # 2x2 tiles + the global one; 1x3 + global and 1x1: 5 tiles each, one program for both
  assert [k for k in engine._exes if isinstance(k, tuple) and k[0] == "insert-images"] == [("insert-images", 64, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,spec", [("contiguous", "k3"), ("paged", "tree")])
def test_speculative_engine_with_images_is_lossless(model, outputs, layout, spec):
  """EAGLE-3 (a random draft: low acceptance, the same text) over image prompts: the target's
  prefill reads the features; the draft reads the target's hidden states there. ~40 s each."""
  from spec_decode.tree import TreeShape
  kw = dict(k=3) if spec == "k3" else dict(tree=TreeShape(3, 2, 5))
  if layout == "paged":
    kw.update(kv_layout="paged", block_size=8)
  engine = _engine(model, _draft(model), **kw)
  engine.compile()
  engine.start()
  try:
    got = run(engine, _requests(outputs))
  finally:
    engine.shutdown()
  assert got == [outputs["one_image.greedy"].tolist(), outputs["two_images.greedy"].tolist()]


def test_prefix_cache_never_shares_one_images_blocks_with_another(model, outputs):
  """Same text, different images, one after the other with the prefix cache on: the second
  request must not reuse the first's blocks (its placeholders are the same tokens). Each equals
  maverick.generate on its own image; a text request after them still gets prefix hits."""
  ids = outputs["one_image.input_ids"].tolist()
  first = images_of("one_image", 1)
  other = [np.random.default_rng(3).integers(0, 256, (90, 70, 3), dtype=np.uint8)]
  engine = _engine(model, kv_layout="paged", block_size=8, prefix_cache=True)
  engine.compile()
  engine.start()
  want = maverick.generate(model, [ids], images=other, max_tiles=4, max_new_tokens=NEW,
                           stop_tokens=[]).tokens[0]
  try:
    a = run(engine, [(ids, dict(images=first, max_tiles=4, max_tokens=NEW))])[0]
    b = run(engine, [(ids, dict(images=other, max_tiles=4, max_tokens=NEW))])[0]
    assert a == outputs["one_image.greedy"].tolist()
    assert b == want and a != b
    assert engine.kv_stats()["prefix_hit_rate"] == 0.0
    text = [5, 17, 42, 99, 7] * 6
    for _ in range(2):
      run(engine, [(text, dict(max_tokens=4))])
    assert engine.kv_stats()["prefix_hit_rate"] > 0.0  # the cache itself is on
  finally:
    engine.shutdown()


@pytest.mark.parametrize("case", ["text_only", "corrupt", "count", "five_for_one", "context"])
def test_bad_image_requests_are_refused_before_a_slot(model, outputs, case):
  ids = outputs["one_image.input_ids"].tolist()
  image = np.full((20, 20, 3), 9, np.uint8)
  if case == "text_only":
    engine = _engine(store.load_hf(FIXTURE, dtype="float32"))
    args, words = (ids, dict(images=[image])), "no vision tower"
  else:
    engine = _engine(model)
    args, words = {
        "corrupt": ((ids, dict(images=[b"\x89PNG not really"])), "cannot decode image"),
        "count": ((ids, dict(images=[image], max_tiles=4)), "20 image tokens.*1 tiles x 4 = 4"),
        # one 5-tile layout, five 1-tile images: the same 20 image tokens
        "five_for_one": ((ids, dict(images=[image] * 5, max_tiles=4)),
                         r"hold 1 image layouts .* but 5 images were given"),
        "context": (([1] + [503] * 5000, dict(images=[image])),
                    "the prompt has 5001 tokens \\(5000 of them image tokens: send fewer"),
    }[case]
  with pytest.raises(RequestError, match=words) as e:
    engine.submit(args[0], lambda ev: None, **args[1])
  assert e.value.param in ("images", "prompt")
  assert engine._waiting.empty()


@pytest.mark.slow
def test_a_preempted_image_request_resumes_with_its_images(model, outputs):
  """A pool of 13 blocks of 8 holds both prompts and their first calls but not both outputs: the
  younger request is preempted and later re-prefilled (prompt + its tokens so far, with its
  images, from position 0); both still give HF's greedy tokens. ~20 s."""
  engine = _engine(model, kv_layout="paged", block_size=8, num_blocks=13, preemption=True,
                   rounds=1)
  engine.compile()
  engine.start()
  try:
    got = run(engine, _requests(outputs))
  finally:
    engine.shutdown()
  assert engine.preemptions > 0
  assert got == [outputs["one_image.greedy"].tolist(), outputs["two_images.greedy"].tolist()]
