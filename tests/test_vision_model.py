"""The Llama 4 vision tower (maverick/vision/model.py) against Hugging Face's Llama4VisionModel +
Llama4MultiModalProjector on tests/fixtures/hf_llama4_mm_tiny (tools/make_multimodal_fixture.py)."""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from maverick.checkpoint import hf_vision
from maverick.checkpoint.hf import CheckpointError, SafetensorsCheckpoint
from maverick.vision import model as vision_lib
from maverick.vision import preprocess

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_llama4_mm_tiny")
CASES = ("one_image", "two_images")


@pytest.fixture(scope="module")
def outputs():
  return dict(np.load(os.path.join(FIXTURE, "outputs.npz")))


@pytest.fixture(scope="module")
def meta():
  with open(os.path.join(FIXTURE, "meta.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def tower():
  with open(os.path.join(FIXTURE, "config.json")) as f:
    cfg = vision_lib.from_hf(json.load(f), dtype="float32")
  return hf_vision.load_tower(SafetensorsCheckpoint(FIXTURE), cfg)


def rel_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def test_config_from_hf_is_the_tiny_preset():
  with open(os.path.join(FIXTURE, "config.json")) as f:
    cfg = vision_lib.from_hf(json.load(f), dtype="float32")
  assert cfg == vision_lib.tiny().replace(max_tiles=cfg.max_tiles)
  assert cfg.patches_per_tile == 4 and cfg.head_dim == 16
  assert vision_lib.from_hf({"model_type": "llama4_text"}) is None


@pytest.mark.parametrize("case", CASES)
def test_features_match_hf(tower, outputs, case):
  pixels = outputs[f"{case}.pixel_values"]
  ref = outputs[f"{case}.features"]
  got = np.asarray(vision_lib.apply(*nnx.split(tower), pixels))
  assert got.shape == ref.shape == (pixels.shape[0] * 4, 64)
  assert rel_err(got, ref) < 1e-4, rel_err(got, ref)


@pytest.mark.parametrize("case", CASES)
def test_preprocessing_gives_hf_pixel_values(outputs, meta, case):
  """Our NumPy preprocessing of the fixture's PNGs = the pixel values HF's processor fed the model."""
  PIL = pytest.importorskip("PIL.Image")
  info = next(c for c in meta["cases"] if c["name"] == case)
  cfg = vision_lib.tiny().preprocess(max_tiles=meta["max_tiles"])
  images = [np.asarray(PIL.open(os.path.join(FIXTURE, f"{case}_{k}.png")).convert("RGB"))
            for k in range(len(info["images"]))]
  pixels, grids = preprocess.preprocess_images(images, cfg)
  assert [list(g) for g in grids] == info["tile_grids"]
  np.testing.assert_allclose(pixels, outputs[f"{case}.pixel_values"], rtol=0, atol=1e-6)


def test_rope_angles_follow_hf_layout():
  """Independent float64 reading of HF's freqs_ci: pair j < head_dim/4 turns with the column,
  the next head_dim/4 pairs with the row (both + 1), the class token (last) not at all."""
  cfg = vision_lib.tiny()
  side, hd = 4, cfg.head_dim
  freq = 1.0 / 10000.0 ** (np.arange(0, hd // 2, 2)[: hd // 4] / (hd // 2))
  angles = vision_lib.rope_angles(cfg)
  assert angles.shape == (side * side + 1, hd // 2)
  for p in range(side * side):
    row, col = divmod(p, side)
    np.testing.assert_allclose(angles[p], np.r_[(col + 1) * freq, (row + 1) * freq], rtol=1e-6)
  assert not angles[-1].any()


def test_pixel_shuffle_against_loops():
  """HF's pixel_shuffle (ratio 0.5), worked through its view/permute steps by hand: output token
  (a, b) of the 2x2 grid holds the 2x2 block of patches at rows 2a, 2a+1 and columns 2b, 2b+1,
  their channels concatenated in row-major order."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 16, 3)).astype(np.float32)
  got = np.asarray(vision_lib.pixel_shuffle(x, 0.5))
  g = x.reshape(2, 4, 4, 3)  # [n, row, column, c]
  want = np.zeros((2, 2, 2, 12), np.float32)
  for a in range(2):
    for b in range(2):
      want[:, a, b] = np.concatenate([g[:, 2 * a, 2 * b], g[:, 2 * a, 2 * b + 1],
                                      g[:, 2 * a + 1, 2 * b], g[:, 2 * a + 1, 2 * b + 1]], -1)
  np.testing.assert_array_equal(got, want.reshape(2, 4, 12))


def test_config_errors_name_the_field():
  with pytest.raises(vision_lib.VisionConfigError, match="intermediate_size"):
    vision_lib.tiny().replace(intermediate_size=64)
  with pytest.raises(vision_lib.VisionConfigError, match="multiple of patch_size"):
    vision_lib.tiny().replace(image_size=50)
  with pytest.raises(vision_lib.VisionConfigError, match="image_end_token_id 503 must be three "
                                                          "different tokens.*eoi_token_index"):
    vision_lib.tiny().replace(image_end_token_id=503)
  with pytest.raises(vision_lib.VisionConfigError, match="image_start_token_id must be a token id"):
    vision_lib.tiny().replace(image_start_token_id=-1)


SAVED_TF5 = os.path.join(os.path.dirname(__file__), "fixtures", "hf_llama4_vision",
                         "tf5_processor_config.json")


def _config_dir(tmp_path, files):
  """A checkpoint dir with the tiny multimodal config.json plus the given {name: JSON value or text}."""
  d = tmp_path / "ckpt"
  d.mkdir(parents=True)
  shutil.copy(os.path.join(FIXTURE, "config.json"), d / "config.json")
  for name, content in files.items():
    (d / name).write_text(content if isinstance(content, str) else json.dumps(content))
  return str(d)


def _tf5(max_patches=..., **extra):
  """processor_config.json as transformers 5.23's Llama4Processor.save_pretrained writes it."""
  image_proc = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Llama4ImageProcessor",
                "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
                "resize_to_max_canvas": False, "size": {"height": 336, "width": 336}}
  if max_patches is not ...:
    image_proc["max_patches"] = max_patches
  return {"fake_image_token": "<|image|>", "image_processor": image_proc, "image_token": "<|image|>",
          "patch_size": 14, "processor_class": "Llama4Processor", **extra}


def test_max_tiles_from_a_transformers5_save(tmp_path):
  """transformers 5 saves max_patches nested in processor_config.json (no preprocessor_config.json):
  the real file it wrote (max_patches 5), and hand-written ones."""
  with open(SAVED_TF5) as f:
    saved = f.read()
  assert json.loads(saved)["image_processor"]["max_patches"] == 5
  assert hf_vision.config_of(_config_dir(tmp_path / "a", {"processor_config.json": saved}),
                             "float32").max_tiles == 5
  assert hf_vision.config_of(_config_dir(tmp_path / "b", {"processor_config.json": _tf5(7)}),
                             "float32").max_tiles == 7


@pytest.mark.parametrize("files, want", [
  # both: the nested dict wins (transformers loads it first and then never reads the other file)
  ({"processor_config.json": _tf5(7), "preprocessor_config.json": {"max_patches": 4}}, 7),
  # the published Llama 4 layout: processor_config.json without image settings
  ({"processor_config.json": {"processor_class": "Llama4Processor", "patch_size": 14},
    "preprocessor_config.json": {"max_patches": 4}}, 4),
  # nested without max_patches: transformers' default, the other file unread
  ({"processor_config.json": _tf5(), "preprocessor_config.json": {"max_patches": 4}}, 16),
  ({"preprocessor_config.json": {"max_patches": 9}}, 9),
  ({}, 16),
])
def test_which_file_gives_max_tiles(tmp_path, files, want):
  assert hf_vision.config_of(_config_dir(tmp_path, files), "float32").max_tiles == want


@pytest.mark.parametrize("files, match", [
  ({"processor_config.json": _tf5(0)}, r"processor_config.json: image_processor.max_patches must be a "
                                        r"positive integer .* got 0"),
  ({"processor_config.json": _tf5("16")}, r"processor_config.json: image_processor.max_patches .* got '16'"),
  ({"processor_config.json": _tf5(True)}, r"image_processor.max_patches .* got True"),
  ({"processor_config.json": _tf5(2.5)}, r"image_processor.max_patches .* got 2.5"),
  ({"preprocessor_config.json": {"max_patches": -3}}, r"preprocessor_config.json: max_patches must be .* got -3"),
  ({"preprocessor_config.json": {"max_patches": "x"}}, r"preprocessor_config.json: max_patches .* got 'x'"),
  ({"processor_config.json": {"image_processor": [16]}}, r"processor_config.json: image_processor must be "
                                                          r"a JSON object"),
  ({"processor_config.json": "{not json"}, r"processor_config.json is not valid JSON"),
  ({"preprocessor_config.json": "[1, 2"}, r"preprocessor_config.json is not valid JSON"),
])
def test_bad_max_patches_names_the_file_and_field(tmp_path, files, match):
  with pytest.raises(CheckpointError, match=match):
    hf_vision.config_of(_config_dir(tmp_path, files), "float32")


def test_loader_refuses_a_tower_that_does_not_match(tmp_path):
  d = tmp_path / "ckpt"
  shutil.copytree(FIXTURE, d)
  with open(d / "config.json") as f:
    raw = json.load(f)
  cfg = vision_lib.from_hf(raw, dtype="float32").replace(num_hidden_layers=3)
  with pytest.raises(CheckpointError, match="missing tensors.*layers.2"):
    hf_vision.load_tower(SafetensorsCheckpoint(str(d)), cfg)


# ---------------------------------------------------------------------------------- our format


def test_converted_checkpoint_keeps_the_tower(tmp_path, tower, outputs):
  """convert_hf_to_orbax(vision=True) -> load_orbax(vision=True): the same tower (bit-exact to the
  one read from HF) and HF's features; save_orbax of that model round-trips it; a text-only
  conversion refuses vision=True."""
  from maverick.checkpoint import store
  out = tmp_path / "conv"
  store.convert_hf_to_orbax(FIXTURE, str(out), dtype="float32", progress=False, vision=True)
  meta = json.loads((out / "maverick.json").read_text())
  assert "vision" in meta["parts"] and meta["vision_config"]["hidden_size"] == 32
  model = store.load_orbax(str(out), vision=True)
  _same_tower(vision_lib.tower_of(model), tower)
  got = vision_lib.apply(*nnx.split(model.vision), outputs["two_images.pixel_values"])
  assert rel_err(got, outputs["two_images.features"]) < 1e-4
  assert vision_lib.tower_of(store.load_orbax(str(out))) is None  # vision=False: text only
  saved = tmp_path / "saved"
  store.save_orbax(model, str(saved))
  _same_tower(store.load_orbax(str(saved), vision=True).vision, tower)
  text_only = tmp_path / "text"
  store.convert_hf_to_orbax(FIXTURE, str(text_only), dtype="float32", progress=False)
  with pytest.raises(CheckpointError, match="holds no vision tower"):
    store.load_orbax(str(text_only), vision=True)


def _same_tower(a, b):
  fa, fb = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k].get_value()), np.asarray(fb[k].get_value()))


@pytest.mark.slow
def test_convert_script_includes_the_tower_unless_text_only(tmp_path):
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda *a: subprocess.run(
      [sys.executable, os.path.join(repo, "scripts", "convert_hf.py"), f"--hf_dir={FIXTURE}",
       "--progress=false", *a], cwd=repo, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  for flag, has_tower in (("--notext_only", True), ("--text_only", False)):
    out = tmp_path / flag
    r = run(f"--out_dir={out}", flag)
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "maverick.json").read_text())
    assert ("vision" in meta["parts"]) == has_tower == ("vision_config" in meta)


