"""Hugging Face Llama 4 safetensors -> our parameter layout, one tensor at a time.

The name map is derived from the config (which layers are MoE, tied embeddings) and from the model's own
abstract state, so a tensor the model does not declare is an "extra tensor" error and a declared weight
with no source is a "missing tensor" error, both raised before any data is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import threading
from typing import Callable, Iterator

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from maverick.config import Config

Path = tuple  # a parameter path in the model state, e.g. ("layers", 3, "attn", "q")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PREFIX = "language_model."
# Tensors of a multimodal Llama 4 checkpoint that the text model does not use.
_IGNORED_PREFIXES = ("vision_model.", "multi_modal_projector.")
# safetensors stores little-endian data. Read the bytes ourselves: `safe_open(framework="np")`
# cannot build bfloat16 arrays ("data type 'bfloat16' not understood"), and every real checkpoint
# is bfloat16.
_FLOAT_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype(ml_dtypes.bfloat16),
                 "F16": np.dtype("<f2")}
# FP8 weights (e4m3, as in the official Maverick FP8 checkpoint); read by the FP8 importer (hf_fp8).
_FP8_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
_READABLE = {**_FLOAT_DTYPES, **_FP8_DTYPES}


# Cooperative interruption: a signal handler (scripts/convert_hf.py) sets this and the reading /
# writing loops raise KeyboardInterrupt at their next tensor or part. Raising straight from the
# handler would land inside C code (a file read, an orbax thread pool) and surface as a
# SystemError or as thread tracebacks instead of a clean unwind.
interrupt = threading.Event()


def raise_if_interrupted() -> None:
  if interrupt.is_set():
    raise KeyboardInterrupt


class CheckpointError(ValueError):
  """A checkpoint that does not match the model it claims to be."""


@dataclasses.dataclass(frozen=True)
class Target:
  path: Path
  transform: Callable[[np.ndarray], np.ndarray]
  # The transform keeps the leading axis (transform(x[a:b]) == transform(x)[a:b]): the tensor can
  # be read and converted in row chunks, never whole (the fused experts, the embedding).
  by_rows: bool = False


@dataclasses.dataclass(frozen=True)
class Source:
  """One HF tensor, its expected shape and the model parameters made from it."""
  name: str
  shape: tuple[int, ...]
  targets: tuple[Target, ...]


def _t(x):  # nn.Linear stores [out, in]; we store [in, out]. A view: the reader makes the copy.
  return x.T


def weight_map(cfg: Config) -> dict[str, Source]:
  """HF tensor name (without `language_model.`) -> Source, for every tensor the model needs."""
  D, H, K, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  V, F, Fm, E = cfg.vocab_size, cfg.intermediate_size, cfg.intermediate_size_mlp, cfg.num_local_experts
  m: dict[str, Source] = {}

  def add(name, shape, *targets):
    m[name] = Source(name, tuple(shape), tuple(Target(*t) for t in targets))

  ident = lambda x: x
  add("model.embed_tokens.weight", (V, D), (("embed",), ident, True))
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    L = ("layers", i)
    add(p + "input_layernorm.weight", (D,), (L + ("input_norm", "weight"), ident))
    add(p + "post_attention_layernorm.weight", (D,), (L + ("post_attn_norm", "weight"), ident))
    add(p + "self_attn.q_proj.weight", (H * Dh, D),
        (L + ("attn", "q"), lambda x: _t(x).reshape(D, H, Dh)))
    add(p + "self_attn.k_proj.weight", (K * Dh, D),
        (L + ("attn", "k"), lambda x: _t(x).reshape(D, K, Dh)))
    add(p + "self_attn.v_proj.weight", (K * Dh, D),
        (L + ("attn", "v"), lambda x: _t(x).reshape(D, K, Dh)))
    add(p + "self_attn.o_proj.weight", (D, H * Dh),
        (L + ("attn", "o"), lambda x: _t(x).reshape(H, Dh, D)))
    f = p + "feed_forward."
    ffn = L + ("ffn",)
    if cfg.is_moe(i):
      add(f + "router.weight", (E, D), (ffn + ("router",), _t))
      # Experts are stored x @ W ([in, out], no `.weight`); gate_up is [gate | up] halves.
      add(f + "experts.gate_up_proj", (E, D, 2 * F),
          (ffn + ("gate",), lambda x: x[..., :F], True),
          (ffn + ("up",), lambda x: x[..., F:], True))
      add(f + "experts.down_proj", (E, F, D), (ffn + ("down",), ident, True))
      for n, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
        add(f + f"shared_expert.{n}_proj.weight", shape, (ffn + ("shared", n), _t))
    else:
      for n, shape in (("gate", (Fm, D)), ("up", (Fm, D)), ("down", (D, Fm))):
        add(f + f"{n}_proj.weight", shape, (ffn + (n,), _t))
  add("model.norm.weight", (D,), (("final_norm", "weight"), ident))
  if not cfg.tie_word_embeddings:
    add("lm_head.weight", (V, D), (("lm_head",), _t))
  return m


# ----------------------------------------------------------------------------------------------
# safetensors reading
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: str
  dtype: str  # safetensors dtype code, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int = 0  # absolute byte offsets of the data in `file`
  end: int = 0


def _read_header(path: str) -> tuple[dict, int]:
  """Parses a safetensors header and checks the file holds every byte it declares.

  Returns (header without `__metadata__`, offset of the data section).
  """
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw_len = f.read(8)
    if len(raw_len) < 8:
      raise CheckpointError(f"{path}: truncated safetensors file (no header); re-download it")
    (n,) = struct.unpack("<Q", raw_len)
    if n > size - 8:
      raise CheckpointError(f"{path}: truncated safetensors file (header says {n} bytes, file "
                            f"has {size - 8}); re-download it")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
  header.pop("__metadata__", None)
  spans = []
  for name, meta in header.items():
    try:
      begin, end = (int(o) for o in meta["data_offsets"])
      shape = tuple(int(d) for d in meta["shape"])
      dtype = meta["dtype"]
    except (KeyError, TypeError, ValueError):
      raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
    if not 0 <= begin <= end:
      raise CheckpointError(f"{path}: tensor {name} has data_offsets [{begin}, {end}]; offsets "
                            "must satisfy 0 <= begin <= end. The file is corrupt; re-download it")
    spans.append((begin, end, name))
    # Only the dtypes we can read are size-checked; the others are rejected by name in `plan`.
    if dtype in _READABLE and end - begin != math.prod(shape) * _READABLE[dtype].itemsize:
      raise CheckpointError(f"{path}: tensor {name} ({dtype} {list(shape)}) spans {end - begin} "
                            "bytes in the header; the file is corrupt")
  data_size = size - 8 - n
  end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
  if end > data_size:
    raise CheckpointError(f"{path}: truncated safetensors file: tensors need {end} data bytes, "
                          f"the file has {data_size}; re-download it")
  # As the format requires (and the safetensors library checks): the tensors' byte ranges tile
  # the data section exactly, in order, with no overlap and no gap. An overlap would read one
  # tensor's bytes as another's.
  pos, previous = 0, None
  for begin, end, name in sorted(spans):
    if begin < pos:
      raise CheckpointError(f"{path}: tensor {name} (bytes [{begin}, {end})) overlaps tensor "
                            f"{previous} (ending at byte {pos}); the file is corrupt, re-download it")
    if begin > pos:
      raise CheckpointError(f"{path}: data bytes [{pos}, {begin}) belong to no tensor (before "
                            f"tensor {name}); the file is corrupt, re-download it")
    pos, previous = end, name
  if pos != data_size:
    raise CheckpointError(f"{path}: the data section has {data_size} bytes but its tensors cover "
                          f"{pos}; the file is corrupt, re-download it")
  return header, 8 + n


class SafetensorsCheckpoint:
  """A single `model.safetensors` or a sharded set with `model.safetensors.index.json`."""

  def __init__(self, directory: str, *, check_finite: bool = True):
    """check_finite: every tensor read is scanned for NaN/inf (FP8 NaN encodings too) and one
    that has any is an error naming it; False skips the scan for a trusted checkpoint."""
    self.directory = directory
    self.check_finite = check_finite
    index_path = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(index_path):
      try:
        with open(index_path) as f:
          weight_files = json.load(f)["weight_map"]
        if not (isinstance(weight_files, dict)
                and all(isinstance(v, str) for v in weight_files.values())):
          raise TypeError("weight_map is not an object of tensor name -> file name")
      except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: malformed index ({e!r}); it needs a 'weight_map' "
                              "object of tensor name -> file") from None
      files = sorted(set(weight_files.values()))
    elif os.path.isfile(single):
      files, weight_files = [SINGLE_FILE], None
    else:
      raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} found")
    self.tensors: dict[str, TensorInfo] = {}
    for fname in files:
      path = os.path.join(directory, fname)
      if not os.path.isfile(path):
        raise CheckpointError(f"{index_path}: shard {fname} is listed but missing from {directory}")
      header, data_start = _read_header(path)
      for name, meta in header.items():
        if weight_files is not None and weight_files.get(name) != fname:
          raise CheckpointError(f"{path}: tensor {name} is not where {INDEX_FILE} says "
                                f"({weight_files.get(name)})")
        begin, end = meta["data_offsets"]
        self.tensors[name] = TensorInfo(fname, meta["dtype"], tuple(meta["shape"]),
                                        data_start + int(begin), data_start + int(end))
    if weight_files is not None:
      absent = sorted(set(weight_files) - set(self.tensors))
      if absent:
        raise CheckpointError(f"{index_path} lists tensors absent from their shards: {absent[:5]}")

  def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor (or its rows [start, stop) along axis 0) as a writable NumPy array (F32, F16,
    BF16 or F8_E4M3) in a 64-byte aligned buffer, so JAX can adopt it without a copy."""
    raise_if_interrupted()
    info = self.tensors[name]
    if info.dtype not in _READABLE:
      raise CheckpointError(f"tensor {name} has dtype {info.dtype}; expected one of "
                            f"{sorted(_READABLE)}")
    dtype = _READABLE[info.dtype]
    shape, begin = info.shape, info.begin
    if rows is not None:
      row_bytes = math.prod(shape[1:]) * dtype.itemsize
      shape = (rows[1] - rows[0],) + tuple(shape[1:])
      begin += rows[0] * row_bytes
    arr = aligned_empty(shape, dtype)
    with open(os.path.join(self.directory, info.file), "rb") as f:
      f.seek(begin)
      got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
    if got != arr.nbytes:  # the file shrank after the header was checked
      raise CheckpointError(f"{info.file}: tensor {name} is truncated; re-download the file")
    if dtype.byteorder not in ("=", "|"):
      arr = arr.astype(dtype.newbyteorder("="))  # big-endian host only
    if self.check_finite:
      bad = count_nonfinite(arr)
      if bad:
        raise CheckpointError(
            f"{info.file}: tensor {name} has {bad} NaN/inf value(s) out of {arr.size}; the "
            f"checkpoint is damaged (re-download or repair it). To load it anyway, pass "
            f"--nocheck_finite (check_finite=False).")
    return arr


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """An uninitialised array whose data starts on an `align`-byte boundary: JAX's CPU backend then
  adopts it (`device_put(x, may_alias=True)`) instead of copying it."""
  dtype = np.dtype(dtype)
  n = math.prod(shape) * dtype.itemsize
  buf = np.empty(n + align, np.uint8)
  off = (-buf.ctypes.data) % align
  return buf[off:off + n].view(dtype).reshape(shape)


