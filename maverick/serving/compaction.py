"""Slot compaction: a step program runs the slots [0, bucket) that hold the highest busy slot, so a
long request left alone in a high slot keeps the whole batch's cost after the others finish (the
tail of a long-tailed length mix). Between steps the engine moves such rows down into free low
slots: a device copy of the row's per-slot state (its KV row too when the cache is contiguous;
with a paged cache only the host's block table row moves, the pools stay), then the source row is
marked done, as a released slot is. Rows carry everything they sample with (keys, params,
counters), so a moved request produces what it would have in place."""

import dataclasses
from typing import Callable, Sequence

import jax


def enabled(requested: bool | None) -> bool:
  """Engine(compaction=None): on where it has run and been tested, the CPU backend; off on a GPU,
  where nothing has run it yet. A bool is taken as given."""
  return jax.default_backend() == "cpu" if requested is None else bool(requested)


def plan_moves(busy_owned: Sequence[bool], released: Sequence[bool],
               batch_bucket: Callable[[int], int]) -> list[tuple[int, int]]:
  """(src, dst) moves, in order, that bring the highest busy slot under the batch bucket of the
  busy count. busy_owned[b]: slot b runs a request; released[b]: its row still has to be marked
  done by a step (it stays where it is, and nothing moves into it)."""
  owned, released = list(busy_owned), list(released)
  moves = []
  while True:
    busy = [b for b in range(len(owned)) if owned[b] or released[b]]
    if not busy:
      return moves
    top = busy[-1]
    if top < batch_bucket(len(busy)) or not owned[top]:
      return moves
    free = [b for b in range(top) if not owned[b] and not released[b]]
    if not free:
      return moves
    moves.append((top, free[0]))
    owned[free[0]], owned[top] = True, False


def move_row(engine, rows: dict, src: jax.Array, dst: jax.Array) -> dict:
  """rows with row dst := row src (every per-slot leaf) and row src done."""
  rows = engine._map_rows(lambda x: x.at[dst].set(x[src]), rows)
  result = rows["result"]
  rows["result"] = dataclasses.replace(result, done=result.done.at[src].set(True))
  return engine._constrain(rows)
