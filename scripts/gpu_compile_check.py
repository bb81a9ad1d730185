"""`maverick-gpu-compile-check` from a source checkout: the code and its documentation are in
maverick/commands/gpu_compile_check.py (`python scripts/gpu_compile_check.py --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maverick.commands import gpu_compile_check  # noqa: E402  (after the sys.path line)

if __name__ == "__main__":
  gpu_compile_check.console_main()
