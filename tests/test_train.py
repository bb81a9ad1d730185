"""Training: loss goes down, resuming replays the uninterrupted run, bad input is reported clearly."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from maverick import config as config_lib
from maverick import data, train

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_target.py"

SMALL = config_lib.Config(
    vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
    tie_word_embeddings=True, attention_chunk_size=8, no_rope_layer_interval=4,
    attn_temperature_tuning=True, floor_scale=8.0, attn_scale=0.1, rope_theta=10000.0,
    dtype="float32")


def _stream(n=6000, seed=0):
  """A learnable token stream: a repeated random phrase with noise."""
  rng = np.random.default_rng(seed)
  phrase = rng.integers(0, 64, 23)
  s = np.tile(phrase, n // 23 + 1)[:n]
  noise = rng.random(n) < 0.1
  s[noise] = rng.integers(0, 64, noise.sum())
  return s.astype(np.int32)


def _tc(**kw):
  base = dict(steps=8, batch_size=4, seq_len=32, learning_rate=1e-2, warmup_steps=2,
              checkpoint_every=2, log_every=1, seed=0)
  base.update(kw)
  return train.TrainConfig(**base)


@pytest.mark.slow
def test_loss_decreases(tmp_path):
  result = train.train(SMALL, _tc(steps=30, checkpoint_every=100), _stream(), str(tmp_path),
                       progress=False)
  losses = [h["ce"] for h in result.history]
  assert result.step == 30
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses
  assert all(np.isfinite(h["balance"]) and h["balance"] > 0 for h in result.history)  # recorded


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tmp_path):
  stream = _stream()
  full = train.train(SMALL, _tc(), stream, str(tmp_path / "full"), progress=False)
  # "Killed" after 5 steps: the last checkpoint is at step 4, so step 5 is redone on restart.
  part = train.train(SMALL, _tc(), stream, str(tmp_path / "resumed"), progress=False,
                     stop_after=5)
  assert part.step == 5
  resumed = train.train(SMALL, _tc(), stream, str(tmp_path / "resumed"), progress=False)
  assert resumed.resumed_from == 4 and resumed.step == 8
  a = jax.tree.leaves(nnx.state(full.model))
  b = jax.tree.leaves(nnx.state(resumed.model))
  for x, y in zip(a, b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_unwritable_output_dir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(train.TrainError, match="cannot write to output directory"):
    train.train(SMALL, _tc(), _stream(), str(blocker / "run"), progress=False)


def test_corpus_shorter_than_a_window(tmp_path):
  with pytest.raises(train.TrainError, match="fewer than one window"):
    train.train(SMALL, _tc(seq_len=64), _stream(n=40), str(tmp_path), progress=False)


def test_bad_train_config():
  with pytest.raises(train.TrainError, match="steps"):
    _tc(steps=0)


def test_non_utf8_files_are_skipped_and_counted(tmp_path):
  (tmp_path / "good.py").write_text("x = 1\n")
  (tmp_path / "bad.py").write_bytes(b"\xff\xfe\x00 latin-1 \xe9\n")
  texts = data.read_texts(str(tmp_path), data.list_files(str(tmp_path)))
  assert texts.files == ["good.py"] and texts.skipped == ["bad.py"]


def test_empty_corpus_folder(tmp_path):
  with pytest.raises(data.CorpusError, match="no .py files"):
    data.load_split(str(tmp_path), "train")
  with pytest.raises(data.CorpusError, match="does not exist"):
    data.load_split(str(tmp_path / "missing"), "train")


def test_split_is_by_whole_file_and_deterministic():
  files = [f"pkg/mod_{i}.py" for i in range(400)]
  val = [f for f in files if data.is_validation(f, 0.1)]
  assert 20 < len(val) < 60  # ~10%
  assert val == [f for f in reversed(files) if data.is_validation(f, 0.1)][::-1]


def _corpus(tmp_path, n_files=12):
  d = tmp_path / "corpus"
  d.mkdir()
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "value", "if", "else", "for", "in", "range", "print"]
  for i in range(n_files):
    lines = [f"def f{i}_{j}(x):\n    return x + {j}\n" + " ".join(rng.choice(words, 6)) + "\n"
             for j in range(40)]
    (d / f"m{i}.py").write_text("".join(lines))
  (d / "latin1.py").write_bytes(b"# caf\xe9\n")
  return d


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_script_smoke_run_exports_a_loadable_model(tmp_path):
  import maverick
  corpus = _corpus(tmp_path)
  out = tmp_path / "model"
  r = _run(f"--data_dir={corpus}", f"--out_dir={out}", f"--workdir={tmp_path / 'work'}",
           "--val_fraction=0.2", "--vocab_size=300", "--hidden_size=32", "--num_layers=4",
           "--num_heads=4", "--num_kv_heads=2", "--expert_width=16", "--mlp_width=32",
           "--chunk_size=16", "--floor_scale=16", "--steps=6", "--batch_size=2", "--seq_len=32",
           "--checkpoint_every=3", "--warmup_steps=2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "1 skipped (not UTF-8)" in r.stdout
  assert (out / "MODEL_CARD.md").is_file() and (out / "tokenizer.json").is_file()
  loaded = maverick.load(str(out))
  assert loaded.config.dtype == "bfloat16" and loaded.tokenizer.vocab_size == 300


def test_script_empty_corpus_is_a_clear_error(tmp_path):
  (tmp_path / "empty").mkdir()
  r = _run(f"--data_dir={tmp_path / 'empty'}", f"--out_dir={tmp_path / 'o'}",
           f"--workdir={tmp_path / 'w'}", "--steps=1")
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert "no .py files" in r.stderr
