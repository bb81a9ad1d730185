"""Image prompts end to end against Hugging Face's Llama4ForConditionalGeneration on
tests/fixtures/hf_llama4_mm_tiny: prompt logits, 20 greedy tokens (maverick.generate), speculative
decoding, and the bad inputs."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maverick
from maverick.checkpoint import store
from maverick.checkpoint.hf import CheckpointError
from maverick.vision import model as vision_lib
from maverick.vision import preprocess

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_llama4_mm_tiny")
CASES = {"one_image": 1, "two_images": 2}
PATCH = 503  # the fixture's <|patch|> id


@pytest.fixture(scope="module")
def outputs():
  return dict(np.load(os.path.join(FIXTURE, "outputs.npz")))


@pytest.fixture(scope="module")
def model():
  return store.load_hf(FIXTURE, dtype="float32", vision=True)


def images_of(case):
  from PIL import Image
  return [np.asarray(Image.open(os.path.join(FIXTURE, f"{case}_{k}.png")).convert("RGB"))
          for k in range(CASES[case])]


def rel_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_match_hf(model, outputs, case):
  """The whole prompt's logits with the features merged at the <|patch|> positions."""
  ids = outputs[f"{case}.input_ids"]

  @nnx.jit
  def forward(model, tokens, pixels):
    embeds = vision_lib.merge_features(model.embed_tokens(tokens), tokens,
                                       jnp.full((1,), tokens.shape[1]), model.vision(pixels),
                                       model.vision.config.image_token_id)
    return model(tokens, input_embeds=embeds).logits[0]

  logits = forward(model, jnp.asarray(ids[None]), outputs[f"{case}.pixel_values"])
  assert rel_err(logits, outputs[f"{case}.logits"]) < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_generate_with_images_matches_hf_greedy(model, outputs, case):
  pytest.importorskip("PIL")
  out = maverick.generate(model, [outputs[f"{case}.input_ids"].tolist()], images=images_of(case),
                          max_tiles=4, max_new_tokens=20, stop_tokens=[])
  assert out.tokens[0] == outputs[f"{case}.greedy"].tolist()


def test_batch_of_image_prompts(model, outputs):
  """Two rows of different lengths and image counts in one call: features are taken in prompt
  order over the batch (right-padded rows), each row equals HF's run alone."""
  pytest.importorskip("PIL")
  prompts = [outputs[f"{c}.input_ids"].tolist() for c in ("two_images", "one_image")]
  images = images_of("two_images") + images_of("one_image")
  out = maverick.generate(model, prompts, images=images, max_tiles=4, max_new_tokens=20,
                          stop_tokens=[])
  assert out.tokens == [outputs["two_images.greedy"].tolist(), outputs["one_image.greedy"].tolist()]


def test_preprocessed_images_are_accepted(model, outputs):
  """PreprocessedImage inputs (HF's own pixel values here) take the same path as raw arrays."""
  pv = outputs["one_image.pixel_values"]
  image = preprocess.PreprocessedImage(pv, (2, 2))
  out = maverick.generate(model, [outputs["one_image.input_ids"].tolist()], images=[image],
                          max_new_tokens=20, stop_tokens=[])
  assert out.tokens[0] == outputs["one_image.greedy"].tolist()


@pytest.mark.slow
def test_speculative_decoding_with_images_equals_greedy(model, outputs):
  """EAGLE-3 with an image prompt is lossless: the target's prefill reads the features, the draft
  reads the target's hidden states there as anywhere (a random draft: low acceptance, same text)."""
  import spec_decode
  from spec_decode import draft as draft_lib
  draft = draft_lib.init_draft(draft_lib.Eagle3Config.for_target(model.config), seed=1)
  prompts = [outputs[f"{c}.input_ids"].tolist() for c in ("one_image", "two_images")]
  images = images_of("one_image") + images_of("two_images")
  out = spec_decode.generate(model, draft, prompts, images=images, max_tiles=4, k=3,
                             max_new_tokens=20, stop_tokens=[])
  assert out.tokens == [outputs["one_image.greedy"].tolist(), outputs["two_images.greedy"].tolist()]


