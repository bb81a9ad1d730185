"""Batched generation as ONE jitted call: prefill, then a `lax.while_loop` of decode steps.

Prompts are RIGHT-padded to a length bucket; each row keeps its own cache length, so every row's
positions start at 0 exactly as an unpadded HF run (no left-pad position shifts). Prompt and
generation lengths are bucketed (powers of two), and lengths, sampling parameters, stop tokens and
per-row limits are traced, so a new prompt length in the same bucket reuses the compiled program.
Inside the call nothing goes back to the host: the loop condition, sampling and stopping all run on
device (tests check the compiled HLO has no host callback, send/recv or in/outfeed).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick import kv_cache as kvc
from maverick import kernels as kernels_lib
from maverick import program_cache
from maverick import sampling
from maverick import sharding
from maverick.model import Llama4
from maverick.vision import model as vision_lib
from maverick.vision import preprocess as vision_pre

MIN_BUCKET = 16
NO_STOP = -1


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
  """Next power of two >= n (at least `minimum`)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Request:
  """Device inputs of one generate call (all traced: changing them never recompiles)."""
  prompt: jax.Array  # [B, Tp] int32, right-padded
  prompt_lengths: jax.Array  # [B] int32
  max_new_tokens: jax.Array  # [B] int32
  stop_ids: jax.Array  # [B, n] int32, padded with -1
  sampling: sampling.SamplingParams  # per-row parameters and random streams (seeds)
  # Image prompts: the tiles of every image, in prompt order over the batch (see image_inputs);
  # None for text. Its tile count is a shape: one compiled program per (buckets, tile count).
  pixel_values: jax.Array | None = None


def prepare(cfg, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 64,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            seed: int | Sequence[int] = 0,
            stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
            max_cache_len: int | None = None, **options) -> tuple[Request, int, int]:
  """Validates and pads on the host. Returns (request, decode steps bucket, cache capacity).
  options: the further sampling options of `maverick.sampling.SamplingParams.create` (min_p,
  presence_penalty, frequency_penalty, repetition_penalty, min_tokens, logit_bias)."""
  if isinstance(prompts, np.ndarray):
    prompts = prompts.tolist()
  if not prompts:
    raise ValueError("no prompts given: pass at least one prompt (a list of token ids)")
  if isinstance(prompts[0], (int, np.integer)):
    raise ValueError("prompts must be a list of token-id lists (a batch); wrap a single prompt "
                     "in a list")
  rows = [list(map(int, p)) for p in prompts]
  for i, p in enumerate(rows):
    if not p:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. BOS)")
    bad = [t for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary "
                       f"[0, {cfg.vocab_size})")
  B = len(rows)
  max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (B,)).copy()
  if (max_new < 1).any():
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  lengths = np.array([len(p) for p in rows], np.int32)
  t_prompt = bucket(lengths.max())
  steps = bucket(max_new.max())
  needed = int((lengths + max_new).max())
  check_context(cfg, lengths, max_new)
  if max_cache_len is not None and needed > max_cache_len:
    longest = int(lengths.max())
    what = ("the prompt alone" if longest >= max_cache_len else
            f"prompt ({longest}) + max_new_tokens ({int(max_new.max())})")
    raise ValueError(f"{what} needs {needed} cache positions but the KV cache holds "
                     f"{max_cache_len}; raise max_cache_len (--max_cache_len) or shorten the input")
  capacity = t_prompt + steps
  if max_cache_len is not None:
    # The prefill writes the whole padded prompt into the cache: a bucket past the user's cache
    # limit shrinks to it (still >= the longest prompt, checked above), so the capacity always
    # holds the padded prompt.
    t_prompt = min(t_prompt, max_cache_len)
    capacity = max(min(capacity, max_cache_len), needed, t_prompt)

  padded = np.zeros((B, t_prompt), np.int32)
  for i, p in enumerate(rows):
    padded[i, :len(p)] = p
  stop = _stop_matrix(cfg, B, stop_tokens)
  params = sampling.SamplingParams.create(B, temperature, top_k, top_p, seed=seed,
                                          vocab_size=cfg.vocab_size, **options)
  # device_put, not jnp.asarray: the latter compiles a small program per new shape, and a generate
  # call must be exactly one compiled executable.
  put = jax.device_put
  req = Request(prompt=put(padded), prompt_lengths=put(lengths),
                max_new_tokens=put(max_new.astype(np.int32)), stop_ids=put(stop),
                sampling=params)
  return req, steps, capacity


