"""Chat requests with image_url parts over the real app and engine (maverick/serving/media.py,
server.py) on the multimodal tiny fixture: a data: URL image's greedy text equals
maverick.generate(images=) on the prompt HF's chat template + processor give; streaming equals
non-streaming; local files only under --allowed_local_media_path; every bad input is a 400 and the
engine sees no request."""

import base64
import contextlib
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import maverick  # noqa: E402
from maverick import tokenizer as tokenizer_lib  # noqa: E402
from maverick import vision  # noqa: E402
from maverick.checkpoint import store  # noqa: E402
from maverick.serving.engine import Engine  # noqa: E402
from maverick.serving.server import Server, create_app  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_llama4_mm_tiny")
PNG = os.path.join(FIXTURE, "one_image_0.png")
WAIT_S = 300
CHAT_SPECIAL = {"<|begin_of_text|>": 1, "<|header_start|>": 2, "<|header_end|>": 3, "<|eot|>": 4}
BEFORE, AFTER = "w5 w6 w7 ", " w8 w9"
MAX_TOKENS = 12


def _tokenizer(directory):
  """A word-level Llama 4-style tokenizer for the fixture: the chat specials at ids 1..4, "w<i>"
  is id i (5..499), the image specials at the fixture's ids 500..505."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = dict(CHAT_SPECIAL, **{f"w{i}": i for i in range(5, 500)}, w0=0)
  tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(list(CHAT_SPECIAL) + [
      "<|image_start|>", "<|image_end|>", vision.IMAGE_TOKEN, vision.PATCH_TOKEN,
      "<|tile_x_separator|>", "<|tile_y_separator|>"])
  assert tok.token_to_id(vision.PATCH_TOKEN) == 503
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>"}, f)
  return tokenizer_lib.Tokenizer.from_dir(directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  tok = _tokenizer(str(tmp_path_factory.mktemp("tok")))
  model = store.load_hf(FIXTURE, dtype="float32", vision=True)
  engine = Engine(model, slots=2, max_seq_len=128, rounds=4, min_bucket=128, batch_buckets=[],
                  stop_tokens=[])
  calls = []
  submit = engine.submit

  def counted(prompt, *a, **kw):
    calls.append(list(prompt))
    return submit(prompt, *a, **kw)
  engine.submit = counted
  server = Server(engine, tok, "mm")
  server.compile_and_start()
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  uv = uvicorn.Server(uvicorn.Config(create_app(server), log_config=None, lifespan="off"))
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
      time.sleep(0.02)
    assert uv.started
    yield dict(base=f"http://127.0.0.1:{sock.getsockname()[1]}", server=server, model=model,
               tok=tok, calls=calls, engine=engine)
  finally:
    uv.should_exit = True
    thread.join(30)
    engine.shutdown()


def data_url(raw: bytes, mime="image/png") -> str:
  return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def chat(url, stream=False, **kw):
  return dict(dict(messages=[{"role": "user", "content": [
      {"type": "text", "text": BEFORE}, {"type": "image_url", "image_url": {"url": url}},
      {"type": "text", "text": AFTER}]}], max_tokens=MAX_TOKENS, temperature=0, stream=stream),
      **kw)


def post(s, body):
  if not body.get("stream"):
    r = httpx.post(s["base"] + "/v1/chat/completions", json=body, timeout=WAIT_S)
    return r.status_code, r.json()
  with httpx.stream("POST", s["base"] + "/v1/chat/completions", json=body, timeout=WAIT_S) as r:
    lines = [line for line in r.iter_lines() if line]
  assert lines[-1] == "data: [DONE]", lines[-3:]
  chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
  return r.status_code, "".join(c["choices"][0]["delta"].get("content", "")
                                for c in chunks if c["choices"])


def expected_text(s, image):
  """HF's path: the Llama 4 chat template's text (the image part becomes <|image|> in place),
  the processor's placeholder expansion, one tokenizer call; then maverick.generate."""
  cfg = s["model"].vision.config.preprocess(None)
  grid = vision.preprocess_image(image, cfg).tile_grid
  text = ("<|begin_of_text|><|header_start|>user<|header_end|>\n\n" + BEFORE + vision.IMAGE_TOKEN
          + AFTER + "<|eot|><|header_start|>assistant<|header_end|>\n\n")
  ids = s["tok"].hf_tokenizer.encode(vision.expand_image_placeholders(text, [grid], cfg),
                                     add_special_tokens=False).ids
  out = maverick.generate(s["model"], [ids], images=[image], max_new_tokens=MAX_TOKENS,
                          stop_tokens=[])
  return ids, s["tok"].decode(out.tokens[0])


