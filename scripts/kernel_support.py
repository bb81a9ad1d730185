"""`maverick-kernel-support` from a source checkout: the code and its documentation are in
maverick/commands/kernel_support.py (`python scripts/kernel_support.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import kernel_support  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  kernel_support.console_main()
