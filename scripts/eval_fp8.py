"""`maverick-eval-fp8` from a source checkout: the code and its documentation are in
maverick/commands/eval_fp8.py (`python scripts/eval_fp8.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import eval_fp8  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  eval_fp8.console_main()
