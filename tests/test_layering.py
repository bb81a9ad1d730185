"""The import graph of maverick/, spec_decode/ and pallas_kernels/ follows the layers of
maverick/layers.py (described in ARCHITECTURE.md): no module imports a higher layer, no import
cycle, no module imports its own package's `__init__`, every module has a layer.

Every import counts, at module level or inside a function: `import a.b`, `from a import b`
(an edge to the submodule a.b when it is one, else to a), relative imports. Only the source is
parsed (ast), nothing is imported, so this runs in a second.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import textwrap

from maverick import layers

REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Edge:
  importer: str
  imported: str
  file: str  # relative to the root
  line: int


def modules_under(root: pathlib.Path, packages) -> dict[str, tuple[pathlib.Path, bool]]:
  """{dotted module name: (file relative to `root`, is a package __init__)} of every .py file
  under `packages`."""
  out = {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      parts = list(path.relative_to(root).with_suffix("").parts)
      is_init = parts[-1] == "__init__"
      if is_init:
        parts = parts[:-1]
      out[".".join(parts)] = (path.relative_to(root), is_init)
  return out


def import_edges(root: pathlib.Path, packages) -> tuple[dict, list[Edge]]:
  """(the modules, every import between two of them: module level and inside functions)."""
  mods = modules_under(root, packages)

  def known(name: str | None) -> str | None:  # the module `name` or its closest known parent
    while name:
      if name in mods:
        return name
      name = name.rpartition(".")[0]
    return None

  edges = []
  for module, (path, is_init) in mods.items():
    package = module if is_init else module.rpartition(".")[0]
    rel = str(path)
    for node in ast.walk(ast.parse((root / path).read_text(), filename=rel)):
      targets = []
      if isinstance(node, ast.Import):
        targets = [known(a.name) for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          base = package.split(".")
          base = base[:len(base) - (node.level - 1)]
          source = ".".join(base + ([node.module] if node.module else []))
        else:
          source = node.module
        for a in node.names:  # `from pkg import submodule` is an edge to the submodule
          full = f"{source}.{a.name}"
          targets.append(full if full in mods else known(source))
      for target in targets:
        if target is not None and target != module:
          edges.append(Edge(module, target, rel, node.lineno))
  return mods, list(dict.fromkeys(edges))  # `from a import x, y` is one edge


def _cycles(nodes, edges: list[Edge]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan, iterative)."""
  succ = {n: sorted({e.imported for e in edges if e.importer == n}) for n in nodes}
  index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]
  for start in sorted(nodes):
    if start in index:
      continue
    work = [(start, iter(succ[start]))]
    index[start] = low[start] = counter[0]
    counter[0] += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      node, it = work[-1]
      nxt = next(it, None)
      if nxt is None:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          comp = []
          while True:
            m = stack.pop()
            on_stack.discard(m)
            comp.append(m)
            if m == node:
              break
          if len(comp) > 1:
            comps.append(sorted(comp))
      elif nxt not in index:
        index[nxt] = low[nxt] = counter[0]
        counter[0] += 1
        stack.append(nxt)
        on_stack.add(nxt)
        work.append((nxt, iter(succ[nxt])))
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
  return comps


def check(mods, edges: list[Edge], table=layers.LAYERS) -> list[str]:
  """Every violation of the layering, one line each (empty: the graph is layered)."""
  problems = []
  name = lambda i: f"layer {i} {table[i][0]!r}"
  layer = {m: layers.layer_of(m, table) for m in mods}
  for m, (path, _) in sorted(mods.items()):
    if layer[m] is None:
      problems.append(f"{path}: module {m} has no layer: add it to a layer of "
                      "maverick/layers.py (and ARCHITECTURE.md)")
  for _, _, entries in table:
    for entry in entries:
      if not any(layers.matches(entry, m) for m in mods):
        problems.append(f"layer table entry {entry!r} matches no module (stale entry)")
  for e in edges:
    where = f"{e.file}:{e.line}: {e.importer} -> {e.imported}"
    if e.importer.startswith(e.imported + "."):
      problems.append(f"{where}: imports its own package's __init__ (the top of that package); "
                      "import the submodule instead")
    lo, li = layer[e.importer], layer[e.imported]
    if lo is not None and li is not None and li > lo:
      problems.append(f"{where}: imports upward, from {name(lo)} to {name(li)}")
  for comp in _cycles(mods, edges):
    inside = [e for e in edges if e.importer in comp and e.imported in comp]
    problems.append("import cycle among " + ", ".join(comp) + ": " + "; ".join(
        f"{e.file}:{e.line} {e.importer} -> {e.imported}" for e in inside))
  return problems


