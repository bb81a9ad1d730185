"""EAGLE-2 dynamic draft trees on device: drafting, one-pass tree verification, path commit.

Shapes are static (depth, top-k, node count), contents are per row. A round:
  1. Draft: the k most likely draft tokens after the last committed position form level 1. For
     each further level, ONE draft forward runs the k frontier nodes (each sees the committed prefix
     and its own ancestors through a tree mask); every frontier node proposes its top-k children,
     scored by cumulative log-probability; the best k children become the next frontier. Of all
     k + (depth-1)*k^2 candidates the `nodes` best are kept, in generation order, so parents come
     before children (a child never outscores its parent; ties go to the lower index).
  2. Verify: the target runs [root, node_1..node_N] in one forward: nodes sit at position
     L + depth, are written to cache slots L..L+N, and see the prefix plus their ancestors.
  3. Accept by walking the tree from the root: at each node its children are tried in order
     (best first) with the lossless multi-candidate rule for deterministic proposals: accept child
     c with probability p(c) under the target distribution with the rejected siblings removed and
     renormalised; when every child is rejected, sample from that residual; at a leaf sample the
     bonus from p. Greedy rows have one-hot p: this is "the deepest node whose whole path matches
     the target's argmax", plus the target's next token.
  4. Commit: the accepted path's target KV entries are moved to slots L..L+n and the draft is
     extended over the path exactly as after a chain round.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp

from maverick import sampling
from maverick.model import TreeMask
from spec_decode.verify import target_probabilities


# The longest draft (chain K or tree depth) and the largest tree taken: acceptance of draft
# position j decays roughly geometrically (the embedded pair accepts position 3 in ~40 % of
# rounds), so past these the verify work only grows.
MAX_DRAFT_DEPTH = 16
MAX_TREE_NODES = 256


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """depth: levels of draft tokens; topk: children per expanded node (and frontier width);
  nodes: draft tokens verified per round (the root, the last emitted token, comes on top)."""
  depth: int
  topk: int
  nodes: int

  def __post_init__(self):
    for name in ("depth", "topk", "nodes"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"tree {name} must be a positive integer, got {value!r}")
    if self.depth > MAX_DRAFT_DEPTH or self.nodes > MAX_TREE_NODES:
      raise ValueError(
          f"tree {self.depth}x{self.topk}x{self.nodes} is past the limits (depth <= "
          f"{MAX_DRAFT_DEPTH}, nodes <= {MAX_TREE_NODES}): deeper drafts are almost never accepted "
          f"and every node is verified each round; use a smaller --tree_depth / --tree_nodes")
    if self.nodes < self.depth:
      raise ValueError(
          f"tree node count {self.nodes} is smaller than tree depth {self.depth}: the tree could "
          f"not hold one full path; use --tree_nodes >= --tree_depth")
    if self.nodes > self.num_candidates:
      raise ValueError(
          f"tree node count {self.nodes} exceeds the {self.num_candidates} candidates a depth-"
          f"{self.depth}, top-{self.topk} tree proposes (topk + (depth-1) * topk^2); lower "
          f"--tree_nodes or raise --tree_topk/--tree_depth")

  @property
  def num_candidates(self) -> int:
    return self.topk + (self.depth - 1) * self.topk * self.topk

  @classmethod
  def parse(cls, text: str) -> "TreeShape":
    """'DEPTHxTOPKxNODES', e.g. '5x8x32'."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not m:
      raise ValueError(f"tree shape {text!r} is not DEPTHxTOPKxNODES (e.g. 5x8x32)")
    return cls(*(int(g) for g in m.groups()))

  def __str__(self) -> str:
    return f"{self.depth}x{self.topk}x{self.nodes}"

  def check_draft_vocab(self, draft_vocab: int):
    if self.topk > draft_vocab:
      raise ValueError(f"tree top-k {self.topk} is larger than the draft vocabulary "
                       f"({draft_vocab} tokens); use --tree_topk <= {draft_vocab}")

  @property
  def cache_slack(self) -> int:
    """Slots past the committed length a round may write: the verify block (nodes + 1) in the
    target cache, the drafting frontier ((depth-1) * topk) in the draft cache."""
    return max(self.nodes + 1, (self.depth - 1) * self.topk) + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeCandidates:
  tokens: jax.Array  # [B, N] target-vocabulary ids, parents before children
  parents: jax.Array  # [B, N] parent candidate index, -1 = the root, N = none (never accepted)
  depths: jax.Array  # [B, N] 1-based level
  scores: jax.Array  # [B, N] cumulative draft log-probability of the path to the node


