"""scripts/generate.py end to end, and maverick.load."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import maverick
from maverick.checkpoint import CheckpointError, convert_hf_to_orbax
from maverick.generation import generate
from test_tokenizer import _build as build_test_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
CLI = REPO / "scripts" / "generate.py"


@pytest.fixture(scope="module")
def hf_dir_with_tokenizer(tmp_path_factory, hf_fixture_dir):
  """The HF fixture plus a locally trained byte-level BPE tokenizer.json (507 ids < vocab 512)."""
  d = tmp_path_factory.mktemp("ckpt") / "hf"
  shutil.copytree(hf_fixture_dir, d)
  build_test_tokenizer(d)
  return d


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(CLI), *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.slow
def test_cli_output_equals_library(hf_dir_with_tokenizer):
  prompt = "def add(a, b):"
  r = _run(f"--checkpoint={hf_dir_with_tokenizer}", f"--prompt={prompt}", "--max_new_tokens=12",
           "--dtype=float32")
  assert r.returncode == 0, r.stderr
  loaded = maverick.load(str(hf_dir_with_tokenizer), dtype="float32")
  out = generate(loaded.model, [loaded.tokenizer.encode(prompt)], max_new_tokens=12,
                 stop_tokens=loaded.stop_tokens)
  text = prompt + loaded.tokenizer.decode([t for t in out.tokens[0]
                                           if t not in loaded.stop_tokens])
  assert text in r.stdout
  assert "tokens/s" in r.stdout and "compile" in r.stdout


@pytest.mark.slow
def test_cli_batch_file_sampling_and_chat(hf_dir_with_tokenizer, tmp_path):
  batch = tmp_path / "prompts.txt"
  batch.write_text("import os\n\nclass A:\nx = 1\n")
  args = [f"--checkpoint={hf_dir_with_tokenizer}", f"--batch_file={batch}", "--max_new_tokens=6",
          "--temperature=0.9", "--top_k=20", "--top_p=0.9", "--seed=5", "--chat"]
  r1, r2 = _run(*args), _run(*args)
  assert r1.returncode == 0, r1.stderr
  assert r1.stdout.count("--- ") == 3
  body = lambda s: [l for l in s.splitlines() if "tokens/s" not in l]
  assert body(r1.stdout) == body(r2.stdout)  # seeded


@pytest.mark.slow
def test_cli_default_speculative_equals_plain():
  """The main job: embedded model + embedded EAGLE-3 draft by default; greedy text is identical
  with speculation off."""
  args = ["--prompt=import os\n\n\ndef read_lines(path):", "--max_new_tokens=40"]
  spec, plain = _run(*args), _run(*args, "--spec_k=0")
  tree = _run(*args, "--tree_depth=4", "--tree_topk=4", "--tree_nodes=12")
  for r in (spec, plain, tree):
    assert r.returncode == 0, r.stderr
  text = lambda r: [l for l in r.stdout.splitlines() if "tokens/s" not in l
                    and not l.startswith("speculative")]
  assert text(spec) == text(plain) == text(tree)
  assert "speculative K=3: acceptance length" in spec.stdout
  assert "speculative tree 4x4x12: acceptance length" in tree.stdout
  assert "speculative" not in plain.stdout


@pytest.mark.slow
def test_cli_random_model():
  r = _run("--checkpoint=random:tiny", "--prompt=hello", "--max_new_tokens=4")
  assert r.returncode == 0, r.stderr
  assert "random weights" in r.stdout and "tokens/s" in r.stdout


@pytest.mark.slow
def test_cli_kv_cache_bf16_is_accepted():
  """--kv_cache bf16 (the unquantized cache a ModelOpt checkpoint can be run with) is what every
  other model's cache is already: accepted, the same greedy text as without it."""
  args = ["--checkpoint=random:tiny", "--prompt=hello", "--max_new_tokens=4"]
  plain, bf16 = _run(*args), _run(*args, "--kv_cache=bf16")
  assert bf16.returncode == 0, bf16.stderr
  text = lambda r: [l for l in r.stdout.splitlines() if "tokens/s" not in l]
  assert text(bf16) == text(plain)


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (["--checkpoint=random:tiny", "--prompt=x", "--top_p=1.5"], ["top_p"]),
    (["--checkpoint=random:tiny", "--prompt=x", "--temperature=-1"], ["temperature"]),
    (["--prompt=x", "--batch_file=/no/such/file"], ["exactly one of --prompt or --batch_file"]),
    (["--checkpoint=/no/such/dir", "--prompt=x"], ["/no/such/dir", "not a directory"]),
    (["--prompt=x", "--spec_k=-1"], ["--spec_k must be >= 0"]),
    (["--prompt=x", "--draft=/no/such/draft"], ["/no/such/draft", "not a directory"]),
    (["--prompt=x", "--tree_depth=3"], ["needs all of --tree_depth, --tree_topk and --tree_nodes"]),
    (["--prompt=x", "--tree_depth=5", "--tree_topk=4", "--tree_nodes=3"],
     ["smaller than tree depth", "--tree_nodes >= --tree_depth"]),
    (["--checkpoint=random:tiny", "--prompt=abcdefghij", "--max_cache_len=4"],
     ["KV cache holds 4"]),
    (["--prompt=x", "--kernels=pallas"], ["kernels='pallas' needs a Hopper", "--kernels auto"]),
    (["--prompt=x", "--kv_cache=fp8"], ["kv_cache='fp8' applies to ModelOpt", "tiny"]),
    (["--prompt=x", "--max_new_tokens=600", "--spec_k=0"],
     ["past the model's context of 512", "--max_new_tokens"]),
])
def test_cli_user_errors_are_one_line(args, words):
  r = _run(*args)
  assert r.returncode == 1
  assert "Traceback" not in r.stderr
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, r.stderr
  for w in words:
    assert w in lines[0]