def test_the_import_graph_is_layered():
  mods, edges = import_edges(REPO, layers.PACKAGES)
  assert len(mods) > 50 and len(edges) > 100  # the parser found the code
  problems = check(mods, edges)
  assert not problems, "the import graph breaks the layering:\n" + "\n".join(problems)


def test_architecture_md_describes_the_table():
  """ARCHITECTURE.md's table row of each layer names exactly that layer's entries."""
  rows = (REPO / "ARCHITECTURE.md").read_text().splitlines()
  for i, (name, _, entries) in enumerate(layers.LAYERS):
    row = [r for r in rows if r.startswith(f"| {i} | {name} |")]
    assert len(row) == 1, f"ARCHITECTURE.md has no table row for layer {i} {name!r}"
    listed = re.findall(r"`([^`]+)`", row[0].split("|")[3])
    assert sorted(listed) == sorted(entries), (name, listed, entries)


# ----------------------------------------------------------------------------------------------
# The checker itself: it must catch what it is there to catch.
# ----------------------------------------------------------------------------------------------
_TABLE = (("low", "", ("pkg.base", "pkg.util")),
          ("mid", "", ("pkg.sub.*",)),
          ("high", "", ("pkg.app", "pkg")))


def _package(tmp_path, files: dict[str, str]):
  for rel, src in files.items():
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(src))
  return import_edges(tmp_path, ("pkg",))


_CLEAN = {
    "pkg/__init__.py": "def __getattr__(name):\n  from pkg import app\n  return app\n",
    "pkg/base.py": "import os\n",
    "pkg/util.py": "from . import base\n",
    "pkg/sub/__init__.py": "from pkg.sub.a import f\n",
    "pkg/sub/a.py": "import pkg.util\ndef f():\n  from pkg.sub import b\n",
    "pkg/sub/b.py": "from ..base import *\n",
    "pkg/app.py": "from pkg.sub import a\nimport pkg.sub\n",
}


def test_checker_accepts_a_layered_package(tmp_path):
  mods, edges = _package(tmp_path, _CLEAN)
  got = {(e.importer, e.imported) for e in edges}
  assert got == {("pkg", "pkg.app"), ("pkg.util", "pkg.base"), ("pkg.sub", "pkg.sub.a"),
                 ("pkg.sub.a", "pkg.util"), ("pkg.sub.a", "pkg.sub.b"),
                 ("pkg.sub.b", "pkg.base"), ("pkg.app", "pkg.sub.a"), ("pkg.app", "pkg.sub")}
  assert check(mods, edges, _TABLE) == []


def test_checker_catches_an_upward_import_inside_a_function(tmp_path):
  mods, edges = _package(tmp_path, dict(_CLEAN, **{
      "pkg/base.py": "import os\n\ndef late():\n  from pkg.sub.b import x\n"}))
  problems = check(mods, edges, _TABLE)
  assert any("pkg/base.py:4: pkg.base -> pkg.sub.b: imports upward, from layer 0 'low' to "
             "layer 1 'mid'" in p for p in problems), problems


def test_checker_catches_a_cycle_within_a_layer(tmp_path):
  mods, edges = _package(tmp_path, dict(_CLEAN, **{"pkg/base.py": "from pkg import util\n"}))
  problems = check(mods, edges, _TABLE)
  assert problems == ["import cycle among pkg.base, pkg.util: pkg/base.py:1 pkg.base -> "
                      "pkg.util; pkg/util.py:1 pkg.util -> pkg.base"], problems


def test_checker_catches_an_import_of_the_own_package_init(tmp_path):
  mods, edges = _package(tmp_path, dict(_CLEAN, **{"pkg/sub/b.py": "from pkg.sub import f\n"}))
  problems = check(mods, edges, _TABLE)
  assert any("pkg/sub/b.py:1: pkg.sub.b -> pkg.sub: imports its own package's __init__" in p
             for p in problems), problems


def test_checker_catches_a_module_without_a_layer(tmp_path):
  mods, edges = _package(tmp_path, dict(_CLEAN, **{"pkg/new.py": "x = 1\n"}))
  assert check(mods, edges, _TABLE) == [
      "pkg/new.py: module pkg.new has no layer: add it to a layer of maverick/layers.py "
      "(and ARCHITECTURE.md)"]
