"""`maverick-convert` from a source checkout: the code and its documentation are in
maverick/commands/convert_hf.py (`python scripts/convert_hf.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import convert_hf  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  convert_hf.console_main()
