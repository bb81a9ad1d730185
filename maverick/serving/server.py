"""OpenAI-compatible HTTP API over a `maverick.serving.Engine` (FastAPI on uvicorn).

  GET  /health               200 {"status": "ok"} once every program is compiled, 503 before
  GET  /v1/models
  POST /v1/completions       prompt: a string or a list of token ids (one prompt per request)
  POST /v1/chat/completions  messages through the model's chat template
Both POSTs stream with "stream": true (server-sent events, then `data: [DONE]`). Extensions:
"top_k", "ignore_eos" (generate to max_tokens), and "return_token_ids": true adds each choice's
generated "token_ids". Errors have
OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for a bad request, 404 for an
unknown model, 413 for a body over `max_request_bytes`, 503 while starting. Stop strings ("stop")
are matched on the decoded text here; the model's end-of-sequence tokens stop on device.

The event loop never waits on a large prompt: bodies are counted while they arrive (refused past the
limit, never buffered whole) and long texts are tokenized in a worker thread. A client that leaves
frees its slot, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from maverick.serving.engine import Engine, RequestError

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant")  # what the Llama 4 template renders (no tools)
# Bodies up to this size are tokenized on the event loop (about a millisecond's work); larger ones
# in a worker thread, so a short request never queues behind a long prompt.
INLINE_TOKENIZE_BYTES = 4096
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
               "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
               "logit_bias": (None, {}), "response_format": (None, {"type": "text"})}


class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status: int, message: str, param=None, code=None,
                   kind="invalid_request_error") -> JSONResponse:
  return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                      status_code=status)


def default_max_request_bytes(max_seq_len: int) -> int:
  """Room for a full context of JSON-escaped text or token ids (32 bytes a token, more than a
  `\\uXXXX` character or a 6-digit id with its comma takes), at least 4 MiB."""
  return max(4 << 20, 32 * max_seq_len)


class Server:
  """Holds the engine and tokenizer; `compile_and_start` readies the engine (call in a thread).
  max_request_bytes: the largest request body taken (default_max_request_bytes by default)."""

  def __init__(self, engine: Engine, tokenizer, model_name: str,
               max_request_bytes: int | None = None):
    self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
    if max_request_bytes is None:
      max_request_bytes = default_max_request_bytes(engine.max_seq_len)
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) \
        or max_request_bytes < 1:
      raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    self.max_request_bytes = max_request_bytes
    self.ready = False
    self.progress = ""
    self.compile_seconds = None
    self.created = int(time.time())

  def compile_and_start(self, progress=None) -> None:
    """progress(name) before each program compiles, progress(None) once ready."""
    def note(what):
      self.progress = what
      if progress is not None:
        progress(what)
    self.compile_seconds = self.engine.compile(note)
    self.engine.start()
    self.ready = True
    if progress is not None:
      progress(None)  # done


def _number(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
  v = body.get(name, default)
  if v is None:
    return default
  ok = isinstance(v, int) if integer else isinstance(v, (int, float))
  if isinstance(v, bool) or not ok or (not integer and not math.isfinite(v)):
    raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}",
                   name)
  if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
    rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
    raise ApiError(400, f"'{name}' must be in {rng}, got {v}", name)
  return v


def _boolean(body, name, default=False) -> bool:
  """A JSON true/false (null: the default); the string "false" is refused, not read as true."""
  v = body.get(name)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise ApiError(400, f"'{name}' must be true or false, got {v!r}", name)
  return v


def _stop_strings(body) -> list[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  if isinstance(stop, str):
    stop = [stop]
  if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
    raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
  if len(stop) > MAX_STOP_STRINGS:
    raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} sequences", "stop")
  return stop


class Detokenizer:
  """Incremental text of a growing token list, with stop strings: `push` returns the new text
  that is safe to show (no half character, nothing that may become a stop string)."""

  def __init__(self, tokenizer, stop_ids, stops: list[str]):
    self.tok, self.stop_ids, self.stops = tokenizer, stop_ids, stops
    self.ids: list[int] = []
    self.shown = ""
    self.stopped = False

  def push(self, tokens, final: bool) -> str:
    self.ids += [t for t in tokens if t not in self.stop_ids]
    text = self.tok.decode(self.ids)
    cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
    if cut >= 0:
      text, self.stopped, final = text[:cut], True, True
    if not final:
      text = text.rstrip("\ufffd")
      hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])),
                 default=0)
      text = text[:len(text) - hold]
    if not text.startswith(self.shown):  # a merge changed earlier text: show the rest only
      return ""
    new, self.shown = text[len(self.shown):], text
    return new


def create_app(server: Server) -> FastAPI:
  app = FastAPI(title="maverick-jax", docs_url=None, redoc_url=None)

  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    response = error_response(e.status, e.message, e.param, e.code, e.kind)
    if e.status == 413:  # close rather than read the rest of a body that is refused anyway
      response.headers["connection"] = "close"
    return response

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, e):
    return error_response(e.status_code, str(e.detail), kind="invalid_request_error")

  @app.get("/health")
  async def health():
    if server.engine.error is not None:
      return error_response(500, f"engine failed: {server.engine.error!r}", kind="server_error")
    if not server.ready:
      return JSONResponse({"status": "starting", "compiling": server.progress}, status_code=503)
    return {"status": "ok", "compile_seconds": server.compile_seconds,
            "active": server.engine.active, "slots": server.engine.slots,
            "released": server.engine.released, "steps": server.engine.steps,
            "steps_by_batch": {str(n): c for n, c in server.engine.steps_by_batch.items()},
            "finished": server.engine.finished, "spec_rounds": server.engine.spec_rounds,
            "spec_accepted": server.engine.spec_accepted}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                        "created": server.created, "owned_by": "maverick-jax",
                                        "max_model_len": server.engine.max_seq_len}]}

  @app.exception_handler(ClientDisconnect)
  async def _client_gone(request, e):  # mid-body: nobody to answer, nothing worth a traceback
    log.info("%s %s: the client left before sending the whole body", request.method,
             request.url.path)
    return Response(status_code=499)  # nginx's "client closed request"; never sent

  async def read_body(request: Request) -> bytes:
    """The body, refused with 413 once it is past the limit: by its Content-Length before a byte
    is read, or (chunked) by a running count, so a huge body is never held in memory."""
    limit = server.max_request_bytes
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} "
                         "bytes (serve.py --max_request_bytes); send a shorter prompt",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
      raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise too_large
      chunks.append(chunk)
    return b"".join(chunks)

  async def parse(request: Request) -> tuple[dict, int]:
    """The request's JSON object, checked for what every POST shares, and its size in bytes."""
    raw = await read_body(request)
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    if not server.ready:
      raise ApiError(503, "the server is still compiling; retry when GET /health returns 200",
                     kind="server_error")
    model = body.get("model")
    if model is not None and model != server.model_name:
      raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                     f"'{server.model_name}' (GET /v1/models)", "model", "model_not_found")
    for name, defaults in UNSUPPORTED.items():
      if body.get(name) not in defaults:
        raise ApiError(400, f"'{name}' is not supported by this server", name)
    if body.get("n", 1) != 1:
      raise ApiError(400, "'n' must be 1: this server returns one choice per request", "n")
    return body, len(raw)

  async def tokenize(fn, text, size: int):
    """fn(text) on the event loop for a small body, else in a worker thread (the tokenizer
    releases the GIL), so other requests are served meanwhile."""
    if size <= INLINE_TOKENIZE_BYTES:
      return fn(text)
    return await asyncio.to_thread(fn, text)

  async def prompt_ids(body, size: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, str):
      if not prompt:
        raise ApiError(400, "'prompt' is empty", "prompt")
      return await tokenize(server.tokenizer.encode, prompt, size)
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      return prompt
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt "
                   "per request)", "prompt")

  async def chat_ids(body, size: int) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise ApiError(400, "'messages' must be a non-empty list of {'role', 'content'} objects",
                     "messages")
    for n, msg in enumerate(messages):  # malformed messages are left to the template's errors
      role = msg.get("role") if isinstance(msg, dict) else None
      if isinstance(role, str) and role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{n}] has the role {role!r}; the roles are "
                       f"{', '.join(map(repr, CHAT_ROLES))}", "messages")
    try:
      return await tokenize(server.tokenizer.apply_chat_template, messages, size)
    except NotImplementedError as e:
      raise ApiError(400, f"this model has no chat template: {e}", "messages") from None
    except (TypeError, ValueError, KeyError) as e:  # TokenizerError is a ValueError
      raise ApiError(400, f"bad 'messages': {e}", "messages") from None

  async def generate(request: Request, chat: bool):
    body, size = await parse(request)
    ids = await (chat_ids(body, size) if chat else prompt_ids(body, size))
    room = server.engine.max_seq_len - len(ids)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _number(body, name, None if chat else 16, lo=1, integer=True)
    if max_tokens is None:
      max_tokens = max(room, 1)
    temperature = _number(body, "temperature", 1.0, lo=0, hi=2)
    top_p = _number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
    top_k = _number(body, "top_k", 0, lo=-1, integer=True)
    seed = _number(body, "seed", None, lo=0, hi=2**32 - 1, integer=True)
    stops = _stop_strings(body)
    stream = _boolean(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
      raise ApiError(400, "'stream_options' must be an object", "stream_options")
    usage_in_stream = _boolean(opts, "include_usage")
    want_ids = _boolean(body, "return_token_ids")
    ignore_eos = _boolean(body, "ignore_eos")
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    try:
      handle = server.engine.submit(
          ids, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
          max_tokens=max_tokens, temperature=float(temperature), top_k=max(int(top_k), 0),
          top_p=float(top_p), seed=random.getrandbits(32) if seed is None else seed,
          stop_tokens=[] if ignore_eos else None)
    except RequestError as e:  # names the request field at fault
      param = {"prompt": "messages" if chat else "prompt", "max_tokens": name}.get(e.param, e.param)
      raise ApiError(400, str(e), param, e.code) from None
    except ValueError as e:
      raise ApiError(400, str(e)) from None
    except RuntimeError as e:  # the engine stopped on an error (also reported by /health)
      raise ApiError(500, str(e), kind="server_error") from None
    detok = Detokenizer(server.tokenizer, handle.stop_ids, stops)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    obj = "chat.completion" if chat else "text_completion"
    created = int(time.time())

    async def pieces():
      """(text delta, new token ids, finish reason or None) until the request ends."""
      try:
        while True:
          ev = await events.get()
          if ev.finish_reason == "error":
            raise RuntimeError("the engine failed; see the server log")
          text = detok.push(ev.tokens, ev.done)
          reason = "stop" if detok.stopped else ev.finish_reason
          if detok.stopped:
            server.engine.cancel(handle)
          yield text, ev.tokens, reason
          if reason is not None:
            return
      finally:
        if not handle.finished:  # client gone or stop string: free the slot
          server.engine.cancel(handle)

    def usage(n):
      return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

    def choice(text, reason, token_ids, delta):
      c: dict[str, Any] = {"index": 0, "finish_reason": reason}
      if chat:
        c["delta" if delta else "message"] = ({"content": text} if delta else
                                              {"role": "assistant", "content": text})
      else:
        c["text"], c["logprobs"] = text, None
      if want_ids:
        c["token_ids"] = token_ids
      return c

    if not stream:
      async def collect():
        text, all_ids, reason = "", [], None
        async for piece, toks, reason in pieces():
          text += piece
          all_ids += toks
        return {"id": rid, "object": obj, "created": created, "model": server.model_name,
                "choices": [choice(text, reason, all_ids, False)], "usage": usage(len(all_ids))}
      # A client that leaves cancels the collecting task, whose `pieces` frees the slot.
      answer = asyncio.ensure_future(collect())
      gone = asyncio.ensure_future(_client_disconnects(request))
      await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
      gone.cancel()
      if not answer.done():
        answer.cancel()
        await asyncio.wait((answer,))  # its `pieces` has cancelled the request
        return Response(status_code=499)  # never sent: the client is gone
      return answer.result()

    async def sse():
      n = 0
      chunk_obj = "chat.completion.chunk" if chat else "text_completion"
      head = {"id": rid, "object": chunk_obj, "created": created, "model": server.model_name}
      if chat:
        first = dict(choice("", None, [], True), delta={"role": "assistant", "content": ""})
        yield f"data: {json.dumps(dict(head, choices=[first]))}\n\n"
      async for piece, toks, reason in pieces():
        n += len(toks)
        if piece or toks or reason:
          yield f"data: {json.dumps(dict(head, choices=[choice(piece, reason, toks, True)]))}\n\n"
      if usage_in_stream:
        yield f"data: {json.dumps(dict(head, choices=[], usage=usage(n)))}\n\n"
      yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await generate(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await generate(request, chat=True)

  return app


async def _client_disconnects(request: Request) -> None:
  """Returns once the client has closed the connection (after the body was read, uvicorn's
  receive() waits for exactly that)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def start_compiling(server: Server, progress=None) -> threading.Thread:
  t = threading.Thread(target=server.compile_and_start, args=(progress,), name="maverick-compile",
                       daemon=True)
  t.start()
  return t
