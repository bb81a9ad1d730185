"""Hugging Face repo ids as checkpoint sources, offline against a cache filled here."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import maverick
from maverick import hub
from maverick.checkpoint import CheckpointError
from param_utils import assert_same_params

REPO = pathlib.Path(__file__).resolve().parents[1]
REPO_ID = "test-org/llama4-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, hf_fixture_dir):
  """An HF hub cache holding REPO_ID in the hub's layout: models--owner--name/{refs,snapshots}."""
  pytest.importorskip("huggingface_hub")
  cache = tmp_path_factory.mktemp("hf_cache")
  repo = cache / ("models--" + REPO_ID.replace("/", "--"))
  snapshot = repo / "snapshots" / COMMIT
  snapshot.mkdir(parents=True)
  for name in ("config.json", "generation_config.json", "model.safetensors"):
    shutil.copy(hf_fixture_dir / name, snapshot / name)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(COMMIT)
  return cache


def test_repo_id_detection(tmp_path, monkeypatch):
  assert hub.is_repo_id("meta-llama/Llama-4-Scout-17B-16E-Instruct")
  assert not hub.is_repo_id("tiny") and not hub.is_repo_id("random:tiny")
  assert not hub.is_repo_id("/abs/path") and not hub.is_repo_id("a/b/c")
  local = tmp_path / "owner" / "name"
  local.mkdir(parents=True)
  monkeypatch.chdir(tmp_path)
  assert not hub.is_repo_id("owner/name")  # an existing local path wins


def test_resolves_offline_from_cache(hub_cache, hf_fixture_dir):
  path = hub.resolve(REPO_ID, cache_dir=str(hub_cache), local_files_only=True)
  assert pathlib.Path(path) == hub_cache / f"models--test-org--llama4-tiny/snapshots/{COMMIT}"
  from_hub = maverick.load(path, dtype="float32")
  assert_same_params(from_hub.model, maverick.load(str(hf_fixture_dir), dtype="float32").model)


def test_not_cached_offline_is_a_clear_error(hub_cache):
  with pytest.raises(CheckpointError, match="nor a Hugging Face repo in the cache"):
    hub.resolve("test-org/absent", cache_dir=str(hub_cache), local_files_only=True)


def test_without_huggingface_hub_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
  with pytest.raises(CheckpointError, match=r"pip install 'maverick-jax\[hub\]'"):
    maverick.load("meta-llama/Llama-4-Scout-17B-16E-Instruct")
  assert hub.resolve("tiny") == "tiny"  # not a repo id: no hub needed


@pytest.mark.slow
def test_repo_id_through_hf_env_and_cli_error(hub_cache):
  """HF_HUB_CACHE + HF_HUB_OFFLINE as a user sets them; the CLI reports a missing repo in one line."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
  code = ("import maverick; l = maverick.load('%s', dtype='float32'); print(l.source); "
          "print(maverick.generate(l.model, [[1, 2, 3]], max_new_tokens=4).tokens)" % REPO_ID)
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert COMMIT in r.stdout
  r = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"),
                      "--checkpoint=test-org/absent", "--prompt=x"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and "Traceback" not in r.stderr
  assert ("generate: error: 'test-org/absent' is neither a local directory nor a Hugging Face "
          "repo in the cache") in r.stderr