def draft_tree(draft, logits, hidden, dcache, committed, embed, shape: TreeShape):
  """EAGLE-2 expansion from the draft's output at the last committed position.

  logits [B, Vd] and hidden [B, D] come from draft position committed-1; level-l nodes are fed at
  draft position committed + l - 1 into slots committed + (l-1)*k + j of the draft cache.
  Returns (TreeCandidates, draft cache). Scores use the draft's raw log-softmax (temperature 1),
  independent of the sampling parameters: the proposals are deterministic, so any choice is lossless.
  """
  k, depth = shape.topk, shape.depth
  B = logits.shape[0]
  R = (depth - 1) * k  # draft-cache slots of the frontier nodes that get fed back
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  score, ids = jax.lax.top_k(logp, k)  # [B, k], best first
  toks, scores = [draft.target_ids(ids)], [score]
  parents = [jnp.full((B, k), -1, jnp.int32)]
  depths = [jnp.ones((B, k), jnp.int32)]
  frontier_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))
  frontier_tok, frontier_score = toks[0], score
  frontier_hidden = jnp.repeat(hidden[:, None], k, axis=1)  # [B, k, D]
  slot_level = jnp.arange(R, dtype=jnp.int32) // k  # level - 1 of each frontier slot
  slot_pos = committed[:, None] + slot_level[None, :]
  visible = jax.nn.one_hot(jnp.arange(k), R, dtype=jnp.bool_)[None].repeat(B, 0)  # [B, k, R]
  for level in range(1, depth):
    tree = TreeMask(start=committed, positions=slot_pos, visible=visible)
    pos = jnp.broadcast_to((committed + level - 1)[:, None], (B, k))
    out = draft(frontier_tok, frontier_hidden, embed, pos,
                cache=dcache.with_lengths(committed + (level - 1) * k), tree=tree)
    dcache = out.cache
    child_logp, child_ids = jax.lax.top_k(jax.nn.log_softmax(out.logits.astype(jnp.float32), -1), k)
    cum = (child_logp + frontier_score[:, :, None]).reshape(B, k * k)
    child_tok = draft.target_ids(child_ids).reshape(B, k * k)
    base = k + (level - 1) * k * k
    toks.append(child_tok)
    scores.append(cum)
    parents.append(jnp.repeat(frontier_idx, k, axis=1))
    depths.append(jnp.full((B, k * k), level + 1, jnp.int32))
    if level + 1 < depth:
      frontier_score, pick = jax.lax.top_k(cum, k)
      parent = pick // k
      frontier_idx = (base + pick).astype(jnp.int32)
      frontier_tok = jnp.take_along_axis(child_tok, pick, axis=1)
      frontier_hidden = jnp.take_along_axis(out.hidden, parent[:, :, None], axis=1)
      own = jax.nn.one_hot(level * k + jnp.arange(k), R, dtype=jnp.bool_)[None]
      visible = jnp.take_along_axis(visible, parent[:, :, None], axis=1) | own
  toks, scores = jnp.concatenate(toks, 1), jnp.concatenate(scores, 1)
  parents, depths = jnp.concatenate(parents, 1), jnp.concatenate(depths, 1)
  N = shape.nodes
  _, keep = jax.lax.top_k(scores, N)
  keep = jnp.sort(keep, axis=1)  # generation order: parents before children
  # Candidate index -> position among the kept nodes (N where dropped).
  new_index = jnp.full(scores.shape, N, jnp.int32).at[
      jnp.arange(B)[:, None], keep].set(jnp.arange(N, dtype=jnp.int32)[None])
  kept_parent = jnp.take_along_axis(parents, keep, axis=1)
  parent_pos = jnp.where(
      kept_parent < 0, -1,
      jnp.take_along_axis(new_index, jnp.maximum(kept_parent, 0), axis=1))
  kept = lambda x: jnp.take_along_axis(x, keep, axis=1)
  return TreeCandidates(tokens=kept(toks), parents=parent_pos, depths=kept(depths),
                        scores=kept(scores)), dcache


def verify_layout(cand: TreeCandidates, max_depth: int):
  """Parents [B, N+1] (root: -1, dropped parent: N+1), depths [B, N+1] and the ancestor-or-self
  mask [B, N+1, N+1] of the verify block [root, node_1..node_N]."""
  B, N = cand.tokens.shape
  parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32),
                             jnp.where(cand.parents < 0, 0, cand.parents + 1)], axis=1)
  depths = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), cand.depths], axis=1)
  eye = jnp.eye(N + 1, dtype=jnp.bool_)[None]
  up = jnp.clip(parents, 0, N)  # the root (and orphans) point at valid rows for the gather
  anc = jnp.broadcast_to(eye, (B, N + 1, N + 1))
  for _ in range(max_depth):
    anc = eye | jnp.where((parents >= 0)[:, :, None],
                          jnp.take_along_axis(anc, up[:, :, None], axis=1), False)
  return parents, depths, anc


def tree_history(tokens_bt, ancestors):
  """[B, T] verify block, [B, T, T] ancestor-or-self mask -> [B, T, T]: at node t the draft
  tokens on its path (root excluded: already committed), -1 elsewhere."""
  on_path = ancestors & (jnp.arange(tokens_bt.shape[1]) > 0)[None, None, :]
  return jnp.where(on_path, tokens_bt[:, None, :], -1)