@pytest.mark.slow
def test_load_dispatches_on_source(hf_dir_with_tokenizer, tmp_path):
  from_hf = maverick.load(str(hf_dir_with_tokenizer), dtype="float32")
  out = convert_hf_to_orbax(str(hf_dir_with_tokenizer), str(tmp_path / "conv"), progress=False)
  from_orbax = maverick.load(out)
  assert from_orbax.tokenizer is not None and from_orbax.config == from_hf.config
  assert from_orbax.stop_tokens == from_hf.stop_tokens
  prompt = [from_hf.tokenizer.encode("x = [")]
  a = generate(from_hf.model, prompt, max_new_tokens=5).tokens
  b = generate(from_orbax.model, prompt, max_new_tokens=5).tokens
  assert a == b
  rnd = maverick.load("random:tiny_top2_tied", seed=1)
  assert rnd.config.tie_word_embeddings and rnd.tokenizer.vocab_size == 259


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="random:<preset>"):
    maverick.load(str(tmp_path / "missing"))
  with pytest.raises(CheckpointError, match="neither"):
    maverick.load(str(tmp_path))
  with pytest.raises(ValueError, match="unknown preset"):
    maverick.load("random:nope")
  with pytest.raises(ValueError, match="random init is limited"):
    maverick.load("random:maverick")
  # --kv_cache picks how a ModelOpt checkpoint is read; a converted one has it recorded already.
  with pytest.raises(CheckpointError, match="applies to ModelOpt FP8 checkpoints"):
    maverick.load("random:tiny", kv_cache="fp8")
  with pytest.raises(CheckpointError, match="converted already.*--kv_cache"):
    maverick.load(maverick.loading.EMBEDDED["tiny"], kv_cache="fp8_static")


def test_preset_parameter_counts_match_published():
  """Total text-model parameters: Maverick ~400B, Scout ~108B (109B with the vision tower)."""
  from maverick import config, model
  assert 399e9 < model.num_params(config.maverick()) < 402e9
  assert 107e9 < model.num_params(config.scout()) < 109e9
