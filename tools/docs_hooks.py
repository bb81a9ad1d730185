"""mkdocs hooks for the documentation site (mkdocs.yml `hooks:`).

- The files under benchmarks/results/ and the embedded models' cards join the site (`results/`,
  `model-cards/`), so pages link to the very file a figure comes from.
- `<!-- result: NAME -->` in a page is replaced by benchmarks/results/NAME (a Markdown table file)
  and `<!-- fp8-parity -->` by a table made from benchmarks/results/fp8_parity_*.json, at build
  time: the site copies no benchmark number by hand.
- `<!-- readme -->` in docs/index.md is replaced by README.md with its repository links made site
  links, so the home page is the README and the strict build checks the README's links too.
- The API check: every public name (`maverick.__all__`, `spec_decode.__all__`,
  `pallas_kernels.__all__`, and the public functions of each `pallas_kernels/<op>/api.py`) must be
  rendered by a `::: path` block in docs/api/ and have a docstring. A miss is a warning, which
  `mkdocs build --strict` turns into a failed build.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL_CARDS = {"tiny": ROOT / "maverick/assets/tiny/MODEL_CARD.md",
               "tiny_eagle3": ROOT / "maverick/assets/tiny_eagle3/MODEL_CARD.md"}
# A logger under "mkdocs": its warnings count for --strict.
log = logging.getLogger("mkdocs.hooks.maverick_docs")

_RESULT = re.compile(r"^<!-- result: ([\w.-]+) -->$", re.M)  # alone on its line
_FP8 = "<!-- fp8-parity -->"
_README = "<!-- readme -->"
# README links into the repository -> the same file on the site.
_README_LINKS = [("](docs/", "]("), ("](benchmarks/results/)", "](benchmarks.md)"),
                 ("](benchmarks/results/", "](results/"),
                 ("](maverick/assets/tiny/MODEL_CARD.md)", "](model-cards/tiny.md)"),
                 ("](maverick/assets/tiny_eagle3/MODEL_CARD.md)", "](model-cards/tiny_eagle3.md)"),
                 ("](ARCHITECTURE.md)", "](concepts/architecture.md)")]
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.M)


# ------------------------------------------------------------------------------------------------
# Result files and model cards on the site


def on_files(files, config):
  from mkdocs.structure.files import File
  extra = [(p, f"results/{p.name}") for p in sorted(RESULTS.iterdir()) if p.is_file()]
  extra += [(p, f"model-cards/{name}.md") for name, p in MODEL_CARDS.items()]
  for path, uri in extra:
    files.append(File.generated(config, uri, abs_src_path=str(path)))
  return files


def result_markdown(name: str) -> str:
  """benchmarks/results/NAME for inclusion: leading HTML comments and the title dropped (the page's
  section names the run), other headings demoted under it."""
  path = RESULTS / name
  if not path.is_file():
    log.warning("no result file benchmarks/results/%s", name)
    return ""
  lines = path.read_text().splitlines()
  while lines and lines[0].startswith("<!--"):
    lines.pop(0)
  lines = [line for line in lines if not line.startswith("# ")]
  return "\n".join("#" + line if line.startswith("#") else line for line in lines)


def fp8_parity_table() -> str:
  """The BF16-vs-FP8 rows of benchmarks/results/fp8_parity_*.json as one Markdown table."""
  rows = ["| result file | FP8 weights | activations | KV cache | top-1 agreement | mean KL (nats) "
          "| perplexity bf16 -> fp8 | greedy token agreement | acceptance length bf16 -> fp8 |",
          "|---|---|---|---|---:|---:|---|---:|---|"]
  for path in sorted(RESULTS.glob("fp8_parity_*.json")):
    d = json.loads(path.read_text())
    q, tf, sp = d["quant"], d["teacher_forced"], d["speculative"]
    skip = set(q.get("skip") or ())
    kinds = [k for k in ("attn", "mlp", "shared") if k not in skip]
    weights = "routed experts" + (" + " + ", ".join(kinds) if kinds else "")
    rows.append(
        f"| [{path.name}](results/{path.name}) | {weights} | {q['activations']} "
        f"| {q.get('kv_cache') or 'bf16'} | {100 * tf['top1_agreement']:.2f} % "
        f"| {tf['mean_kl']:.5f} | {tf['ppl_bf16']:.3f} -> {tf['ppl_fp8']:.3f} "
        f"({100 * tf['ppl_increase']:+.2f} %) | {100 * d['greedy']['token_agreement']:.2f} % "
        f"| {sp['acceptance_bf16']:.3f} -> {sp['acceptance_fp8']:.3f} "
        f"({100 * sp['acceptance_fp8'] / sp['acceptance_bf16']:.1f} %) |")
  return "\n".join(rows)


def readme_markdown() -> str:
  """README.md as the site's home page: its links into the repository made site links."""
  text = (ROOT / "README.md").read_text()
  for old, new in _README_LINKS:
    text = text.replace(old, new)
  return text


