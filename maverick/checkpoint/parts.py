"""How our checkpoint format splits a model's parameters into parts: one orbax checkpoint per part
("embed", "layer_000", ..., "head", and "vision" for a vision tower), each a pytree keyed by the parameter's path inside the part.
Shared by the format's writer and reader (store) and the streaming importers (hf_fp8, ...).
"""

from __future__ import annotations


def part_of(path: tuple) -> str:
  if path[0] == "vision":  # the vision tower (model.vision), its own part
    return "vision"
  if path[0] == "layers":
    return f"layer_{int(path[1]):03d}"
  return "embed" if path[0] in ("embed", "embed_scale") else "head"


def part_key(path: tuple) -> tuple[str, ...]:
  """Path of a parameter inside its part's pytree."""
  rest = path[2:] if path[0] == "layers" else path
  return tuple(str(p) for p in rest)


def full_path(part: str, key: tuple[str, ...]) -> tuple:
  """Inverse of (part_of, part_key): the model-state path of `key` in `part`."""
  return ("layers", int(part[6:])) + tuple(key) if part.startswith("layer_") else tuple(key)
