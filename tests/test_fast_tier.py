"""The fast tier (`pytest -m "not slow"`, docs/getting-started.md, "Test") keeps at least one test
of every test file, so a quick run still touches every part of the code. Read from the source
with ast: nothing is imported or collected."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _is_slow_mark(node: ast.expr) -> bool:
  """`pytest.mark.slow`, called or not."""
  if isinstance(node, ast.Call):
    node = node.func
  return (isinstance(node, ast.Attribute) and node.attr == "slow"
          and isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def fast_tests(source: str) -> list[str]:
  """Names of the test functions (module level or in Test* classes) not marked slow; none when
  the module's `pytestmark` marks everything slow."""
  tree = ast.parse(source)
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark"
                                            for t in node.targets):
      marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
      if any(_is_slow_mark(m) for m in marks):
        return []

  def fast(fns, slow_class=False):
    return [f.name for f in fns if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.name.startswith("test") and not slow_class
            and not any(_is_slow_mark(d) for d in f.decorator_list)]

  names = fast(tree.body)
  for cls in tree.body:
    if isinstance(cls, ast.ClassDef) and cls.name.startswith("Test"):
      names += fast(cls.body, any(_is_slow_mark(d) for d in cls.decorator_list))
  return names


def test_the_mark_reader():
  src = ("import pytest\n@pytest.mark.slow\ndef test_a(): pass\n"
         "@pytest.mark.parametrize('x', [1])\ndef test_b(x): pass\n"
         "@pytest.mark.slow\nclass TestC:\n  def test_c(self): pass\n")
  assert fast_tests(src) == ["test_b"]
  assert fast_tests("import pytest\npytestmark = [pytest.mark.slow]\ndef test_a(): pass\n") == []


def test_every_test_file_has_a_fast_test():
  files = sorted(TESTS.glob("test_*.py"))
  assert len(files) > 40
  empty = [f.name for f in files if not fast_tests(f.read_text())]
  assert not empty, f"only slow tests in {empty}: give each a quick test (under a few seconds)"
