"""`maverick-train-target` from a source checkout: the code and its documentation are in
maverick/commands/train_target.py (`python scripts/train_target.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import train_target  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  train_target.console_main()
