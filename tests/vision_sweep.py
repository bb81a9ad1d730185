"""The size sweep's RGB inputs (tests/fixtures/hf_llama4_vision/size_sweep.*): one function that
tools/make_vision_fixture.py (which writes the fixture, in a venv with torch) and
tests/test_vision_preprocess.py (which checks against it) both import; NumPy only. The fixture keeps
each input's sha256, so a change here shows as drift."""

import numpy as np


def sweep_image(h: int, w: int, chans: int, seed: int) -> np.ndarray:
  """uint8 (h, w, chans): an integer hash of (seed, block row, block col, channel) on 1..3 x 1..4 px
  blocks."""
  bh, bw = 1 + seed % 3, 1 + (seed // 3) % 4
  y = (np.arange(h, dtype=np.uint32) // bh)[:, None, None]
  x = (np.arange(w, dtype=np.uint32) // bw)[None, :, None]
  c = np.arange(chans, dtype=np.uint32)[None, None, :]
  v = (y * np.uint32(0x9E3779B1)) ^ (x * np.uint32(0x85EBCA77)) ^ (c * np.uint32(0xC2B2AE3D))
  v = v ^ np.uint32((seed * 0x27D4EB2F) & 0xFFFFFFFF)
  v = v ^ (v >> np.uint32(15))
  v = v * np.uint32(0x2C1B3C6D)
  v = v ^ (v >> np.uint32(12))
  v = v * np.uint32(0x297A2D39)
  v = v ^ (v >> np.uint32(15))
  return (v >> np.uint32(24)).astype(np.uint8)
