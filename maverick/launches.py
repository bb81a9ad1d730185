"""Kernel launches of a compiled XLA:GPU program, read from its thunk sequence dump.

At batch 1 a decode step is launch-bound (each launch costs ~2 us of GPU time whatever it does),
so the number of kernels one step runs, one after another, is its latency budget. XLA writes the
program it will run as a thunk sequence (`--xla_dump_to=DIR`: `*thunk_sequence_after_thunk_passes
.txt`, ids per line, nested thunks indented, a `kWhile`'s condition and body under labels) and the
HLO instruction behind each thunk id (`*thunk_metadata.txt`); the optimized HLO gives each `while`
its `known_trip_count`. A launch is every node that puts work on the GPU: an XLA kernel
(`kCustomKernel` / `kKernel`: a fusion), a custom call (our Mosaic kernels), a copy, a memset, a
collective, a library call (cuBLAS, cuDNN, CUB sort). Containers (`kCommandBuffer`,
`kSequential`, `kWhile`, `kConditional`) and stream events are not. A `while` body counts times
its trip count and its condition one more time; a loop of unknown trip count is counted once and
reported in `unknown_trip_whiles`.
"""

from __future__ import annotations

import collections
import dataclasses
import re

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\b(.*)$")
_LABEL = re.compile(r"^(\s*)(condition|body|branch[^:]*|case[^:]*|[a-z_ ]+):\s*$")
CONTAINERS = ("kCommandBuffer", "kSequential", "kWhile", "kConditional", "kDynamicSliceFusion")
NOT_LAUNCHES = ("kWaitForStreams", "kAsyncDone", "kAsyncStart", "kRecordEvent", "kWaitEvent")
COLLECTIVE = re.compile(r"All|Collective|Nccl|Nvshmem|ReduceScatter|Broadcast|Ragged")


@dataclasses.dataclass
class Launches:
  total: int  # each conditional at its smallest branch
  by_kind: dict[str, int]
  unknown_trip_whiles: int
  largest: int  # each conditional at its largest branch

  def per_layer(self, layers: int) -> float:
    return self.total / max(layers, 1)


def kind_of(thunk_kind: str, name: str) -> str:
  """A launch's kind for the report: `mosaic` (a custom call), `copy`, `collective`, `memset`,
  `library` (cuBLAS / cuDNN / CUB), or an XLA fusion by what it computes: its name without the
  `loop_` / `input_` emitter prefix, the `_fusion` suffix and the number (`loop_pad_fusion_8` ->
  `pad`, `input_reduce_fusion` -> `reduce`, `gemm_fusion_dot_3` -> `gemm`)."""
  if thunk_kind == "kCustomCall":
    return "mosaic"
  if thunk_kind in ("kCopy", "kDeviceToDeviceCopy"):
    return "copy"
  if "Memset" in thunk_kind:
    return "memset"
  if COLLECTIVE.search(thunk_kind):
    return "collective"
  if thunk_kind in ("kGemm", "kCublasLtMatmul", "kCuDnn", "kCubSort", "kConvolution", "kFft"):
    return "library"
  if thunk_kind not in ("kCustomKernel", "kKernel"):
    return thunk_kind.removeprefix("k").lower()
  base = re.sub(r"[._]\d+$", "", name.split()[0] if name else "kernel")
  base = re.sub(r"[._]\d+$", "", base)  # sort_15_0 -> sort
  if base.startswith("gemm_fusion"):
    return "gemm"
  base = re.sub(r"^(loop|input|wrapped|triton)_", "", base)
  return base.removesuffix("_fusion") or "kernel"


def _annotations(metadata_text: str) -> dict[int, str]:
  """thunk id -> its HLO instruction (profile_annotation) from a `*thunk_metadata.txt` dump."""
  out, name = {}, None
  for line in metadata_text.splitlines():
    m = re.search(r'profile_annotation: "([^"]*)"', line)
    if m:
      name = m.group(1)
    m = re.search(r"thunk_id: (\d+)", line)
    if m and name is not None:
      out[int(m.group(1))] = name
      name = None
    if line.startswith("thunk_metadata"):
      name = None
  return out


def trip_counts(metadata_text: str, hlo_text: str) -> dict[int, int]:
  """thunk id of each `kWhile` -> its HLO while's known_trip_count (absent when XLA knows none)."""
  trips = {}
  for m in re.finditer(r"%?([\w.\-]+) = [^\n]*? while\([^\n]*", hlo_text):
    n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', m.group(0))
    if n:
      trips[m.group(1)] = int(n.group(1))
  return {tid: trips[name] for tid, name in _annotations(metadata_text).items() if name in trips}


