"""The device-side tile schedule of the grouped GEMM (plain jnp, computed before the kernel).

Rows are cut into aligned blocks of `tile_m` rows. A "tile" is one (group, block) pair whose rows
overlap: a block that straddles a group boundary is visited once per group, and each visit stores
only its own group's rows. Rows past sum(group_sizes) form one extra pseudo-group (-1) whose tiles
store zeros, so every output row is written exactly once and the output needs no memset.

The number of tiles is bounded statically: each non-empty group adds at most one tile beyond the
blocks it covers, so tiles <= cdiv(A, tile_m) + min(E, A) (E real groups, the zero tail counted
within the + min(E, A): with E >= A at most A groups are non-empty). Nothing here loops over
experts in Python and nothing loops on device: cost is O(tiles * E), one fusion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows of the schedule array.
GROUP, BLOCK, ROW_LO, ROW_HI = range(4)
ZERO_GROUP = -1  # the tail pseudo-group: rows past sum(group_sizes), stored as zeros


def safe_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """int32 sizes that are safe whatever the caller passed: each clamped to [0, num_rows] in its
  own dtype (before any cast can wrap it), then cut where the running total reaches num_rows, with
  a saturating scan so no partial sum can overflow. Group sizes are traced (routing computes
  them), so this is done on device; valid sizes (>= 0, summing to <= num_rows) pass unchanged."""
  sizes = jnp.clip(group_sizes, 0, num_rows).astype(jnp.int32)
  if sizes.shape[0] * num_rows < 2**31:
    # No partial sum of clipped sizes can overflow: a plain cumsum (one reduce-window fusion on a
    # GPU; the saturating scan below lowers to ~2 log E pad/slice/select launches per call).
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
  else:
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, num_rows), sizes)
  return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def max_tiles(num_rows: int, num_groups: int, tile_m: int) -> int:
  return -(-num_rows // tile_m) + min(num_groups, num_rows)


def padded_tiles(num_rows: int, num_groups: int, tile_m: int) -> int:
  # A multiple of 4 int32s: the schedule's rows are copied to SMEM by TMA (16-byte granules).
  return -(-max_tiles(num_rows, num_groups, tile_m) // 4) * 4


def tile_schedule(group_sizes: jax.Array, num_rows: int, tile_m: int) -> jax.Array:
  """int32 [4, padded_tiles]: per tile its group (-1: zero tail), its row block, and the half-open
  row range [lo, hi) within the block that it owns. Unused tiles have lo == hi (skipped)."""
  num_groups = group_sizes.shape[0]
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  # Groups are clipped to the A rows (sum(group_sizes) > A is the caller's bug; never read past A).
  ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  # The zero tail [sum, A) as group number E; it is renamed ZERO_GROUP below.
  starts = jnp.concatenate([starts, ends[-1:]])
  ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
  nonempty = ends > starts
  first_block = starts // tile_m
  last_block = (ends - 1) // tile_m
  tiles_per_group = jnp.where(nonempty, last_block - first_block + 1, 0)
  tile_end = jnp.cumsum(tiles_per_group)

  total = padded_tiles(num_rows, num_groups, tile_m)
  t = jnp.arange(total, dtype=jnp.int32)
  # compare_all: one [T, E+1] compare-and-count fusion. The default binary-search method is a
  # device `while` of log2(E) trips, ~5 launches each, on every MoE layer of a decode step.
  group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"),
                      num_groups).astype(jnp.int32)
  block = first_block[group] + t - (tile_end[group] - tiles_per_group[group])
  block_row = block * tile_m
  lo = jnp.maximum(starts[group], block_row) - block_row
  hi = jnp.minimum(ends[group], block_row + tile_m) - block_row
  used = t < tile_end[-1]
  group = jnp.where(group == num_groups, ZERO_GROUP, group)
  block = jnp.where(used, block, 0)
  lo = jnp.where(used, lo, 0)
  hi = jnp.where(used, hi, 0)
  return jnp.stack([group, block, lo, hi]).astype(jnp.int32)


def row_schedule(row_groups: jax.Array, num_groups: int, tile_m: int,
                 num_rows: int | None = None) -> jax.Array:
  """The schedule of rows in ANY order, each its own tile: tile a = (row_groups[a], a's row block,
  [a's row in it, + 1)); a group outside [0, num_groups) is the zero group (its row stored as 0).
  For decode (a few rows, each routed on its own) this replaces the sort by expert, its inverse
  scatter and the group-size scan: the caller keeps its row order. `num_rows` (default A =
  len(row_groups)): x's rows, when the caller padded x to the row tile; rows [A, num_rows) get
  zero-group tiles, one per block. Same [4, padded_tiles] layout as `tile_schedule`; needs
  A <= num_groups + 1."""
  routed = row_groups.shape[0]
  num_rows = routed if num_rows is None else num_rows
  total = padded_tiles(num_rows, num_groups, tile_m)
  g = row_groups.astype(jnp.int32)
  g = jnp.where((g >= 0) & (g < num_groups), g, ZERO_GROUP)
  a = jnp.arange(routed, dtype=jnp.int32)
  fields = [jnp.stack([g, a // tile_m, a % tile_m, a % tile_m + 1])]
  if num_rows > routed:  # the padded tail: static, one zero tile per block it touches
    blocks = range(routed // tile_m, -(-num_rows // tile_m))
    tail = [[ZERO_GROUP, b, max(routed - b * tile_m, 0), min(num_rows - b * tile_m, tile_m)]
            for b in blocks]
    fields.append(jnp.asarray(tail, jnp.int32).T)
  fields = jnp.concatenate(fields, axis=1)
  assert fields.shape[1] <= total, (routed, num_rows, num_groups, tile_m)
  return jnp.pad(fields, ((0, 0), (0, total - fields.shape[1])))  # unused: lo == hi == 0


# TMA boxes hold at most 256 elements per dimension: the kernel copies the schedule flattened into
# rows of at most this many int32s.
PACK_WIDTH = 256


def pack(schedule: jax.Array) -> jax.Array:
  """[4, T] -> [R, W] (row-major flat, zero padded): field f of tile t at flat index f * T + t."""
  flat = schedule.reshape(-1)
  width = min(PACK_WIDTH, flat.shape[0])
  rows = -(-flat.shape[0] // width)
  return jnp.pad(flat, (0, rows * width - flat.shape[0])).reshape(rows, width)


def read_packed(packed_ref, num_tiles: int, field: int, tile):
  """Field `field` of tile `tile` (traced) from the packed schedule in SMEM."""
  flat = field * num_tiles + tile
  width = packed_ref.shape[1]
  return packed_ref[flat // width, flat % width]
