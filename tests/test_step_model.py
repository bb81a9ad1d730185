"""maverick.step_model: the modeled step time's byte count and formula, against hand arithmetic."""

import types

import numpy as np
import pytest

from maverick import step_model


def _array(shape, dtype):
  return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


CFG = types.SimpleNamespace(num_local_experts=4, num_experts_per_tok=1, num_hidden_layers=2,
                            layer_types=("chunked_attention", "full_attention"),
                            attention_chunk_size=16, head_dim=8, num_key_value_heads=2)

STATE = [
    (("embed",), _array((1000, 32), "float32")),  # a gather: not read
    (("layers", 0, "attn", "q"), _array((4, 8, 32), "float32")),  # 4096 B
    (("layers", 1, "ffn", "gate"), _array((4, 16, 32), "uint8")),  # routed: 2048 B for 4 experts
    (("layers", 1, "ffn", "gate_scale"), _array((4, 16), "float32")),  # routed: 256 B
    (("layers", 1, "ffn", "shared", "up"), _array((16, 32), "uint8")),  # 512 B
    (("layers", 1, "ffn", "router"), _array((32, 4), "float32")),  # 512 B
]


def test_bytes_read_count_the_experts_the_rows_can_pick_and_each_layers_visible_cache():
  one = step_model.step_bytes(STATE, CFG, batch=1, tokens_per_row=1, context=40,
                              kv_bytes_per_value=2)
  # 1 row of top-1 picks 1 of 4 experts: a quarter of the routed bytes
  assert one.weights == 4096 + (2048 + 256) // 4 + 512 + 512
  # K and V (2) x visible positions (16 on the chunked layer, 40 on the full one) x 2 heads x 8 x 2 B
  assert one.kv == 2 * (16 + 40) * 2 * 8 * 2
  three = step_model.step_bytes(STATE, CFG, batch=3, tokens_per_row=2, context=40,
                                kv_bytes_per_value=1, kv_heads_local=1)
  assert three.weights == 4096 + 2048 + 256 + 512 + 512  # 6 rows can pick all 4 experts
  assert three.kv == 3 * 2 * (16 + 40) * 1 * 8 * 1
  halved = step_model.step_bytes(STATE, CFG, batch=1, tokens_per_row=1, context=40,
                                 shard_shape=lambda x: (x.shape[0] // 2,) + tuple(x.shape[1:]))
  assert halved.weights == one.weights // 2


def test_step_time_is_the_slower_of_bytes_and_flops_plus_the_launches():
  h200 = step_model.GPUS["h200"]
  assert step_model.step_seconds(100, 4.8e9, 0.0, "h200") == pytest.approx(
      1e-3 + 100 * step_model.LAUNCH_US * 1e-6)
  # the calibration: the measured H200 step (1,670 launches, 0.46 ms of bytes) is 3.164 ms
  assert step_model.step_seconds(1670, 0.46e-3 * h200.hbm_bytes_per_s, 0.0, "h200") == (
      pytest.approx(3.164e-3))
  assert step_model.step_seconds(0, 0, h200.fp8_flops_per_s, "h200", launch_us=0) == 1.0
  assert step_model.step_seconds(10, 0, 0, "b200", launch_us=1.0) == pytest.approx(1e-5)
  # a K=3 round: verify 1 ms + 3 draft steps of 0.5 ms emitting 3 tokens -> 1200 tokens/s
  assert step_model.spec_tokens_per_s(1e-3, 0.5e-3, 3, 3.0) == pytest.approx(1200.0)
  assert step_model.tokens_per_s(2e-3) == pytest.approx(500.0)
