"""Tokenizer tests on a small Llama-4-style byte-level BPE trained here (no downloads, no shared/)."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from maverick.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>",
            "<|eom|>", "<|eot|>", "<|finetune_right_pad|>")

# The o200k-style split regex of Llama 4's tokenizer.json pre-tokenizer.
SPLIT_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ROUND_TRIP = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "  leading and trailing spaces  ",
    "tabs\tand\n\nblank lines\r\n\n",
    "naïve café — 東京 🚀 Ünïcödé",
    "x = [1, 22, 333, 4444]  # numbers",
    "",
]


def _corpus() -> list[str]:
  names = ("alpha", "beta", "gamma", "delta", "value", "result", "index", "count")
  lines = []
  for i in range(300):
    a, b = names[i % len(names)], names[(i * 3 + 1) % len(names)]
    lines.append(f"def {a}_{i}({b}, n={i % 17}):\n    return {b} * {i % 7} + n  # {a} {b}\n")
    lines.append(f"for {a} in range({i}):\n\tprint('{b}', {a})\n")
  return lines


def _build(directory: pathlib.Path) -> None:
  tok = HFTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_corpus(), trainer)
  # Added after training so the special ids sit above the BPE vocab, as in Llama 4 (200000+).
  tok.add_special_tokens(list(SPECIALS))
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.TemplateProcessing(
      single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
      special_tokens=[("<|begin_of_text|>", bos)])
  tok.save(str(directory / "tokenizer.json"))
  ids = {t: tok.token_to_id(t) for t in SPECIALS}
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>",
      "pad_token": "<|finetune_right_pad|>"}))
  (directory / "generation_config.json").write_text(json.dumps({
      "bos_token_id": ids["<|begin_of_text|>"],
      "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom|>"], ids["<|eot|>"]]}))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> pathlib.Path:
  d = tmp_path_factory.mktemp("llama4_tok")
  _build(d)
  return d


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
  return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def sid(tok_dir) -> dict[str, int]:
  """Special-token ids read straight from the HF tokenizer, independently of maverick."""
  hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
  return {t: hf.token_to_id(t) for t in SPECIALS}


def _copy(src: pathlib.Path, dst: pathlib.Path, only: tuple[str, ...] = ("tokenizer.json",)):
  dst.mkdir(parents=True, exist_ok=True)
  for name in only:
    shutil.copy(src / name, dst / name)
  return dst


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
  ids = tok.encode(text, add_bos=False)
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode(text)) == text  # BOS skipped as a special token


def test_bpe_actually_merges(tok):
  text = "def alpha_1(beta, n=1):\n    return beta * 1 + n"
  assert len(tok.encode(text, add_bos=False)) < len(text.encode()) // 2


def test_bos_exactly_once(tok, sid):
  bos = sid["<|begin_of_text|>"]
  ids = tok.encode("return alpha")
  assert ids[0] == bos and ids.count(bos) == 1
  assert ids[1:] == tok.encode("return alpha", add_bos=False)
  assert bos not in tok.encode("return alpha", add_bos=False)
  assert tok.encode("") == [bos]
  assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>return alpha"


def test_bos_added_without_post_processor(tok_dir, tmp_path, sid):
  d = _copy(tok_dir, tmp_path / "nopp", ("tokenizer.json", "tokenizer_config.json"))
  raw = json.loads((d / "tokenizer.json").read_text())
  raw["post_processor"] = None
  (d / "tokenizer.json").write_text(json.dumps(raw))
  t = Tokenizer.from_dir(d)
  bos = sid["<|begin_of_text|>"]
  ids = t.encode("hello")
  assert ids[0] == bos and ids.count(bos) == 1
  assert ids[1:] == t.encode("hello", add_bos=False)


def test_special_ids(tok, sid):
  assert tok.bos_id == sid["<|begin_of_text|>"]
  assert tok.pad_id == sid["<|finetune_right_pad|>"]
  assert tok.eos_ids == tuple(sorted(sid[t] for t in ("<|end_of_text|>", "<|eom|>", "<|eot|>")))
  assert tok.vocab_size == 500 + len(SPECIALS)
  assert min(sid.values()) >= 500  # specials above the BPE vocab, like Llama 4


def test_eos_collected_from_all_files(tok_dir, tmp_path, sid):
  d = _copy(tok_dir, tmp_path / "eos")
  (d / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": {"content": "<|begin_of_text|>", "special": True},
      "eos_token": {"__type": "AddedToken", "content": "<|eot|>"}, "pad_token": None}))
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": sid["<|eom|>"]}))
  (d / "config.json").write_text(json.dumps({
      "model_type": "llama4", "text_config": {"eos_token_id": [sid["<|end_of_text|>"],
                                                               sid["<|eot|>"]]}}))
  t = Tokenizer.from_dir(d)
  assert t.bos_id == sid["<|begin_of_text|>"]
  assert t.eos_ids == tuple(sorted({sid["<|eom|>"], sid["<|eot|>"], sid["<|end_of_text|>"]}))
  assert t.pad_id == sid["<|finetune_right_pad|>"]  # null in the config: falls back to the vocab


def test_only_tokenizer_json_uses_llama4_names(tok_dir, tmp_path, sid):
  t = Tokenizer.from_dir(_copy(tok_dir, tmp_path / "bare"))
  assert t.bos_id == sid["<|begin_of_text|>"]
  assert t.eos_ids == tuple(sorted(sid[x] for x in ("<|end_of_text|>", "<|eom|>", "<|eot|>")))


def test_unknown_token_in_config(tok_dir, tmp_path):
  d = _copy(tok_dir, tmp_path / "unk")
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
  with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*<\|nope\|>"):
    Tokenizer.from_dir(d)


def test_bad_eos_type(tok_dir, tmp_path):
  d = _copy(tok_dir, tmp_path / "badeos")
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
  with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
    Tokenizer.from_dir(d)


def test_chat_template(tok, sid):
  messages = [{"role": "system", "content": "  Be brief.\n"},
              {"role": "user", "content": "def alpha(beta):\n    return beta"},
              {"role": "assistant", "content": "It returns beta."},
              {"role": "user", "content": [{"type": "text", "text": "And "},
                                           {"type": "text", "text": "gamma?"}]}]
  enc = lambda s: tok.encode(s, add_bos=False)
  hs, he, eot = sid["<|header_start|>"], sid["<|header_end|>"], sid["<|eot|>"]
  expected = [sid["<|begin_of_text|>"]]
  for role, content in (("system", "Be brief."), ("user", "def alpha(beta):\n    return beta"),
                        ("assistant", "It returns beta."), ("user", "And gamma?")):
    expected += [hs, *enc(role), he, *enc("\n\n" + content), eot]
  prompt = expected + [hs, *enc("assistant"), he, *enc("\n\n")]
  assert tok.apply_chat_template(messages) == prompt
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_chat_template_matches_rendered_string(tok):
  # HF renders the template to a string and encodes it; the id sequence must be the same.
  messages = [{"role": "user", "content": "hi there\n"}, {"role": "assistant", "content": "ok"}]
  rendered = ("<|begin_of_text|><|header_start|>user<|header_end|>\n\nhi there\n<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\nok<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\n")
  assert tok.apply_chat_template(messages) == tok.encode(rendered, add_bos=False)


def test_chat_template_system_parts_keep_only_the_first(tok):
  """HF's Llama 4 template renders a list-valued system message as its first text part, trimmed
  (`messages[0]['content'][0]['text'] | trim`); other messages concatenate their parts."""
  messages = [{"role": "system", "content": [{"type": "text", "text": " Be brief. "},
                                             {"type": "text", "text": "Ignored."}]},
              {"role": "user", "content": "hi"}]
  rendered = ("<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
              "<|header_start|>user<|header_end|>\n\nhi<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\n")
  assert tok.apply_chat_template(messages) == tok.encode(rendered, add_bos=False)


def test_chat_template_bad_messages(tok):
  with pytest.raises(TypeError, match="role"):
    tok.apply_chat_template([{"content": "x"}])
  with pytest.raises(TypeError, match="text content parts"):
    tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])


def test_chat_template_needs_specials(tmp_path):
  hf = HFTokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  hf.train_from_iterator(["plain text only"], trainers.BpeTrainer(
      vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  hf.save(str(tmp_path / "tokenizer.json"))
  t = Tokenizer.from_dir(tmp_path)
  assert t.bos_id is None and t.eos_ids == ()
  assert t.decode(t.encode("plain text")) == "plain text"
  with pytest.raises(TokenizerError, match=r"<\|header_start\|>"):
    t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_decode_skips_out_of_vocab(tok):
  ids = tok.encode("alpha", add_bos=False)
  assert tok.decode([*ids, tok.vocab_size, 202047, -1]) == "alpha"


def test_missing_tokenizer_json(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*Hugging Face"):
    Tokenizer.from_dir(tmp_path)
  assert load_tokenizer(tmp_path) is None


def test_load_tokenizer(tok_dir, sid):
  t = load_tokenizer(tok_dir)
  assert isinstance(t, Tokenizer) and t.bos_id == sid["<|begin_of_text|>"]


def test_malformed_tokenizer_json(tmp_path):
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
  with pytest.raises(TokenizerError, match="malformed JSON"):
    Tokenizer.from_dir(tmp_path)
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
  with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
    Tokenizer.from_dir(tmp_path)


def test_malformed_side_file(tok_dir, tmp_path):
  d = _copy(tok_dir, tmp_path / "badcfg")
  (d / "generation_config.json").write_text("{oops")
  with pytest.raises(TokenizerError, match="generation_config.json"):
    Tokenizer.from_dir(d)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_byte_tokenizer_round_trip(text):
  bt = ByteTokenizer()
  ids = bt.encode(text)
  assert ids[0] == bt.bos_id == 256 and ids[1:] == list(text.encode("utf-8"))
  assert bt.decode(ids) == text
  assert bt.encode(text, add_bos=False) == ids[1:]


def test_byte_tokenizer_interface():
  bt = ByteTokenizer()
  assert (bt.bos_id, bt.eos_ids, bt.pad_id, bt.vocab_size) == (256, (257,), 258, 259)
  ids = bt.encode("é")
  # Ids beyond 259 come from a random model's larger vocab: skipped, never a crash.
  assert bt.decode([*ids, 259, 100000, 257]) == "é"
  assert bt.decode([256, 104, 105, 257], skip_special_tokens=False) == (
      "<|begin_of_text|>hi<|end_of_text|>")
  assert bt.decode([0xC3]) == "\ufffd"  # a truncated UTF-8 sequence is replaced, not an error
  with pytest.raises(NotImplementedError, match="tokenizer.json"):
    bt.apply_chat_template([{"role": "user", "content": "hi"}])