def test_data_url_image_equals_generate_and_streaming_equals_plain(served):
  with open(PNG, "rb") as f:
    raw = f.read()
  ids, want = expected_text(served, np.asarray(Image.open(PNG).convert("RGB")))
  status, body = post(served, chat(data_url(raw)))
  assert status == 200, body
  assert served["calls"][-1] == ids
  assert body["choices"][0]["message"]["content"] == want and want
  assert body["usage"]["prompt_tokens"] == len(ids)
  status, text = post(served, chat(data_url(raw), stream=True))
  assert status == 200 and text == want


def test_local_files_only_under_the_allowed_directory(served, tmp_path, monkeypatch):
  allowed = tmp_path / "media"
  allowed.mkdir()
  with open(PNG, "rb") as f:
    (allowed / "cat.png").write_bytes(f.read())
  (tmp_path / "secret.png").write_bytes((allowed / "cat.png").read_bytes())
  before = len(served["calls"])
  status, body = post(served, chat(str(allowed / "cat.png")))
  assert status == 400 and "--allowed_local_media_path" in body["error"]["message"]
  monkeypatch.setattr(served["server"], "allowed_local_media_path", str(allowed))
  for url in (str(tmp_path / "secret.png"), str(allowed / ".." / "secret.png")):
    status, body = post(served, chat(url))
    assert status == 400 and "outside the allowed directory" in body["error"]["message"], body
  assert len(served["calls"]) == before
  _, want = expected_text(served, np.asarray(Image.open(PNG).convert("RGB")))
  for url in (str(allowed / "cat.png"), (allowed / "cat.png").as_uri()):
    status, body = post(served, chat(url))
    assert status == 200 and body["choices"][0]["message"]["content"] == want, body


def _big_images(n):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    import io
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (300, 300, 3), dtype=np.uint8)).save(buf, "PNG")
    out.append({"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}})
  return out


BAD = {
    "http": (chat("https://example.com/cat.png"),
             "messages[0].content[1]: fetching images from the network is not supported; send a "
             "data: URL"),
    "corrupt": (chat(data_url(b"\x89PNG\r\n\x1a\n not really a png")),
                "messages[0].content[1]: cannot decode image"),
    "svg": (chat(data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")),
            "messages[0].content[1]: cannot decode image"),
    "not_an_image": (chat(data_url(b"hello", "text/plain")),
                     "messages[0].content[1]: unsupported media type 'text/plain'"),
    "not_base64": (chat("data:image/png;base64,%%%"), "not valid base64"),
    "too_many_tokens": (dict(messages=[{"role": "user", "content": _big_images(3)}],
                             max_tokens=2), "image tokens: send fewer or smaller images"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_image_inputs_are_400_and_nothing_is_generated(served, case):
  body, words = BAD[case]
  before = len(served["calls"])
  status, answer = post(served, body)
  assert status == 400, answer
  assert words in answer["error"]["message"], answer
  # refused before the engine runs anything: no submit reached a slot
  assert served["calls"][before:] in ([], [served["calls"][-1]] if case == "too_many_tokens"
                                      else [])
  assert served["engine"].active == 0 and served["engine"]._waiting.empty()


def test_an_image_to_a_text_only_model_is_400(served, monkeypatch):
  monkeypatch.setattr(served["engine"], "model", store.load_hf(FIXTURE, dtype="float32"))
  before = len(served["calls"])
  with open(PNG, "rb") as f:
    status, answer = post(served, chat(data_url(f.read())))
  assert status == 400 and "this model takes no images" in answer["error"]["message"], answer
  assert len(served["calls"]) == before
