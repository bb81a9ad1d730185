"""Llama 4 tokenizers: the HF `tokenizer.json` wrapper, a byte-level fallback, and the chat template.

`Tokenizer` wraps the HF fast tokenizer (`tokenizers` library), resolving BOS / EOS / PAD ids from the
side files HF repos ship next to it. `ByteTokenizer` needs no files at all and is meant for randomly
initialised models. Both expose the same small interface:
`encode`, `decode`, `bos_id`, `eos_ids`, `pad_id`, `vocab_size`, `apply_chat_template`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

TOKENIZER_FILE = "tokenizer.json"

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
EOM_TOKEN = "<|eom|>"
EOT_TOKEN = "<|eot|>"
PAD_TOKEN = "<|finetune_right_pad|>"
HEADER_START_TOKEN = "<|header_start|>"
HEADER_END_TOKEN = "<|header_end|>"

# Used only when no side file names the stop tokens (a repo that ships just tokenizer.json).
_DEFAULT_STOP_TOKENS = (END_OF_TEXT_TOKEN, EOM_TOKEN, EOT_TOKEN)

Message = Mapping[str, Any]


class TokenizerError(ValueError):
  """A tokenizer directory or file that cannot be used."""


class Tokenizer:
  """HF fast byte-level BPE tokenizer plus the Llama 4 special-token ids.

  Build it with `Tokenizer.from_dir`. BOS / PAD come from the first source that names them:
  `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json`, `config.json` (top
  level or `text_config`). `eos_ids` is the union of every EOS named in those files, sorted:
  generation must stop on any of them (`<|eot|>` ends an instruct turn, `<|end_of_text|>` a
  base-model document).
  When no file names them (a repo with only tokenizer.json), BOS is the token the post-processor
  prepends, else `<|begin_of_text|>`; EOS falls back to those of `<|end_of_text|>`, `<|eom|>`,
  `<|eot|>` in the vocabulary, and PAD to `<|finetune_right_pad|>`.
  """

  def __init__(self, tok: tokenizers.Tokenizer, *, bos_id: int | None = None,
               eos_ids: Iterable[int] = (), pad_id: int | None = None):
    self._tok = tok
    self._vocab_size = tok.get_vocab_size(with_added_tokens=True)
    # What the post-processor adds around a probe text tells whether (and which) BOS it prepends.
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    prepends = len(full) > len(bare) and full[1:1 + len(bare)] == bare
    if bos_id is None and prepends:
      bos_id = full[0]  # no file names the BOS, but the post-processor uses one
    if bos_id is None:
      bos_id = tok.token_to_id(BOS_TOKEN)
    eos = sorted({int(i) for i in eos_ids})
    if not eos:
      eos = sorted({i for i in map(tok.token_to_id, _DEFAULT_STOP_TOKENS) if i is not None})
    if pad_id is None:
      pad_id = tok.token_to_id(PAD_TOKEN)
    self._bos_id = bos_id
    self._eos_ids = tuple(eos)
    self._pad_id = pad_id
    # Decided once: HF's own `encode` adds BOS through the post-processor, and adding it again would
    # give the model a double BOS it never saw in training.
    self._post_adds_bos = prepends

  @classmethod
  def from_dir(cls, directory: str | os.PathLike) -> Tokenizer:
    """Loads `directory/tokenizer.json` and the optional HF side files next to it."""
    directory = os.fspath(directory)
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"{path}: no {TOKENIZER_FILE} found. Expected the Hugging Face fast-tokenizer file that "
          f"Llama 4 repos ship next to config.json (or use ByteTokenizer for a random model).")
    tok = _load_hf_tokenizer(path)

    tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
    gen_cfg = _read_json(os.path.join(directory, "generation_config.json"))
    model_cfg = _read_json(os.path.join(directory, "config.json"))
    text_cfg = model_cfg.get("text_config")
    text_cfg = text_cfg if isinstance(text_cfg, dict) else {}

    def token_id(cfg: Mapping[str, Any], key: str, where: str) -> int | None:
      return _resolve_token(tok, cfg.get(key), f"{os.path.join(directory, where)}: {key}")

    def ids(cfg: Mapping[str, Any], key: str, where: str) -> list[int]:
      return _id_list(cfg.get(key), f"{os.path.join(directory, where)}: {key}")

    def first(*candidates: int | None) -> int | None:
      return next((c for c in candidates if c is not None), None)

    bos = first(token_id(tok_cfg, "bos_token", "tokenizer_config.json"),
                token_id(special_map, "bos_token", "special_tokens_map.json"),
                *ids(gen_cfg, "bos_token_id", "generation_config.json")[:1],
                *ids(model_cfg, "bos_token_id", "config.json")[:1],
                *ids(text_cfg, "bos_token_id", "config.json text_config")[:1])
    pad = first(token_id(tok_cfg, "pad_token", "tokenizer_config.json"),
                token_id(special_map, "pad_token", "special_tokens_map.json"),
                *ids(gen_cfg, "pad_token_id", "generation_config.json")[:1],
                *ids(model_cfg, "pad_token_id", "config.json")[:1],
                *ids(text_cfg, "pad_token_id", "config.json text_config")[:1])
    eos = [token_id(tok_cfg, "eos_token", "tokenizer_config.json"),
           token_id(special_map, "eos_token", "special_tokens_map.json"),
           *ids(gen_cfg, "eos_token_id", "generation_config.json"),
           *ids(model_cfg, "eos_token_id", "config.json"),
           *ids(text_cfg, "eos_token_id", "config.json text_config")]
    return cls(tok, bos_id=bos, eos_ids=[e for e in eos if e is not None], pad_id=pad)

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return self._eos_ids

  @property
  def pad_id(self) -> int | None:
    return self._pad_id

  @property
  def vocab_size(self) -> int:
    """Tokenizer vocabulary incl. added tokens (the model's embedding table may be larger)."""
    return self._vocab_size

  @property
  def hf_tokenizer(self) -> tokenizers.Tokenizer:
    return self._tok

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text`.

    add_bos=True runs the tokenizer's post-processor (as HF `encode` does), which for Llama 4 prepends
    `<|begin_of_text|>`; BOS is prepended here only if the post-processor does not add it itself, so it
    appears exactly once. add_bos=False skips the post-processor entirely. As in HF, special-token
    strings inside `text` (e.g. "<|eot|>") are encoded as the special tokens.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    ids = self._ids(text, add_bos)
    if add_bos and not self._post_adds_bos and self._bos_id is not None:
      ids = [self._bos_id, *ids]
    return list(ids)

  def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch, not encode: it releases the GIL while it works (the same ids), so a long prompt
    # tokenized in a server thread leaves the event loop free.
    return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`; ids outside the tokenizer vocabulary are skipped."""
    # A sampled id can lie in the padding rows of a larger embedding table; skip it rather than fail.
    valid = [i for i in map(int, ids) if 0 <= i < self._vocab_size]
    return self._tok.decode(valid, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Message],
                          add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the Llama 4 instruct chat prompt (text-only, no tools).

    `<|begin_of_text|>`, then per message `<|header_start|>{role}<|header_end|>\\n\\n{content}<|eot|>`;
    add_generation_prompt appends `<|header_start|>assistant<|header_end|>\\n\\n`. A leading system
    message is whitespace-trimmed and, given as a list of parts, reduced to its first text part,
    as HF's template does. Each text run between special tokens is
    encoded on its own, which is how HF tokenizes the rendered template string.
    """
    header_start, header_end, eot = (self._special(t) for t in
                                     (HEADER_START_TOKEN, HEADER_END_TOKEN, EOT_TOKEN))
    if self._bos_id is None:
      raise TokenizerError(f"apply_chat_template needs a BOS token ({BOS_TOKEN}); none is known")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
      raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    text = lambda s: self._ids(s, False)
    ids = [self._bos_id]
    for n, msg in enumerate(messages):
      role, content = _message_parts(msg, n)
      if n == 0 and role == "system":
        if isinstance(msg["content"], list):  # HF's template keeps only the first text part
          content = msg["content"][0]["text"] if msg["content"] else ""
        content = content.strip()
      ids += [header_start, *text(role), header_end, *text("\n\n" + content), eot]
    if add_generation_prompt:
      ids += [header_start, *text("assistant"), header_end, *text("\n\n")]
    return ids

  def _special(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise TokenizerError(f"apply_chat_template needs the Llama 4 special token {token!r}, which is "
                           "not in this tokenizer's vocabulary (is this a Llama 4 tokenizer?)")
    return i


class ByteTokenizer:
  """Dependency-free fallback for random models: ids 0..255 are bytes, then BOS, EOS, PAD."""

  BOS = 256
  EOS = 257
  PAD = 258
  _NAMES = {BOS: BOS_TOKEN, EOS: END_OF_TEXT_TOKEN, PAD: PAD_TOKEN}

  @property
  def bos_id(self) -> int:
    return self.BOS

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.EOS,)

  @property
  def pad_id(self) -> int:
    return self.PAD

  @property
  def vocab_size(self) -> int:
    return 259

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """UTF-8 bytes of `text`, with BOS first when add_bos."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return ([self.BOS] if add_bos else []) + list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """UTF-8 text of the byte ids; invalid UTF-8 becomes U+FFFD.

    Ids >= 259 are skipped: a random model's vocabulary is usually larger than 259.
    """
    out, run = [], bytearray()
    for i in map(int, ids):
      if 0 <= i < 256:
        run.append(i)
      elif i in self._NAMES and not skip_special_tokens:
        out.append(run.decode("utf-8", errors="replace") + self._NAMES[i])
        run = bytearray()
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)

  def apply_chat_template(self, messages: Sequence[Message],
                          add_generation_prompt: bool = True) -> list[int]:
    raise NotImplementedError(
        "ByteTokenizer has no chat special tokens; apply_chat_template needs a Llama 4 "
        f"{TOKENIZER_FILE} (load it with Tokenizer.from_dir)")


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer | None:
  """The `Tokenizer` of `directory`, or None when it has no tokenizer.json."""
  if not os.path.isfile(os.path.join(os.fspath(directory), TOKENIZER_FILE)):
    return None
  return Tokenizer.from_dir(directory)


def _load_hf_tokenizer(path: str) -> tokenizers.Tokenizer:
  try:
    with open(path, encoding="utf-8") as f:
      raw = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise TokenizerError(f"{path}: cannot read: {e}") from e
  try:
    return tokenizers.Tokenizer.from_str(raw)
  except Exception as e:  # the Rust side raises a bare Exception
    # Re-parse only on failure, for a precise message on plain JSON syntax errors.
    try:
      json.loads(raw)
    except json.JSONDecodeError as je:
      raise TokenizerError(f"{path}: malformed JSON: {je}") from None
    raise TokenizerError(f"{path}: valid JSON but not a Hugging Face tokenizer.json: {e}") from None


def _read_json(path: str) -> dict[str, Any]:
  """An optional JSON object file: {} when absent, an error when present but unusable."""
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise TokenizerError(f"{path}: cannot read as JSON: {e}") from e
  if not isinstance(data, dict):
    raise TokenizerError(f"{path}: expected a JSON object at the top level")
  return data


def _resolve_token(tok: tokenizers.Tokenizer, value: Any, where: str) -> int | None:
  """Id of a tokenizer_config token entry: a string, an AddedToken dict {"content": ...}, or null."""
  if value is None:
    return None
  if isinstance(value, dict):
    value = value.get("content")
  if not isinstance(value, str):
    raise TokenizerError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}")
  i = tok.token_to_id(value)
  if i is None:
    raise TokenizerError(f"{where}: token {value!r} is not in the vocabulary of {TOKENIZER_FILE}")
  return i


def _id_list(value: Any, where: str) -> list[int]:
  """A config `*_token_id` entry (int, list of ints, or null) as a list."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  for v in values:
    # bool is an int subclass; `true` as a token id is a broken file, not id 1.
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise TokenizerError(f"{where}: expected a non-negative int or list of ints, got {value!r}")
  return list(values)


def _message_parts(msg: Any, n: int) -> tuple[str, str]:
  """(role, text content) of one chat message; content may be a str or a list of text parts."""
  if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
    raise TypeError(f"messages[{n}] must be a dict with 'role' and 'content', got {msg!r}")
  role, content = msg["role"], msg["content"]
  if not isinstance(role, str) or not role:
    raise TypeError(f"messages[{n}]['role'] must be a non-empty str, got {role!r}")
  if isinstance(content, str):
    return role, content
  if isinstance(content, list):
    parts = []
    for part in content:
      if not (isinstance(part, Mapping) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise TypeError(f"messages[{n}]: only text content parts are supported, got {part!r}")
      parts.append(part["text"])
    return role, "".join(parts)
  raise TypeError(f"messages[{n}]['content'] must be a str or a list of text parts, got {content!r}")


# Llama 4's special tokens that a small model trained here needs (ids follow the BPE vocabulary).
TRAINED_SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, HEADER_START_TOKEN, HEADER_END_TOKEN,
                          EOM_TOKEN, EOT_TOKEN, PAD_TOKEN)


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str | os.PathLike) -> Tokenizer:
  """Trains a byte-level BPE (the kind of tokenizer.json Llama 4 ships) and writes tokenizer.json and
  tokenizer_config.json into `directory`. `vocab_size` counts the special tokens."""
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  n_special = len(TRAINED_SPECIAL_TOKENS)
  if vocab_size < 256 + n_special:
    raise ValueError(f"vocab_size {vocab_size} < {256 + n_special} (256 bytes + specials)")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_special, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer=trainer)
  tok.add_special_tokens(list(TRAINED_SPECIAL_TOKENS))
  bos = tok.token_to_id(BOS_TOKEN)
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
      special_tokens=[(BOS_TOKEN, bos)])
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, TOKENIZER_FILE))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": BOS_TOKEN, "eos_token": END_OF_TEXT_TOKEN, "pad_token": PAD_TOKEN}, f,
              indent=1)
  return Tokenizer.from_dir(directory)