# ---------------------------------------------------------------------------------- bad inputs


def test_image_to_a_text_only_model_is_refused(outputs):
  text_only = store.load_hf(FIXTURE, dtype="float32")
  assert vision_lib.tower_of(text_only) is None
  with pytest.raises(ValueError, match="no vision tower"):
    maverick.generate(text_only, [outputs["one_image.input_ids"].tolist()],
                      images=[np.zeros((30, 30, 3), np.uint8) + 7], max_new_tokens=2)


def test_more_image_tokens_than_the_context_is_refused(model):
  context = model.config.max_position_embeddings
  prompt = [1] + [PATCH] * (context + 4)
  with pytest.raises(ValueError, match=f"{context + 4} image tokens.*context of {context}"):
    maverick.generate(model, [prompt], images=[np.full((20, 20, 3), 9, np.uint8)],
                      max_new_tokens=2)


def test_image_token_count_must_match_the_images(model, outputs):
  ids = outputs["one_image.input_ids"].tolist()
  with pytest.raises(ValueError, match="20 image tokens.*1 tiles x 4 = 4"):
    maverick.generate(model, [ids], images=[np.full((20, 20, 3), 9, np.uint8)], max_tiles=4,
                      max_new_tokens=2)
  with pytest.raises(ValueError, match=r"hold 1 image layouts .*prompt 0: 1\) but 0 images"):
    maverick.generate(model, [ids], max_new_tokens=2)


IDS = {preprocess.IMAGE_START: 500, preprocess.IMAGE_END: 501, preprocess.IMAGE_TOKEN: 502,
       preprocess.PATCH_TOKEN: PATCH, preprocess.TILE_X_SEPARATOR: 504,
       preprocess.TILE_Y_SEPARATOR: 505}  # the fixture's ids (see _word_tokenizer)


def _layout_ids(grid, cfg):
  """The token ids of image_prompt_tokens(grid) with the fixture's ids."""
  import re
  text = preprocess.image_prompt_tokens(grid, cfg)
  pieces = re.findall("|".join(re.escape(t) for t in IDS), text)
  assert "".join(pieces) == text
  return [IDS[p] for p in pieces]


def _fake(grid, cfg):
  """A PreprocessedImage with this tile grid (its pixels are never looked at: refused before)."""
  n = grid[0] * grid[1] + (grid[0] * grid[1] > 1)
  return preprocess.PreprocessedImage(np.ones((n, 3, cfg.tile_size, cfg.tile_size), np.float32), grid)


def test_five_images_for_one_layout_are_refused(model, outputs):
  """The issue's example: one image layout (2x2 + global = 5 tiles, 20 image tokens) and five small
  images of one tile each (20 features too): the counts agree, the images do not."""
  ids = outputs["one_image.input_ids"].tolist()
  assert ids.count(500) == 1 and ids.count(PATCH) == 20
  small = [np.full((20, 20, 3), 9 * k, np.uint8) for k in range(1, 6)]
  with pytest.raises(ValueError, match=r"hold 1 image layouts .*prompt 0: 1\) but 5 images were "
                                       r"given.*expand_image_placeholders"):
    maverick.generate(model, [ids], images=small, max_tiles=4, max_new_tokens=2)


