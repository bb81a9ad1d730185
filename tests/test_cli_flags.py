"""Command-line mistakes and interruptions of the scripts end in one line, never a traceback or a
hang: a repeated --mesh axis, Ctrl-C in scripts/generate.py, and scripts/plan_memory.py's flags
(the limits generate.py applies). Every subprocess here stops before anything is compiled."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from maverick import mesh_flags
from maverick.sharding import ShardingError
from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_mesh_flag_refuses_a_repeated_axis():
  assert mesh_flags.parse_mesh("data=2, tensor=4") == {"data": 2, "tensor": 4}
  with pytest.raises(ShardingError, match=r"'tensor=2,tensor=4' gives tensor twice"):
    mesh_flags.parse_mesh("tensor=2,tensor=4")