@dataclasses.dataclass
class _Node:
  kind: str
  tid: int
  name: str
  indent: int
  sections: dict = dataclasses.field(default_factory=dict)  # section label -> [children]
  section: str | None = None  # where the next child goes


def parse(thunk_text: str) -> list[_Node]:
  """The thunk sequence as a tree: top-level nodes; a `kWhile`'s children under "condition" and
  "body", a `kConditional`'s under each branch label, other containers' under None."""
  roots: list[_Node] = []
  stack: list[_Node] = []
  for line in thunk_text.splitlines():
    m = _THUNK.match(line)
    label = None if m else _LABEL.match(line)
    if label:
      indent = len(label.group(1))
      if indent:  # "condition:" is printed at column 0, right after its kWhile line
        while stack and stack[-1].indent >= indent:
          stack.pop()
      # The label opens a section of the innermost open loop or conditional.
      for node in reversed(stack):
        if node.kind in ("kWhile", "kConditional"):
          node.section = label.group(2)
          break
      continue
    if not m:
      continue
    indent = len(m.group(1))
    node = _Node(m.group(3), int(m.group(2)), re.sub(r"^\s*\[[^\]]*\]\s*", "", m.group(4)).strip(),
                 indent)
    while stack and stack[-1].indent >= indent:
      stack.pop()
    if stack:
      parent = stack[-1]
      parent.sections.setdefault(parent.section, []).append(node)
    else:
      roots.append(node)
    stack.append(node)
  return roots


def _walk(nodes):
  for node in nodes:
    yield node
    for children in node.sections.values():
      yield from _walk(children)


def main_loop(thunk_text: str) -> int | None:
  """Thunk id of the program's main loop (a generate program's decode loop): the outermost
  `kWhile` with the most thunks under it; None without one."""
  def outermost(nodes):
    for node in nodes:
      if node.kind == "kWhile":
        yield node
      elif node.kind != "kWhile":
        for children in node.sections.values():
          yield from outermost(children)
  loops = list(outermost(parse(thunk_text)))
  if not loops:
    return None
  return max(loops, key=lambda n: sum(1 for _ in _walk([n]))).tid


def count(thunk_text: str, trips: dict[int, int] | None = None,
          per_iteration_of: int | None = None) -> Launches:
  """Launches of one run of the program whose thunk sequence is `thunk_text`; `trips`: thunk id of
  a `kWhile` -> trip count (`trip_counts`). A `kConditional` counts its smallest branch (the
  sampling filters' are skipped by greedy requests); `largest` counts every one's largest.
  `per_iteration_of`: a `kWhile`'s id: only ONE iteration of it (its body, its condition once),
  e.g. one decode step of a generate loop (`main_loop`)."""
  trips = trips or {}
  unknown = [0]

  def launch_kind(node):
    if node.kind in CONTAINERS or node.kind in NOT_LAUNCHES:
      return None
    return kind_of(node.kind, node.name)

  def run(nodes, pick) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for node in nodes:
      out.update(one(node, pick))
    return out

  def one(node, pick, once=False) -> collections.Counter:
    kind = launch_kind(node)
    if kind is not None:
      return collections.Counter({kind: 1})
    if node.kind == "kConditional" and node.sections:
      return pick((run(c, pick) for c in node.sections.values()),
                  key=lambda c: sum(c.values()))
    out = collections.Counter()
    for section, children in node.sections.items():
      got = run(children, pick)
      if node.kind == "kWhile" and not once:
        if node.tid not in trips and pick is min:
          unknown[0] += 1 if section == "body" else 0
        n = trips.get(node.tid, 1)
        got = collections.Counter({k: v * (n + 1 if section == "condition" else n)
                                   for k, v in got.items()})
      out.update(got)
    return out

  roots = parse(thunk_text)
  if per_iteration_of is not None:
    roots = [n for n in _walk(roots) if n.tid == per_iteration_of]
  low = run(roots, min) if per_iteration_of is None else one(roots[0], min, once=True)
  high = run(roots, max) if per_iteration_of is None else one(roots[0], max, once=True)
  return Launches(sum(low.values()), dict(low.most_common()), unknown[0], sum(high.values()))
