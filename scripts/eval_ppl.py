"""`maverick-eval-ppl` from a source checkout: the code and its documentation are in
maverick/commands/eval_ppl.py (`python scripts/eval_ppl.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import eval_ppl  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  eval_ppl.console_main()
