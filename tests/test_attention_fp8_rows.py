"""The decode attention kernel writes the FP8 o projection's input rows (maverick.kernels
.cache_attention `quantize_for`): the o GEMM then has no quantize launch of its own.

References: the same model with the epilogue switched off (the o GEMM quantizes the attention
output itself with the quantize kernel): both quantize the same bf16 rows with the same f32 math,
so the logits are equal; and, sharded, which rows each device's o GEMM takes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from maverick import kernel_attention
from maverick import kernels as kernels_lib
from maverick import model as model_lib
from maverick import quant
from maverick import sharding
from pallas_kernels import decode_attention, selfcheck
from test_kernels_model import _prefill_then_decode, aligned_config
from test_sharded_kernels import B, _decode_step
from test_sharded_kernels import _prefill_then_decode as tp8_prefill_then_decode
from test_sharded_kernels import reference_kernels  # noqa: F401 (fixture)
from test_sharded_kernels import aligned_config as tp8_config

HEAD_DIM = 128  # the combine kernel (and so its epilogue) takes head_dim 128


def _model(**sharded):
  cfg = (tp8_config() if sharded else aligned_config(num_layers=2)).replace(head_dim=HEAD_DIM)
  model = quant.quantize_model(model_lib.init_model(cfg, seed=0), quant.QuantConfig())
  return sharding.shard_model(model, sharding.make_mesh(**sharded), "tp") if sharded else model


@pytest.mark.slow
def test_decode_attention_quantizes_the_o_input_and_logits_are_unchanged(monkeypatch):
  """FP8 model, kernel path in interpret mode: at decode (8 rows) no quantization of an
  attention output row [H * Dh] is traced (prefill's o still quantizes its own: prefill
  attention has no epilogue), and the logits match the run with the epilogue off."""
  model = _model()
  cfg = model.config
  width = cfg.num_attention_heads * HEAD_DIM
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 24)), jnp.int32)
  quantized = []
  original = kernels_lib._quantize_dynamic
  monkeypatch.setattr(kernels_lib, "_quantize_dynamic",
                      lambda x2, *a, **k: quantized.append(x2.shape) or original(x2, *a, **k))

  def run():
    jax.clear_caches()
    quantized.clear()
    with pallas_kernels.interpret(detect_races=False):
      kernels_lib.set_kernels(model, "pallas")
      out = _prefill_then_decode(model, tokens, decode_rows=8)
    return out, [s for s in quantized if s[-1] == width]

  (prefill, step), o_rows = run()
  assert o_rows == [(24, width)] * cfg.num_hidden_layers, o_rows  # prefill only
  with monkeypatch.context() as m:
    m.setattr(decode_attention, "supports_quantize", lambda heads, dh: False)
    (prefill0, step0), o_rows0 = run()
  assert o_rows0 == [(24, width)] * 2 + [(8, width)] * 2, o_rows0
  # Bit for bit on the hosts seen (both quantize the same bf16 rows with the same f32 math); the
  # two combine kernels are different programs, whose multiply-adds another host's XLA:CPU may
  # contract into FMAs apart, a bf16 step of the attention output and then an e4m3 step: allow
  # a hundredth of the logits' range (a wrong scale or row is off by far more).
  np.testing.assert_array_equal(prefill, prefill0)  # prefill: no epilogue on either side
  np.testing.assert_allclose(step, step0, rtol=0, atol=1e-2 * np.abs(step0).max())
  assert np.mean(step.argmax(-1) == step0.argmax(-1)) >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_tp8_o_projection_takes_each_devices_rows(arch, monkeypatch):
  """TP8, lowered for the GPU (auto mode): every layer's decode attention quantizes its output
  rows padded to the o GEMM's row tile (64 rows on sm90, 128 on sm100) over the device's own
  heads (1 head of 128 here), and no o GEMM quantizes its input."""
  model = _model(tensor=8)
  kernels_lib.set_kernels(model, None)
  calls, quantized = [], []
  original = decode_attention.decode_attention
  monkeypatch.setattr(decode_attention, "decode_attention",
                      lambda q, *a, **k: calls.append((q.shape, k.get("quantize")))
                      or original(q, *a, **k))
  original_q = kernels_lib._quantize_dynamic
  monkeypatch.setattr(kernels_lib, "_quantize_dynamic",
                      lambda x2, *a, **k: quantized.append(x2.shape) or original_q(x2, *a, **k))
  fn, args = _decode_step(model)
  text = pallas_kernels.lower_for_gpu(lambda *a: fn(*a), *args, arch=arch)
  assert text.count("mosaic_gpu_v2(") > 0
  tile = 64 if arch == "sm90" else 128
  runs = [c for c in calls if c[1] is not None]
  assert runs and {c[1][0] for c in runs} == {tile}, calls
  assert {c[0][2] for c in runs} == {1}, calls  # one local head
  assert not [s for s in quantized if s[-1] == HEAD_DIM], quantized


@pytest.mark.slow
def test_tp8_logits_equal_with_and_without_the_epilogue(reference_kernels, monkeypatch):
  """TP8 (1 head a device), the kernels' entries running their XLA references (multi-device
  interpret mode does not run Mosaic kernels): each device's o GEMM takes the rows its own
  attention quantized (a row scale per device and token), so prefill and decode logits equal
  the run where o quantizes its input itself."""
  model = _model(tensor=8)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, (B, 12)), jnp.int32)

  def run():
    jax.clear_caches()
    with pallas_kernels.interpret():
      kernels_lib.set_kernels(model, "pallas")
      out = tp8_prefill_then_decode(model, tokens)
    reference_kernels.clear()
    return out

  quantizing = []
  original = decode_attention.decode_attention
  monkeypatch.setattr(decode_attention, "decode_attention",
                      lambda *a, **k: quantizing.append(k.get("quantize")) or original(*a, **k))
  prefill, step = run()
  assert quantizing and all(q is not None for q in quantizing), quantizing
  quantizing.clear()
  with monkeypatch.context() as m:
    m.setattr(decode_attention, "supports_quantize", lambda heads, dh: False)
    prefill0, step0 = run()
  assert quantizing and all(q is None for q in quantizing), quantizing
  np.testing.assert_array_equal(prefill, prefill0)
  np.testing.assert_array_equal(step, step0)


def test_epilogue_has_its_own_self_check(monkeypatch, tmp_path):
  """Auto mode: the attention runs the epilogue only when its own probe passes too (the FP8
  rows, dequantized, within one e4m3 step). The entry swapped for its reference passes both
  probes; with the kernel side's scales off by 2x the epilogue's fails: one
  KernelFallbackWarning naming it, and the attention still runs its kernel, without the
  epilogue (o then quantizes its input itself)."""
  rng = np.random.default_rng(4)
  B, T, H, S = 1, 1, 4, 128
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k_cache, v_cache = bf16(B, T, H, HEAD_DIM), bf16(B, S, 1, HEAD_DIM), bf16(B, S, 1, HEAD_DIM)
  positions = jnp.full((B, T), S - 1, jnp.int32)
  original, calls = decode_attention.decode_attention, []

  def reference(*args, bad=False, **kw):
    calls.append((kw["implementation"], kw.get("quantize")))
    out = original(*args, **dict(kw, implementation="xla"))
    if bad and kw["implementation"] == "pallas" and kw.get("quantize") is not None:
      out = (out[0], out[1], out[2] * 2)
    return out

  for bad in (False, True):
    monkeypatch.setattr(decode_attention, "decode_attention",
                        lambda *a, _bad=bad, **k: reference(*a, bad=_bad, **k))
    monkeypatch.setenv("MAVERICK_CACHE_DIR", str(tmp_path / str(bad)))
    selfcheck.clear_memory()
    with (pallas_kernels.interpret(), selfcheck.force(), kernels_lib.fused_forward(),
          warnings.catch_warnings(record=True) as ws):
      warnings.simplefilter("always")
      y = kernel_attention.cache_attention(q, k_cache, v_cache, positions, None, None, {}, None,
                                      quantize_for=(256, True))
      rows = kernels_lib.quantized_rows(y, None)
    fallbacks = [w for w in ws if issubclass(w.category, selfcheck.KernelFallbackWarning)]
    assert selfcheck.probes_run == 2, selfcheck.probes_run
    assert calls[-1] == ("pallas", None if bad else (64, None)), calls
    assert (rows is None) == bad and y.shape == q.shape
    assert len(fallbacks) == bad and (not bad or "FP8 epilogue" in str(fallbacks[0].message))
  selfcheck.clear_memory()