def check_context(cfg, prompt_lengths, max_new_tokens) -> None:
  """Refuses rows whose prompt + max_new_tokens runs past the model's context. Refused, not
  clamped: a silently shorter answer is worse than an error that says what to lower."""
  lengths = np.asarray(prompt_lengths, np.int64)
  total = lengths + np.asarray(max_new_tokens, np.int64)
  context = cfg.max_position_embeddings
  if (total <= context).all():
    return
  i = int(np.argmax(total))
  if lengths[i] >= context:  # at the context is too long too: one new token must fit after it
    raise ValueError(f"prompt {i} has {lengths[i]} tokens and the model's context of {context} "
                     f"positions (max_position_embeddings) must hold the prompt and at least one "
                     f"new token: shorten it to at most {context - 1} tokens")
  raise ValueError(f"prompt {i} ({lengths[i]} tokens) + max_new_tokens ({total[i] - lengths[i]}) "
                   f"= {total[i]}, past the model's context of {context} positions "
                   f"(max_position_embeddings): lower max_new_tokens (--max_new_tokens) to at "
                   f"most {context - lengths[i]} or shorten the prompt")


def _token_id(t) -> int:
  if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
    raise ValueError(f"stop token {t!r} is not an integer token id")
  return int(t)


def _stop_matrix(cfg, batch: int, stop_tokens) -> np.ndarray:
  if stop_tokens is None:
    per_row = [list(cfg.eos_token_ids)] * batch
  elif len(stop_tokens) and isinstance(stop_tokens[0], (list, tuple, np.ndarray)):
    if len(stop_tokens) != batch:
      raise ValueError(f"stop_tokens has {len(stop_tokens)} rows for {batch} prompts")
    per_row = [[_token_id(t) for t in s] for s in stop_tokens]
  else:
    per_row = [[_token_id(t) for t in stop_tokens]] * batch
  for s in per_row:
    bad = [t for t in s if not 0 <= t < cfg.vocab_size]
    if bad:
      raise ValueError(f"stop token ids {bad[:5]} are outside the vocabulary [0, "
                       f"{cfg.vocab_size}); pass ids the tokenizer produces (e.g. "
                       f"tokenizer.encode('...') or loaded.stop_tokens)")
  width = max(1, max(len(s) for s in per_row))
  out = np.full((batch, width), NO_STOP, np.int32)
  for i, s in enumerate(per_row):
    out[i, :len(s)] = s
  return out


def prefill(model: Llama4, req: Request, capacity: int, *, capture_layers=(), cache=None,
            start=None):
  """Fills an empty cache with the prompts; returns (forward output at each row's last prompt token,
  cache with lengths = prompt lengths). `cache`: the (empty-rowed, lengths 0) cache to fill, e.g. a
  paged one (kv_cache.PagedKVCache) whose tables name the rows' blocks; default a new contiguous
  one of `capacity`. `start` [B]: the cache already holds positions < start (a prefix-cache hit):
  req.prompt is then the prompt FROM start (right-padded), written at start.., attending to the
  cache; req.prompt_lengths stay whole-prompt lengths."""
  B = req.prompt.shape[0]
  if cache is None:
    cache = kvc.KVCache.init(model.config, B, capacity)
  cache = sharding.constrain_cache(cache, sharding.plan_of(model))
  embeds = None
  if req.pixel_values is not None:  # the image features replace the <|patch|> embeddings
    # With images, `start` must be 0 (req.prompt the whole prompt): the features are matched to
    # the image tokens from the first one on. The paged engine never prefix-caches image prompts.
    tower = model.vision
    embeds = vision_lib.merge_features(model.embed_tokens(req.prompt), req.prompt,
                                       req.prompt_lengths, tower(req.pixel_values),
                                       tower.config.image_token_id)
  if start is not None:
    out = model(req.prompt, cache=cache.with_lengths(start),
                logits_at=req.prompt_lengths - start - 1, capture_layers=capture_layers,
                input_embeds=embeds)
    return out, out.cache.with_lengths(req.prompt_lengths)
  out = model(req.prompt, cache=cache, prefill=True, logits_at=req.prompt_lengths - 1,
              capture_layers=capture_layers, input_embeds=embeds)
  return out, out.cache.with_lengths(req.prompt_lengths)


