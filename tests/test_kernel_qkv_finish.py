"""pallas_kernels.qkv_finish: the q / k / v GEMM output finished in one launch (split-K sum,
RoPE, QK norm, temperature, the cache append, the query packed for the decode kernel), in GPU
interpret mode, against a float64 NumPy layer written here, against the op's XLA reference, and
the reference against maverick.model's own functions."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels
from maverick import model as model_lib
from pallas_kernels import KernelInputError
from pallas_kernels import qkv_finish as qf

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
DH = 128
INV_FREQ = tuple(float(f) for f in (1.0 / (np.float32(500000.0) ** (
    np.arange(0, DH, 2, dtype=np.float32) / DH))).astype(np.float32))


def _bf16(x):
  return np.asarray(x, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def _np_layer(parts, rows, heads, positions, layer, is_query):
  """float64 NumPy: [B, T, heads, Dh] as the model makes them, bf16 between its ops."""
  B, T = positions.shape
  x = _bf16(np.asarray(parts, np.float64).sum(0)[:rows]).reshape(B, T, heads, DH)
  pos = np.asarray(positions, np.float64)[:, :, None, None]
  if layer.inv_freq is not None:
    ang = pos * np.asarray(layer.inv_freq, np.float32).astype(np.float64)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    x = _bf16(np.stack([x0 * np.cos(ang) - x1 * np.sin(ang),
                        x0 * np.sin(ang) + x1 * np.cos(ang)], -1).reshape(x.shape))
  if layer.qk_norm:
    x = _bf16(x / np.sqrt((x * x).mean(-1, keepdims=True) + layer.eps))
  if is_query and layer.temperature is not None:
    fs, a = layer.temperature
    x = _bf16(x * (np.log1p(np.floor((pos + 1) / fs)) * a + 1))
  return x


def _case(name):
  """(B, T, H, K, splits, layer, cache kind, paged)."""
  rope_norm = qf.Layer(INV_FREQ, True, 1e-5, None)
  nope = qf.Layer(None, False, 1e-5, (4.0, 0.1))
  return {
      "rope_norm_bf16_split3": (2, 2, 4, 2, 3, rope_norm, "bf16", False),
      "nope_temperature_fp8_dynamic": (2, 4, 2, 1, 2, nope, "dynamic", False),
      "rope_fp8_static_paged_finished": (3, 1, 2, 2, 1, qf.Layer(INV_FREQ), "static", True),
      "rope_norm_fp8_dynamic_paged_full_tile": (4, 2, 4, 1, 2, rope_norm, "dynamic", True),
      # one TP8 rank of Maverick at batch-1 decode: 5 query heads over 1 KV head, 8 K-splits
      "tp8_shard_decode": (1, 1, 5, 1, 8, rope_norm, "bf16", False),
  }[name]


CASES = ["rope_norm_bf16_split3", "nope_temperature_fp8_dynamic",
         "rope_fp8_static_paged_finished", "rope_norm_fp8_dynamic_paged_full_tile",
         "tp8_shard_decode"]


def _inputs(name, seed=0):
  B, T, H, K, S, layer, kind, paged = _case(name)
  rng = np.random.default_rng(seed)
  R = 8  # the GEMM's row tile; the full-tile case fills it (its last row is a token)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  parts = [f(S, R, n * DH) for n in (H, K, K)]
  if S == 1:  # a finished product: bf16
    parts = [p.astype(BF16) for p in parts]
  starts = rng.integers(0, 20, B).astype(np.int32)
  positions = (starts[:, None] + np.arange(T)).astype(np.int32)
  cdt = BF16 if kind == "bf16" else FP8
  if paged:
    bs, M = 8, 4  # rows own distinct blocks of a 16-block pool, in a random order
    table = rng.permutation(16)[:B * M].reshape(B, M).astype(np.int32)
    starts = rng.integers(0, M * bs - T + 1, B).astype(np.int32)
    positions = (starts[:, None] + np.arange(T)).astype(np.int32)
    shape = (16, bs, K, DH)
  else:
    table, shape = None, (B, 32, K, DH)
  caches = [f(*shape).astype(cdt), f(*shape).astype(cdt)]
  if kind == "dynamic":
    caches += [np.abs(f(*shape[:3])) + 0.1, np.abs(f(*shape[:3])) + 0.1]
  statics = (np.float32(0.02), np.float32(0.03)) if kind == "static" else None
  return dict(parts=parts, positions=positions, starts=starts, caches=caches, table=table,
              statics=statics, B=B, T=T, H=H, K=K, layer=layer, kind=kind)


def _run(inp, implementation):
  j = lambda x: None if x is None else jnp.asarray(x)
  return qf.qkv_finish(
      *map(j, inp["parts"]), j(inp["positions"]), j(inp["starts"]),
      tuple(map(j, inp["caches"])), num_heads=inp["H"], num_kv_heads=inp["K"],
      layer=inp["layer"], mpad=64, block_table=j(inp["table"]),
      static_scales=inp["statics"], implementation=implementation)


def _slots(inp):
  """(cache index tuples of the new entries [B, T], a mask of every other slot)."""
  B, T = inp["positions"].shape
  slots = inp["starts"][:, None] + np.arange(T)
  shape = inp["caches"][0].shape
  if inp["table"] is None:
    idx = (np.repeat(np.arange(B)[:, None], T, 1), slots)
  else:
    idx = (np.take_along_axis(inp["table"], slots // shape[1], 1), slots % shape[1])
  others = np.ones(shape[:2], bool)
  others[idx] = False
  return idx, others


def _check(inp, q, caches):
  B, T, H, K, layer, kind = (inp[k] for k in ("B", "T", "H", "K", "layer", "kind"))
  G, rows = H // K, B * T
  want_q = _np_layer(inp["parts"][0], rows, H, inp["positions"], layer, True)
  want_k = _np_layer(inp["parts"][1], rows, K, inp["positions"], layer, False)
  want_v = _np_layer(inp["parts"][2], rows, K, inp["positions"], qf.Layer(None), False)
  got = np.asarray(q, np.float64).reshape(B, K, 64, DH)
  packed = got[:, :, :T * G].reshape(B, K, T, G, DH).transpose(0, 2, 1, 3, 4).reshape(
      B, T, H, DH)
  np.testing.assert_allclose(packed, want_q, rtol=2.0 ** -6, atol=1e-6)  # <= 2 bf16 roundings
  assert not got[:, :, T * G:].any(), "packed query rows past T * G must be zero"
  idx, others = _slots(inp)
  for i, (new, old, want) in enumerate(zip(caches[:2], inp["caches"][:2], (want_k, want_v))):
    new, old = np.asarray(new.astype(jnp.float32)), old.astype(np.float32)
    np.testing.assert_array_equal(new[others], old[others])  # nothing else written
    entries = new[idx].astype(np.float64)  # [B, T, K, Dh]
    if kind == "bf16":
      np.testing.assert_allclose(entries, want, rtol=2.0 ** -6, atol=1e-6)
      continue
    if kind == "dynamic":
      scales = np.asarray(caches[2 + i])
      np.testing.assert_array_equal(scales[others], inp["caches"][2 + i][others])
      s = scales[idx].astype(np.float64)[..., None]
      np.testing.assert_allclose(s[..., 0], np.abs(want).max(-1) / 448, rtol=2.0 ** -7)
    else:
      s = float(inp["statics"][i])
    # e4m3 codes keep 3 mantissa bits: within half a step (2^-4 relative) of value / scale, or
    # of its subnormal step (2^-9) near zero.
    np.testing.assert_allclose(entries, np.clip(want / s, -448, 448), rtol=2.0 ** -4,
                               atol=2.0 ** -9)


@pytest.mark.parametrize("name", CASES)
def test_matches_float64_in_interpret_mode(name):
  inp = _inputs(name)
  with pallas_kernels.interpret():
    q, caches = _run(inp, "pallas")
  _check(inp, q, caches)
  # and the op's XLA reference: the same values to a bf16 rounding (XLA:CPU may contract the
  # rotation's multiply-adds apart), the same e4m3 codes or one step apart
  want_q, want_caches = _run(inp, "xla")
  np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(want_q, np.float32),
                             rtol=2.0 ** -7, atol=1e-6)
  for a, b in zip(caches, want_caches):
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)),
                               np.asarray(b.astype(jnp.float32)), rtol=2.0 ** -3, atol=1e-6)


@pytest.mark.parametrize("name", CASES[:2])
def test_xla_reference_matches_float64(name):
  inp = _inputs(name, seed=1)
  _check(inp, *_run(inp, "xla"))


def test_reference_is_the_models_project_math():
  """The reference's RoPE / QK norm / temperature on bf16 values are maverick.model's
  apply_rope, rms_norm and temperature_scale, bit for bit."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 3, 4, DH)), jnp.bfloat16)
  pos = jnp.asarray([[0, 1, 2], [7000, 7001, 9000]], jnp.int32)
  from pallas_kernels.qkv_finish import reference
  inv = jnp.asarray(INV_FREQ, jnp.float32)
  model_q = model_lib.rms_norm(model_lib.apply_rope(x, pos, inv), None, 1e-5)
  ours = reference.finish_qk(x.astype(jnp.float32), pos, qf.Layer(INV_FREQ, True, 1e-5), False)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(model_q, np.float32))
  scale = model_lib.temperature_scale(pos, 8192.0, 0.1)
  model_t = (x.astype(jnp.float32) * scale[:, :, None, None]).astype(jnp.bfloat16)
  ours = reference.finish_qk(x.astype(jnp.float32), pos, qf.Layer(None, False, 1e-5,
                                                                   (8192.0, 0.1)), True)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(model_t, np.float32))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("kind", ["bf16", "dynamic_paged"])
