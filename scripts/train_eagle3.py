"""`maverick-train-eagle3` from a source checkout: the code and its documentation are in
maverick/commands/train_eagle3.py (`python scripts/train_eagle3.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import train_eagle3  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  train_eagle3.console_main()
