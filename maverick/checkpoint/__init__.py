"""Checkpoint import (Hugging Face safetensors) and our orbax format."""

from maverick.checkpoint.hf import CheckpointError, SafetensorsCheckpoint
from maverick.checkpoint.store import (
    convert_hf_to_orbax, is_orbax_checkpoint, load_hf, load_orbax, save_orbax)

__all__ = ["CheckpointError", "SafetensorsCheckpoint", "convert_hf_to_orbax",
           "is_orbax_checkpoint", "load_hf", "load_orbax", "save_orbax"]
