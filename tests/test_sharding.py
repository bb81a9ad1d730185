"""Sharding on 8 fake CPU devices: TP and EP layouts agree with one device (logits, greedy plain and
speculative generation), the TP decode step's collectives, bad meshes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maverick import config as config_lib
from maverick import generation as gen
from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick import sharding
from maverick.checkpoint import load_hf
from spec_decode import draft as draft_lib
from spec_decode import speculative as spec
from test_generate import count_compiles

# The HF fixture has 4 heads, 2 KV heads, 8 experts: meshes that divide them.
FIXTURE_MESHES = [("tp", dict(data=4, tensor=2)), ("ep", dict(expert=8)),
                  ("ep", dict(expert=4, tensor=2))]


def wide_config() -> config_lib.Config:
  """>= 8 experts and heads, KV heads and widths divisible by 8 (TP8 / EP8), top-2 routing."""
  return config_lib.Config(
      vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=16,
      num_local_experts=16, num_experts_per_tok=2, interleave_moe_layer_step=2,
      attention_chunk_size=8, no_rope_layer_interval=4, attn_temperature_tuning=True,
      floor_scale=8.0, attn_scale=0.25, use_qk_norm=True, rope_scaling=None,
      max_position_embeddings=1024, dtype="float32")


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  return np.asarray(model_lib.apply(graphdef, state, jnp.asarray(tokens)).logits)


def _sharded_fixture(hf_fixture_dir, layout, mesh_kw):
  model = load_hf(str(hf_fixture_dir), dtype="float32")
  return sharding.shard_model(model, sharding.make_mesh(**mesh_kw), layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", FIXTURE_MESHES)
def test_fixture_logits_match_single_device(hf_fixture_dir, hf_fixture, fixture_model, layout,
                                            mesh_kw):
  model = _sharded_fixture(hf_fixture_dir, layout, mesh_kw)
  leaf = model.layers[1].ffn.gate[...]
  assert len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
  got = _logits(model, hf_fixture["inputs"])
  np.testing.assert_allclose(got, _logits(fixture_model, hf_fixture["inputs"]), atol=1e-5, rtol=0)
  np.testing.assert_allclose(got, hf_fixture["logits"], atol=2e-4, rtol=0)  # HF, independent


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", [("tp", dict(tensor=8)), ("ep", dict(expert=8)),
                                            ("ep", dict(expert=2, tensor=4))])
def test_eight_way_logits_match_single_device(layout, mesh_kw):
  cfg = wide_config()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
  reference = model_lib.init_model(cfg, seed=3)
  model = sharding.shard_model(model_lib.init_model(cfg, seed=3), sharding.make_mesh(**mesh_kw),
                               layout)
  np.testing.assert_allclose(_logits(model, tokens), _logits(reference, tokens), atol=1e-5, rtol=0)
  # 2 x 2 tokens x top-2 = 8 assignments: the gathered (decode-sized) expert path on <= 8 experts.
  np.testing.assert_allclose(_logits(model, tokens[:, :2]), _logits(reference, tokens[:, :2]),
                             atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", [("tp", dict(tensor=8)), ("ep", dict(expert=2, tensor=4))])
def test_fp8_model_logits_match_single_device(layout, mesh_kw):
  """FP8 weights (router, routed and shared experts, attention, MLP): their scales are sharded with
  the weights' output axes inside the sharded MoE. Weight-only FP8 has the same arithmetic on one
  device and on the mesh (1e-5). With per-token FP8 activations a row-parallel shard scales its own
  slice of the row (a finer-grained scale than one device's), so the two differ by FP8 rounding:
  the mesh's error against the unquantized model must be no worse than one device's (x1.25)."""
  from maverick.quant import QuantConfig, quantize_model
  cfg = wide_config()
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24))
  mesh = sharding.make_mesh(**mesh_kw)
  exact = {t.shape: _logits(model_lib.init_model(cfg, seed=3), t) for t in (tokens, tokens[:, :2])}
  for activations in ("none", "dynamic_per_token"):
    quant = QuantConfig(activations=activations, skip=("embed", "lm_head"))  # FP8 router too
    reference = quantize_model(model_lib.init_model(cfg, seed=3), quant)
    model = sharding.shard_model(quantize_model(model_lib.init_model(cfg, seed=3), quant), mesh,
                                 layout)
    assert model.layers[1].ffn.gate[...].dtype == jnp.float8_e4m3fn
    assert model.layers[1].ffn.router_scale is not None
    for t in (tokens, tokens[:, :2]):  # grouped and gathered expert paths
      got, want = _logits(model, t), _logits(reference, t)
      if activations == "none":
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
      else:
        f32 = exact[t.shape]
        assert np.abs(got - f32).mean() <= 1.25 * np.abs(want - f32).mean()
        assert (got.argmax(-1) == f32.argmax(-1)).mean() >= (want.argmax(-1) == f32.argmax(-1)).mean() - 0.05


def _prompts(n, seed, vocab=512):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, rng.integers(3, 20)).tolist() for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", FIXTURE_MESHES[:2])
def test_greedy_generation_matches_single_device(hf_fixture_dir, hf_fixture, fixture_model,
                                                 layout, mesh_kw):
  model = _sharded_fixture(hf_fixture_dir, layout, mesh_kw)
  prompts = [hf_fixture["inputs"][0].tolist()] + _prompts(3, seed=1)
  kw = dict(max_new_tokens=12, stop_tokens=[])
  gen._EXECUTABLES.clear()
  with count_compiles() as compiles:
    out = gen.generate(model, prompts, **kw)
  # At most one: JAX's own cache may already hold this program from another test in the process.
  assert len(compiles) <= 1, "a sharded generate call is still one compiled executable"
  assert out.tokens == gen.generate(fixture_model, prompts, **kw).tokens
  assert out.tokens[0] == hf_fixture["greedy"][:12].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("layout,mesh_kw", [FIXTURE_MESHES[0], FIXTURE_MESHES[2]])
def test_speculative_greedy_matches_single_device(hf_fixture_dir, fixture_model, layout, mesh_kw):
  dcfg = draft_lib.Eagle3Config.for_target(fixture_model.config)
  model = _sharded_fixture(hf_fixture_dir, layout, mesh_kw)
  mesh = sharding.plan_of(model).mesh
  draft = sharding.shard_model(draft_lib.init_draft(dcfg, seed=1), mesh, layout)
  prompts = _prompts(4, seed=2)
  kw = dict(k=3, max_new_tokens=12, stop_tokens=[])
  spec._EXECUTABLES.clear()
  with count_compiles() as compiles:
    out = spec.generate(model, draft, prompts, **kw)
  assert len(compiles) <= 1  # one program (JAX's own cache may already hold it)
  single = spec.generate(fixture_model, draft_lib.init_draft(dcfg, seed=1), prompts, **kw)
  assert out.tokens == single.tokens
  np.testing.assert_array_equal(out.accepted, single.accepted)
  assert out.tokens == gen.generate(fixture_model, prompts, max_new_tokens=12,
                                    stop_tokens=[]).tokens


def test_sharded_generate_program_has_loop_and_no_host_communication(hf_fixture_dir):
  model = _sharded_fixture(hf_fixture_dir, "tp", dict(data=4, tensor=2))
  req, steps, capacity = gen.prepare(model.config, _prompts(4, seed=3), max_new_tokens=4)
  req = sharding.place_request(req, sharding.plan_of(model))
  graphdef, state = nnx.split(model)
  hlo = gen.generate_jit.lower(graphdef, state, req, steps=steps, capacity=capacity,
                               pad_id=0).compile().as_text()
  assert "while" in hlo.split("ENTRY")[1]
  for f in ("xla_ffi_python_cpu_callback", "xla_python_cpu_callback", " send(", " recv(",
            " infeed(", " outfeed("):
    assert f not in hlo, f


def collectives(hlo: str) -> dict[str, list[str]]:
  """Collective instructions of an optimized HLO module, by opcode."""
  ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
  out = {op: [] for op in ops}
  for line in hlo.splitlines():
    m = re.search(r"=\s*\S+\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                  r"collective-permute)(-start)?\(", line)
    if m:
      out[m.group(1)].append(line)
  return out


def _decode_step_hlo(cfg, mesh, layout, B):
  model = sharding.shard_model(model_lib.init_model(cfg), mesh, layout)
  plan = sharding.plan_of(model)
  graphdef, state = nnx.split(model)

  def step(state, tokens, cache):
    out = nnx.merge(graphdef, state)(tokens, cache=sharding.constrain_cache(cache, plan))
    return out.logits, sharding.constrain_cache(out.cache, plan)

  cache = jax.eval_shape(lambda: kvc.KVCache.init(cfg, B, 64))
  tokens = jax.ShapeDtypeStruct((B, 1), jnp.int32)
  return jax.jit(step, donate_argnums=2).lower(state, tokens, cache).compile().as_text()


def _numel(line: str) -> int:
  shape = re.search(r"=\s*\w+\[([\d,]*)\]", line).group(1)
  return int(np.prod([int(d) for d in shape.split(",") if d]))


def test_ep_decode_step_moves_only_token_rows():
  """EP8 (data-parallel attention, one row per device): per MoE layer one all-gather of the rows
  into the experts and one reduce-scatter back, nothing else; attention needs no collective."""
  cfg = wide_config()
  B = 8
  found = collectives(_decode_step_hlo(cfg, sharding.make_mesh(expert=8), "ep", B))
  n_moe = len(cfg.moe_layers)
  assert len(found["all-gather"]) == len(found["reduce-scatter"]) == n_moe, found
  assert not found["all-reduce"] and not found["all-to-all"] and not found["collective-permute"]
  for line in found["all-gather"]:
    assert _numel(line) == B * cfg.hidden_size, line  # gathered rows, not weights


def test_tp_decode_step_has_two_all_reduces_per_layer_and_no_weight_gather():
  """TP8 on the 16-expert config: one decode step (T=1, KV cache) compiles to exactly 2
  all-reduces per layer (attention output, FFN output) + 1 for the vocab-sharded embedding lookup,
  each the size of the activations [B, 1, D]; no all-gather, reduce-scatter or all-to-all."""
  cfg = wide_config()
  B = 2
  hlo = _decode_step_hlo(cfg, sharding.make_mesh(tensor=8), "tp", B)
  found = collectives(hlo)
  L = cfg.num_hidden_layers
  assert len(found["all-reduce"]) == 2 * L + 1, "\n".join(found["all-reduce"])
  for op in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
    assert not found[op], (op, found[op][:3])
  # Every all-reduce moves activations (B*D values), never a weight.
  for line in found["all-reduce"]:
    assert _numel(line) == B * cfg.hidden_size, line


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_more_devices_than_present():
  with pytest.raises(sharding.ShardingError, match="needs 16 devices but only 8"):
    sharding.make_mesh(tensor=16)
  with pytest.raises(sharding.ShardingError, match="uses 4 of the 8 devices"):
    sharding.make_mesh(tensor=4)
  with pytest.raises(sharding.ShardingError, match="does not divide the 8 devices"):
    sharding.make_mesh(data=3)


def test_mesh_not_dividing_heads_or_experts(fixture_model):
  with pytest.raises(sharding.ShardingError, match="num_attention_heads=4 is not divisible by "
                     "the mesh axis tensor=8"):
    sharding.shard_model(fixture_model, sharding.make_mesh(tensor=8), "tp")
  with pytest.raises(sharding.ShardingError, match="num_key_value_heads=2 .* tensor=4"):
    sharding.shard_model(fixture_model, sharding.make_mesh(data=2, tensor=4), "tp")
  model = model_lib.init_model(config_lib.tiny_top2_tied())  # 6 experts
  with pytest.raises(sharding.ShardingError, match="num_local_experts=6 .* expert=4"):
    sharding.shard_model(model, sharding.make_mesh(expert=4, tensor=2), "ep")
  with pytest.raises(sharding.ShardingError, match="layout 'tp' .* expert axis of size 8"):
    sharding.shard_model(fixture_model, sharding.make_mesh(expert=8), "tp")
  with pytest.raises(sharding.ShardingError, match="unknown layout"):
    sharding.shard_model(fixture_model, sharding.make_mesh(tensor=2, data=4), "fsdp")


def test_weight_dimension_not_dividing_names_the_weight():
  cfg = wide_config().replace(intermediate_size=36)
  with pytest.raises(sharding.ShardingError, match=r"weight layers\.1\.ffn\.\w+ .* 36 is not "
                     "divisible by mesh axis tensor=8"):
    sharding.shard_model(model_lib.init_model(cfg), sharding.make_mesh(tensor=8), "tp")


def test_rows_split_over_data_and_expert_axes():
  ep = sharding.Plan(sharding.make_mesh(data=2, expert=2, tensor=2), "ep")
  assert ep.batch_axis(4) == ("data", "expert")  # data-parallel attention across expert groups
  assert ep.batch_axis(2) == "data"
  assert ep.batch_axis(3) is None
  assert sharding.Plan(sharding.make_mesh(expert=4, tensor=2), "ep").batch_axis(4) == "expert"
  tp = sharding.Plan(sharding.make_mesh(data=4, tensor=2), "tp")
  assert tp.batch_axis(8) == "data" and tp.batch_axis(2) is None
