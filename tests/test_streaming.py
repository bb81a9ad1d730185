"""Streaming generation (maverick.streaming) and scripts/generate.py --stream."""

import os
import pathlib
import subprocess
import sys

import pytest

import spec_decode
from maverick import streaming
from spec_decode import draft as draft_lib

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def random_draft(fixture_model):
  return draft_lib.init_draft(draft_lib.Eagle3Config.for_target(fixture_model.config), seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True])
def test_stream_equals_hf_greedy(fixture_model, random_draft, hf_fixture, speculative):
  """Chunks of 7 over 20 tokens (the prompt grows across a length bucket) give HF's greedy text."""
  prompt, greedy = hf_fixture["inputs"][0].tolist(), hf_fixture["greedy"].tolist()
  chunks = list(streaming.stream(fixture_model, prompt, chunk_tokens=7, max_new_tokens=20,
                                 draft=random_draft if speculative else None, k=2,
                                 stop_tokens=[]))
  assert [len(c.tokens) for c in chunks] == [7, 7, 6]
  assert [c.done for c in chunks] == [False, False, True]
  assert sum((c.tokens for c in chunks), []) == greedy[:20]
  if speculative:
    # Each chunk's first token comes from its prefill; every round then emits >= 1 token and
    # counts every token it emits (a round cut by the limit counts more than it keeps).
    for c in chunks:
      assert 1 <= c.output.rounds.sum() <= len(c.tokens) - 1 <= c.output.accepted.sum()


@pytest.mark.slow
def test_stream_with_tree_draft_equals_hf_greedy(fixture_model, random_draft, hf_fixture):
  prompt, greedy = hf_fixture["inputs"][0].tolist(), hf_fixture["greedy"].tolist()
  chunks = streaming.stream(fixture_model, prompt, chunk_tokens=8, max_new_tokens=16,
                            draft=random_draft, tree=spec_decode.TreeShape(3, 2, 4),
                            stop_tokens=[])
  assert [t for c in chunks for t in c.tokens] == greedy[:16]


def test_stream_stops_on_stop_token(fixture_model, hf_fixture):
  prompt, greedy = hf_fixture["inputs"][0].tolist(), hf_fixture["greedy"].tolist()
  stop = greedy[11]
  assert stop not in greedy[:11]
  # The stop token ends the 3rd chunk of 4 exactly: the stream must still end there.
  chunks = list(streaming.stream(fixture_model, prompt, chunk_tokens=4, max_new_tokens=20,
                                 stop_tokens=[stop]))
  assert sum((c.tokens for c in chunks), []) == greedy[:12]  # the stop token is kept
  assert len(chunks) == 3 and chunks[-1].done


def test_stream_rejects_bad_arguments(fixture_model):
  with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
    next(streaming.stream(fixture_model, [1, 2], chunk_tokens=0))
  with pytest.raises(ValueError, match="ONE prompt"):
    next(streaming.stream(fixture_model, [[1, 2], [3]]))
  # The whole request is checked against the context before the first chunk runs.
  with pytest.raises(ValueError, match="past the model's context of 4096"):
    next(streaming.stream(fixture_model, [1] * 4000, max_new_tokens=200))


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_stream_prints_the_same_text(tmp_path):
  args = ["--prompt=import os\n\n\ndef read_lines(path):", "--max_new_tokens=24", "--dtype=float32"]
  streamed, whole = _cli(*args, "--stream", "--stream_chunk=8"), _cli(*args)
  assert streamed.returncode == 0 and whole.returncode == 0, streamed.stderr + whole.stderr
  text = lambda r: [l for l in r.stdout.splitlines() if not l.startswith(("[", "speculative"))]
  assert text(streamed) == text(whole)
  assert "device calls of <= 8 | first output after" in streamed.stdout
  assert "speculative K=3: acceptance length" in streamed.stdout
  batch = tmp_path / "two.txt"
  batch.write_text("a = 1\nb = 2\n")
  r = _cli(f"--batch_file={batch}", "--stream")
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert "--stream prints one prompt's tokens as they come" in r.stderr
