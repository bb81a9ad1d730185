"""Hand-written mutants of the speculative decoding loop: each is one plausible bug, applied by
recompiling ONE function of spec_decode with a single source edit and swapping it in where the
loop looks it up. scripts/mutation_score.py and tests/test_mutation.py run the fast checks of
tests/spec_checks.py against each and require every mutant to make one of them fail.

A mutant's `hint` lists the checks worth trying first (they cost a compile each); the others still
run when those pass, so the hint only orders the work, it never decides the outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import textwrap

import jax

from maverick import kv_cache as kvc
from maverick import program_cache
from spec_decode import speculative as spec
from spec_decode import tree as tree_lib
from spec_decode import verify as verify_lib

# Checks in spec_checks order (names used by hints).
GREEDY = ("greedy rules",)
TEACHER = ("teacher chain b4", "teacher tree b4", "teacher chain b1", "teacher tree b1")
CHI2_CHAIN = ("chi2 chain temp", "chi2 chain top_p")
CHI2_TREE = ("chi2 tree temp", "chi2 tree top_p")
PENALTIES = ("chi2 chain penalties", "chi2 tree penalties")


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  module: object  # where the function is defined
  func: str
  old: str  # exact source text, must occur once
  new: str
  hint: tuple[str, ...] = ()


def _mutated(m: Mutant):
  src = textwrap.dedent(inspect.getsource(getattr(m.module, m.func)))
  if src.count(m.old) != 1:
    raise RuntimeError(f"mutant {m.name!r}: {m.old!r} occurs {src.count(m.old)} times in "
                       f"{m.module.__name__}.{m.func} (the code changed: update the mutant)")
  namespace = dict(vars(m.module))
  exec(compile(src.replace(m.old, m.new), f"<mutant {m.name}>", "exec"), namespace)
  return namespace[m.func]


def clear_compiled():
  """Compiled loops are cached by static args and avals, not by the code: drop them."""
  spec._EXECUTABLES.clear()
  jax.clear_caches()


@contextlib.contextmanager
def applied(m: Mutant):
  # A mutant edits code in memory, which the exported-program cache's key (the source files)
  # cannot see: with it on, a mutated loop could load the unmutated program from disk.
  if program_cache.stats()[0] is not None:
    raise RuntimeError("mutants need maverick.program_cache off (program_cache.enable(None))")
  fn = _mutated(m)
  saved = []

  def swap(obj, name, value):
    saved.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)

  if m.func == "_spec_generate":
    swap(spec, "spec_generate_jit", jax.jit(fn, static_argnames=(
        "tgt_graphdef", "dr_graphdef", "k", "steps", "capacity", "pad_id", "tree")))
  else:
    swap(m.module, m.func, fn)
    if hasattr(spec, m.func):  # imported by name into the loop's module
      swap(spec, m.func, fn)
  clear_compiled()
  try:
    yield
  finally:
    for obj, name, value in reversed(saved):
      setattr(obj, name, value)
    clear_compiled()


S, V, T = spec, verify_lib, tree_lib
MUTANTS = [
    Mutant("commit length L + 2n + 1", S, "round_fns",
           "L_new = jnp.where(active, L + n + 1, L)",
           "L_new = jnp.where(active, L + 2 * n + 1, L)", TEACHER),
    Mutant("chain verify one position late", S, "round_fns",
           "out = target(tokens, cache=cache.with_lengths(L), capture_layers=aux)",
           "out = target(tokens, cache=cache.with_lengths(L + 1), capture_layers=aux)", TEACHER),
    Mutant("tree nodes one position late", S, "round_fns",
           "positions = L[:, None] + depths", "positions = L[:, None] + depths + 1",
           TEACHER[1:]),
    Mutant("commit_path commits the first slots, not the path", T, "commit_path",
           "cache.copy_slots(start[:, None] + path, start)",
           "cache.copy_slots(start[:, None] + jax.numpy.arange(path.shape[1])[None], start)",
           TEACHER[1:]),
    Mutant("chain bonus drawn from the last draft's row (greedy)", V, "verify_chain_greedy",
           "jnp.take_along_axis(best, n[:, None], axis=1)",
           "jnp.take_along_axis(best, jnp.minimum(n, K - 1)[:, None], axis=1)", TEACHER),
    Mutant("chain bonus drawn from the last draft's row (sampled)", V, "verify_chain_sampled",
           "p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]",
           "p_n = jnp.take_along_axis(p, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]",
           CHI2_CHAIN),
    Mutant("greedy chain accepts past the first mismatch", V, "verify_chain_greedy",
           "jnp.sum(jnp.cumprod(match, axis=1), axis=1)", "jnp.sum(match, axis=1)", GREEDY),
    Mutant("tree next token drawn from the root's row (greedy)", T, "verify_tree_greedy",
           "jnp.take_along_axis(best, cur[:, None], axis=1)[:, 0]", "best[:, 0]", TEACHER[1:]),
    Mutant("tree next token drawn from the root's row (sampled)", T, "verify_tree_sampled",
           "p_cur = jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0]",
           "p_cur = p[:, 0]", CHI2_TREE),
    Mutant("correction from p instead of the residual p - q", V, "verify_chain_sampled",
           "residual = jnp.maximum(p_n - q_n, 0.0)", "residual = p_n", CHI2_CHAIN),
    Mutant("acceptance ignores q (u < p)", V, "verify_chain_sampled",
           "accept = u * q_draft < p_draft", "accept = u < p_draft", CHI2_CHAIN),
    Mutant("q lifted to draft ids (d2t ignored)", S, "draft_chain",
           "jnp.where(at_j[:, None], q[:, None], probs)",
           "jnp.where(at_j[:, None], sampling.probabilities(jnp.pad(logits, ((0, 0), (0, vocab - "
           "logits.shape[-1])), constant_values=-jnp.inf), params)[:, None], probs)", CHI2_CHAIN),
    Mutant("sampling params not applied to q", S, "draft_chain",
           "jnp.where(at_j[:, None], q[:, None], probs)",
           "jnp.where(at_j[:, None], jax.nn.softmax(draft.lift_logits(logits, vocab).astype("
           "jnp.float32))[:, None], probs)", CHI2_CHAIN[::-1]),
    Mutant("draft fed the features one position early", S, "round_fns",
           "dout = draft(emitted, draft.fuse(features), embed",
           "dout = draft(emitted, draft.fuse(jnp.roll(features, 1, axis=1)), embed", TEACHER),
    Mutant("draft fed the tokens one position late", S, "round_fns",
           "dout = draft(emitted, draft.fuse(features), embed",
           "dout = draft(jnp.roll(emitted, -1, axis=1), draft.fuse(features), embed", TEACHER),
    Mutant("prefill pairs each feature with its own token", S, "spec_prefill",
           "shifted = jnp.concatenate([req.prompt[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)",
           "shifted = req.prompt", TEACHER),
    Mutant("stop token seen only at the end of a round", S, "round_fns",
           "result = stop(result, emitted, n + 1, logprobs)",
           "result = sampling.append(result, emitted, n + 1, jnp.where(jnp.any(nxt[:, None] == "
           "stop_ids, axis=1, keepdims=True), stop_ids, -1), max_tokens, pad_id, logprobs)",
           TEACHER),
    Mutant("finished rows still count rounds", S, "round_fns",
           "stats.rounds + active,", "stats.rounds + 1,", TEACHER[2:]),
    Mutant("finished rows still count accepted tokens", S, "round_fns",
           "stats.accepted + jnp.where(active, n + 1, 0)", "stats.accepted + n + 1", TEACHER[2:]),
    Mutant("rejected tree level kept on the path (greedy)", T, "verify_tree_greedy",
           "path.append(jnp.where(hit, cur, 0))", "path.append(cur)", TEACHER[1:]),
    Mutant("rejected tree level kept on the path (sampled)", T, "verify_tree_sampled",
           "path.append(jnp.where(hit, cur, 0))", "path.append(cur)", CHI2_TREE),
    Mutant("tree residual keeps rejected siblings", T, "verify_tree_sampled",
           "tried = jnp.where((alive & ~hit)[:, None], children, tried)", "pass", CHI2_TREE),
    Mutant("penalties at a chain position ignore the drafts before it", V, "chain_history",
           "return jnp.where(before[None], tokens[:, None, :], -1)",
           "return jnp.where(before[None] & False, tokens[:, None, :], -1)", PENALTIES),
    Mutant("penalties at a tree node ignore its path", T, "tree_history",
           "return jnp.where(on_path, tokens_bt[:, None, :], -1)",
           "return jnp.where(on_path & False, tokens_bt[:, None, :], -1)", PENALTIES[::-1]),
    Mutant("q recorded without the penalties it was drawn with", S, "draft_chain",
           "return sampling.draw(keys, jnp.log(q), params), jnp.where(at_j[:, None], q[:, None], probs)",
           "return sampling.draw(keys, jnp.log(q), params), jnp.where(at_j[:, None], "
           "sampling.probabilities(draft.lift_logits(logits, vocab), params)[:, None], probs)",
           PENALTIES),
    Mutant("commit_path leaves the FP8 k scales behind", kvc, "_map_layers",
           "k_scale=each(cache.k_scale),", "k_scale=cache.k_scale,", ("fp8 tree commit",)),
]
