"""Streaming generation: new tokens of one prompt in chunks, as the device produces them.

Generation is one device call with no host sync inside (maverick.generate), so a stream is a series
of such calls, each producing `chunk_tokens` tokens from the text so far (prompt + tokens streamed so
far). The cost, against one call for the whole output:
  - every chunk re-runs the prefill over the whole text so far (the KV cache is not kept between
    calls), so the extra work grows with length: about (output / chunk) prefills;
  - one dispatch and device->host copy per chunk;
  - a compile the first time the text enters a new power-of-two length bucket (then cached).
Bigger chunks amortise all three; the first chunk's latency is the time to first token.

Greedy output equals one call's output up to floating-point ties (prefill and decode compute the
same values in a different order); sampled output follows the same distribution, deterministically
for a seed (chunk i samples with seed + i).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import numpy as np

import spec_decode
from maverick import generation as plain


@dataclasses.dataclass
class Chunk:
  tokens: list[int]  # new tokens of this chunk (stop token included when one was produced)
  output: object  # the Generation / SpecGeneration of this chunk's device call
  seconds: float  # wall time of this chunk, compile included
  done: bool  # the stream ends after this chunk


def stream(model, prompt: Sequence[int], *, chunk_tokens: int = 16, max_new_tokens: int = 64,
           draft=None, k: int = 3, tree=None, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
           max_cache_len: int | None = None, images=None,
           max_tiles: int | None = None) -> Iterator[Chunk]:
  """Yields the continuation of ONE prompt chunk by chunk; speculative when `draft` is given
  (an EAGLE-3 draft head, `k` tokens per round, or a draft `tree` shape where spec_decode has
  tree drafting). Arguments as for `maverick.generate`; `images` go with every chunk's call (its
  prefill re-reads the prompt's image tokens; preprocess them once with
  maverick.vision.preprocess_image to skip re-decoding)."""
  if chunk_tokens < 1:
    raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if len(prompt) and isinstance(prompt[0], (list, tuple, np.ndarray)):
    raise ValueError("stream() takes ONE prompt (a list of token ids), not a batch")
  plain.check_context(model.config, [len(prompt)], max_new_tokens)  # before the first chunk
  stops = set(model.config.eos_token_ids if stop_tokens is None else stop_tokens)
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_cache_len=max_cache_len,
            stop_tokens=sorted(stops), images=images, max_tiles=max_tiles)
  context, produced, i = list(prompt), 0, 0
  while True:
    n = min(chunk_tokens, max_new_tokens - produced)
    start = time.perf_counter()
    if draft is None:
      out = plain.generate(model, [context], max_new_tokens=n, seed=(seed + i) % 2**32, **kw)
    else:
      shape = {} if tree is None else {"tree": tree}
      out = spec_decode.generate(model, draft, [context], k=k, max_new_tokens=n,
                                 seed=(seed + i) % 2**32, **shape, **kw)
    new = out.tokens[0]
    produced += len(new)
    context += new
    done = produced >= max_new_tokens or len(new) < n or (bool(new) and new[-1] in stops)
    yield Chunk(new, out, time.perf_counter() - start, done)
    if done:
      return
    i += 1
