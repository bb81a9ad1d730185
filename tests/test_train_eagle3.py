"""EAGLE-3 training-time test: the unrolled training forward is exactly the inference chain, the
loss goes down, training resumes exactly, and the reduced vocabulary map is valid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maverick import train as train_lib
from spec_decode import checkpoint as draft_ckpt
from spec_decode import draft as draft_lib
from spec_decode import train as spec_train


@pytest.fixture(scope="module")
def draft(fixture_model):
  return draft_lib.init_draft(draft_lib.Eagle3Config.for_target(fixture_model.config), seed=2)


@pytest.mark.slow
def test_ttt_steps_equal_inference_chain(fixture_model, draft):
  """TTT step j at base i must see exactly the keys a chain step sees at inference: the
  target-feature prefix <= i and its own chain entries. Compare with the cached inference path."""
  rng = np.random.default_rng(0)
  T, length = 14, 4
  tokens = jnp.asarray(rng.integers(0, 512, (1, T)), jnp.int32)
  aux = draft.config.aux_layer_ids
  feats = jnp.concatenate(list(fixture_model(tokens, capture_layers=aux).hidden), -1)
  embed = fixture_model.embed[...]
  ttt = spec_train.ttt_forward(draft, feats, tokens, embed, length)
  for i in (0, 5, 8):
    # Inference: extend over positions 0..i from target features, then chain steps fed the
    # teacher-forced tokens.
    cache = draft.init_cache(1, 32)
    out = draft(tokens[:, 1:i + 2], draft.fuse(feats[:, :i + 1]), embed, cache=cache,
                prefill=True, logits_at=jnp.asarray([i]))
    np.testing.assert_allclose(out.logits, ttt[0][:, i], atol=1e-5)
    hidden, cache = out.hidden, out.cache.with_lengths(jnp.asarray([i + 1]))
    for j in range(1, length):
      if i + 1 + j >= T:
        break
      out = draft(tokens[:, i + 1 + j][:, None], hidden[:, None], embed, cache=cache)
      np.testing.assert_allclose(out.logits[:, 0], ttt[j][:, i], atol=1e-5)
      hidden, cache = out.hidden[:, 0], out.cache


def _sequences(fixture_model, n=32):
  stream = np.random.default_rng(1).integers(0, 512, 4000).astype(np.int32)
  return spec_train.generate_sequences(fixture_model, stream, num=n, prompt_len=8, gen_len=24,
                                       temperature=0.0, seed=0, batch_size=16, progress=False)


def _tc(**kw):
  base = dict(steps=8, batch_size=4, seq_len=32, learning_rate=3e-3, warmup_steps=2,
              weight_decay=0.0, checkpoint_every=2, log_every=1)
  base.update(kw)
  return train_lib.TrainConfig(**base)


@pytest.mark.slow
def test_generated_sequences_are_target_greedy(fixture_model):
  from maverick.generation import generate
  seqs = _sequences(fixture_model, n=4)
  assert seqs.shape == (4, 32)
  again = generate(fixture_model, seqs[:, :8], max_new_tokens=24, stop_tokens=[]).tokens
  assert np.array_equal(seqs[:, 8:], np.asarray(again))


@pytest.mark.slow
def test_loss_decreases_and_resume_is_exact(fixture_model, tmp_path):
  cfg = draft_lib.Eagle3Config.for_target(fixture_model.config, intermediate_size=32)
  seqs = _sequences(fixture_model)
  ttt = spec_train.TTTConfig(length=3)
  long = spec_train.train_draft(fixture_model, cfg, _tc(steps=40, checkpoint_every=100), seqs,
                                str(tmp_path / "long"), ttt=ttt, progress=False)
  losses = [h["loss"] for h in long.history]
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3])
  full = spec_train.train_draft(fixture_model, cfg, _tc(), seqs, str(tmp_path / "full"), ttt=ttt,
                                progress=False)
  part = spec_train.train_draft(fixture_model, cfg, _tc(), seqs, str(tmp_path / "res"), ttt=ttt,
                                progress=False, stop_after=5)
  assert part.step == 5
  resumed = spec_train.train_draft(fixture_model, cfg, _tc(), seqs, str(tmp_path / "res"),
                                   ttt=ttt, progress=False)
  assert resumed.resumed_from == 4
  for a, b in zip(jax.tree.leaves(nnx.state(full.draft)), jax.tree.leaves(nnx.state(resumed.draft))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_reduced_vocab_map_keeps_most_frequent_ids():
  seqs = np.asarray([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7]], np.int32)
  d2t = spec_train.vocab_map(seqs, target_vocab=12, draft_vocab=3)
  ids = np.arange(3) + d2t
  assert ids.tolist() == [5, 7, 9]
  draft_ckpt.check_d2t(d2t, 12)


def test_bad_training_input(fixture_model, draft, tmp_path):
  cfg = draft.config
  with pytest.raises(train_lib.TrainError, match="sequences"):
    spec_train.train_draft(fixture_model, cfg, _tc(), np.zeros((4,), np.int32), str(tmp_path))
  with pytest.raises(train_lib.TrainError, match="ttt length"):
    spec_train.TTTConfig(length=0)


def _script(name, *args):
  import os
  import pathlib
  import subprocess
  import sys
  repo = pathlib.Path(__file__).resolve().parents[1]
  return subprocess.run([sys.executable, str(repo / "scripts" / name), *args], cwd=repo,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=600)


@pytest.mark.slow
def test_train_eagle3_script_bad_input(tmp_path):
  r = _script("train_eagle3.py", "--gen_temperatures=-1", f"--workdir={tmp_path / 'w'}",
              f"--out_dir={tmp_path / 'o'}")
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert "--gen_temperatures" in r.stderr
  (tmp_path / "empty").mkdir()
  r = _script("train_eagle3.py", f"--data_dir={tmp_path / 'empty'}", f"--workdir={tmp_path / 'w'}",
              f"--out_dir={tmp_path / 'o'}")
  assert r.returncode == 1 and "no .py files" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_eval_ppl_script(tmp_path):
  r = _script("eval_ppl.py", "--max_files=2", "--batch_size=2", "--seq_len=128")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "bits/byte" in r.stdout and "unigram byte model" in r.stdout
  (tmp_path / "empty").mkdir()
  r = _script("eval_ppl.py", f"--data_dir={tmp_path / 'empty'}")
  assert r.returncode == 1 and "no .py files" in r.stderr and "Traceback" not in r.stderr