def test_lowers_at_the_maverick_tp8_shape(arch, kind):
  """One TP8 rank of Maverick at decode: 5 query heads, 1 KV head, 8 K-split partials of a
  64-row tile, an 8k cache (paged: 64-slot blocks, FP8 with per-token scales)."""
  paged = kind != "bf16"
  cdt = jnp.float8_e4m3fn if paged else jnp.bfloat16
  shape = (128, 64, 1, DH) if paged else (1, 8192, 1, DH)
  sd = jax.ShapeDtypeStruct
  caches = (sd(shape, cdt), sd(shape, cdt)) + ((sd(shape[:3], jnp.float32),) * 2 if paged else ())

  def fn(qp, kp, vp, pos, starts, caches, table):
    return qf.qkv_finish(qp, kp, vp, pos, starts, caches, num_heads=5, num_kv_heads=1,
                         layer=qf.Layer(INV_FREQ, True), mpad=64, block_table=table,
                         implementation="pallas")

  text = pallas_kernels.lower_for_gpu(
      fn, sd((8, 64, 5 * DH), jnp.float32), sd((8, 64, DH), jnp.float32),
      sd((8, 64, DH), jnp.float32), sd((1, 1), jnp.int32), sd((1,), jnp.int32), caches,
      sd((1, 128), jnp.int32) if paged else None, arch=arch)
  assert text.count("mosaic_gpu_v2(") == 1


