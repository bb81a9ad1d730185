"""Runs notebooks/quickstart.ipynb on CPU (8 fake devices, as tests/test_notebook.py does) and
writes it with its outputs to docs/notebooks/quickstart.ipynb, the copy the documentation site
renders. The source notebook stays committed without outputs (they would go stale); this copy
is regenerated whenever the source changes, and tests/test_notebook.py checks that its cells
are the source's, so the site never shows code the notebook no longer has.

  python tools/render_notebook.py        # ~1-2 min on 2 cores
"""

import os
import pathlib
import re
import sys

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE = REPO / "notebooks" / "quickstart.ipynb"
RENDERED = REPO / "docs" / "notebooks" / "quickstart.ipynb"


def main() -> int:
  nb = nbformat.read(SOURCE, as_version=4)
  env_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                     os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {env_flags}".strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
  os.environ.pop("MPLBACKEND", None)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(SOURCE.parent)}})
  client.execute()
  for cell in nb.cells:  # run timestamps would change the file on every render
    cell.metadata.pop("execution", None)
  RENDERED.parent.mkdir(parents=True, exist_ok=True)
  if RENDERED.is_symlink():
    RENDERED.unlink()
  tmp = RENDERED.with_suffix(f".tmp-{os.getpid()}")
  nbformat.write(nb, tmp)
  os.replace(tmp, RENDERED)
  print(f"wrote {RENDERED.relative_to(REPO)} ({RENDERED.stat().st_size // 1024} KB)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
