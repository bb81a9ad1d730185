"""Memory of loading and converting: a sharded direct load never puts a whole tensor on one device
(device-resident bytes stay near each device's share), a conversion holds about one layer in host
memory (peak RSS measured in a fresh process), and killed conversions recover."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from param_utils import flat_params
from safetensors.numpy import load_file

import convert_rss
from maverick import model as model_lib
from maverick import sharding
from maverick.checkpoint import hf, load_hf, store

REPO = pathlib.Path(__file__).resolve().parent.parent

# The HF fixture has 4 heads, 2 KV heads, 8 experts.
MESHES = [("tp", dict(data=4, tensor=2)), ("ep", dict(expert=4, tensor=2))]


def _device_bytes(arrays) -> dict:
  """Bytes each device holds of `arrays`, from their shardings (no array is touched)."""
  out: dict = {}
  for a in arrays:
    shard = a.dtype.itemsize * int(np.prod(a.sharding.shard_shape(a.shape)))
    for d in a.sharding.device_set:
      out[d] = out.get(d, 0) + shard
  return out


class DeviceWatch:
  """Samples the device-resident bytes of arrays created since it started, after every tensor
  read and every placement, and records any array that sits whole on one device while having the
  shape of a parameter the layout shards."""

  def __init__(self, monkeypatch, sharded_shapes: set):
    self.before = {id(a) for a in jax.live_arrays()}
    self._keep = jax.live_arrays()  # ids stay unique while these live
    self.peak: dict = {}
    self.whole: list = []
    self.sharded_shapes = sharded_shapes
    read, put, make = hf.SafetensorsCheckpoint.read, jax.device_put, jax.make_array_from_callback

    def sampled(f):
      def g(*a, **k):
        out = f(*a, **k)
        self.sample()
        return out
      return g
    monkeypatch.setattr(hf.SafetensorsCheckpoint, "read", sampled(read))
    monkeypatch.setattr(jax, "device_put", sampled(put))
    monkeypatch.setattr(jax, "make_array_from_callback", sampled(make))

  def sample(self):
    new = [a for a in jax.live_arrays() if id(a) not in self.before]
    for d, b in _device_bytes(new).items():
      self.peak[d] = max(self.peak.get(d, 0), b)
    self.whole += [a.shape for a in new if len(a.sharding.device_set) == 1
                   and a.shape in self.sharded_shapes]


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  return np.asarray(model_lib.apply(graphdef, state, jnp.asarray(tokens)).logits)


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", MESHES)
def test_sharded_hf_load_never_holds_a_whole_tensor(monkeypatch, hf_fixture_dir, hf_fixture,
                                                    fixture_model, layout, mesh_kw):
  mesh = sharding.make_mesh(**mesh_kw)
  plan = sharding.Plan(mesh, layout)
  targets = sharding.param_shardings(nnx.state(fixture_model), plan)
  flat = dict(nnx.to_flat_state(nnx.state(fixture_model)))
  sharded = {flat[p].shape for p, s in targets.items() if not s.is_fully_replicated}
  replicated = {flat[p].shape for p, s in targets.items() if s.is_fully_replicated}
  watch = DeviceWatch(monkeypatch, sharded - replicated)
  model = load_hf(str(hf_fixture_dir), dtype="float32", mesh=mesh, layout=layout)
  watch.sample()
  monkeypatch.undo()

  assert sharding.plan_of(model) == plan and sharding.plan_of(model.layers[1].ffn) == plan
  got = flat_params(model)
  final = _device_bytes([v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))])
  for p, v in nnx.to_flat_state(nnx.state(model)):
    assert v.get_value().sharding == targets[p], p
  assert set(final) == set(jax.devices())
  biggest_shard = max(x.itemsize * int(np.prod(targets[p].shard_shape(x.shape)))
                      for p, x in got.items())
  whole = sum(x.nbytes for x in got.values())
  for d, share in final.items():
    # Each device's peak is its share of the model plus at most a tensor's slice in flight; the
    # old path (whole tensors on the default device, resharded after) peaked at `whole` there.
    assert watch.peak[d] <= 1.3 * share + biggest_shard, (d, watch.peak[d], share, whole)
  # ... so the bound above catches a whole-model detour through the default device.
  assert 1.3 * final[jax.devices()[0]] + biggest_shard < whole
  assert watch.whole == [], f"whole tensors placed on one device: {watch.whole[:5]}"

  # Same values as the single-device load, and the same logits (HF's golden ones, independent).
  want = flat_params(fixture_model)
  assert got.keys() == want.keys()
  for p in want:
    np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
  np.testing.assert_allclose(_logits(model, hf_fixture["inputs"]), hf_fixture["logits"],
                             atol=2e-4, rtol=0)


@pytest.mark.parametrize("kind", ["compressed-tensors", "modelopt"])
def test_sharded_fp8_load_equals_single_device(monkeypatch, tmp_path, hf_fixture_dir, kind):
  """The FP8 importers place their tensors the same way: values equal the unsharded import, no
  whole tensor on one device."""
  t = load_file(str(hf_fixture_dir / "model.safetensors"))
  cfg = json.loads((hf_fixture_dir / "config.json").read_text())
  if kind == "compressed-tensors":
    import test_fp8_checkpoint as f8
    stored, _ = f8.compressed_tensors_layout(t)
    d = f8._write(tmp_path / "hf", cfg, f8.COMPRESSED, stored)
  else:
    import test_modelopt_checkpoint as mo
    calib = np.random.default_rng(0).integers(0, cfg["vocab_size"], (4, 24))
    stored = mo.modelopt_layout(t, cfg, calib)[0]
    d = mo.write_checkpoint(tmp_path / "hf", cfg, stored, mo._quant_config(mo.EXCLUDE),
                            mo._config_json_form(mo.EXCLUDE))
  single = load_hf(str(d), dtype="float32")
  mesh = sharding.make_mesh(expert=4, tensor=2)
  targets = sharding.param_shardings(nnx.state(single), sharding.Plan(mesh, "ep"))
  flat = dict(nnx.to_flat_state(nnx.state(single)))
  sharded = {flat[p].shape for p, s in targets.items() if not s.is_fully_replicated}
  replicated = {flat[p].shape for p, s in targets.items() if s.is_fully_replicated}
  watch = DeviceWatch(monkeypatch, sharded - replicated)
  model = load_hf(str(d), dtype="float32", mesh=mesh, layout="ep")
  monkeypatch.undo()
  assert watch.whole == []
  assert model.config == single.config
  got, want = flat_params(model), flat_params(single)
  assert got.keys() == want.keys()
  for p in want:
    assert got[p].dtype == want[p].dtype, p
    np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
  for p, v in nnx.to_flat_state(nnx.state(model)):
    assert v.get_value().sharding == targets[p], p


@pytest.mark.slow
def test_conversion_peak_rss_is_about_one_layer(tmp_path, hf_fixture_dir):
  """Converting a checkpoint whose one decoder layer is a ~220 MB MoE layer: the peak resident
  memory of the converting process rises by less than 1.25x that layer (measured: ~1.1x)."""
  layer = convert_rss.write_checkpoint(tmp_path / "hf")
  assert layer > 200e6
  r = subprocess.run([sys.executable, str(REPO / "tests" / "convert_rss.py"), str(tmp_path / "hf"),
                      str(tmp_path / "out"), str(hf_fixture_dir)],
                     cwd=REPO, capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
  assert r.returncode == 0, r.stderr[-3000:]
  m = json.loads(r.stdout.strip().splitlines()[-1])
  rise = m["peak"] - m["rss_before"]
  print(f"conversion peak RSS rise {rise / 1e6:.0f} MB = {rise / layer:.3f} x the layer "
        f"({layer / 1e6:.0f} MB)")
  assert rise < 1.25 * layer, (rise, layer)
  # The converted layer holds the HF tensors (spot check of the biggest one, bit for bit).
  parts = dict(store.iter_orbax_parts(str(tmp_path / "out")))
  gate_up = load_file(str(tmp_path / "hf" / "model.safetensors"))[
      "model.layers.0.feed_forward.experts.gate_up_proj"]
  F = gate_up.shape[-1] // 2
  np.testing.assert_array_equal(np.asarray(parts["layer_000"][("ffn", "up")]), gate_up[..., F:])
  np.testing.assert_array_equal(np.asarray(parts["layer_000"][("ffn", "gate")]), gate_up[..., :F])
