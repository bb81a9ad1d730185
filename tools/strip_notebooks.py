"""Strips outputs, execution counts and run timestamps from notebooks (they are committed clean; CI runs them).

  python tools/strip_notebooks.py                 # every notebooks/*.ipynb
  python tools/strip_notebooks.py path/to/x.ipynb
"""

import glob
import os
import sys

import nbformat


def strip(path: str) -> bool:
  """Returns True when the file changed."""
  nb = nbformat.read(path, as_version=4)
  changed = False
  for cell in nb.cells:
    if "execution" in cell.metadata:  # run timestamps
      del cell.metadata["execution"]
      changed = True
    if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
      cell.outputs, cell.execution_count = [], None
      changed = True
  if changed:
    tmp = f"{path}.tmp-{os.getpid()}"
    nbformat.write(nb, tmp)
    os.replace(tmp, path)
  return changed


if __name__ == "__main__":
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  paths = sys.argv[1:] or sorted(glob.glob(os.path.join(root, "notebooks", "*.ipynb")))
  for p in paths:
    print(("stripped " if strip(p) else "clean    ") + p)
