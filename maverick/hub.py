"""Hugging Face Hub repo ids as checkpoint sources ("meta-llama/Llama-4-Scout-17B-16E-Instruct").

Optional: needs `huggingface_hub` (`pip install 'maverick-jax[hub]'`). A repo id resolves to its
snapshot directory in the HF cache (HF_HUB_CACHE / HF_HOME, shared with transformers), downloading
only what loading reads: configs, tokenizer files and safetensors (or a converted checkpoint's
`maverick.json` + `params/`). HF_HUB_OFFLINE=1 (or local_files_only=True) uses the cache only; gated
repos need `hf auth login` or HF_TOKEN, as for any HF tool.
"""

from __future__ import annotations

import os
import re

from maverick.checkpoint.hf import CheckpointError

# owner/name, HF's character set; a path that exists locally always wins over a repo id.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "params/*"]


def is_repo_id(source: str) -> bool:
  """True for 'owner/name' strings that are not an existing local path."""
  return bool(_REPO_ID.match(source)) and not os.path.exists(source) and ".." not in source


def resolve(source: str, *, revision: str | None = None, cache_dir: str | None = None,
            local_files_only: bool | None = None) -> str:
  """A local directory for `source`: unchanged unless it is a Hub repo id, else the repo's snapshot
  directory in the HF cache (downloaded first unless offline)."""
  if not is_repo_id(source):
    return source
  try:
    import huggingface_hub
    from huggingface_hub import errors
  except ImportError:
    raise CheckpointError(
        f"{source!r} is not a local directory; to use it as a Hugging Face repo id install "
        "huggingface_hub (pip install 'maverick-jax[hub]'), or download it yourself (hf download "
        f"{source} --local-dir DIR) and pass DIR") from None
  kw = {} if local_files_only is None else {"local_files_only": local_files_only}
  try:
    return huggingface_hub.snapshot_download(source, revision=revision, cache_dir=cache_dir,
                                             allow_patterns=ALLOW_PATTERNS,
                                             library_name="maverick-jax", **kw)
  except errors.LocalEntryNotFoundError:
    raise CheckpointError(
        f"{source!r} is neither a local directory nor a Hugging Face repo in the cache, and "
        "downloading is off (HF_HUB_OFFLINE=1 or no network); check the path, or download the repo "
        "once online") from None
  except errors.GatedRepoError:
    raise CheckpointError(f"{source!r} is a gated repo: accept its license on huggingface.co, then "
                          "log in (hf auth login) or set HF_TOKEN") from None
  except errors.RepositoryNotFoundError:
    raise CheckpointError(f"{source!r} is neither a local directory nor a Hugging Face repo (or the "
                          "repo is private: log in with hf auth login); check the spelling") from None
  except errors.RevisionNotFoundError:
    raise CheckpointError(f"{source!r} has no revision {revision!r}") from None
