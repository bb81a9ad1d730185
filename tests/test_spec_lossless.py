"""Speculative decoding tests that fail when the loop breaks (tests/mutants.py proves it: see
test_every_mutant_is_killed). Checks live in tests/spec_checks.py, shared with
scripts/mutation_score.py; references are plain greedy decoding and exact float64 probabilities."""

import pytest

import spec_checks as sc


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_teacher_draft_greedy_equals_plain_greedy(mode):
  """Batch 4 (per-row stops inside accepted runs, a limit cutting one) and each row alone."""
  sc.teacher_greedy(mode, batch=1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("setting", sorted(sc.SAMPLING))
def test_sampled_tokens_and_pairs_match_exact_distribution(mode, setting):
  """4 sampled tokens (the 4th is a bonus after a fully accepted first round) on a target that uses
  its cache: chi-squared of every token and every consecutive pair vs float64 enumeration."""
  sc.sampled_distribution(mode, setting)


@pytest.mark.slow
def test_teacher_draft_tree_with_fp8_kv_cache():
  """commit_path moves FP8 KV scales with their entries: the teacher tree run on an FP8-cache
  target (paths through siblings, partial paths) equals that target's plain greedy output."""
  sc.teacher_greedy("tree", 4, sc.fp8_case())


def test_greedy_fast_paths_equal_the_rejection_rule():
  sc.greedy_rules()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("setting", sorted(sc.ADJUSTED))
def test_penalties_min_p_and_logit_bias_keep_the_exact_distribution(mode, setting):
  """Presence/frequency/repetition penalties and logit_bias (which read the history, drafts
  accepted earlier in the round included) and min_p under speculation: chi-squared of every token
  and pair vs a float64 NumPy enumeration of the penalised target distribution."""
  sc.sampled_distribution(mode, setting)