def test_each_layout_must_match_its_image(model, outputs):
  from maverick import generation
  cfg = model.vision.config.preprocess(4)
  two = outputs["two_images.input_ids"].tolist()  # a 1x3 (+ global) layout, then a 1x1 one
  grids = [(1, 3), (1, 1)]
  layouts = [_layout_ids(g, cfg) for g in grids]
  assert two.count(500) == 2 and all(any(two[k:k + len(lay)] == lay for k in range(len(two)))
                                     for lay in layouts)
  ok = generation.image_inputs(model, [two], [_fake(g, cfg) for g in grids])
  assert ok.shape[0] == 5
  cases = [  # (prompts, images' grids, message)
    # the right images in the wrong order
    ([two], [(1, 1), (1, 3)], r"prompt 0, image 0 of the row \(image 0 of the batch\): its layout "
                              r"holds 16 image tokens \(a 1x3 grid\) but the image gives 1 tiles x 4 = 4"),
    # same tile count, transposed grid
    ([two], [(3, 1), (1, 1)], r"prompt 0, image 0.*holds 16 image tokens \(a 1x3 grid\) but the image "
                              r"gives 4 tiles x 4 = 16 \(3x1 grid \+ global\)"),
    # rows: the second row's image given to the first
    ([[7, 8], two], [(1, 3)], r"hold 2 image layouts .*prompt 0: 0, prompt 1: 2\) but 1 images"),
    ([two, [7] + _layout_ids((2, 2), cfg)], [(1, 3), (1, 1), (1, 2)],
     r"prompt 1, image 0 of the row \(image 2 of the batch\).*a 2x2 grid.*1x2 grid \+ global"),
    # image tokens outside any layout (counts agree)
    ([[1] + [PATCH] * 4], [(1, 1)], r"prompt 0 holds 4 image tokens .*outside any"),
    ([[1, 500, 502] + [PATCH] * 4 + [500, 501]], [(1, 1)], r"prompt 0 has unpaired image markers"),
  ]
  for prompts, image_grids, match in cases:
    with pytest.raises(ValueError, match=match):
      generation.image_inputs(model, prompts, [_fake(g, cfg) for g in image_grids])
  # two rows, each right
  pv = generation.image_inputs(model, [two, [7] + _layout_ids((2, 2), cfg)],
                               [_fake(g, cfg) for g in [(1, 3), (1, 1), (2, 2)]])
  assert pv.shape[0] == 4 + 1 + 5


def test_corrupt_image_bytes_are_refused(model, outputs):
  pytest.importorskip("PIL")
  with pytest.raises(preprocess.ImageInputError, match="cannot decode image"):
    maverick.generate(model, [outputs["one_image.input_ids"].tolist()],
                      images=[b"\x89PNG not really"], max_new_tokens=2)


def test_vision_needs_a_multimodal_checkpoint():
  with pytest.raises(CheckpointError, match="text-only"):
    maverick.load("random:tiny", vision=True)


# ---------------------------------------------------------------------------------- the CLI


