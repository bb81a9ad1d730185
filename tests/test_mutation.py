"""Every hand-written mutant of the speculative loop (tests/mutants.py) makes a fast losslessness
check (tests/spec_checks.py) fail: the checks can fail. Runs in this process, one mutant at a time,
compiled programs dropped in between (scripts/mutation_score.py prints the same table)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))

import mutants  # noqa: E402
import mutation_score  # noqa: E402
import pytest  # noqa: E402


def test_every_mutant_still_applies_to_the_source():
  """Each mutant's edit finds its text exactly once in today's function and the edited source
  compiles (Python, not XLA): a refactor of the loop cannot silently retire a mutant."""
  assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS) >= 12
  for m in mutants.MUTANTS:
    assert callable(mutants._mutated(m)), m.name


@pytest.mark.slow
def test_every_mutant_is_killed():
  results = mutation_score.run(log=lambda line: None)
  survivors = [name for name, killer, _, _ in results if killer is None]
  assert len(results) >= 12
  assert not survivors, survivors
