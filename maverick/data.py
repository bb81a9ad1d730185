"""Text corpora for training and evaluation: the Python standard library's own `.py` files.

The stdlib exists offline on every machine, so the embedded model can be trained and evaluated anywhere.
The split is by whole file and deterministic: a file is held out for validation when the SHA-256 of its
path relative to the stdlib root falls in the lowest `val_fraction` of the hash range, so the split does
not depend on listing order or on which other files exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from typing import Sequence

import numpy as np


class CorpusError(ValueError):
  """A text folder that cannot serve as a corpus."""


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def is_validation(relpath: str, val_fraction: float) -> bool:
  digest = hashlib.sha256(relpath.replace(os.sep, "/").encode()).digest()
  return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def list_files(root: str, suffix: str = ".py", exclude: Sequence[str] = ("site-packages",)
               ) -> list[str]:
  """Relative paths of every `suffix` file under root, sorted (skipping `exclude` directories)."""
  if not os.path.isdir(root):
    raise CorpusError(f"corpus folder {root} does not exist")
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in exclude and not d.startswith("."))
    for f in filenames:
      if f.endswith(suffix):
        out.append(os.path.relpath(os.path.join(dirpath, f), root))
  return sorted(out)


def split_files(root: str, split: str, val_fraction: float = 0.05, suffix: str = ".py"
                ) -> list[str]:
  """'train', 'validation' or 'all' files of a folder (relative paths, sorted)."""
  files = list_files(root, suffix)
  if split == "all":
    return files
  if split not in ("train", "validation"):
    raise ValueError(f"split must be 'train', 'validation' or 'all', got {split!r}")
  want_val = split == "validation"
  return [f for f in files if is_validation(f, val_fraction) == want_val]


@dataclasses.dataclass
class Texts:
  root: str
  files: list[str]  # relative paths that decoded as UTF-8
  texts: list[str]
  skipped: list[str]  # not UTF-8 (or unreadable): skipped and counted, never fatal

  @property
  def num_bytes(self) -> int:
    return sum(len(t.encode("utf-8")) for t in self.texts)


def read_texts(root: str, files: Sequence[str]) -> Texts:
  kept, texts, skipped = [], [], []
  for rel in files:
    try:
      with open(os.path.join(root, rel), encoding="utf-8") as f:
        text = f.read()
    except (UnicodeDecodeError, OSError):
      skipped.append(rel)
      continue
    if text.strip():
      kept.append(rel)
      texts.append(text)
  if not texts:
    raise CorpusError(f"no usable text files in {root} ({len(files)} candidate files, "
                      f"{len(skipped)} not UTF-8); point --data_dir at a folder of .py files")
  return Texts(root, kept, texts, skipped)


def load_split(root: str | None, split: str, val_fraction: float = 0.05,
               suffix: str = ".py") -> Texts:
  root = root or stdlib_root()
  files = split_files(root, split, val_fraction, suffix)
  if not files:
    raise CorpusError(f"no {suffix} files in the {split!r} split of {root}")
  return read_texts(root, files)


def encode_documents(hf_tokenizer, texts: Sequence[str], bos_id: int) -> list[np.ndarray]:
  """Each text as [BOS, tokens...] int32, the way generation sees a prompt."""
  encoded = hf_tokenizer.encode_batch(list(texts), add_special_tokens=False)
  return [np.concatenate([[bos_id], e.ids]).astype(np.int32) for e in encoded]


def token_stream(documents: Sequence[np.ndarray], eos_id: int) -> np.ndarray:
  """All documents as one int32 stream, each ended by EOS (so the model learns to stop)."""
  eos = np.asarray([eos_id], np.int32)
  return np.concatenate([part for d in documents for part in (d, eos)])


def sample_windows(stream: np.ndarray, batch_size: int, length: int, seed: int, step: int
                   ) -> np.ndarray:
  """[batch, length + 1] random windows; a pure function of (seed, step), so training resumes
  exactly where it stopped."""
  if len(stream) <= length + 1:
    raise CorpusError(f"corpus has {len(stream)} tokens, fewer than one training window of "
                      f"{length + 1}; use more text or a shorter --seq_len")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - length - 1, size=batch_size)
  return np.stack([stream[s:s + length + 1] for s in starts])
