"""pallas_kernels.decode_attention_paged: the sm90 and sm100 kernels reading K/V through a block
table (no gather) in GPU interpret mode, against a float64 NumPy reference over a contiguous
view gathered here with loops, and against the XLA path (reference.gather_pages + the XLA
reference). Tolerances: see test_kernel_decode_attention.py (same kernel math, same roundings).

Every case shuffles the table (rows' blocks are scattered over the pool, out of order), fills the
blocks no row owns with garbage, and puts NaN in pool block 0, which no row owns: NO_BLOCK
entries map to tile 0 inside the kernel, so a kernel that read a NO_BLOCK entry (or any block
outside the row's table) would return NaN (0 * NaN in P @ V)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelInputError, common
from pallas_kernels.decode_attention import decode_attention_paged, pallas_support_paged
from pallas_kernels.decode_attention import plan as plan_lib
from test_kernel_decode_attention import ATOL, FP8, RTOL, np_attention, np_visibility, random_tree


def make_paged(seed, B, T, H, K, Dh, bs, M, N, fp8=False, no_block=()):
  """Pools of N blocks, a table [B, M] of distinct shuffled blocks from 1..N-1 (block 0 and the
  spare blocks hold NaN / garbage) with NO_BLOCK (-1) at the (row, entry) pairs in no_block."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.bfloat16)
  kv_dtype = FP8 if fp8 else jnp.bfloat16
  amp = 2 if fp8 else 1
  pools = []
  for _ in range(2):
    x = rng.normal(size=(N, bs, K, Dh)) * amp
    x[0] = np.nan
    pools.append(x)
  ids = rng.permutation(np.arange(1, N))[:B * M].reshape(B, M)
  owned = set(ids.ravel().tolist())
  for blk in range(1, N):
    if blk not in owned:  # garbage a wrong block index would pick up
      for x in pools:
        x[blk] = 300.0 * (1 if blk % 2 else -1)
  for b, j in no_block:
    ids[b, j] = -1
  k_pool, v_pool = (jnp.asarray(x, kv_dtype) for x in pools)
  scales = {}
  if fp8:  # powers of two: exact products
    scales = {n: jnp.asarray(2.0 ** rng.integers(-3, 1, size=(N, bs, K)), jnp.float32)
              for n in ("k_scale", "v_scale")}
  return q, k_pool, v_pool, jnp.asarray(ids, jnp.int32), scales


def np_gather(pool, table):
  """[B, M * bs, ...] float64 with loops; NO_BLOCK slots are zeros (they must be invisible)."""
  pool = np.asarray(jnp.asarray(pool).astype(jnp.float32), np.float64)
  table = np.asarray(table)
  B, M = table.shape
  bs = pool.shape[1]
  out = np.zeros((B, M * bs) + pool.shape[2:])
  for b in range(B):
    for j in range(M):
      if table[b, j] >= 0:
        out[b, j * bs:(j + 1) * bs] = pool[table[b, j]]
  return out


