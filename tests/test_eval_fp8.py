"""BF16-vs-FP8 parity metrics (maverick.quant.parity) and scripts/eval_fp8.py."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from maverick import config as config_lib
from maverick import model as model_lib
from maverick import quant
from maverick.quant import parity

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_greedy_agreement_counts():
  ga = parity.greedy_agreement([[1, 2, 3, 4], [5, 6], [7, 8, 9, 9]],
                               [[1, 2, 0, 4], [5, 6], [1, 8, 9, 9]])
  assert ga.prompts == 3 and ga.tokens == 10 and ga.exact == 1
  assert ga.token_agreement == pytest.approx(8 / 10)
  assert ga.prefix_agreement == pytest.approx((2 / 4 + 1 + 0) / 3)


@pytest.mark.slow
def _blend(a, b, t):
  """A model with weights (1 - t) a + t b: close to a, but not equal (its top-1 agrees in part)."""
  from flax import nnx
  import jax
  gd, sa = nnx.split(a)
  _, sb = nnx.split(b)
  return nnx.merge(gd, jax.tree.map(lambda x, y: (1 - t) * x + t * y, sa, sb))


def test_teacher_forced_metrics_against_numpy():
  """The metrics against NumPy over each model's own logits: exactly for two float32 models
  (batches of 2, padded, against one eager batch of 3), and for an FP8-KV model by agreement:
  its e4m3 roundings can flip between the jitted batches and the eager reference (jax 0.12.1 on
  an EPYC: eager and jitted logprobs 0.15 apart, top-1 0.714 vs 0.690; 0.12.0.1: equal)."""
  cfg = config_lib.tiny("float32")
  ref = model_lib.init_model(cfg, seed=4)
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, 512, (3, 16)).astype(np.int32)
  targets = rng.integers(0, 512, (3, 16)).astype(np.int32)
  targets[2, 10:] = -1
  same = parity.teacher_forced(ref, ref, inputs, targets, batch_size=2)
  assert same.tokens == 42 and same.top1_agreement == 1.0
  assert abs(same.mean_kl) < 1e-6 and same.ppl_bf16 == pytest.approx(same.ppl_fp8)
  from maverick import kv_cache as kvc
  logsm = lambda x: x - x.max(-1, keepdims=True) - np.log(
      np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
  m = targets >= 0
  nll = lambda lp: -np.take_along_axis(lp, np.maximum(targets, 0)[..., None], -1)[..., 0][m].mean()
  pr = logsm(np.asarray(ref(inputs).logits, np.float64))
  near = _blend(ref, model_lib.init_model(cfg, seed=5), 0.05)
  fp8 = quant.quantize_model(ref, quant.QuantConfig(kv_cache="fp8"))
  for test, exact in ((near, True), (fp8, False)):
    got = parity.teacher_forced(ref, test, inputs, targets, batch_size=2)
    cache = kvc.KVCache.init(test.config, 3, 16) if test is fp8 else None  # FP8: through its cache
    pt = logsm(np.asarray(test(inputs, cache=cache).logits, np.float64))
    top1 = (pr.argmax(-1) == pt.argmax(-1))[m].mean()
    kl = (np.exp(pr) * (pr - pt)).sum(-1)[m].mean()
    if exact:
      assert 0.2 < top1 < 0.9, top1  # a test that partly agrees
      assert got.top1_agreement == pytest.approx(top1)
    else:
      assert abs(got.top1_agreement - top1) <= 2 / 42 + 1e-9, (got.top1_agreement, top1)
    assert got.mean_kl == pytest.approx(kl, rel=1e-3 if exact else 5e-2)
    assert got.ppl_bf16 == pytest.approx(math.exp(nll(pr)), rel=1e-4)
    assert got.ppl_fp8 == pytest.approx(math.exp(nll(pt)), rel=1e-4 if exact else 1e-2)


@pytest.mark.slow
def test_eval_fp8_cli(tmp_path):
  out = tmp_path / "r.json"
  r = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "eval_fp8.py"), "--max_files=2", "--max_windows=4",
       "--seq_len=64", "--prompts=2", "--gen_tokens=8", "--kv_cache=fp8", f"--out_json={out}"],
      check=False, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads(out.read_text())
  assert res["quant"]["kv_cache"] == "fp8" and res["teacher_forced"]["tokens"] > 0
  assert res["speculative"]["fp8_lossless"] is True
  assert "top-1 agreement" in r.stdout
  bad = subprocess.run([sys.executable, str(REPO / "scripts" / "eval_fp8.py"), "--seq_len=0"],
                       check=False, capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert bad.returncode == 1 and "--seq_len must be >= 1" in bad.stderr