def as_aligned(x: np.ndarray, dtype) -> np.ndarray:
  """`x` in `dtype`, C-contiguous and 64-byte aligned: `x` itself when it already is (no copy)."""
  dtype = np.dtype(dtype)
  if x.dtype == dtype and x.flags.c_contiguous and x.ctypes.data % 64 == 0:
    return x
  out = aligned_empty(x.shape, dtype)
  out[...] = x
  return out


# Exponent bits of each readable dtype: all set means inf or NaN (e4m3fn: no inf, NaN = S.1111.111).
_NONFINITE_MASK = {"float32": (np.uint32, 0x7F800000), "float16": (np.uint16, 0x7C00),
                   "bfloat16": (np.uint16, 0x7F80), "float8_e4m3fn": (np.uint8, 0x7F)}


def count_nonfinite(arr: np.ndarray, chunk: int = 1 << 24) -> int:
  """NaN/inf count from the bit patterns, in chunks: no float copy of a multi-GB tensor."""
  uint, mask = _NONFINITE_MASK[arr.dtype.name]
  bits = arr.reshape(-1).view(uint)
  return sum(int(np.count_nonzero((bits[i:i + chunk] & mask) == mask))
             for i in range(0, bits.size, chunk))


def plan(ckpt: SafetensorsCheckpoint, cfg: Config) -> list[tuple[str, Source]]:
  """Checks names, shapes and dtypes against the model from headers alone; returns the read order
  (file by file, so each shard is opened once)."""
  expected = weight_map(cfg)
  found: dict[str, str] = {}  # canonical -> stored name
  extra = []
  for stored in ckpt.tensors:
    canonical = stored[len(_PREFIX):] if stored.startswith(_PREFIX) else stored
    if canonical in expected:
      if canonical in found:
        raise CheckpointError(f"tensor {canonical} appears twice ({found[canonical]}, {stored})")
      found[canonical] = stored
    elif not canonical.startswith(_IGNORED_PREFIXES):
      extra.append(stored)
  missing = sorted(set(expected) - set(found))
  if missing:
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise CheckpointError(f"missing tensor(s) {missing[:5]}{more} in {ckpt.directory}: the "
                          "checkpoint does not match its config.json (layers, MoE layers, "
                          "tie_word_embeddings)")
  if extra:
    more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
    raise CheckpointError(f"unexpected tensor(s) {sorted(extra)[:5]}{more} in {ckpt.directory}: "
                          "the checkpoint does not match its config.json")
  for canonical, stored in found.items():
    info, src = ckpt.tensors[stored], expected[canonical]
    if info.shape != src.shape:
      raise CheckpointError(f"tensor {stored} has shape {list(info.shape)}, expected "
                            f"{list(src.shape)} from config.json")
    if info.dtype not in _FLOAT_DTYPES:
      raise CheckpointError(f"tensor {stored} has dtype {info.dtype}; expected one of "
                            f"{sorted(_FLOAT_DTYPES)} (FP8 checkpoints need the FP8 importer)")
  order = sorted(found.items(), key=lambda kv: (ckpt.tensors[kv[1]].file, kv[1]))
  return [(stored, expected[canonical]) for canonical, stored in order]


