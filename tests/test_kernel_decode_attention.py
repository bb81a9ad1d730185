"""pallas_kernels.decode_attention: the sm90 (wgmma) and sm100 (tcgen05/TMEM) split-K kernels in
GPU interpret mode (races detected) against a float64 NumPy reference written here, the XLA
reference against the model's `attention(cache_mask(...))`, lowering for sm_90 and sm_100 at
Maverick shapes, and bad input. The sm100 interpret cases are a subset (interpret mode is slow).

Tolerance (bf16 output): the kernel and the float64 reference see the same bf16 (or e4m3) inputs;
the kernel's roundings are the bf16 probabilities fed to the P@V MMA (relative 2**-9, as the
XLA reference does), the bf16 per-split partial outputs and the bf16 output (2**-9 relative each),
so |err| <= ~3 * 2**-9 * max|v| plus f32 accumulation noise: atol = rtol = 2e-2 for |v| of a few
units. FP8 scales are powers of two, so scale * e4m3 products are exact and the same tolerance
holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelInputError, common
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.decode_attention import bench

ATOL = RTOL = 2e-2
FP8 = jnp.float8_e4m3fn


def np_visibility(q_pos, S, chunk, tree=None):
  """[B, T, S] bool, written with loops over the tree block (independent of the jnp masks)."""
  q_pos = np.asarray(q_pos)
  B, T = q_pos.shape
  kv_pos = np.tile(np.arange(S), (B, 1))
  allowed = np.ones((B, T, S), bool)
  if tree is not None:
    start, positions, visible = (np.asarray(x) for x in tree)
    R = positions.shape[1]
    for b in range(B):
      allowed[b, :, start[b]:] = False
      for r in range(R):
        s = start[b] + r
        if s < S:
          kv_pos[b, s] = positions[b, r]
          allowed[b, :, s] = visible[b, :, r]
  q = q_pos[:, :, None]
  kv = kv_pos[:, None, :]
  mask = (kv <= q) & (kv >= 0) & allowed
  if chunk is not None:
    mask &= (kv // chunk) == (q // chunk)
  return mask


def np_attention(q, k, v, mask, k_scale=None, v_scale=None):
  q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  if k_scale is not None:
    k = k * np.asarray(k_scale, np.float64)[..., None]
    v = v * np.asarray(v_scale, np.float64)[..., None]
  B, T, H, Dh = q.shape
  K = k.shape[2]
  k = np.repeat(k, H // K, axis=2)
  v = np.repeat(v, H // K, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) * Dh ** -0.5
  m = mask[:, None]
  s = np.where(m, s, -np.inf)
  mx = np.max(s, axis=-1, keepdims=True)
  e = np.where(m, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
  den = e.sum(-1, keepdims=True)
  p = np.where(den > 0, e / np.where(den > 0, den, 1), 0)
  return np.einsum("bhts,bshd->bthd", p, v)


def make_inputs(seed, B, T, H, K, Dh, S, fp8=False):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.bfloat16)
  kv_dtype = FP8 if fp8 else jnp.bfloat16
  k = jnp.asarray(rng.normal(size=(B, S, K, Dh)) * (2 if fp8 else 1), kv_dtype)
  v = jnp.asarray(rng.normal(size=(B, S, K, Dh)) * (2 if fp8 else 1), kv_dtype)
  scales = {}
  if fp8:  # powers of two: exact products (see the module docstring)
    scales = {n: jnp.asarray(2.0 ** rng.integers(-3, 1, size=(B, S, K)), jnp.float32)
              for n in ("k_scale", "v_scale")}
  return q, k, v, scales


def random_tree(rng, R):
  """Parent array (node 0 is the root) -> depth per node and ancestor-or-self visibility."""
  parent = [-1] + [int(rng.integers(0, r)) for r in range(1, R)]
  depth = [0] * R
  vis = np.zeros((R, R), bool)
  for r in range(R):
    if r:
      depth[r] = depth[parent[r]] + 1
    a = r
    while a >= 0:
      vis[r, a] = True
      a = parent[a]
  return np.array(depth), vis


def run_case(q, k, v, q_pos, *, chunk=None, tree=None, num_splits=None, arch="sm90", **scales):
  """The `arch` kernel in interpret mode and the XLA reference against the float64 reference."""
  ref = np_attention(q, k, v, np_visibility(q_pos, k.shape[1], chunk, tree), **scales)
  tree_kw = {}
  if tree is not None:
    tree_kw = dict(zip(("tree_start", "tree_positions", "tree_visible"),
                       (jnp.asarray(x) for x in tree)))
  with common.interpret(arch=arch):
    out = decode_attention(q, k, v, jnp.asarray(q_pos, jnp.int32), chunk_size=chunk,
                           num_splits=num_splits, implementation="pallas", **tree_kw, **scales)
    out = np.asarray(jax.block_until_ready(out).astype(jnp.float32), np.float64)
  np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
  xla = decode_attention(q, k, v, jnp.asarray(q_pos, jnp.int32), chunk_size=chunk,
                         implementation="xla", **tree_kw, **scales)
  np.testing.assert_allclose(np.asarray(xla.astype(jnp.float32)), ref, atol=ATOL, rtol=RTOL)
  return out


# (name, seed, B, T, H, K, Dh, S, q positions, chunk, num_splits, fp8)
CASES = [
    # row 0 holds only the new token (length 1); row 1 straddles a block boundary and takes 6
    # KV steps in one split: more than the 4 pipeline stages, so slots are refilled
    ("t1_g1_len1_refill", 0, 2, 1, 2, 2, 64, 384, [[0], [329]], None, 1, False),
    # lengths 64 and 65: exactly one block, and one token into the next; three uneven splits
    ("t1_g4_blockedge_splits3", 1, 2, 1, 8, 2, 64, 192, [[63], [64]], None, 3, False),
    # EAGLE-3 verify: 4 consecutive queries, GQA 5 (20 packed rows). Row 1: a query at -1 sees no
    # slot (the model never makes one; it must return 0), then a cache holding only new tokens.
    ("t4_g5_splits2", 2, 2, 4, 5, 1, 64, 192, [[125, 126, 127, 128], [-1, 0, 1, 2]], None, 2,
     False),
    # chunk boundary at 64: queries 64, 65 see only slots 64.. (the new chunk)
    ("t4_g4_chunked", 3, 2, 4, 4, 1, 64, 128, [[62, 63, 64, 65], [126, 127, 128, 129]], 64, 2,
     False),
    ("t1_g1_fp8", 4, 2, 1, 2, 2, 64, 128, [[0], [100]], None, 1, True),
    # fp8 across a chunk boundary at 256, 5 KV steps in one split: the k/v scale slots refill
    ("t4_g4_fp8_chunked_refill", 5, 1, 4, 8, 2, 64, 320, [[254, 255, 256, 257]], 256, 1, True),
    # num_splits=None: auto (interpret mode emulates 2 SMs)
    ("t1_g5_dh128_autosplit", 6, 1, 1, 5, 1, 128, 128, [[77]], None, None, False),
]
# sm100 (interpret mode is slow: a subset). Its stage count at Dh=64 with one consumer is 4 (a
# power of two), so refilling needs 5+ KV steps in one split: row 1 takes 8.
SM100_CASES = [
    ("t1_g1_len1_refill8", 0, 2, 1, 2, 2, 64, 512, [[0], [459]], None, 1, False),
] + [c for c in CASES if c[0] in ("t4_g5_splits2", "t4_g4_fp8_chunked_refill")]
KERNEL_CASES = ([pytest.param(c, "sm90", id=c[0]) for c in CASES]
                + [pytest.param(c, "sm100", id=f"sm100-{c[0]}") for c in SM100_CASES])


@pytest.mark.slow
@pytest.mark.parametrize("case,arch", KERNEL_CASES)
def test_kernel_matches_float64(case, arch):
  _, seed, B, T, H, K, Dh, S, q_pos, chunk, splits, fp8 = case
  q, k, v, scales = make_inputs(seed, B, T, H, K, Dh, S, fp8)
  q_pos = np.array(q_pos)
  out = run_case(q, k, v, q_pos, chunk=chunk, num_splits=splits, arch=arch, **scales)
  assert np.all(out[q_pos < 0] == 0)


@pytest.mark.slow
@pytest.mark.parametrize("fp8,chunk,arch", [(False, None, "sm90"), (True, 64, "sm90"),
                                            (False, None, "sm100")],
                         ids=["bf16", "fp8_chunked", "sm100-bf16"])
def test_tree_verify(fp8, chunk, arch):
  """R = T = 5 tree nodes after a committed prefix; slots after the tree hold garbage that must
  stay invisible. fp8_chunked: row 0's tree crosses the chunk boundary at 64, so deep nodes lose
  the committed prefix and their shallow ancestors."""
  rng = np.random.default_rng(10 + fp8)
  B, R, H, K, Dh, S = 2, 5, 4, 1, 64, 128
  q, k, v, scales = make_inputs(20 + fp8, B, R, H, K, Dh, S, fp8)
  start = np.array([62, 30], np.int32)
  depths, vis = zip(*(random_tree(rng, R) for _ in range(B)))
  positions = np.stack(depths).astype(np.int32) + start[:, None]
  visible = np.stack(vis)
  run_case(q, k, v, positions, chunk=chunk, tree=(start, positions, visible), num_splits=2,
           arch=arch, **scales)


def test_tree_of_40_nodes():
  """R = 40 > 32: visibility crosses into the second bit word. The queries are the last 3 nodes
  (T < R, as when only leaves are scored); deep chains make their ancestors span both words."""
  rng = np.random.default_rng(12)
  B, T, R, H, K, Dh, S = 1, 3, 40, 2, 1, 64, 128
  q, k, v, _ = make_inputs(22, B, T, H, K, Dh, S)
  depth, vis = random_tree(rng, R)
  start = np.array([20], np.int32)
  node_positions = (depth + 20)[None].astype(np.int32)
  queries = np.arange(R - T, R)
  run_case(q, k, v, node_positions[:, queries], tree=(start, node_positions, vis[queries][None]),
           num_splits=1)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs the 8 host devices conftest sets")
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_two_consumer_warpgroups(monkeypatch, arch):
  """The GPU configuration: 2 consumer warpgroups taking alternate KV steps (fp8, tree, chunk,
  8 steps over 4 stages on sm90 and sm100, so slots are refilled; on sm100 each consumer has
  its own TMEM columns). Interpret mode defaults to 1 consumer: with 3 warpgroup threads blocked
  in callbacks a 1-device CPU client's pool can deadlock; with 8 host devices it has not (6/6
  runs)."""
  from pallas_kernels.decode_attention import api
  monkeypatch.setattr(api, "INTERPRET_COMPUTE_WGS", 2)
  rng = np.random.default_rng(60)
  q, k, v, scales = make_inputs(61, 1, 5, 4, 1, 64, 640, fp8=True)
  depth, vis = random_tree(rng, 5)
  start = np.array([500], np.int32)
  positions = (depth + 500)[None].astype(np.int32)
  run_case(q, k, v, positions, chunk=512, tree=(start, positions, vis[None]), num_splits=1,
           arch=arch, **scales)


def test_xla_reference_matches_model():
  """reference.py equals maverick.model.attention(cache_mask(...)) on rows that see something
  (pallas_kernels does not import maverick; the test does)."""
  from maverick import model
  rng = np.random.default_rng(40)
  B, T, H, K, Dh, S = 2, 5, 4, 2, 32, 96
  for fp8 in (False, True):
    q, k, v, scales = make_inputs(41, B, T, H, K, Dh, S, fp8)
    start = jnp.array([60, 10], jnp.int32)
    depths, vis = zip(*(random_tree(rng, T) for _ in range(B)))
    positions = jnp.asarray(np.stack(depths) + np.asarray(start)[:, None], jnp.int32)
    tree = model.TreeMask(start, positions, jnp.asarray(np.stack(vis)))
    for chunk in (None, 64):
      for tr in (None, tree):
        mask = model.cache_mask(positions, S, chunk, tr)
        want = model.attention(q, k, v, mask, scales.get("k_scale"), scales.get("v_scale"))
        kw = {} if tr is None else dict(tree_start=tr.start, tree_positions=tr.positions,
                                        tree_visible=tr.visible)
        got = decode_attention(q, k, v, positions, chunk_size=chunk, implementation="xla",
                               **kw, **scales)
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)),
                                   np.asarray(want.astype(jnp.float32)), atol=1e-2, rtol=1e-2)


def test_combine_kernel_matches_float64():
  """The split combine kernel alone: P split partials with their log2-sum-exps, some splits
  empty (-inf) and one row empty in every split (comes out 0), merged and laid out as
  [B, T, H, Dh] with packed row m = t * G + g of kv head k -> head k * G + g. float64 NumPy
  written here; bf16 partials and output (2**-9 relative each)."""
  from pallas_kernels import interpret
  from pallas_kernels.decode_attention import combine as combine_kernel
  rng = np.random.default_rng(7)
  P, B, K, T, G, Dh, Mpad = 6, 2, 2, 3, 5, 128, 64
  out = jnp.asarray(rng.standard_normal((P, B * K, Mpad, Dh)), jnp.bfloat16)
  lse = rng.standard_normal((P, B * K, Mpad)) * 4
  lse[2] = -np.inf  # an empty split
  lse[:, 1, 3] = -np.inf  # a row that sees nothing
  with interpret():
    got = combine_kernel.combine_rows(out, jnp.asarray(lse, jnp.float32), batch=B, steps=T,
                                      groups=G, out_dtype=jnp.bfloat16)
  o = np.asarray(out, np.float64)
  want = np.zeros((B, T, K * G, Dh))
  for b in range(B):
    for k in range(K):
      for t in range(T):
        for g in range(G):
          m, l = t * G + g, lse[:, b * K + k, t * G + g]
          if np.all(np.isinf(l)):
            continue
          w = np.exp2(l - l.max())
          want[b, t, k * G + g] = (w[:, None] * o[:, b * K + k, m]).sum(0) / w.sum()
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=ATOL, rtol=RTOL)
  assert np.all(np.asarray(got)[0, 0, G + 3] == 0)  # bk = 1: b = 0, k = 1; m = 3: t = 0, g = 3


@pytest.mark.parametrize("S,arch", [(8192, "sm90"), (131072, "sm90"), (8192, "sm100")])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_lowers_at_maverick_shapes(S, arch, fp8):
  """EAGLE-3 verify (T = 4, G = 5: 20 packed rows) at Maverick shapes, chunked at 8192."""
  B, T, H, K, Dh = 8, 4, 40, 8, 128
  sd = jax.ShapeDtypeStruct
  kv = FP8 if fp8 else jnp.bfloat16
  args = [sd((B, T, H, Dh), jnp.bfloat16), sd((B, S, K, Dh), kv), sd((B, S, K, Dh), kv),
          sd((B, T), jnp.int32)]
  if fp8:
    args += [sd((B, S, K), jnp.float32)] * 2

  def f(q, k, v, pos, *scales):
    kw = dict(zip(("k_scale", "v_scale"), scales))
    return decode_attention(q, k, v, pos, chunk_size=8192, implementation="pallas", **kw)
  text = common.lower_for_gpu(f, *args, arch=arch)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("Dh,kv,arch", [(128, jnp.bfloat16, "sm90"), (64, FP8, "sm90"),
                                        (128, FP8, "sm100"), (64, jnp.bfloat16, "sm100")],
                         ids=["dh128_bf16", "dh64_fp8", "sm100-dh128_fp8", "sm100-dh64_bf16"])
def test_lowers_tree_verify(Dh, kv, arch):
  """Tree verify (T = R = 49: 245 packed rows, 4 query tiles of 64 on sm90 / 2 of 128 on sm100;
  2 bit words), and the Dh=64 tiles (64-byte fp8 swizzle) the interpret tests use."""
  B, T, R, H, K, S = 8, 49, 49, 40, 8, 8192
  sd = jax.ShapeDtypeStruct
  fp8 = kv == FP8
  args = [sd((B, T, H, Dh), jnp.bfloat16), sd((B, S, K, Dh), kv), sd((B, S, K, Dh), kv),
          sd((B, T), jnp.int32), sd((B,), jnp.int32), sd((B, R), jnp.int32),
          sd((B, T, R), jnp.bool_)] + [sd((B, S, K), jnp.float32)] * (2 * fp8)

  def f(q, k, v, pos, start, positions, visible, *scales):
    return decode_attention(q, k, v, pos, chunk_size=8192, tree_start=start,
                            tree_positions=positions, tree_visible=visible,
                            implementation="pallas", **dict(zip(("k_scale", "v_scale"), scales)))
  assert "mosaic_gpu" in common.lower_for_gpu(f, *args, arch=arch)


def _bad_inputs():
  q, k, v, _ = make_inputs(50, 1, 1, 2, 1, 64, 64)
  pos = jnp.zeros((1, 1), jnp.int32)
  k8 = k.astype(FP8)
  scale = jnp.ones((1, 64, 1), jnp.float32)
  return [
      ("v_cache", dict(q=q, k_cache=k, v_cache=v.astype(jnp.float32), q_positions=pos)),
      ("v_cache", dict(q=q, k_cache=k8, v_cache=v, q_positions=pos, k_scale=scale,
                       v_scale=scale)),
      ("q:", dict(q=q.astype(jnp.float32), k_cache=k, v_cache=v, q_positions=pos)),
      ("k_scale", dict(q=q, k_cache=k8, v_cache=v.astype(FP8), q_positions=pos,
                       k_scale=scale[:, :, 0], v_scale=scale)),
      ("v_scale", dict(q=q, k_cache=k8, v_cache=v.astype(FP8), q_positions=pos, k_scale=scale)),
      ("q_positions", dict(q=q, k_cache=k, v_cache=v, q_positions=jnp.zeros((1,), jnp.int32))),
      ("tree_visible", dict(q=q, k_cache=k, v_cache=v, q_positions=pos,
                            tree_start=jnp.zeros((1,), jnp.int32),
                            tree_positions=jnp.zeros((1, 3), jnp.int32),
                            tree_visible=jnp.ones((1, 1, 2), bool))),
      ("head_dim", dict(q=q[..., :32], k_cache=k[..., :32], v_cache=v[..., :32],
                        q_positions=pos)),
  ]


@pytest.mark.parametrize("i", range(8))
def test_bad_input_raises(i):
  what, kwargs = _bad_inputs()[i]
  with common.interpret(), pytest.raises(KernelInputError, match=what):
    decode_attention(**kwargs, implementation="pallas")


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_auto_implementation_picks_kernel_in_interpret_mode(monkeypatch, arch):
  from pallas_kernels.decode_attention import api
  calls = []
  monkeypatch.setattr(api, "_pallas", lambda *a: calls.append(a) or a[0])
  q, k, v, _ = make_inputs(52, 1, 1, 2, 1, 64, 64)
  with common.interpret(arch=arch):
    decode_attention(q, k, v, jnp.array([[10]], jnp.int32))
  assert len(calls) == 1 and calls[0][-1][1] == arch  # mode = (interpreting, arch, wgs)


def test_unsupported_head_dim_falls_back_to_xla_on_auto():
  q, k, v, _ = make_inputs(51, 1, 1, 2, 1, 32, 64)
  with common.interpret():
    out = decode_attention(q, k, v, jnp.array([[10]], jnp.int32))  # would raise if it ran pallas
  assert out.shape == q.shape


def test_bench_toy_cases_match_reference():
  with common.interpret():
    for case in bench.benchmark_cases(toy=True):
      out = np.asarray(jax.block_until_ready(case.kernel(*case.args)).astype(jnp.float32))
      ref = np.asarray(case.reference(*case.args).astype(jnp.float32))
      err = np.abs(out - ref).max() / np.abs(ref).max()
      assert err <= case.max_rel_error, (case.name, err)
