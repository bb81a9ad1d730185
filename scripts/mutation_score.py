"""Mutation score of the fast speculative decoding checks (tests/spec_checks.py) against the
hand-written mutants of tests/mutants.py, all in this process: one compile per mutant and check
tried, nothing else. Prints each mutant, the check that killed it (or SURVIVED) and the score.

  PYTHONPATH=. .venv/bin/python scripts/mutation_score.py [-k substring]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"


def run(mutants=None, log=lambda line: print(line, flush=True)):
  """[(mutant name, killing check or None, why, seconds)]. References are built first."""
  import mutants as mutants_lib
  import spec_checks
  spec_checks.prepare()
  results = []
  for m in mutants if mutants is not None else mutants_lib.MUTANTS:
    start = time.perf_counter()
    order = list(m.hint) + [c for c in spec_checks.CHECKS if c not in m.hint]
    killer, why = None, ""
    with mutants_lib.applied(m):
      for name in order:
        try:
          spec_checks.CHECKS[name]()
        except Exception as e:  # a failing assertion or a crash: the test fails either way
          killer, why = name, f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
          break
    results.append((m.name, killer, why, time.perf_counter() - start))
    log(f"{'killed' if killer else 'SURVIVED':8s} {m.name:50s} by {killer}  "
        f"({results[-1][3]:.0f} s)  {why}")
  return results


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("-k", default="", help="only mutants whose name contains this")
  args = ap.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(TESTS))
  import mutants as mutants_lib
  chosen = [m for m in mutants_lib.MUTANTS if args.k in m.name]
  start = time.perf_counter()
  results = run(chosen)
  killed = sum(k is not None for _, k, _, _ in results)
  print(f"mutation score: {killed}/{len(results)} killed in {time.perf_counter() - start:.0f} s")
  return 0 if killed == len(results) else 1


if __name__ == "__main__":
  sys.exit(main())
