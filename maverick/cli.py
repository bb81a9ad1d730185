"""Plumbing shared by the absl command-line scripts in scripts/ and benchmarks/."""

from __future__ import annotations

import os
import sys

from absl import flags
from absl import logging


class UsageError(ValueError):
  """A user mistake on the command line: reported in one line, without a traceback."""


def start(argv) -> None:
  """Quiets absl/orbax INFO logs unless -v/--verbosity was given; rejects positional arguments."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments {argv[1:]}; all options are --flags (see --help)")


def fail(prog: str, error: BaseException | str) -> int:
  """Prints `prog: error: ...` as one line on stderr and returns the exit status 1."""
  print(f"{prog}: error: {str(error).replace(chr(10), ' ')}", file=sys.stderr)
  return 1


def write_atomic(path: str, text: str) -> None:
  """Writes a text file so that readers see the old or the new content, never a partial one."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


KERNEL_CHOICES = ("auto", "xla", "pallas")


def define_kernels_flag():
  """--kernels for scripts that build a model (see maverick/kernels.py)."""
  return flags.DEFINE_enum(
      "kernels", "auto", list(KERNEL_CHOICES),
      "Pallas kernels: auto = on a Hopper/Blackwell GPU for calls whose kernel config passed its "
      "one-time on-device self-check (else XLA, with one warning); xla = never; pallas = always "
      "where the kernel takes the shapes (an error without a GPU).")


def kernels_value(flag) -> str | None:
  """The flag's value as `maverick.load(kernels=...)` takes it (auto -> None)."""
  return None if flag.value == "auto" else flag.value


def define_check_finite_flag():
  """--check_finite for scripts that read Hugging Face checkpoints."""
  return flags.DEFINE_bool(
      "check_finite", True,
      "Scan every tensor read from a Hugging Face checkpoint for NaN/inf and stop with an error "
      "naming it; --nocheck_finite skips the scan for a trusted checkpoint.")
