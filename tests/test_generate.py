"""On-device generation: HF greedy tokens, batching, stopping, one executable, no host sync."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maverick import generation as gen
from maverick import model as model_lib


@contextlib.contextmanager
def count_compiles():
  """Counts XLA backend compilations (each compiled executable) inside the block."""
  events = []
  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_greedy_matches_hf_generate(fixture_model, hf_fixture):
  """20 KV-cache greedy tokens after the 53-token prompt, crossing the chunk boundary at 64."""
  out = gen.generate(fixture_model, [hf_fixture["inputs"][0]], max_new_tokens=20, stop_tokens=[])
  assert out.tokens[0] == hf_fixture["greedy"].tolist()


@pytest.mark.slow
def test_step_by_step_reference_loop_agrees(fixture_model, hf_fixture):
  """A plain host loop of full-recompute forwards (no cache) picks the same tokens."""
  seq = hf_fixture["inputs"][0].tolist()
  graphdef, state = nnx.split(fixture_model)
  for _ in range(6):
    logits = model_lib.apply(graphdef, state, jnp.asarray([seq]), logits_at=jnp.asarray([len(seq) - 1]))
    seq.append(int(np.argmax(np.asarray(logits.logits[0]))))
  out = gen.generate(fixture_model, [hf_fixture["inputs"][0]], max_new_tokens=6, stop_tokens=[])
  assert out.tokens[0] == seq[-6:] == hf_fixture["greedy"][:6].tolist()


@pytest.mark.slow
def test_batch_rows_of_different_lengths_match_single_rows(fixture_model, hf_fixture):
  rng = np.random.default_rng(0)
  prompts = [hf_fixture["inputs"][0].tolist(), rng.integers(0, 512, 9).tolist(),
             hf_fixture["inputs"][1][:30].tolist(), rng.integers(0, 512, 1).tolist()]
  batch = gen.generate(fixture_model, prompts, max_new_tokens=20, stop_tokens=[])
  assert batch.tokens[0] == hf_fixture["greedy"].tolist()
  for p, toks in zip(prompts[1:], batch.tokens[1:]):
    assert gen.generate(fixture_model, [p], max_new_tokens=20, stop_tokens=[]).tokens[0] == toks


@pytest.mark.slow
def test_per_row_stop_tokens_and_max_tokens(fixture_model, hf_fixture):
  greedy = hf_fixture["greedy"].tolist()  # 129 193 129 456 129 324 ...
  prompt = hf_fixture["inputs"][0].tolist()
  out = gen.generate(fixture_model, [prompt] * 3, max_new_tokens=[20, 20, 4],
                     stop_tokens=[[324], [456, 7], [324]])
  assert out.tokens[0] == greedy[:6]  # stops after the first 324, which is kept
  assert out.tokens[1] == greedy[:4]
  assert out.tokens[2] == greedy[:4]  # max tokens before its stop token
  np.testing.assert_array_equal(out.num_tokens, [6, 4, 4])


def test_sampling_is_seeded(fixture_model, hf_fixture):
  prompts = [hf_fixture["inputs"][0][:20].tolist(), hf_fixture["inputs"][1][:11].tolist()]
  kw = dict(max_new_tokens=12, temperature=1.0, top_k=40, top_p=0.95, stop_tokens=[])
  a = gen.generate(fixture_model, prompts, seed=3, **kw).tokens
  b = gen.generate(fixture_model, prompts, seed=3, **kw).tokens
  c = gen.generate(fixture_model, prompts, seed=4, **kw).tokens
  assert a == b and a != c
  assert all(len(r) == 12 for r in a)


def _device_call(model, prompts, **kw):
  req, steps, capacity = gen.prepare(model.config, prompts, **kw)
  graphdef, state = nnx.split(model)
  args = (graphdef, state, req)
  static = dict(steps=steps, capacity=capacity, pad_id=0)
  return args, static


def test_one_executable_and_no_recompile_within_bucket(fixture_model):
  rng = np.random.default_rng(1)
  # A bucket no other test uses, so its first call must compile.
  p1 = [rng.integers(0, 512, 70).tolist(), rng.integers(0, 512, 100).tolist()]
  p2 = [rng.integers(0, 512, 90).tolist(), rng.integers(0, 512, 128).tolist()]
  with count_compiles() as first:
    gen.generate(fixture_model, p1, max_new_tokens=3, stop_tokens=[])
  with count_compiles() as second:
    gen.generate(fixture_model, p2, max_new_tokens=5, temperature=0.5, top_p=0.9, seed=1,
                 stop_tokens=[7])
  assert len(first) == 1, "a generate call must be exactly one compiled executable"
  assert len(second) == 0, "same bucket, other lengths/sampling/stops must not recompile"


def test_compiled_program_has_loop_and_no_host_communication(fixture_model):
  args, static = _device_call(fixture_model, [[1, 2, 3]], max_new_tokens=4)
  hlo = gen.generate_jit.lower(*args, **static).compile().as_text()
  assert re.search(r"\bwhile\(", hlo) or " while(" in hlo or "while" in hlo.split("ENTRY")[1]
  forbidden = ["xla_ffi_python_cpu_callback", "xla_ffi_python_gpu_callback",
               "xla_python_cpu_callback", "xla_python_gpu_callback", " send(", " recv(",
               "send-done", "recv-done", " infeed(", " outfeed("]
  for f in forbidden:
    assert f not in hlo, f


def test_no_device_to_host_transfer_inside_call(fixture_model):
  args, static = _device_call(fixture_model, [[5, 6, 7, 8]], max_new_tokens=8)
  with jax.transfer_guard_device_to_host("disallow"):
    tokens, num, _ = gen.generate_jit(*args, **static)
    tokens.block_until_ready()
  assert int(num[0]) >= 1


@pytest.mark.parametrize("prompts,kw,match", [
    ([[]], {}, "prompt 0 is empty"),
    ([], {}, "no prompts"),
    ([[1, 2]], {"temperature": -1.0}, "temperature"),
    ([[1, 2]], {"top_p": 0.0}, "top_p"),
    ([[1, 2]], {"top_p": 1.5}, "top_p"),
    ([[1, 2]], {"top_k": -3}, "top_k"),
    ([[1, 600]], {}, "outside the vocabulary"),
    ([[1] * 40], {"max_cache_len": 32}, "prompt alone needs"),
    ([[1] * 20], {"max_cache_len": 32, "max_new_tokens": 20}, "raise max_cache_len"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([1, 2, 3], {}, "list of token-id lists"),
    # The fixture's context is 4096 positions.
    ([[1] * 4097], {}, "prompt 0 has 4097 tokens and the model's context of 4096 positions"),
    # At the context exactly is too long as well: the message says what fits.
    ([[1] * 4096], {}, r"prompt 0 has 4096 tokens and the model's context of 4096 positions "
     r"\(max_position_embeddings\) must hold the prompt and at least one new token: shorten it "
     r"to at most 4095 tokens"),
    ([[1, 2], [1] * 4000], {"max_new_tokens": 100},
     r"prompt 1 \(4000 tokens\) \+ max_new_tokens \(100\) = 4100, past the model's context of "
     r"4096 positions \(max_position_embeddings\): lower max_new_tokens \(--max_new_tokens\) to "
     r"at most 96"),
    ([[1, 2]], {"stop_tokens": [10**9]}, r"stop token ids \[1000000000\] are outside the vocabulary"),
    ([[1, 2]], {"stop_tokens": [-1]}, r"stop token ids \[-1\] are outside"),
    ([[1, 2]], {"stop_tokens": [2**31]}, r"stop token ids \[2147483648\] are outside"),
    ([[1, 2]], {"stop_tokens": [[5], [2.5]]}, "stop_tokens has 2 rows for 1 prompts"),
    ([[1, 2]], {"stop_tokens": [2.5]}, "stop token 2.5 is not an integer"),
])
def test_bad_input_is_rejected_clearly(fixture_model, prompts, kw, match):
  with pytest.raises(ValueError, match=match):
    gen.generate(fixture_model, prompts, **kw)


def test_executable_cache_is_bounded_lru():
  """Compiled programs are kept for reuse, but only the `maxsize` most recently used."""
  cache = gen.ExecutableCache(maxsize=2)
  lowered = {n: jax.jit(lambda x, n=n: x * n).lower(jnp.float32(1)) for n in (2, 3, 5)}
  exe2, t = cache.get_or_compile("two", lambda: lowered[2])
  assert t > 0 and float(exe2(jnp.float32(4))) == 8.0
  cache.get_or_compile("three", lambda: lowered[3])
  assert cache.get_or_compile("two", lambda: lowered[2]) == (exe2, 0.0)  # hit: now most recent
  cache.get_or_compile("five", lambda: lowered[5])  # evicts "three", the least recently used
  assert len(cache) == 2
  assert cache.get_or_compile("two", lambda: lowered[2])[1] == 0.0
  assert cache.get_or_compile("three", lambda: lowered[3])[1] > 0