def on_page_markdown(markdown, page, config, files):
  depth = page.file.src_uri.count("/")
  up = "../" * depth
  markdown = markdown.replace(_README, readme_markdown())
  markdown = _RESULT.sub(lambda m: result_markdown(m.group(1)), markdown)
  if _FP8 in markdown:
    markdown = markdown.replace(_FP8, fp8_parity_table().replace("](results/", f"]({up}results/"))
  return markdown


# ------------------------------------------------------------------------------------------------
# The API check


def op_api_functions(root: pathlib.Path = ROOT) -> list[str]:
  """`pallas_kernels.<op>.api.<fn>` for every public function each op's api.py defines."""
  names = []
  for api in sorted((root / "pallas_kernels").glob("*/api.py")):
    tree = ast.parse(api.read_text())
    op = api.parent.name
    for node in tree.body:
      if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
        names.append(f"pallas_kernels.{op}.api.{node.name}")
  return names


def public_names() -> dict[str, str]:
  """Each public name -> the path where it is defined (what a `::: path` block may name too)."""
  out = {}
  for package in ("maverick", "spec_decode", "pallas_kernels"):
    module = importlib.import_module(package)
    for name in module.__all__:
      obj = getattr(module, name)
      home = getattr(obj, "__module__", None)
      qual = getattr(obj, "__qualname__", None)
      out[f"{package}.{name}"] = f"{home}.{qual}" if home and qual else f"{package}.{name}"
  for path in op_api_functions():
    out[path] = path
  return out


def documented_paths(api_dir: pathlib.Path) -> set[str]:
  """The paths named by `::: path` blocks in the API pages."""
  return {m.group(1) for page in sorted(api_dir.glob("*.md"))
          for m in _DIRECTIVE.finditer(page.read_text())}


def has_docstring(path: str) -> bool:
  import griffe
  package = path.split(".")[0]
  loaded = griffe.load(package, search_paths=[str(ROOT)], resolve_aliases=False)
  obj = loaded[path[len(package) + 1:]] if path != package else loaded
  while obj.is_alias:
    obj = obj.final_target
  return bool(obj.docstring and obj.docstring.value.strip())


def api_problems(names: dict[str, str], documented: set[str], docstring=has_docstring) -> list[str]:
  """What the API check reports: public names with no `:::` block, or without a docstring."""
  problems = []
  for public, home in sorted(names.items()):
    shown = public in documented or home in documented
    if not shown:
      problems.append(f"public name {public} ({home}) is not in the API reference (docs/api/*.md)")
    elif not docstring(home if home in documented else public):
      problems.append(f"public name {public} ({home}) has no docstring")
  return problems


def on_pre_build(config):
  api_dir = pathlib.Path(config["docs_dir"]) / "api"
  for problem in api_problems(public_names(), documented_paths(api_dir)):
    log.warning(problem)