def test_support_and_bad_input():
  sd = jax.ShapeDtypeStruct
  caches = (sd((1, 16, 1, DH), jnp.bfloat16),) * 2
  kw = dict(num_heads=2, num_kv_heads=1, layer=qf.Layer(INV_FREQ), mpad=64)
  assert qf.pallas_support(sd((1, 8, 2 * DH), jnp.float32), caches, sd((1, 1), jnp.int32),
                           **kw) == (True, "")
  assert not qf.pallas_support(sd((1, 8, 2 * 64), jnp.float32), caches, sd((1, 1), jnp.int32),
                               **kw)[0]
  assert not qf.pallas_support(sd((1, 8, 2 * DH), jnp.float32), caches, sd((1, 1), jnp.int32),
                               **{**kw, "layer": qf.Layer(None, False, 1e-5, (2.5, 0.1))})[0]
  ones = lambda *s, dt=jnp.float32: jnp.ones(s, dt)
  pos, starts = ones(1, 1, dt=jnp.int32), ones(1, dt=jnp.int32)
  bf = (ones(1, 16, 1, DH, dt=jnp.bfloat16),) * 2
  with pytest.raises(KernelInputError, match=r"do not hold 2 query and 1 KV heads"):
    qf.qkv_finish(ones(1, 8, 3 * DH), ones(1, 8, DH), ones(1, 8, DH), pos, starts, bf, **kw)
  fp8 = (ones(1, 16, 1, DH, dt=jnp.float8_e4m3fn),) * 2
  with pytest.raises(KernelInputError, match=r"pass static_scales"):
    qf.qkv_finish(ones(1, 8, 2 * DH), ones(1, 8, DH), ones(1, 8, DH), pos, starts, fp8, **kw)
  with pytest.raises(KernelInputError, match=r"mpad=1 < T \* G = 2"):
    qf.qkv_finish(ones(1, 8, 2 * DH), ones(1, 8, DH), ones(1, 8, DH), pos, starts, bf,
                  **{**kw, "mpad": 1})


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_writes_follow_the_kv_cache_rules(implementation):
  """The cache writes are maverick.kv_cache's: a paged slot with no block (NO_BLOCK) or past the
  table is dropped (an idle row must not write into a block another row holds), a contiguous
  row's start is clamped to S - T (dynamic_update_slice's rule). Checked against kv_cache.write /
  write_paged of the same entries (read back from a roomy contiguous cache)."""
  from maverick import kv_cache as kvc
  rng = np.random.default_rng(9)
  B, T, S, bs, M = 3, 2, 32, 8, 2
  f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
  parts = (f(2, 8, 2 * DH), f(2, 8, DH), f(2, 8, DH))
  kw = dict(num_heads=2, num_kv_heads=1, layer=qf.Layer(INV_FREQ), mpad=64)
  run = lambda starts, caches, table=None: _interpreted(implementation, lambda: qf.qkv_finish(
      *parts, jnp.asarray(starts)[:, None] + jnp.arange(T), jnp.asarray(starts, jnp.int32),
      caches, block_table=table, implementation=implementation, **kw))
  roomy = tuple(jnp.zeros((B, 64, 1, DH), jnp.bfloat16) for _ in range(2))
  starts = np.array([7, 15, 30], np.int32)  # row 2: past a paged table of 16 slots
  _, wide = run(starts, roomy)
  new = [w[jnp.arange(B)[:, None], jnp.asarray(starts)[:, None] + jnp.arange(T)] for w in wide]
  # paged: row 0's second block is NO_BLOCK (its slot 8 dropped, slot 7 kept), row 2 past the table
  table = jnp.asarray([[3, kvc.NO_BLOCK], [5, 1], [0, 2]], jnp.int32)
  pools = tuple(f(6, bs, 1, DH).astype(jnp.bfloat16) for _ in range(2))
  _, got = run(starts, pools, table)
  for g, p, n in zip(got, pools, new):
    want = kvc.write_paged(p, n, jnp.asarray(starts), table)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))
  # contiguous: row 2 starts at S - 2 + ... clamped (30 + 2 > 32 would not; 31 does)
  starts = np.array([0, 5, 31], np.int32)
  _, wide = run(starts, roomy)
  new = [w[jnp.arange(B)[:, None], jnp.asarray(starts)[:, None] + jnp.arange(T)] for w in wide]
  caches = tuple(f(B, S, 1, DH).astype(jnp.bfloat16) for _ in range(2))
  _, got = run(starts, caches)
  for g, c, n in zip(got, caches, new):
    want = kvc.write(c, n, jnp.asarray(starts))
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