def verify_tree(logits_btv, tokens_bt, parents, depths, ancestors, params, result, stop_ids,
                max_depth: int):
  """Walks the tree of the verify block. Returns (n [B] accepted draft tokens, next token [B],
  path [B, depth+1] verify-block indices of the root and the accepted nodes; entries past n are 0).
  result: the committed history (penalties; its token count keys the random streams).
  When every row is greedy no [B, T, V] distribution is built.
  """
  logits_btv = sampling.adjust(logits_btv, params, result, stop_ids,
                               tree_history(tokens_bt, ancestors))
  walk = lambda fn: functools.partial(fn, max_depth=max_depth)
  return jax.lax.cond(sampling.any_sampled(params), walk(verify_tree_sampled),
                      walk(verify_tree_greedy), logits_btv, tokens_bt, parents, depths, params,
                      result.num_tokens)


def verify_tree_greedy(logits_btv, tokens_bt, parents, depths, params, index, *, max_depth: int):
  """The recursive rule for one-hot p: at each level take the child whose token is its parent's
  argmax (siblings are distinct tokens), then the argmax after the last accepted node."""
  B, T, _ = logits_btv.shape
  best = jnp.argmax(logits_btv, axis=-1).astype(jnp.int32)  # [B, T]
  is_parents_best = tokens_bt == jnp.take_along_axis(best, jnp.clip(parents, 0, T - 1), axis=1)
  cur = jnp.zeros((B,), jnp.int32)
  alive = jnp.ones((B,), jnp.bool_)
  path = [cur]
  for level in range(1, max_depth + 1):
    accept = (parents == cur[:, None]) & (depths == level) & is_parents_best
    hit = alive & jnp.any(accept, axis=1)
    cur = jnp.where(hit, jnp.argmax(accept, axis=1).astype(jnp.int32), cur)
    path.append(jnp.where(hit, cur, 0))
    alive = hit
  n = jnp.sum(jnp.stack(path[1:], 1) > 0, axis=1).astype(jnp.int32)
  return n, jnp.take_along_axis(best, cur[:, None], axis=1)[:, 0], jnp.stack(path, 1)


def verify_tree_sampled(logits_btv, tokens_bt, parents, depths, params, index, *,
                        max_depth: int):
  B, T, V = logits_btv.shape
  p = target_probabilities(logits_btv, params)  # [B, T, V]
  p_parent = jnp.take_along_axis(p, jnp.clip(parents, 0, T - 1)[:, :, None], axis=1)
  tok_p = jnp.take_along_axis(p_parent, tokens_bt[:, :, None], axis=2)[..., 0]  # [B, T]
  u = sampling.uniform(sampling.row_keys(params, index, sampling.SALT_ACCEPT), T)
  cur = jnp.zeros((B,), jnp.int32)
  alive = jnp.ones((B,), jnp.bool_)
  tried = jnp.zeros((B, T), jnp.bool_)
  path = [cur]
  for level in range(1, max_depth + 1):
    children = (parents == cur[:, None]) & (depths == level)
    mass = jnp.where(children, tok_p, 0.0)
    before = jnp.cumsum(mass, axis=1) - mass  # siblings tried earlier, in index (score) order
    accept = children & (tok_p > 0) & (u * jnp.maximum(1.0 - before, 0.0) < tok_p)
    hit = alive & jnp.any(accept, axis=1)
    tried = jnp.where((alive & ~hit)[:, None], children, tried)
    cur = jnp.where(hit, jnp.argmax(accept, axis=1).astype(jnp.int32), cur)
    path.append(jnp.where(hit, cur, 0))
    alive = hit
  n = jnp.sum(jnp.stack(path[1:], 1) > 0, axis=1).astype(jnp.int32)
  p_cur = jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0]
  removed = jnp.zeros((B, V), p.dtype).at[jnp.arange(B)[:, None], tokens_bt].max(
      tried.astype(p.dtype))
  residual = p_cur * (1.0 - removed)
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_cur)
  nxt = sampling.draw(sampling.row_keys(params, index, sampling.SALT_RESIDUAL), jnp.log(residual),
                      params)
  return n, nxt, jnp.stack(path, 1)


def gather_path(x_bt, path):
  """x [B, T, ...] -> [B, depth+1, ...] along the path."""
  idx = path.reshape(path.shape + (1,) * (x_bt.ndim - 2))
  return jnp.take_along_axis(x_bt, idx, axis=1)


def commit_path(cache, start, path):
  """Moves the accepted path's KV entries (verify-block slots start + path) to slots start..;
  entries past the accepted length are garbage past the committed length, overwritten later."""
  # An FP8 cache's per-token scales travel with their entries (copy_slots moves them too): a
  # slot's e4m3 values mean nothing without the scale they were quantized with.
  return cache.copy_slots(start[:, None] + path, start)
