"""`maverick-benchmark` from a source checkout: the code and its documentation are in
maverick/commands/benchmark.py (`python scripts/benchmark.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import benchmark  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  benchmark.console_main()
