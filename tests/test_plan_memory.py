"""scripts/plan_memory.py on a reduced config: compiled per-device numbers agree with real sharded
arrays and the KV-cache formula; bad input."""

import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from maverick import config as config_lib
from maverick import memory_plan
from maverick import model as model_lib
from maverick import sharding
from param_utils import single_device_env

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "plan_memory.py"


def _device0_bytes(model) -> int:
  """Bytes of the model's real arrays that live on the first device."""
  from flax import nnx
  _, state = nnx.split(model)
  total = 0
  for _, var in nnx.to_flat_state(state):
    shard = var.get_value().addressable_shards[0]
    total += shard.data.nbytes
  return total


def test_bytes_match_real_sharded_arrays():
  cfg = config_lib.tiny(dtype="bfloat16")
  plan = sharding.Plan(sharding.make_mesh(data=4, tensor=2), "tp")
  B, S = 8, 256
  r = memory_plan.plan_decode_step(cfg, plan, batch=B, context=S, quant="bf16")
  real = sharding.shard_model(model_lib.init_model(cfg), plan.mesh, "tp")
  assert r.weight_bytes == _device0_bytes(real)
  # K and V, every layer, rows over data=4, KV heads over tensor=2, bf16; plus lengths [B/4] int32.
  kv = 2 * cfg.num_hidden_layers * (B // 4) * S * (cfg.num_key_value_heads // 2) * cfg.head_dim * 2
  assert r.kv_bytes == kv + (B // 4) * 4
  assert r.argument_bytes >= r.weight_bytes + kv
  assert r.alias_bytes >= kv  # the cache is updated in place
  assert 0 < r.temp_bytes < r.weight_bytes + kv


def test_fp8_weights_take_a_byte_plus_scales():
  cfg = config_lib.tiny(dtype="bfloat16")
  plan = sharding.Plan(sharding.make_mesh(tensor=2, devices=jax.devices()[:2]), "tp")
  bf16 = memory_plan.plan_decode_step(cfg, plan, batch=2, context=64, quant="bf16")
  fp8 = memory_plan.plan_decode_step(cfg, plan, batch=2, context=64, quant="fp8")
  D, V, E, L = cfg.hidden_size, cfg.vocab_size, cfg.num_local_experts, cfg.num_hidden_layers
  # Kept in bf16: embed and lm_head (vocab over tensor=2), norms and routers (replicated).
  kept = 2 * (2 * V * D // 2 + (2 * L + 1) * D + len(cfg.moe_layers) * D * E)
  quantized_bf16 = bf16.weight_bytes - kept
  scales = fp8.weight_bytes - kept - quantized_bf16 // 2
  assert 0 < scales < 0.1 * quantized_bf16  # one f32 per output channel


@pytest.mark.slow
def test_kv_cache_formats_counted_by_hand():
  """Per-device KV bytes: the model dtype (bf16; None or "bf16") 2 bytes a value, no scales;
  "fp8" 1 byte plus an f32 scale per token and KV head; "fp8_static" (ModelOpt k/v scales) 1 byte
  and no per-token scales, its two f32 scalars per layer counted with the weights."""
  cfg = config_lib.tiny(dtype="bfloat16")
  plan = sharding.Plan(sharding.make_mesh(data=2, tensor=2, devices=jax.devices()[:4]), "tp")
  B, S = 4, 128
  L, K, Dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
  r = {kv: memory_plan.plan_decode_step(cfg, plan, batch=B, context=S, quant="fp8-modelopt",
                                        kv_cache=kv)
       for kv in (None, "bf16", "fp8", "fp8_static")}
  rows, heads = B // 2, K // 2  # rows over data=2, KV heads over tensor=2
  values = 2 * L * rows * S * heads * Dh  # K and V, every layer
  lengths = rows * 4
  assert r[None].kv_bytes == r["bf16"].kv_bytes == 2 * values + lengths
  assert r["bf16"].weight_bytes == r[None].weight_bytes
  assert r["fp8"].kv_bytes == values + 2 * L * rows * S * heads * 4 + lengths
  assert r["fp8_static"].kv_bytes == values + lengths
  assert r["fp8_static"].weight_bytes == r[None].weight_bytes + 2 * L * 4
  assert r["fp8"].weight_bytes == r[None].weight_bytes


def _run(*args):
  env = single_device_env()
  return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.slow
def test_script_reduced_config(tmp_path):
  out = tmp_path / "plan.json"
  p = _run("--config", "tiny", "--mesh", "2", "--data", "2", "--quant", "fp8", "--context",
           "512", "--batch", "4", "--spec_k", "2", "--json_out", str(out), "--vision_tiles", "5")
  assert p.returncode == 0, p.stderr[-2000:]
  assert "decode step" in p.stdout and "speculative round" in p.stdout
  assert "fits B200 (180 GB)" in p.stdout and "fits H200 (141 GB)" in p.stdout
  data = json.loads(out.read_text())
  assert data["mesh"] == {"data": 2, "expert": 1, "tensor": 2}
  assert [r["name"] for r in data["reports"]] == ["decode step", "speculative round",
                                                   "vision (5 tiles)"]
  assert all(r["total_bytes"] > r["kv_bytes"] > 0 for r in data["reports"][:2])
  assert data["reports"][2]["weight_bytes"] > 0 == data["reports"][2]["kv_bytes"]


@pytest.mark.slow
def test_script_bf16_kv_cache_of_a_modelopt_checkpoint(tmp_path):
  """--quant fp8-modelopt --kv_cache bf16 (a ModelOpt checkpoint run with generate.py --kv_cache
  bf16): K and V 2 bytes a value, no scales, against the default fp8_static's 1 byte."""
  cfg = config_lib.tiny(dtype="bfloat16")
  L, K, Dh = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
  B, S = 2, 64
  kv_bytes = {}
  for kv in ("bf16", "auto"):
    out = tmp_path / f"{kv}.json"
    p = _run("--config", "tiny", "--mesh", "2", "--quant", "fp8-modelopt", "--kv_cache", kv,
             "--context", str(S), "--batch", str(B), "--spec_k", "0", "--json_out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads(out.read_text())
    kv_bytes[data["kv_cache"]] = data["reports"][0]["kv_bytes"]
  values = 2 * L * B * S * (K // 2) * Dh  # K and V, every layer, KV heads over tensor=2
  assert kv_bytes == {"bf16": 2 * values + B * 4, "fp8_static": values + B * 4}


@pytest.mark.slow
@pytest.mark.parametrize("args,match", [
    (("--config", "tiny", "--mesh", "8"), "num_attention_heads=4 is not divisible"),
    (("--config", "nope"), "neither a preset"),
    (("--config", "tiny", "--mesh", "2", "--layout", "ep", "--tensor", "3"), "does not divide"),
])
def test_script_bad_input(args, match):
  p = _run(*args, "--context", "64", "--batch", "2", "--spec_k", "0")
  assert p.returncode == 1 and match in p.stderr, p.stderr[-2000:]
  assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args,match", [
    # Used to make 100000 fake devices first (over 300 s); the model's heads refuse this mesh.
    (("--mesh", "100000"), "num_attention_heads=40 is not divisible by the mesh axis tensor=100000"),
    (("--mesh", "8", "--layout", "ep", "--tensor", "1", "--data", "4096", "--batch", "4096"),
     "needs 32768 devices, past the 1024"),
    (("--spec_k", "100000"), "past the limit of 16 (--spec_k)"),  # generation's limit
    (("--dtype", "int8"), "--dtype=int8: value should be one of <float32|bfloat16|float16>"),
])
def test_script_refuses_generations_limits_before_making_devices(args, match):
  """The full-size defaults (maverick, mesh 8): refused before any device or compile, in the
  words generation uses, without a traceback."""
  p = subprocess.run([sys.executable, str(SCRIPT), *args], env=single_device_env(),
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 1 and match in p.stderr, p.stderr[-2000:]
  assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) <= 2, p.stderr[-2000:]


@pytest.mark.slow
def test_modelopt_static_scales_and_nvidia_draft_head():
  """fp8-modelopt = fp8 + one f32 static input scale per FP8 weight; the speculative round adds
  NVIDIA's EAGLE-3 head, counted by hand from its published shapes (one device: no sharding)."""
  cfg = config_lib.tiny(dtype="bfloat16")
  plan = sharding.Plan(sharding.make_mesh(devices=jax.devices()[:1]), "tp")
  kw = dict(batch=2, context=64)
  fp8 = memory_plan.plan_decode_step(cfg, plan, quant="fp8", **kw)
  mo = memory_plan.plan_decode_step(cfg, plan, quant="fp8-modelopt", **kw)
  L, n_moe = cfg.num_hidden_layers, len(cfg.moe_layers)
  # q, k, v, o in every layer; gate/up/down in dense layers; experts + shared expert in MoE ones.
  n_fp8 = 4 * L + 3 * (L - n_moe) + 6 * n_moe
  assert mo.weight_bytes - fp8.weight_bytes == 4 * n_fp8 == mo.static_scale_bytes
  assert mo.total_bytes == (mo.argument_bytes + mo.temp_bytes + mo.output_bytes
                            - mo.alias_bytes + 4 * n_fp8)

  spec = memory_plan.plan_spec_round(cfg, plan, k=2, quant="fp8-modelopt", **kw)
  D, V, H, K, Dh = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_dim)
  Fm = cfg.intermediate_size_mlp  # assumed MLP width of the head
  bf16 = 2
  head = bf16 * (3 * D * D  # fc: 3 fused target features -> D
                 + 2 * D * H * Dh + 2 * (2 * D * K * Dh)  # q, k, v read [embedding | hidden]
                 + H * Dh * D  # o
                 + 3 * D * Fm  # MLP
                 + D * V  # lm_head, full vocabulary
                 + 4 * D)  # embed, hidden, post-attention and final norms
  head += 4 * V  # d2t (int32), identity for a full-vocabulary head
  assert spec.weight_bytes - mo.weight_bytes == head
  # The draft's own KV cache: one layer of K and V, bf16, plus its lengths.
  draft_kv = 2 * 2 * 64 * K * Dh * bf16 + 2 * 4
  assert spec.kv_bytes - mo.kv_bytes == draft_kv


@pytest.mark.slow
def test_script_modelopt_with_nvidia_draft(tmp_path):
  out = tmp_path / "plan.json"
  p = _run("--config", "tiny", "--mesh", "2", "--quant", "fp8-modelopt", "--draft",
           "nvidia-eagle3", "--context", "256", "--batch", "2", "--spec_k", "2", "--json_out",
           str(out))
  assert p.returncode == 0, p.stderr[-2000:]
  assert "draft: NVIDIA EAGLE-3 head, bf16: fc 192 -> 64" in p.stdout
  assert "own lm_head over 512 tokens" in p.stdout and "assumed" in p.stdout
  data = json.loads(out.read_text())
  assert data["quant"] == "fp8-modelopt" and data["draft"] == "nvidia-eagle3"
  assert all(r["static_scale_bytes"] > 0 for r in data["reports"])


# --- Serving view: hand formulas and the block allocator itself -----------------------------------


def _allocator_peak(prompt_len, length, *, slack, bs, chunk):
  """Peak blocks held (global, chunked) by one request run through serving/blocks.py: the prompt
  prefilled a chunk at a time, then one token committed per round of `slack` reserved positions."""
  from maverick.serving import blocks as B
  mgr = B.BlockManager({B.GLOBAL: B.BlockPool(1000, bs), B.CHUNKED: B.BlockPool(1000, bs)},
                       chunk_size=chunk)
  held = lambda name: sum(b != B.NO_BLOCK for b in mgr.requests["r"].tables[name])
  peak = [0, 0]

  def note():
    peak[0] = max(peak[0], held(B.GLOBAL))
    peak[1] = max(peak[1], held(B.CHUNKED))

  tokens = list(range(length))
  mgr.admit("r", tokens[:prompt_len], prefill=chunk)
  note()
  done = 0
  while done < prompt_len:
    piece = tokens[done:min(done + chunk, prompt_len)]
    mgr.commit("r", piece)
    done += len(piece)
    mgr.release_invisible("r")
    if done < prompt_len:
      mgr.reserve("r", min(chunk, prompt_len - done))
      note()
  while done < length:
    mgr.reserve("r", slack)
    note()
    mgr.commit("r", tokens[done:done + 1])
    done += 1
    mgr.release_invisible("r")
  return peak


@pytest.mark.parametrize("prompt_len,length", [(1, 2), (3, 5), (10, 15), (14, 17), (16, 30),
                                               (40, 41), (5, 63), (33, 64), (20, 100)])
def test_expected_blocks_is_the_allocators_peak(prompt_len, length):
  bs, chunk, slack = 4, 16, 3
  g, c = _allocator_peak(prompt_len, length, slack=slack, bs=bs, chunk=chunk)
  P, L = [prompt_len], [length]
  assert memory_plan.expected_blocks(P, L, slack=slack, block=bs) == g
  assert memory_plan.expected_blocks(P, L, slack=slack, block=bs, chunk=chunk) == c


def test_length_mix_is_the_stated_lognormals():
  mix = memory_plan.LengthMix(prompt_median=1000, prompt_sigma=0.5, output_median=200,
                              output_sigma=0.25, cap=1_000_000, samples=200_000, seed=3)
  p, x = mix.sample()
  assert x.dtype == np.int64 and (x > p).all() and (p >= 1).all()
  # Sum of two lognormals: E = m1 e^(s1^2/2) + m2 e^(s2^2/2) (+1 per ceil, on average ~0.5 each).
  mean = 1000 * np.exp(0.5 ** 2 / 2) + 200 * np.exp(0.25 ** 2 / 2) + 1
  assert abs(x.mean() - mean) / mean < 0.01
  cp, capped = memory_plan.LengthMix(cap=4096, seed=3).sample()
  assert capped.max() == 4096 and (capped == 4096).mean() > 0.01 and cp.max() == 4095
  np.testing.assert_array_equal(capped, memory_plan.LengthMix(cap=4096, seed=3).sample()[1])
  with pytest.raises(ValueError, match="sigmas >= 0"):
    memory_plan.LengthMix(prompt_sigma=-1)


def test_serving_plan_by_hand():
  """tiny: 8 layers, every 4th NoPE (global): 2 global + 6 chunk-local (chunk 16); 2 KV heads of
  head_dim 32, over tensor=2: one head per device."""
  cfg = config_lib.tiny(dtype="bfloat16")
  dcfg = memory_plan.nvidia_eagle3(cfg)
  mix = memory_plan.LengthMix(prompt_median=20, prompt_sigma=0.8, output_median=8,
                              output_sigma=0.5, cap=96, samples=300, seed=1)
  G = memory_plan.GB
  hbm = {"X": 10 * G, "Y": 3 * G}
  rows = memory_plan.plan_serving(cfg, tensor=2, weight_bytes=G, mix=mix, slack=4,
                                  draft_config=dcfg, block=8, reserve_bytes=0.5 * G,
                                  kv_caches=("bf16", "fp8", "fp8_static"), hbm=hbm)
  assert [(r.device, r.kv_cache) for r in rows] == [
      ("X", "bf16"), ("Y", "bf16"), ("X", "fp8"), ("Y", "fp8"), ("X", "fp8_static"),
      ("Y", "fp8_static")]
  per_layer = {"bf16": 2 * 32 * 2, "fp8": 2 * (32 + 4), "fp8_static": 2 * 32}
  # Blocks per request: the allocator's own peak, run request by request.
  peaks = np.array([_allocator_peak(int(p), int(n), slack=4, bs=8, chunk=16)
                    for p, n in zip(*mix.sample())])
  paged, local = peaks.mean(axis=0)
  assert local < paged
  contiguous = 104  # 96 + 4 rounded up to 8
  for r in rows:
    g = 2 * per_layer[r.kv_cache] + 2 * 32 * 2  # 2 global layers + the bf16 draft layer
    c = 6 * per_layer[r.kv_cache]
    assert (r.global_token_bytes, r.chunked_token_bytes) == (g, c)
    free = hbm[r.device] - 1.5 * G
    assert r.free_bytes == free
    assert r.contiguous == int(free // (contiguous * (g + c)))
    assert r.paged == int(free // (paged * 8 * (g + c)))
    assert r.paged_chunked == int(free // (8 * (paged * g + local * c)))
    assert r.contiguous < r.paged < r.paged_chunked


@pytest.mark.slow
def test_script_serving_view(tmp_path):
  out = tmp_path / "serving.json"
  p = _run("--config", "tiny", "--mesh", "2", "--quant", "fp8", "--serving", "--context", "512",
           "--prompt_median", "40", "--output_median", "20", "--block_size", "8", "--json_out",
           str(out))
  assert p.returncode == 0, p.stderr[-2000:]
  assert "SERVING PLAN (by formula, not measured)" in p.stdout
  assert "no engine pages" not in p.stdout
  assert ("paged = Engine(kv_layout='paged', block_size=8, num_blocks=requests x expected global "
          "blocks, preemption=True" in p.stdout)
  assert ("paged+chunk-local = the same + num_chunked_blocks=requests x expected chunk-local"
          in p.stdout)
  assert "2 global + 1 draft (bf16) | 6 chunk-local (chunk 16)" in p.stdout
  data = json.loads(out.read_text())
  assert [(r["device"], r["kv_cache"]) for r in data["rows"]] == [
      ("B200", "bf16"), ("H200", "bf16"), ("B200", "fp8"), ("H200", "fp8")]
  # Weights are the compiled plan's (same abstract shards), not a separate estimate.
  plan = sharding.Plan(sharding.make_mesh(tensor=2, devices=jax.devices()[:2]), "tp")
  cfg = config_lib.tiny(dtype="bfloat16")
  spec = memory_plan.plan_spec_round(cfg, plan, batch=2, context=64, k=3, quant="fp8")
  assert data["rows"][0]["weight_bytes"] == spec.weight_bytes


@pytest.mark.parametrize("args,match", [
    (("--block_size", "5"), "--block_size 5 must be >= 1 and divide the chunk size 8192"),
    (("--reserve_gb", "-1"), "--reserve_gb must be >= 0"),
    (("--prompt_sigma", "-0.5"), "sigmas >= 0"),
    (("--output_median", "0"), "medians, cap and samples >= 1"),
    (("--vision_tiles", "4"), "--vision_tiles plans the vision tower's compiled prefill; it "
                              "does not apply to --serving"),
])
def test_script_serving_bad_input(args, match):
  """Refused before any device is made, one line, no traceback (full-size defaults)."""
  p = subprocess.run([sys.executable, str(SCRIPT), "--serving", *args], env=single_device_env(),
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 1 and match in p.stderr, p.stderr[-2000:]
  assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) <= 2, p.stderr[-2000:]
