"""Image prompts in the serving engine (issue 30): a request's pixel values, and its insert program.

A request with images carries the tiles of its images ([tiles, 3, S, S] float32, from
`maverick.generation.image_inputs`, the path `maverick.generate(images=)` takes). Its insert runs
the same prefill as a text request with `plain.Request.pixel_values` set: the tower's features
replace the <|patch|> embeddings (`maverick.generation.prefill`), the draft (speculative) reads the
target's features at those positions as it does for text, and the step loop is unchanged. The tile
count is a shape, so there is one insert program per (prompt bucket, tile count), compiled on first
use (text requests keep their ahead-of-time programs).

The paged prefix cache keys blocks by token ids, and an image's placeholder tokens are the same
for every image: a request with images neither reuses nor publishes prefix blocks (it is admitted
"private", see blocks.BlockManager.admit), and its prefill starts at 0.
"""

from __future__ import annotations

import jax

from maverick import generation as plain
from maverick.vision import model as vision_lib
from maverick.vision import preprocess as vision_pre


def request_pixels(engine, prompt, images, max_tiles):
  """The pixel values [tiles, 3, S, S] of one request's `images` (None without images), checked
  against the prompt's image tokens and the model; bad input raises ValueError (ImageInputError
  for bytes Pillow cannot decode) with the message to show."""
  if images is not None and not isinstance(images, (list, tuple)):
    images = [images]
  if images and vision_lib.tower_of(engine.model) is None:
    raise ValueError("this model has no vision tower (a text-only model, or one loaded without "
                     "vision=True / --vision): it cannot take images; send text only or serve a "
                     "multimodal Llama 4 checkpoint")
  return plain.image_inputs(engine.model, [list(prompt)], images or None, max_tiles)


def insert(engine, bucket: int, args, pixels):
  """Runs the insert for a prompt bucket with these image tiles (pixels, on the host): its
  program is compiled the first time a (bucket, tile count) comes; returns the new slot state."""
  pixels = plain.with_images(plain.Request(None, None, None, None, None), pixels,
                             engine.model).pixel_values  # replicated, as the tower is
  key = ("insert-images", bucket, pixels.shape[0])
  if key not in engine._exes:
    insert = jax.jit(engine._insert, donate_argnums=(1,))
    engine._exes[key] = insert.lower(engine._states, engine._slots_state, *args,
                                     pixels=pixels).compile()
  return engine._exes[key](engine._states, engine._slots_state, *args, pixels=pixels)


def of_which(engine, prompt) -> str:
  """" (n of them image tokens: ...)" for a prompt with image tokens, else ""."""
  tower = vision_lib.tower_of(engine.model)
  n = 0 if tower is None else sum(t == tower.config.image_token_id for t in prompt)
  return (f" ({n} of them image tokens: send fewer or smaller images, or a lower max_tiles)"
          if n else "")


ImageInputError = vision_pre.ImageInputError