def run_paged(q, k_pool, v_pool, table, q_pos, *, chunk=None, tree=None, num_splits=None,
              arch="sm90", **scales):
  S = table.shape[1] * k_pool.shape[1]
  k, v = np_gather(k_pool, table), np_gather(v_pool, table)
  sc = {n: np_gather(s, table) for n, s in scales.items()}
  ref = np_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                     jnp.asarray(v, jnp.float32), np_visibility(q_pos, S, chunk, tree), **sc)
  tree_kw = {}
  if tree is not None:
    tree_kw = dict(zip(("tree_start", "tree_positions", "tree_visible"),
                       (jnp.asarray(x) for x in tree)))
  pos = jnp.asarray(q_pos, jnp.int32)
  with common.interpret(arch=arch):
    out = decode_attention_paged(q, k_pool, v_pool, table, pos, chunk_size=chunk,
                                 num_splits=num_splits, implementation="pallas", **tree_kw,
                                 **scales)
    out = np.asarray(jax.block_until_ready(out).astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(out)), "the kernel read a block outside the row's table"
  np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
  xla = decode_attention_paged(q, k_pool, v_pool, table, pos, chunk_size=chunk,
                               implementation="xla", **tree_kw, **scales)
  xla = np.asarray(xla.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(xla, ref, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(out, xla, atol=ATOL, rtol=RTOL)
  return out


# (name, seed, B, T, H, K, Dh, bs, M, N, q positions, chunk, num_splits, fp8, NO_BLOCK entries)
CASES = [
    # block = 2 tiles; row 0's context spans 3 blocks (6 KV steps: the 4-slot ring refills),
    # row 1 ends inside its second tile of block 1; 2 splits
    ("bf16_bs128_ctx3blocks", 0, 2, 1, 4, 2, 64, 128, 3, 9, [[329], [150]], None, 2, False, ()),
    # block = tile; K+1 verify (T = 4, G = 5); row 1's table ends in NO_BLOCK past its length
    ("bf16_bs64_verify", 1, 2, 4, 5, 1, 64, 64, 4, 10, [[190, 191, 192, 193], [60, 61, 62, 63]],
     None, 1, False, ((1, 2), (1, 3))),
    # dynamic FP8 on a chunked layer (chunk 128 = a block): the blocks before each row's chunk
    # are released (NO_BLOCK) as blocks.BlockManager does; queries cross row 0's chunk boundary
    ("fp8_chunked_released", 2, 2, 2, 4, 2, 64, 128, 4, 10, [[383, 384], [260, 261]], 128, 2,
     True, ((0, 0), (0, 1), (1, 0))),
]
SM100_CASES = [c for c in CASES if c[0] == "fp8_chunked_released"]  # interpret mode is slow
KERNEL_CASES = ([pytest.param(c, "sm90", id=c[0]) for c in CASES]
                + [pytest.param(c, "sm100", id=f"sm100-{c[0]}") for c in SM100_CASES])


@pytest.mark.slow  # ~30 s, as the contiguous kernel's float64 cases
@pytest.mark.parametrize("case,arch", KERNEL_CASES)
def test_paged_kernel_matches_references(case, arch):
  _, seed, B, T, H, K, Dh, bs, M, N, q_pos, chunk, splits, fp8, no_block = case
  q, k_pool, v_pool, table, scales = make_paged(seed, B, T, H, K, Dh, bs, M, N, fp8, no_block)
  run_paged(q, k_pool, v_pool, table, np.array(q_pos), chunk=chunk, num_splits=splits, arch=arch,
            **scales)


@pytest.mark.slow  # ~8 s
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_paged_tree_verify(arch):
  """R = T = 5 tree nodes after a committed prefix, the tree crossing a block boundary (blocks
  of 64 slots); the table's entries past the tree are NO_BLOCK."""
  rng = np.random.default_rng(70)
  B, R, H, K, Dh, bs, M, N = 2, 5, 4, 1, 64, 64, 3, 8
  q, k_pool, v_pool, table, _ = make_paged(71, B, R, H, K, Dh, bs, M, N, no_block=((1, 2),))
  start = np.array([62, 30], np.int32)
  depths, vis = zip(*(random_tree(rng, R) for _ in range(B)))
  positions = np.stack(depths).astype(np.int32) + start[:, None]
  run_paged(q, k_pool, v_pool, table, positions, tree=(start, positions, np.stack(vis)),
            num_splits=2, arch=arch)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs the 8 host devices conftest sets")
def test_paged_two_consumer_warpgroups(monkeypatch):
  """The GPU configuration (2 consumer warpgroups taking alternate KV steps; see
  test_kernel_decode_attention.test_two_consumer_warpgroups): fp8, a tree, a chunk boundary,
  8 KV steps over 4 stages from 128-slot blocks, the released blocks NO_BLOCK."""
  from pallas_kernels.decode_attention import api
  monkeypatch.setattr(api, "INTERPRET_COMPUTE_WGS", 2)
  rng = np.random.default_rng(75)
  q, k_pool, v_pool, table, scales = make_paged(76, 1, 5, 4, 1, 64, 128, 8, 10, fp8=True,
                                                no_block=((0, 0), (0, 1), (0, 2), (0, 3)))
  depth, vis = random_tree(rng, 5)
  start = np.array([1000], np.int32)
  positions = (depth + 1000)[None].astype(np.int32)  # chunk 512..1023: 8 tiles
  run_paged(q, k_pool, v_pool, table, positions, chunk=512, tree=(start, positions, vis[None]),
            num_splits=1, **scales)


def test_split_tiles_resolve_blocks():
  """api._split_tiles against a loop: tile i of split j is the pool tile holding logical tile
  split_first + i, block table[b, t // per_block] * per_block + t % per_block."""
  from pallas_kernels.decode_attention import api
  table = np.array([[5, -1, 2], [0, 4, 3]], np.int32)
  bs, per_max = 128, 3
  split_first = np.array([[0, 3], [1, 4]], np.int32)
  got = np.asarray(api._split_tiles(jnp.asarray(table), bs, jnp.asarray(split_first), 6, per_max))
  assert got.shape == (2, 2, 1, 4)
  for b in range(2):
    for j in range(2):
      for i in range(4):
        t = min(split_first[b, j] + i, 5)
        blk = table[b, t // 2]
        assert got[b, j, 0, i] == (blk * 2 + t % 2 if blk >= 0 else 0), (b, j, i)


def test_long_context_takes_more_splits(monkeypatch):
  """A split's tile ids must fit its SMEM table: past MAX_SPLIT_TILES tiles the api raises the
  split count (here 1 requested, 3 taken for 5 tiles at a cap of 2)."""
  from pallas_kernels.decode_attention import api, sm90
  monkeypatch.setattr(plan_lib, "MAX_SPLIT_TILES", 2)
  seen = {}
  real = sm90.split_attention

  def spy(*a, **kw):
    seen.update(num_splits=kw["num_splits"], table=kw["tile_table"].shape)
    return real(*a, **kw)
  monkeypatch.setattr(sm90, "split_attention", spy)
  q, k_pool, v_pool, table, _ = make_paged(80, 1, 1, 2, 1, 64, 64, 5, 7)
  run_paged(q, k_pool, v_pool, table, np.array([[300]]), num_splits=1)
  assert seen == dict(num_splits=3, table=(1, 3, 1, 4))


def test_planner_paged():
  """The planner takes block sizes that are multiples of the 64-slot tile and counts the split's
  tile ids in SMEM."""
  for S, table_bytes in ((8192, 1024), (131072, 4096)):  # 128 ids (1 KiB aligned); 1024 ids
    for arch in ("sm90", "sm100"):
      ok = plan_lib.plan(4, 40, 8, 128, S, jnp.bfloat16, block_size=128, arch=arch)
      assert ok.supported, ok.why
      contiguous = plan_lib.plan(4, 40, 8, 128, S, jnp.bfloat16, arch=arch)
      assert ok.smem_bytes - contiguous.smem_bytes == table_bytes
      assert ok.config == contiguous.config  # the table costs no pipeline stage
  bad = plan_lib.plan(4, 40, 8, 128, 8192, jnp.bfloat16, block_size=32, arch="sm90")
  assert not bad.supported and "block size 32" in bad.why
  q = jax.ShapeDtypeStruct((8, 4, 40, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((100, 16, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((8, 512), jnp.int32)
  supported, why = pallas_support_paged(q, pool, table, arch="sm90")
  assert not supported and "block size 16" in why


def _bad_paged():
  q, k_pool, v_pool, table, _ = make_paged(90, 1, 1, 2, 1, 64, 64, 2, 4)
  pos = jnp.array([[10]], jnp.int32)
  k8 = k_pool.astype(FP8)
  return [
      ("block size 32", dict(q=q, k_pool=k_pool[:, :32], v_pool=v_pool[:, :32], block_table=table,
                             q_positions=pos)),
      ("block_table", dict(q=q, k_pool=k_pool, v_pool=v_pool, block_table=table[:, :, None],
                           q_positions=pos)),
      ("block_table", dict(q=q, k_pool=k_pool, v_pool=v_pool,
                           block_table=jnp.concatenate([table, table]), q_positions=pos)),
      ("v_pool", dict(q=q, k_pool=k_pool, v_pool=v_pool[:3], block_table=table, q_positions=pos)),
      ("k_scale", dict(q=q, k_pool=k8, v_pool=k8, block_table=table, q_positions=pos,
                       k_scale=jnp.ones((1, 128, 1), jnp.float32),
                       v_scale=jnp.ones((4, 64, 1), jnp.float32))),
  ]


@pytest.mark.parametrize("i", range(5))
def test_paged_bad_input_raises(i):
  what, kwargs = _bad_paged()[i]
  with common.interpret(), pytest.raises(KernelInputError, match=what):
    decode_attention_paged(**kwargs, implementation="pallas")


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_paged_lowers_at_maverick_shapes(arch, fp8):
  """EAGLE-3 verify (T = 4, G = 5) over 128-slot blocks, 64 entries per row (8192 slots), a pool
  of 600 blocks, chunked at 8192."""
  B, T, H, K, Dh, bs, M, N = 8, 4, 40, 8, 128, 128, 64, 600
  sd = jax.ShapeDtypeStruct
  kv = FP8 if fp8 else jnp.bfloat16
  args = [sd((B, T, H, Dh), jnp.bfloat16), sd((N, bs, K, Dh), kv), sd((N, bs, K, Dh), kv),
          sd((B, M), jnp.int32), sd((B, T), jnp.int32)] + [sd((N, bs, K), jnp.float32)] * (2 * fp8)

  def f(q, k, v, table, pos, *scales):
    kw = dict(zip(("k_scale", "v_scale"), scales))
    return decode_attention_paged(q, k, v, table, pos, chunk_size=8192, implementation="pallas",
                                  **kw)
  assert "mosaic_gpu" in common.lower_for_gpu(f, *args, arch=arch)
