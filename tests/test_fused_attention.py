"""maverick.fused_attention: a layer's decode / verify attention on the kernel path in four
launches (q/k/v GEMM, qkv_finish, decode attention, combine), in GPU interpret mode, against the
same layer on the XLA path: its output, and the cache it leaves (the new entries to a bf16 or
e4m3 rounding, every other slot untouched); RoPE + QK-norm and NoPE + temperature layers; bf16,
FP8 per-token and FP8 static caches; contiguous and paged; bf16 and FP8 weights; on a TP2 mesh
(each device's heads and cache shard). Head_dim 128: qkv_finish's warpgroup takes a multiple of
128 (the aligned configs of test_kernels_model have 64 and keep the unfused path)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from maverick import fused_attention
from maverick import kernels as kernels_lib
from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick import quant
from maverick import sharding
from pallas_kernels import qkv_finish
from test_kernels_model import aligned_config
from test_sharded_kernels import reference_kernels  # noqa: F401 (fixture)


def fused_config(num_layers=4, **kw):
  """aligned_config with head_dim 128: layers 0-2 chunked RoPE + QK norm, layer 3 NoPE with
  temperature tuning; 4 query heads over 1 KV head (or `kw`)."""
  return aligned_config(num_layers).replace(head_dim=128, **kw)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def finish_calls(monkeypatch):
  calls = []
  real = qkv_finish.qkv_finish

  def spy(*args, **kw):
    calls.append(kw.get("implementation"))
    return real(*args, **kw)
  monkeypatch.setattr(qkv_finish, "qkv_finish", spy)
  return calls


CASES = {
    # layer, B, T, kv cache, FP8 weights, paged
    "rope_norm_bf16kv_verify": (0, 2, 3, None, False, False),
    "nope_temperature_fp8kv_fp8weights": (3, 2, 1, "fp8", True, False),
    "rope_fp8static_paged": (1, 2, 2, "fp8_static", False, True),
}


def _layer_inputs(name):
  layer, B, T, kv, fp8_weights, paged = CASES[name]
  cfg = fused_config(quant=quant.QuantConfig(weights=None, kv_cache=kv) if kv else None)
  model = model_lib.init_model(cfg, seed=0)
  if fp8_weights:
    model = quant.quantize_model(model, quant.QuantConfig(kv_cache=kv))
  attn = model.layers[layer].attn
  if kv == "fp8_static":  # calibrated-looking scales (max |k| / 448 of this random model)
    attn.k_cache_scale[...] = jnp.float32(0.02)
    attn.v_cache_scale[...] = jnp.float32(0.015)
  rng = np.random.default_rng(layer + 10 * B + T)
  fill = lambda xs: tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32).astype(x.dtype)
                          if x.dtype != jnp.float32 else
                          jnp.asarray(rng.uniform(0.01, 0.05, x.shape), jnp.float32)
                          for x in xs)
  lengths = jnp.asarray(rng.integers(20, 100, B), jnp.int32)
  if paged:  # rows own distinct blocks of a 12-block pool, in a random order
    M, bs = 4, 64
    cache = kvc.PagedKVCache.init(model.config, B, 12, M, bs)
    cache = cache.with_tables(rng.permutation(12)[:B * M].reshape(B, 1, M))
  else:
    cache = kvc.KVCache.init(model.config, B, 128)
  # random contents everywhere, so a write to the wrong slot shows
  cache = dataclasses.replace(cache, k=fill(cache.k), v=fill(cache.v),
                              **({} if cache.k_scale is None else
                                 dict(k_scale=fill(cache.k_scale), v_scale=fill(cache.v_scale))))
  cache = cache.with_lengths(lengths)
  x = jnp.asarray(rng.standard_normal((B, T, cfg.hidden_size)), jnp.bfloat16)
  positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)
  return model, attn, layer, cache, x, positions, paged


def _call(attn, layer, cache, x, positions, paged):
  kw = dict(block_table=cache.table(layer)) if paged else {}
  return attn(x, positions, cache.layer(layer), cache.lengths, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_the_xla_path(name, finish_calls):
  model, attn, layer, cache, x, positions, paged = _layer_inputs(name)
  kernels_lib.set_kernels(model, "xla")
  want, want_cache = _call(attn, layer, cache, x, positions, paged)
  assert not finish_calls
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    got, got_cache = _call(attn, layer, cache, x, positions, paged)
  assert finish_calls == ["pallas"], "the fused path did not run"
  # The decode kernel's bf16 per-split partials and the GEMM's K split vs XLA's einsum (measured
  # 0.36 %, 1.2 % with FP8 weights, 0.39 % on an EPYC); a wrong RoPE pair, slot, head or
  # temperature is 10 % or more.
  assert _rel(got, want) < 3e-2
  for new, ref, old in zip(got_cache, want_cache, cache.layer(layer)):
    new, ref, old = (np.asarray(a.astype(jnp.float32)) for a in (new, ref, old))
    changed = np.any(ref != old, axis=tuple(range(2, ref.ndim)))  # the slots XLA wrote
    np.testing.assert_array_equal(new[~changed], old[~changed])  # nothing else written
    # bf16 entries within a rounding of XLA's, e4m3 codes within a step (2^-3), scales alike
    np.testing.assert_allclose(new[changed], ref[changed], rtol=2.0 ** -3, atol=2.0 ** -6)


def test_head_dim_64_keeps_the_unfused_path(finish_calls):
  model = model_lib.init_model(aligned_config(1), seed=0)
  attn = model.layers[0].attn
  cache = kvc.KVCache.init(model.config, 1, 64).with_lengths(jnp.asarray([5], jnp.int32))
  x = jnp.ones((1, 1, 128), jnp.bfloat16)
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    _, new_cache = attn(x, jnp.asarray([[5]], jnp.int32), cache.layer(0), cache.lengths)
  assert not finish_calls
  assert float(jnp.abs(new_cache[0][0, 5].astype(jnp.float32)).sum()) > 0


@pytest.mark.slow
def test_tp2_decode_runs_qkv_finish_on_each_devices_heads(reference_kernels):
  """Sharded (TP2: 2 of 4 query heads and 1 of 2 KV heads a device): prefill + a decode step
  on the kernel path (kernel entry points on their XLA references, as test_sharded_kernels)
  against the sharded XLA path; qkv_finish got local shapes and the cache shard."""
  cfg = fused_config(2, num_attention_heads=4, num_key_value_heads=2)
  model = sharding.shard_model(model_lib.init_model(cfg, seed=0),
                               sharding.make_mesh(tensor=2, devices=jax.devices()[:2]), "tp")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)

  def run():
    graphdef, state = nnx.split(model)
    plan = sharding.plan_of(model)
    cache = sharding.constrain_cache(kvc.KVCache.init(model.config, 2, 64), plan)
    out = model_lib.apply(graphdef, state, tokens, cache=cache, prefill=True)
    step = model_lib.apply(graphdef, state, tokens[:, :1], cache=out.cache)
    return np.asarray(step.logits, np.float32), step.cache

  kernels_lib.set_kernels(model, "xla")
  want, want_cache = run()
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(model, "pallas")
    got, got_cache = run()
  shapes = {s for name, s, *_ in reference_kernels if name == "qkv_finish"}
  assert shapes, "qkv_finish did not run"
  # q partials [S, R, 2 heads * 128], k / v [S, R, 128], positions, starts, caches [2, 64, 1, 128]
  assert all(s[0][2] == 2 * 128 and s[1][2] == 128 and s[5] == (2, 64, 1, 128)
             for s in shapes), shapes
  assert _rel(got, want) < 3e-2 and np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
  for a, b in zip(jax.tree.leaves(got_cache.k), jax.tree.leaves(want_cache.k)):
    assert _rel(a, b) < 1e-2


def test_layer_of_reads_the_attention_layer():
  cfg = fused_config()
  model = model_lib.init_model(cfg, seed=0)
  rope, nope = (fused_attention.layer_of(model.layers[i].attn) for i in (0, 3))
  assert rope.inv_freq is not None and rope.qk_norm and rope.temperature is None
  assert nope.inv_freq is None and not nope.qk_norm
  assert nope.temperature == (cfg.floor_scale, cfg.attn_scale)


@pytest.mark.slow
def test_speculative_greedy_equals_plain_greedy_on_the_fused_path(finish_calls):
  """Target and EAGLE-3 draft (head_dim 128: both take the fused layer) in GPU interpret mode:
  the speculative loop's verify (T = K + 1) and the plain loop's steps (T = 1) write the cache
  and attend through qkv_finish, and greedy speculative output is plain greedy output."""
  import maverick
  import spec_decode
  from spec_decode import draft as draft_lib
  cfg = fused_config(2)
  model = model_lib.init_model(cfg, seed=0)
  draft = draft_lib.init_draft(draft_lib.Eagle3Config.for_target(cfg), seed=1)
  prompt = [list(np.random.default_rng(5).integers(0, 512, 10))]
  with pallas_kernels.interpret(detect_races=False):
    for m in (model, draft):
      kernels_lib.set_kernels(m, "pallas")
    plain = maverick.generate(model, prompt, max_new_tokens=6)
    spec = spec_decode.generate(model, draft, prompt, k=3, max_new_tokens=6)
  assert "pallas" in finish_calls
  assert spec.tokens == plain.tokens, (spec.tokens, plain.tokens)