# Row chunks of a tensor read by rows: big enough for fast reads, small next to a layer.
CHUNK_BYTES = 16 << 20


def iter_params(ckpt: SafetensorsCheckpoint, cfg: Config, dtype=None, order=None
                ) -> Iterator[tuple[Path, np.ndarray]]:
  """Yields (parameter path, array in our layout and `dtype`, C-contiguous and aligned), reading
  one HF tensor at a time. A tensor whose targets all keep its rows (fused experts, embedding) is
  read in row chunks straight into its outputs, so it is never in memory twice; any other tensor
  is read whole and freed once its targets are built. `order`: plan(ckpt, cfg) if already made."""
  dtype = jnp.dtype(dtype or cfg.dtype)
  for stored, src in (plan(ckpt, cfg) if order is None else order):
    yield from _read_source(ckpt, stored, src, dtype)


def _read_source(ckpt: SafetensorsCheckpoint, stored: str, src: Source, dtype):
  info = ckpt.tensors[stored]
  row_bytes = math.prod(info.shape[1:]) * _READABLE[info.dtype].itemsize
  if all(t.by_rows for t in src.targets) and len(info.shape) > 1 and \
      info.end - info.begin > CHUNK_BYTES:
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    n = info.shape[0]
    first = ckpt.read(stored, rows=(0, min(step, n)))
    outs = []
    for t in src.targets:
      piece = t.transform(first)
      outs.append(aligned_empty((n,) + piece.shape[1:], dtype))
      outs[-1][:piece.shape[0]] = piece
    del first, piece
    for a in range(step, n, step):
      chunk = ckpt.read(stored, rows=(a, min(a + step, n)))
      for t, out in zip(src.targets, outs):
        out[a:a + chunk.shape[0]] = t.transform(chunk)
      del chunk
    for t in src.targets:
      yield t.path, outs.pop(0)
    return
  raw = ckpt.read(stored)
  targets = list(src.targets)
  while targets:
    t = targets.pop(0)
    x = as_aligned(t.transform(raw), dtype)
    if not targets:
      del raw  # the last target: the source is not needed while the caller holds x
    yield t.path, x
    del x