def test_memory_plan_counts_the_replicated_tower():
  """plan_vision_prefill: every device holds the whole tower (its bytes from the HF tensors'
  sizes), plus the forward's temporaries."""
  import jax
  from maverick import memory_plan, sharding
  ckpt = SafetensorsCheckpoint(FIXTURE)
  n = sum(int(np.prod(t.shape)) for name, t in ckpt.tensors.items()
          if name.startswith(("vision_model.", "multi_modal_projector.")))
  plan = sharding.Plan(sharding.make_mesh(data=4, tensor=2), "tp")
  assert jax.device_count() == 8
  r = memory_plan.plan_vision_prefill(vision_lib.tiny(), plan, tiles=5)
  assert r.weight_bytes == 4 * n and r.temp_bytes > 0


def test_maverick_tower_size():
  """The maverick() preset's parameter count, from the published shapes (hidden 1408, 34 layers,
  MLP 5632, 336 px / 14 px tiles, adapter 5632 -> 4096 -> 4096, projector 4096 -> 5120)."""
  D, F, L, P = 1408, 5632, 34, (336 // 14) ** 2
  layer = 4 * (D * D + D) + (D * F + F) + (F * D + D) + 4 * D
  want = 3 * 14 * 14 * D + D + (P + 1) * D + 4 * D + L * layer + F * 4096 + 4096 * 4096 + 4096 * 5120
  _, state = nnx.split(vision_lib.abstract_tower(vision_lib.maverick()))
  got = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(state))
  assert got == want


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_fp8_multimodal_checkpoint_gives_the_bf16_features(tmp_path, hf_fixture_dir, outputs, fmt):
  """FP8 multimodal checkpoints, text part FP8 and tower BF16 as NVIDIA (ModelOpt) and Meta
  (compressed-tensors, the official Maverick FP8) export them: load_hf(vision=True) gives the
  features of the BF16 source's tower, bit for bit."""
  import ml_dtypes
  from safetensors.numpy import load_file, save_file
  from test_fp8_checkpoint import COMPRESSED, compressed_tensors_layout
  from test_modelopt_checkpoint import MM_EXCLUDE, _quant_config, modelopt_layout
  from maverick.checkpoint import store
  text_cfg = json.loads((hf_fixture_dir / "config.json").read_text())
  text = load_file(str(hf_fixture_dir / "model.safetensors"))
  with open(os.path.join(FIXTURE, "config.json")) as f:
    cfg = dict(json.load(f), text_config=text_cfg)
  quant_file = None
  if fmt == "modelopt":
    calib = np.random.default_rng(0).integers(0, text_cfg["vocab_size"], (2, 16))
    stored, quant_file = modelopt_layout(text, text_cfg, calib)[0], _quant_config(MM_EXCLUDE)
  else:
    stored = compressed_tensors_layout(text)[0]
    cfg["quantization_config"] = dict(COMPRESSED, ignore=COMPRESSED["ignore"] + [
        "re:.*vision_model.*", "re:.*multi_modal_projector.*"])
  vision = {k: v.astype(ml_dtypes.bfloat16)
            for k, v in load_file(os.path.join(FIXTURE, "model.safetensors")).items()
            if k.startswith(("vision_model.", "multi_modal_projector."))}
  (tmp_path / "fp8").mkdir()
  (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
  if quant_file:
    (tmp_path / "fp8" / "hf_quant_config.json").write_text(json.dumps(quant_file))
  save_file({"language_model." + k: v for k, v in stored.items()} | vision,
            str(tmp_path / "fp8" / "model.safetensors"))
  (tmp_path / "bf16").mkdir()
  (tmp_path / "bf16" / "config.json").write_text(json.dumps(
      {k: v for k, v in cfg.items() if k != "quantization_config"}))
  save_file({"language_model." + k: v for k, v in text.items()} | vision,
            str(tmp_path / "bf16" / "model.safetensors"))
  kw = {"kv_cache": "fp8"} if fmt == "modelopt" else {}
  fp8 = store.load_hf(str(tmp_path / "fp8"), dtype="float32", vision=True, **kw)
  assert fp8.config.quant is not None
  bf16 = store.load_hf(str(tmp_path / "bf16"), dtype="float32", vision=True)
  pv = outputs["two_images.pixel_values"]
  np.testing.assert_array_equal(np.asarray(fp8.vision(pv)), np.asarray(bf16.vision(pv)))
  assert rel_err(fp8.vision(pv), outputs["two_images.features"]) < 2e-2  # bf16 weights vs HF f32
