"""`maverick-plan-memory` from a source checkout: the code and its documentation are in
maverick/commands/plan_memory.py (`python scripts/plan_memory.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import plan_memory  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  plan_memory.console_main()