def image_inputs(model: Llama4, prompts, images, max_tiles: int | None = None):
  """Host side of image prompts: the pixel values [tiles, 3, S, S] (float32) of `images`, or None.

  `images`: every image of the batch in prompt order (row 0's first), each an HxWx3 / HxW / HxWx4
  uint8 array, image file bytes or a path (decoded with Pillow), or a
  `maverick.vision.PreprocessedImage`. The prompts must already hold each image's token layout
  (`maverick.vision.expand_image_placeholders` on the text, with the tile grids that
  `maverick.vision.preprocess_image(image, model.vision.config.preprocess(max_tiles))` gives):
  each row's layouts are matched with the images in order, one layout per image, by patch count and
  tile grid (`check_image_layouts`), and the image tokens against the model's context."""
  tower = vision_lib.tower_of(model)
  if images is None or (isinstance(images, (list, tuple)) and not images):
    if tower is not None:
      check_image_layouts(tower.config, model.config, prompts, [])
    return None
  if tower is None:
    raise ValueError("images were given but this model has no vision tower (a text-only model or "
                     "one loaded with vision=False / --text_only): load a multimodal Llama 4 "
                     "checkpoint with its vision tower, or send text only")
  if isinstance(images, np.ndarray) and images.ndim == 4:
    images = list(images)
  if not isinstance(images, (list, tuple)):
    images = [images]
  cfg = tower.config.preprocess(max_tiles)
  done = []
  for im in images:
    if not isinstance(im, vision_pre.PreprocessedImage):
      if isinstance(im, (bytes, bytearray, memoryview, str)) or hasattr(im, "__fspath__"):
        im = vision_pre.decode_image(im)
      im = vision_pre.preprocess_image(im, cfg)
    done.append(im)
  check_image_layouts(tower.config, model.config, prompts, done)
  return np.concatenate([im.pixel_values for im in done]).astype(np.float32)


_FIX = ("build the prompt with maverick.vision.expand_image_placeholders from these images' tile "
        "grids (same max_tiles): one <|image|> per image, in order")


def _tiles(grid) -> int:
  return grid[0] * grid[1] + (grid[0] * grid[1] > 1)  # + the global tile