def _word_tokenizer(directory):
  """A word-level tokenizer.json for the fixture: "w<i>" is id i (0..499), the image special tokens
  sit at the fixture's ids 500..505; no BOS, no EOS."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([preprocess.IMAGE_START, preprocess.IMAGE_END, preprocess.IMAGE_TOKEN,
                          preprocess.PATCH_TOKEN, preprocess.TILE_X_SEPARATOR,
                          preprocess.TILE_Y_SEPARATOR])
  assert tok.token_to_id(preprocess.PATCH_TOKEN) == PATCH
  tok.save(str(directory / "tokenizer.json"))


def _run_cli(*args):
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(repo, "scripts", "generate.py"), *args],
                        cwd=repo, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [[], ["--stream", "--stream_chunk=7"]], ids=["call", "stream"])
def test_cli_image_flag_matches_hf(tmp_path, outputs, stream):
  """scripts/generate.py --image twice: the prompt's <|image|> placeholders expand to the images'
  layouts (max_tiles from preprocessor_config.json) and the greedy text is HF's; streamed too
  (every chunk's call takes the images)."""
  import json
  import shutil
  pytest.importorskip("PIL")
  d = tmp_path / "mm"
  shutil.copytree(FIXTURE, d)
  (d / "preprocessor_config.json").write_text(json.dumps({"max_patches": 4}))
  _word_tokenizer(d)
  ids = outputs["two_images.input_ids"].tolist()
  words = []  # the fixture prompt as text: each image's layout collapses to one <|image|>
  for t in ids:
    if t == 502:
      words.append(preprocess.IMAGE_TOKEN)
    elif t < 500:
      words.append(f"w{t}")
  prompt = " ".join(words)
  r = _run_cli(f"--checkpoint={d}", f"--prompt={prompt}", "--max_new_tokens=20",
               "--dtype=float32", "--spec_k=0", f"--image={d / 'two_images_0.png'}",
               f"--image={d / 'two_images_1.png'}", *stream)
  assert r.returncode == 0, r.stderr
  assert " ".join(f"w{t}" for t in outputs["two_images.greedy"]) in r.stdout


def test_cli_image_needs_one_prompt(tmp_path):
  batch = tmp_path / "p.txt"
  batch.write_text("a\nb\n")
  r = _run_cli("--checkpoint=random:tiny", f"--batch_file={batch}", "--image=x.png")
  assert r.returncode != 0 and "--image goes with one --prompt (not --batch_file)" in r.stderr


@pytest.mark.slow
def test_one_program_per_tile_count_without_host_communication(model, outputs):
  """Other images with the same tile count reuse the compiled program; it has the decode loop on
  device and no host callback or transfer."""
  from maverick import generation
  ids = outputs["one_image.input_ids"].tolist()
  rng = np.random.default_rng(0)
  first, second = (rng.integers(0, 256, (70, 60, 3), dtype=np.uint8) for _ in range(2))
  assert preprocess.preprocess_image(first, model.vision.config.preprocess(4)).tile_grid == (2, 2)
  maverick.generate(model, [ids], images=[first], max_tiles=4, max_new_tokens=4, stop_tokens=[])
  again = maverick.generate(model, [ids], images=[second], max_tiles=4, max_new_tokens=4,
                            stop_tokens=[])
  assert again.compile_seconds == 0.0
  hlo = generation._EXECUTABLES.most_recent().as_text()
  assert "while" in hlo.split("ENTRY")[1]
  for f in ("xla_ffi_python_cpu_callback", "xla_python_cpu_callback", " send(", " recv(",
            " infeed(", " outfeed("):
    assert f not in hlo, f


@pytest.mark.slow
def test_sharded_model_with_images_matches_hf(outputs):
  """On a mesh the tower is replicated and the pixel values too: the same greedy text."""
  import jax
  from maverick import sharding
  mesh = sharding.make_mesh(data=4, tensor=2)
  loaded = maverick.load(FIXTURE, dtype="float32", mesh=mesh, vision=True)
  tower = loaded.model.vision
  assert tower.patch_embed.weight[...].sharding.is_fully_replicated
  assert len(tower.patch_embed.weight[...].sharding.device_set) == jax.device_count()
  prompts = [outputs[f"{c}.input_ids"].tolist() for c in ("one_image", "two_images")]
  out = maverick.generate(loaded.model, prompts, images=images_of("one_image") + images_of(
      "two_images"), max_tiles=4, max_new_tokens=20, stop_tokens=[])
  assert out.tokens == [outputs["one_image.greedy"].tolist(), outputs["two_images.greedy"].tolist()]


def test_quantized_load_keeps_the_tower(outputs):
  """maverick.load(..., quant=FP8, vision=True): the text model is quantized, the tower is the
  one loaded (not FP8) and still gives HF's features."""
  from maverick import quant
  loaded = maverick.load(FIXTURE, dtype="float32", vision=True, quant=quant.QuantConfig())
  assert loaded.model.config.quant is not None
  assert loaded.model.vision.patch_embed.weight[...].dtype == jnp.float32
  got = loaded.model.vision(outputs["one_image.pixel_values"])
  assert rel_err(got, outputs["one_image.features"]) < 1e-4


def test_streaming_with_images_equals_hf_greedy(model, outputs):
  """maverick.streaming.stream(images=): each chunk's call re-reads the prompt's image tokens with
  the images (chunks of 7: three prefills over prompt + tokens so far); joined, HF's greedy."""
  from maverick import streaming
  cfg = model.vision.config.preprocess(4)
  images = [preprocess.preprocess_image(im, cfg) for im in images_of("two_images")]
  chunks = list(streaming.stream(model, outputs["two_images.input_ids"].tolist(), images=images,
                                 chunk_tokens=7, max_new_tokens=20, stop_tokens=[]))
  assert len(chunks) == 3
  assert sum((c.tokens for c in chunks), []) == outputs["two_images.greedy"].tolist()
