"""Dynamic FP8 KV (`kv_cache="fp8"`): a prefill into an FP8 cache attends to K/V as stored (e4m3
per token and kv head, the scales on scores and probabilities), exactly what later decode steps and
prefix hits read, so prefill-then-decode == a prefix hit (start= path) == one prefill of everything.
The Pallas prefill kernel path: tests/test_kernels_model.py::test_fp8_kv_prefill_kernel_reads_stored_kv."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from maverick import config as config_lib
from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick import quant

QC = quant.QuantConfig(weights=None, kv_cache="fp8")


def np_stored_kv(x):
  """float64 NumPy fake quantization of K or V [B, T, K, Dh] per token and kv head: scale =
  max(max|x|, 1/512) / 448 (f32), values e4m3fn(clip(x / scale, +-448)) times the scale."""
  x = np.asarray(x, np.float32)
  scale = (np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1 / 512)) / np.float32(448))
  q = np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
  return q.astype(np.float64) * scale.astype(np.float64)


def np_attention(q, k, v, chunk):
  """float64 causal GQA attention at positions 0..T-1, within aligned chunks when `chunk`."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, H, Dh = q.shape
  G = H // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # query head j reads kv head j // G
  s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(Dh)
  pos = np.arange(T)
  mask = pos[None, :] <= pos[:, None]
  if chunk is not None:
    mask &= (pos[None, :] // chunk) == (pos[:, None] // chunk)
  s = np.where(mask, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", p, v)


@pytest.fixture(scope="module")
def fp8_kv_model():
  """The tiny model (chunk 16), dense layers only: top-1 routing would turn an e4m3 rounding flip
  (f32 noise between two paths) into an expert jump and measure the router, not the cache."""
  cfg = config_lib.tiny("float32").replace(moe_layers=(), quant=QC)
  return model_lib.init_model(cfg, seed=3)


# Layer 0: chunked RoPE + QK norm; layer 3: global NoPE with temperature tuning. from_zero=True
# takes the block-by-block chunked path (T = 40 > chunk 16), False the masked one.
@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("from_zero", [True, False], ids=["blocks", "masked"])
def test_fp8_prefill_attention_equals_numpy_stored_kv(fp8_kv_model, layer, from_zero):
  model = fp8_kv_model
  attn = model.layers[layer].attn
  B, T = 2, 40
  x = jnp.asarray(np.random.default_rng(layer).standard_normal((B, T, 64)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cache = kvc.KVCache.init(model.config, B, 48)
  got, new_cache = attn(x, pos, cache.layer(layer), cache.lengths, attend_to_cache=False,
                        positions_from_zero=from_zero)
  assert len(new_cache) == 4 and new_cache[0].dtype == jnp.float8_e4m3fn
  q, k, v = attn.project(x, pos)
  o = np.asarray(attn.o[...], np.float64)  # [H, Dh, D], f32 weights
  out = lambda kk, vv: np.einsum("bthk,hkd->btd", np_attention(q, kk, vv, attn.chunk_size), o)
  want, raw = out(np_stored_kv(k), np_stored_kv(v)), out(k, v)
  tol = 1e-5 * np.abs(want).max()
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol)
  # The test can tell: attending to the raw K/V is far outside the tolerance.
  assert np.abs(raw - want).max() > 100 * tol


def test_fp8_prefill_then_decode_equals_prefix_hit_equals_one_prefill(fp8_kv_model):
  """36 tokens (chunks of 16): one prefill of all; prefill 20 (past the first chunk boundary)
  then 16 decode steps (through the next); prefill 20 then the other 16 in one forward attending
  to the cache (a prefix hit, generation.prefill's start= path). All three read the same e4m3
  K/V, so their logits agree to f32 noise (plus the odd e4m3 rounding flip it causes in a later
  layer's K/V: ~1e-4), while the unquantized forward (no cache: raw K/V) is far away."""
  model = fp8_kv_model
  B, T, P = 2, 36, 20
  toks = jnp.asarray(np.random.default_rng(7).integers(0, 512, (B, T)), jnp.int32)
  graphdef, state = nnx.split(model)
  empty = kvc.KVCache.init(model.config, B, T)
  full = np.asarray(model_lib.apply(graphdef, state, toks, cache=empty, prefill=True).logits)
  pre = model_lib.apply(graphdef, state, toks[:, :P], cache=empty, prefill=True)
  hit = model_lib.apply(graphdef, state, toks[:, P:], cache=pre.cache)
  cache, steps = pre.cache, []
  for t in range(P, T):
    out = model_lib.apply(graphdef, state, toks[:, t:t + 1], cache=cache)
    cache = out.cache
    steps.append(out.logits)
  assert cache.quantized and int(cache.lengths[0]) == T
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  decode, hit = np.asarray(jnp.concatenate(steps, 1)), np.asarray(hit.logits)
  assert rel(np.asarray(pre.logits), full[:, :P]) < 2e-3, rel(np.asarray(pre.logits), full[:, :P])
  assert rel(decode, full[:, P:]) < 2e-3, rel(decode, full[:, P:])
  assert rel(hit, full[:, P:]) < 2e-3, rel(hit, full[:, P:])
  # ... and the caches hold the same K/V (layer 0: same inputs on every path).
  full_cache = model_lib.apply(graphdef, state, toks, cache=empty, prefill=True).cache
  np.testing.assert_array_equal(np.asarray(cache.k[0]).view(np.uint8),
                                np.asarray(full_cache.k[0]).view(np.uint8))
  raw = np.asarray(model(toks).logits)
  assert rel(raw[:, P:], full[:, P:]) > 2e-2  # the K/V quantization is really on


@pytest.mark.parametrize("layer", [0, 3])
def test_bf16_fp8_prefill_attention_is_the_cache_reads_bit_for_bit(layer):
  """bf16: a prefill (attend_to_cache=False) and the same tokens attending to the cache they were
  just written to (a prefix hit at 0, what the paged engine's insert runs) compute the same thing
  when the cache holds exactly the T slots: bit for bit. Dequantizing K/V to bf16 before a
  prefill would round them (2^-9) and part the paged engine from the contiguous one at
  near-ties (tests/test_serving_paged.py::test_paged_engine_fp8_kv_equals_contiguous)."""
  cfg = config_lib.tiny("bfloat16").replace(moe_layers=(), quant=QC)
  attn = model_lib.init_model(cfg, seed=3).layers[layer].attn
  B, T = 2, 40
  x = jnp.asarray(np.random.default_rng(9).standard_normal((B, T, 64)), jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  cache = kvc.KVCache.init(cfg, B, T)
  pre, written = attn(x, pos, cache.layer(layer), cache.lengths, attend_to_cache=False)
  hit, _ = attn(x, pos, cache.layer(layer), cache.lengths)
  np.testing.assert_array_equal(np.asarray(pre, np.float32), np.asarray(hit, np.float32))
  assert written[0].dtype == jnp.float8_e4m3fn and pre.dtype == jnp.bfloat16