def _layouts(row, vcfg, i: int):
  """[(patch tokens, tile grid or None when the layout is not one)] of each
  <|image_start|> ... <|image_end|> in prompt row `i`, in order."""
  t = np.asarray(row, np.int64)
  starts = np.flatnonzero(t == vcfg.image_start_token_id)
  ends = np.flatnonzero(t == vcfg.image_end_token_id)
  if (len(starts) != len(ends) or np.any(ends <= starts)
      or np.any(starts[1:] <= ends[:-1])):
    raise ValueError(f"prompt {i} has unpaired image markers ({len(starts)} <|image_start|> "
                     f"(id {vcfg.image_start_token_id}), {len(ends)} <|image_end|> (id "
                     f"{vcfg.image_end_token_id}), not alternating): {_FIX}")
  patch = t == vcfg.image_token_id
  inside = np.zeros(len(t) + 1, np.int64)
  np.add.at(inside, starts, 1)
  np.add.at(inside, ends + 1, -1)
  outside = int(np.sum(patch & (np.cumsum(inside[:-1]) == 0)))
  if outside:
    raise ValueError(f"prompt {i} holds {outside} image tokens (<|patch|>, id "
                     f"{vcfg.image_token_id}) outside any <|image_start|> ... <|image_end|> layout: "
                     f"{_FIX}")
  ppt = vcfg.patches_per_tile
  out = []
  for s, e in zip(starts, ends):
    seg = patch[s + 1:e]
    n = int(seg.sum())
    # runs of patch tokens: each tile's patches, separated by one tile-separator token
    edges = np.diff(np.concatenate([[0], seg.astype(np.int8), [0]]))
    run_starts, run_ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    grid = None
    if len(run_starts) and np.all(run_ends - run_starts == ppt):
      if len(run_starts) == 1:
        grid = (1, 1)
      else:  # the token after each local tile: <|tile_x_separator|>, at a row's end <|tile_y_...|>
        seps = t[s + 1 + run_ends[:-1]]
        row_end = seps == seps[-1]
        cols = int(np.argmax(row_end)) + 1
        if len(seps) > 1 and np.array_equal(row_end, (np.arange(len(seps)) + 1) % cols == 0):
          grid = (len(seps) // cols, cols)
    out.append((n, grid))
  return out


def check_image_layouts(vcfg, cfg, prompts, images) -> None:
  """Each prompt row's image layouts against `images` (PreprocessedImage, the whole batch's in
  prompt order, row 0's first): one layout per image, in order, each with the image's tile grid
  and tiles x patches_per_tile <|patch|> tokens; the image tokens fit the model's context.
  ValueError naming the row, the image and the fix otherwise."""
  if not len(prompts) or not all(isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
    return  # malformed prompts: `prepare` says what is wrong with them
  context = cfg.max_position_embeddings
  layouts = []
  for i, p in enumerate(prompts):
    n = int(np.sum(np.asarray(p, np.int64) == vcfg.image_token_id)) if len(p) else 0
    if n >= context:
      raise ValueError(f"prompt {i} holds {n} image tokens, more than the model's context of "
                       f"{context} positions leaves room for (the prompt and one new token): send "
                       "fewer or smaller images, or lower max_tiles")
    layouts.append(_layouts(p, vcfg, i) if len(p) else [])
  per_row = [len(rows) for rows in layouts]
  if sum(per_row) != len(images):
    rows = ", ".join(f"prompt {i}: {n}" for i, n in enumerate(per_row))
    raise ValueError(f"the prompts hold {sum(per_row)} image layouts (<|image_start|> ... "
                     f"<|image_end|>; {rows}) but {len(images)} images were given, taken in prompt "
                     f"order over the batch: {_FIX}")
  ppt = vcfg.patches_per_tile
  j = 0
  for i, rows in enumerate(layouts):
    for k, (n, grid) in enumerate(rows):
      im = images[j]
      want_grid = tuple(int(v) for v in im.tile_grid)
      tiles = _tiles(want_grid)
      if im.pixel_values.shape[0] != tiles:
        raise ValueError(f"image {j} has {im.pixel_values.shape[0]} tiles of pixel values but its "
                         f"tile grid {want_grid} needs {tiles}: pass the PreprocessedImage that "
                         "maverick.vision.preprocess_image returns")
      if n != tiles * ppt or grid != want_grid:
        held = "not a tile layout" if grid is None else f"a {grid[0]}x{grid[1]} grid"
        raise ValueError(f"prompt {i}, image {k} of the row (image {j} of the batch): its layout "
                         f"holds {n} image tokens ({held}) but the image gives {tiles} tiles x "
                         f"{ppt} = {tiles * ppt} ({want_grid[0]}x{want_grid[1]} grid"
                         f"{' + global' if tiles > 1 else ''}): {_FIX}")
      j += 1


def with_images(req: Request, pixels, model) -> Request:
  """`req` with its pixel values on the model's devices (replicated: the tower is)."""
  if pixels is None:
    return req
  plan = sharding.plan_of(model)
  if plan is None:
    return dataclasses.replace(req, pixel_values=jax.device_put(pixels))
  spec = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
  return dataclasses.replace(req, pixel_values=sharding.put(pixels, spec))


def decode_round(model: Llama4, token, cache, result: sampling.Output, params, stop_ids, stop):
  """One decode step of every row: the loop body of `_generate` and of the serving engine
  (maverick/serving). Done rows commit nothing. stop(result, new [B, M], num_new [B], logprobs)
  appends."""
  out = model(token[:, None], cache=cache)
  # Finished rows keep their length: their (ignored) writes stay at one slot.
  cache = out.cache.with_lengths(jnp.where(result.done, cache.lengths, out.cache.lengths))
  token, logprobs = sampling.sample(out.logits[:, 0], params, result, stop_ids)
  result = stop(result, token[:, None], (~result.done).astype(jnp.int32), logprobs)
  return token, cache, result


def init_output(cfg, req: Request, batch: int, capacity: int, max_append: int, pad_id: int):
  """The empty output of `req` (with its prompts' tokens marked for the repetition penalty)."""
  return sampling.init_output(batch, capacity, max_append, pad_id, req.prompt, req.prompt_lengths,
                              cfg.vocab_size)


def _generate(graphdef: nnx.GraphDef, state: nnx.State, req: Request, *, steps: int,
              capacity: int, pad_id: int):
  model = nnx.merge(graphdef, state)
  B = req.prompt.shape[0]
  out, cache = prefill(model, req, capacity)
  stop = lambda out, new, n, lp: sampling.append(out, new, n, req.stop_ids, req.max_new_tokens,
                                                 pad_id, lp)
  result = init_output(model.config, req, B, steps, 1, pad_id)
  token, logprobs = sampling.sample(out.logits, req.sampling, result, req.stop_ids)
  result = stop(result, token[:, None], jnp.ones((B,), jnp.int32), logprobs)

  def cond(carry):
    step, _, _, result = carry
    return (step < steps) & ~jnp.all(result.done)

  def body(carry):
    step, token, cache, result = carry
    token, cache, result = decode_round(model, token, cache, result, req.sampling, req.stop_ids,
                                        stop)
    return step + 1, token, cache, result

  _, _, _, result = jax.lax.while_loop(cond, body, (1, token, cache, result))
  return result.tokens[:, :steps], result.num_tokens, output_logprobs(result, steps)


def output_logprobs(result: sampling.Output, steps: int) -> sampling.TokenLogprobs:
  return sampling.TokenLogprobs(result.logprob[:, :steps], result.top_ids[:, :steps],
                                result.top_logprobs[:, :steps])


def host_logprobs(lp: sampling.TokenLogprobs, num, top: int | None):
  """Per row [(logprob, [(id, logprob)] * top)] per token from the program's output, or None
  when no logprobs were asked for (nothing is fetched then)."""
  if top is None:
    return None
  lp = jax.tree.map(sharding.to_host, lp)
  return [sampling.logprob_lists(lp.logprob[b], lp.top_ids[b], lp.top_logprobs[b], int(n), top)
          for b, n in enumerate(num)]


generate_jit = jax.jit(_generate, static_argnames=("graphdef", "steps", "capacity", "pad_id"))

class ExecutableCache:
  """Compiled programs by (static args, input avals), least recently used dropped past `maxsize`.

  Compiling ahead of the call lets callers see compile time apart from generation time. Bounded:
  every executable holds its machine code (on CPU, several memory mappings per fused kernel), so
  a long session that sweeps many buckets must not keep them all."""

  def __init__(self, maxsize: int = 16):
    self.maxsize = maxsize
    self._entries: collections.OrderedDict = collections.OrderedDict()

  def get_or_compile(self, key, lower):
    """(executable, seconds spent compiling now: 0.0 when cached); `lower()` -> jax Lowered."""
    if key in self._entries:
      self._entries.move_to_end(key)
      return self._entries[key], 0.0
    start = time.perf_counter()
    exe = lower().compile()
    self._entries[key] = exe
    while len(self._entries) > self.maxsize:
      self._entries.popitem(last=False)
    return exe, time.perf_counter() - start

  def clear(self) -> None:
    self._entries.clear()

  def most_recent(self):
    """The executable compiled or fetched last (for profiling and HLO inspection)."""
    if not self._entries:
      raise LookupError("nothing was compiled yet: call generate first")
    return next(reversed(self._entries.values()))

  def __len__(self) -> int:
    return len(self._entries)


def avals_key(*trees) -> tuple:
  leaves, treedef = jax.tree.flatten(trees)
  return treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves)


_EXECUTABLES = ExecutableCache()


def compiled_generate(graphdef, state, req: Request, *, steps: int, capacity: int, pad_id: int):
  """Returns (compiled executable, seconds spent compiling now: 0.0 when cached)."""
  key = (graphdef, steps, capacity, pad_id, avals_key(state, req))
  return _EXECUTABLES.get_or_compile(key, lambda: program_cache.lower(
      generate_jit, graphdef, state, req, steps=steps, capacity=capacity, pad_id=pad_id))


@dataclasses.dataclass
class Generation:
  tokens: list[list[int]]  # per row, stop token included when one was produced
  num_tokens: np.ndarray  # [B]
  compile_seconds: float  # 0.0 when the program for this bucket was already compiled
  run_seconds: float  # the device call, results fetched
  # With logprobs=N: per row, per token (logprob, [(token id, logprob)] of the N most likely).
  logprobs: list | None = None

  @property
  def tokens_per_second(self) -> float:
    return float(self.num_tokens.sum()) / max(self.run_seconds, 1e-9)


def program(model: Llama4, prompts: Sequence[Sequence[int]], *, max_new_tokens=64,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            seed: int | Sequence[int] = 0, stop_tokens=None, max_cache_len: int | None = None,
            pad_id: int | None = None, images=None, max_tiles: int | None = None, **options):
  """(compiled program, its arguments, compile seconds) of one `generate` call: `generate` runs
  exactly `exe(*args)`, so a benchmark or profiler that calls this measures the same program
  (cache capacity, buckets and kernels included)."""
  pixels = image_inputs(model, prompts, images, max_tiles)
  req, steps, capacity = prepare(
      model.config, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
      top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens, max_cache_len=max_cache_len,
      **options)
  req = with_images(sharding.place_request(req, sharding.plan_of(model)), pixels, model)
  graphdef, state = nnx.split(model)
  capacity = kernels_lib.cache_capacity(capacity, model)
  exe, compile_s = compiled_generate(graphdef, state, req, steps=steps, capacity=capacity,
                                     pad_id=resolve_pad_id(model.config, pad_id))
  return exe, (state, req), compile_s


def generate(model: Llama4, prompts: Sequence[Sequence[int]], *, max_new_tokens=64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | Sequence[int] = 0, stop_tokens=None, max_cache_len: int | None = None,
             pad_id: int | None = None, images=None, max_tiles: int | None = None,
             **options) -> Generation:
  """Generates continuations of a batch of token-id prompts in one device call.

  images: for a model with a vision tower, every image of the batch in prompt order; the prompts
  hold their token layouts (see `image_inputs`). max_tiles: the most local tiles per image
  (default: the tower config's). The image features replace the embeddings at the image tokens in
  the prefill; the decode loop is the same as for text.

  stop_tokens: one list for all rows or one list per row (default: the config's eos ids).
  seed: one int (row b draws from stream b of it) or one seed per row (a row then samples what a
  single request with that seed samples, whatever the batch). options: min_p, presence_penalty,
  frequency_penalty, repetition_penalty, min_tokens, logit_bias ({token id: bias}), logprobs (N
  in 0..20: each token's logprob and the N most likely alternatives, in `Generation.logprobs`), as
  in `maverick.sampling.SamplingParams.create`.
  """
  exe, args, compile_s = program(
      model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
      top_p=top_p, seed=seed, stop_tokens=stop_tokens, max_cache_len=max_cache_len, pad_id=pad_id,
      images=images, max_tiles=max_tiles, **options)
  start = time.perf_counter()
  tokens, num, lp = exe(*args)
  tokens, num = sharding.to_host(tokens), sharding.to_host(num)
  logprobs = host_logprobs(lp, num, options.get("logprobs"))
  run_s = time.perf_counter() - start
  return Generation(tokens=[tokens[i, :n].tolist() for i, n in enumerate(num)], num_tokens=num,
                    compile_seconds=compile_s, run_seconds=run_s, logprobs=logprobs)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prompt_logprobs(graphdef, state, prompt):
  """Full-sequence forward: the logprob of prompt token t+1 after tokens 0..t and the top
  alternatives there, under the model's raw distribution (f32 logits, no sampling transform)."""
  logits = nnx.merge(graphdef, state)(prompt).logits[:, :-1]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  n = min(sampling.MAX_LOGPROBS, logp.shape[-1])
  top_lp, top_ids = jax.lax.top_k(logp, n)
  pad = ((0, 0), (0, 0), (0, sampling.MAX_LOGPROBS - n))
  return sampling.TokenLogprobs(
      jnp.take_along_axis(logp, prompt[:, 1:, None], axis=-1)[..., 0],
      jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1),
      jnp.pad(top_lp, pad, constant_values=-jnp.inf))


def prompt_logprobs(model: Llama4, prompt: Sequence[int], top: int = 0) -> list:
  """Prompt logprobs (OpenAI `echo`): [None] for the first token, then per token (logprob, [(id,
  logprob)] of the `top` most likely) from one forward over the whole prompt (padded to its
  length bucket; it holds [T, V] f32 logits)."""
  n = len(prompt)
  padded = np.zeros((1, bucket(n)), np.int32)
  padded[0, :n] = prompt
  lp = jax.tree.map(sharding.to_host, _prompt_logprobs(*nnx.split(model), jax.device_put(padded)))
  return [None] + sampling.logprob_lists(lp.logprob[0], lp.top_ids[0], lp.top_logprobs[0],
                                         n - 1, top)


def resolve_pad_id(cfg, pad_id) -> int:
  if pad_id is not None:
    return int(pad_id)
  return int(cfg.pad_token_id) if cfg.pad_token_id is not None else 0