def _interpreted(implementation, fn):
  if implementation == "xla":
    return fn()
  with pallas_kernels.interpret():
    return fn()


def test_decode_attention_takes_the_packed_queries():
  """decode_attention(q_packed=) on qkv_finish's output equals the call on q itself (the XLA
  path unpacks it; interpret mode runs the kernel on it), and a wrongly shaped pack is refused
  with the shape it needs."""
  from pallas_kernels import decode_attention as decode
  rng = np.random.default_rng(11)
  B, T, H, K, S = 2, 2, 4, 1, 128
  q = jnp.asarray(rng.standard_normal((B, T, H, DH)), jnp.bfloat16)
  kc, vc = (jnp.asarray(rng.standard_normal((B, S, K, DH)), jnp.bfloat16) for _ in range(2))
  pos = jnp.asarray([[40, 41], [90, 91]], jnp.int32)
  mpad = decode.packed_rows(T, H, K)
  from pallas_kernels.qkv_finish import reference
  packed = reference.pack_queries(q, K, mpad)
  shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  for impl in ("xla", "pallas"):
    with pallas_kernels.interpret():
      want = decode.decode_attention(q, kc, vc, pos, implementation=impl)
      got = decode.decode_attention(shape, kc, vc, pos, implementation=impl, q_packed=packed)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  with pytest.raises(KernelInputError, match=r"q_packed: got shape \(2, 8, 128\).*expected "
                                             r"bfloat16 \[B\*K=2, 64, 128\]"):
    decode.decode_attention(shape, kc, vc, pos, q_packed=packed[:, :8])
