"""OpenAI-compatible HTTP API over a `maverick.serving.Engine` (FastAPI on uvicorn).

  GET  /health               200 {"status": "ok"} once every program is compiled, 503 before,
                             500 with the error if compiling failed or the engine stopped on one
  GET  /metrics              Prometheus text (maverick.serving.metrics)
  GET  /v1/models
  POST /v1/completions       prompt: a string, a list of token ids, or a list of either
  POST /v1/chat/completions  messages through the model's chat template
  POST /tokenize, /detokenize  vLLM's shapes
Both generation POSTs take n >= 1 and stream with "stream": true (server-sent events, then
`data: [DONE]`); each choice is its own engine request. Parameters are read in
maverick.serving.params: every name vLLM takes is honoured or refused with 400 naming it. Errors
have OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for a bad request, 401
without the API key, 404 for an unknown model, 413 for a body over `max_request_bytes`, 503
while starting, 500 once start-up or the engine failed. Stop strings are matched on the decoded
text here (the output, usage and logprobs end at the token that completes one; min_tokens holds
them back as vLLM does: see Detokenizer); end-of-sequence and stop_token_ids stop on device.
Logprobs are formatted in maverick.serving.logprobs.

The event loop never waits on a large prompt: bodies are counted while they arrive (refused past the
limit, never buffered whole) and long texts are tokenized in a worker thread. A client that leaves
frees its slots, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import random
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from maverick.serving import media
from maverick.serving import params
from maverick.serving.logprobs import Formatter
from maverick.serving.metrics import Gateway, Metrics
from maverick.serving.params import ApiError
from maverick.vision import model as vision_lib

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")  # what the Llama 4 template renders (no tools)
EOT_TOKEN = "<|eot|>"  # ends a chat message; left off the last one for continue_final_message
# Bodies up to this size are tokenized on the event loop (about a millisecond's work); larger ones
# in a worker thread, so a short request never queues behind a long prompt.
INLINE_TOKENIZE_BYTES = 4096
MAX_CHOICES = 128  # engine requests one HTTP request may start (n x prompts)
TOKENIZE_NAMES = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "continue_final_message", "return_token_strs"}


def error_response(status: int, message: str, param=None, code=None,
                   kind="invalid_request_error") -> JSONResponse:
  return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                      status_code=status)


def default_max_request_bytes(max_seq_len: int) -> int:
  """Room for a full context of JSON-escaped text or token ids (32 bytes a token, more than a
  `\\uXXXX` character or a 6-digit id with its comma takes), at least 4 MiB."""
  return max(4 << 20, 32 * max_seq_len)


class Server:
  """Holds the engine and tokenizer; `compile_and_start` readies the engine (call in a thread,
  `start_compiling`); if it fails, `compile_error` holds the exception.
  max_request_bytes: the largest request body taken (default_max_request_bytes by default).
  api_key: when set, every path but /health needs the header `Authorization: Bearer <api_key>`.
  allowed_local_media_path: a directory whose files chat image parts may name (file:// or a
  path); None: only data: URLs (see maverick/serving/media.py)."""

  def __init__(self, engine, tokenizer, model_name: str,
               max_request_bytes: int | None = None, api_key: str | None = None,
               allowed_local_media_path: str | None = None):
    self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
    if max_request_bytes is None:
      max_request_bytes = default_max_request_bytes(engine.max_seq_len)
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) \
        or max_request_bytes < 1:
      raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    if api_key is not None and not (isinstance(api_key, str) and api_key.strip() == api_key
                                    and api_key):
      raise ValueError("api_key must be a non-empty string without surrounding spaces")
    self.max_request_bytes, self.api_key = max_request_bytes, api_key
    if allowed_local_media_path is not None and not os.path.isdir(allowed_local_media_path):
      raise ValueError(f"allowed_local_media_path {allowed_local_media_path!r} is not a directory")
    self.allowed_local_media_path = allowed_local_media_path
    self.ready = False
    self.progress = ""
    self.compile_error: BaseException | None = None  # compile_and_start's failure
    self.compile_seconds = None
    self.created = int(time.time())
    # id -> handle of requests not yet finished or cancelled (the queue-length metric)
    self.open_handles: dict = {}
    self.metrics = Metrics(self)

  def queued(self) -> int:
    """Requests submitted that no slot has taken yet."""
    return sum(getattr(h, "admitted", None) is None for h in list(self.open_handles.values()))

  def compile_and_start(self, progress=None) -> None:
    """progress(name) before each program compiles, progress(None) once ready. A failure is
    kept in `compile_error` (GET /health then answers 500 with it) and raised."""
    def note(what):
      self.progress = what
      if progress is not None:
        progress(what)
    try:
      self.compile_seconds = self.engine.compile(note)
      self.engine.start()
    except BaseException as e:
      self.compile_error = e
      raise
    self.ready = True
    if progress is not None:
      progress(None)  # done


class Detokenizer:
  """Incremental text of a growing token list, with stop strings: `push` returns the new text
  that is safe to show (no half character, nothing that may become a stop string) and the tokens
  that are returned: all, or those up to and including the one that completes a stop string.

  min_tokens holds stop strings back as vLLM does (its detokenizer moves the stop-string search
  window past the text of the first min_tokens tokens): with m = min_tokens, an occurrence counts
  only if it ends after the text of the first m tokens, i.e. its last character comes from token
  m + 1 or later. It may start inside that text: a stop string that starts before token m + 1 and
  completes at or after it ends the output. Occurrences that end within the first m tokens' text
  are ordinary text. The output ends at the first token whose text completes a counted occurrence
  (never one of the first m), so the text and the token count (usage) agree. End-of-sequence and
  stop token ids are masked on device for the first m tokens (sampling.adjust)."""

  def __init__(self, tokenizer, stop_ids, stops: list[str], include_stop: bool = False,
               skip_special: bool = True, min_tokens: int = 0):
    self.tok, self.stop_ids, self.stops = tokenizer, stop_ids, stops
    self.include_stop, self.skip_special = include_stop, skip_special
    self.longest = max(map(len, stops), default=0)
    self.min_tokens = min_tokens
    self.count = 0  # tokens pushed so far (special and stop tokens too, as min_tokens counts)
    # Length of the first min_tokens tokens' text (a trailing half character left out: the token
    # that completes it adds it); None until that many tokens were pushed.
    self.floor = 0 if min_tokens == 0 else None
    self.ids: list[int] = []
    self.shown = ""
    self.stopped = False

  def _text(self, tokens) -> str:
    return self.tok.decode(self.ids + [t for t in tokens if t not in self.stop_ids],
                           skip_special_tokens=self.skip_special)

  def _stop_at(self, text: str):
    """The earliest counted stop string in `text` (after what was shown, which holds none that
    counts, and ending past `floor`): (start, end)."""
    frm = max(0, len(self.shown) - self.longest)
    hits = [(i, i + len(s)) for s in self.stops
            for i in [text.find(s, max(frm, self.floor - len(s) + 1))] if i >= 0]
    return min(hits, default=None)

  def push(self, tokens: list[int], final: bool) -> tuple[str, list[int]]:
    before, self.count = self.count, self.count + len(tokens)
    if self.floor is None and self.count >= self.min_tokens:
      self.floor = len(self._text(tokens[:self.min_tokens - before]).rstrip("\ufffd"))
    text = self._text(tokens)
    checked = self.stops and self.count > self.min_tokens
    hit = self._stop_at(text) if checked else None
    if hit is not None:  # the first token whose text completes a stop string ends the output
      first = max(1, self.min_tokens - before + 1)  # the first min_tokens tokens never do
      k = next(k for k in range(first, len(tokens) + 1)
               if self._stop_at(self._text(tokens[:k])) is not None)
      tokens = tokens[:k]
      text = self._text(tokens)
      start, end = self._stop_at(text)
      text, self.stopped, final = text[:end if self.include_stop else start], True, True
    self.ids += [t for t in tokens if t not in self.stop_ids]
    if not final:
      text = text.rstrip("\ufffd")
      hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])),
                 default=0)
      text = text[:len(text) - hold]
    if not text.startswith(self.shown):  # a merge changed earlier text: show the rest only
      return "", tokens
    new, self.shown = text[len(self.shown):], text
    return new, tokens


def _check_text(value, param: str, where: str = "") -> None:
  """Text the tokenizer cannot take (a lone UTF-16 surrogate such as \\ud800, which JSON allows)
  is a 400 naming where it is, not a tokenizer crash."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ApiError(400, f"'{param}'{where} is not valid Unicode text: character {e.start} is a "
                     f"lone surrogate {value[e.start]!r}; send UTF-16 surrogates in pairs",
                     param) from None
  elif isinstance(value, list):
    for n, v in enumerate(value):
      _check_text(v, param, f"{where}[{n}]")
  elif isinstance(value, dict):
    for k, v in value.items():
      _check_text(v, param, f"{where}[{k!r}]")


@dataclasses.dataclass(eq=False)
class _Choice:
  """One engine request of an HTTP request (one of its n x prompts choices)."""
  index: int
  handle: Any
  detok: Detokenizer
  arrival: float
  prompt: list
  last: float | None = None
  text: str = ""
  ids: list = dataclasses.field(default_factory=list)
  reason: str | None = None
  echo: str | None = None  # the prompt text still to show (completions' echo)
  prompt_lp: list | None = None  # the engine's prompt logprobs (first event)
  lp_ids: list = dataclasses.field(default_factory=list)  # tokens with logprobs (echo: prompt too)
  lp: list = dataclasses.field(default_factory=list)  # their engine entries
  offset: int = 0  # text_offset of the next logprob token


def create_app(server: Server) -> FastAPI:
  app = FastAPI(title="maverick-jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.add_middleware(Gateway, server=server)
  engine, metrics = server.engine, server.metrics

  @app.exception_handler(ApiError)
  async def _api_error(request, e: ApiError):
    response = error_response(e.status, e.message, e.param, e.code, e.kind)
    if e.status == 413:  # close rather than read the rest of a body that is refused anyway
      response.headers["connection"] = "close"
    return response

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, e):
    return error_response(e.status_code, str(e.detail), kind="invalid_request_error")

  @app.exception_handler(Exception)
  async def _bug(request, e):  # OpenAI's body, not plain text; the traceback goes to the log
    log.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return error_response(500, f"internal error: {type(e).__name__}; see the server log",
                          kind="server_error")

  @app.get("/health")
  async def health():
    if server.compile_error is not None:
      return error_response(500, startup_failure(server), kind="server_error")
    if engine.error is not None:
      return error_response(500, f"engine failed: {engine.error!r}", kind="server_error")
    if not server.ready:
      return JSONResponse({"status": "starting", "compiling": server.progress}, status_code=503)
    return {"status": "ok", "compile_seconds": server.compile_seconds,
            "active": engine.active, "slots": engine.slots,
            "released": engine.released, "steps": engine.steps,
            "steps_by_batch": {str(n): c for n, c in engine.steps_by_batch.items()},
            "finished": engine.finished, "spec_rounds": engine.spec_rounds,
            "spec_accepted": engine.spec_accepted,
            **(engine.kv_stats() if hasattr(engine, "kv_stats") else {})}  # test stubs lack it

  @app.get("/metrics")
  async def prometheus():
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                        "created": server.created, "owned_by": "maverick-jax",
                                        "max_model_len": engine.max_seq_len}]}

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

  async def parse(request: Request, need_engine: bool = True) -> tuple[dict, int]:
    """The request's JSON object, checked for what every POST shares, and its size in bytes."""
    raw = await read_body(request)
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    if need_engine and server.compile_error is not None:
      raise ApiError(500, startup_failure(server), kind="server_error")
    if need_engine and not server.ready:
      raise ApiError(503, "the server is still compiling; retry when GET /health returns 200",
                     kind="server_error")
    model = body.get("model")
    if model is not None and model != server.model_name:
      raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                     f"'{server.model_name}' (GET /v1/models)", "model", "model_not_found")
    return body, len(raw)

  async def tokenize(fn, text, size: int):
    """fn(text) on the event loop for a small body, else in a worker thread (the tokenizer
    releases the GIL), so other requests are served meanwhile."""
    if size <= INLINE_TOKENIZE_BYTES:
      return fn(text)
    return await asyncio.to_thread(fn, text)

  async def prompt_ids(body, size: int, add_special: bool) -> list[list[int]]:
    """Every prompt of a completions request: a string, a list of ids, or a list of either."""
    prompt = body.get("prompt")
    is_ids = lambda p: isinstance(p, list) and p and all(
        isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str) or is_ids(prompt):
      prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and all(
        (isinstance(p, str) and p) or is_ids(p) for p in prompt)):
      raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a list of "
                     "either", "prompt")
    return [await encode(p, size, add_special) if isinstance(p, str) else p for p in prompt]

  async def encode(text: str, size: int, add_special: bool) -> list[int]:
    _check_text(text, "prompt")
    try:
      return await tokenize(functools.partial(server.tokenizer.encode, add_bos=add_special), text,
                            size)
    except (TypeError, ValueError) as e:  # TokenizerError is a ValueError
      raise ApiError(400, f"the tokenizer refused 'prompt': {e}", "prompt") from None

  async def chat_ids(body, size: int, add_generation_prompt=True, continue_final=False):
    """(prompt ids, the images' PreprocessedImage in prompt order) of a chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise ApiError(400, "'messages' must be a non-empty list of {'role', 'content'} objects",
                     "messages")
    _check_text(messages, "messages")
    for n, msg in enumerate(messages):  # malformed messages are left to the template's errors
      role = msg.get("role") if isinstance(msg, dict) else None
      if isinstance(role, str) and role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{n}] has the role {role!r}; the roles are "
                       f"{', '.join(map(repr, CHAT_ROLES))}", "messages")
    try:
      messages, images = media.take_images(messages, server.allowed_local_media_path)
      tower = vision_lib.tower_of(getattr(engine, "model", None))
      if images and tower is None:
        raise media.MediaError("this model takes no images (a text-only model, or one served "
                               "without --vision): send text only")
      cfg = tower.config.preprocess(None) if images else None
      images = await asyncio.to_thread(media.decode, images, cfg) if images else []
    except media.MediaError as e:
      raise ApiError(400, str(e), "messages") from None
    render = functools.partial(server.tokenizer.apply_chat_template,
                               add_generation_prompt=add_generation_prompt and not continue_final)
    try:
      ids = await tokenize(render, messages, size)
    except NotImplementedError as e:
      raise ApiError(400, f"this model has no chat template: {e}", "messages") from None
    except (TypeError, ValueError, KeyError) as e:  # TokenizerError is a ValueError
      raise ApiError(400, f"bad 'messages': {e}", "messages") from None
    if continue_final:  # the last message stays open: the model continues it
      eot = server.tokenizer.token_to_id(EOT_TOKEN)
      if ids and ids[-1] == eot:
        ids = ids[:-1]
    if images:
      try:
        ids = media.expand(ids, server.tokenizer, images, cfg)
      except media.MediaError as e:
        raise ApiError(400, str(e), "messages") from None
    return ids, images

  def submit_all(prompts, o: params.Options, chat: bool, events, loop,
                 images=None) -> list[_Choice]:
    """One engine request per (prompt, n) pair; choice index = prompt * n + j, drawn with seed +
    index (mod 2**32) when a seed is given. Nothing is left queued when one is refused."""
    if len(prompts) * o.n > MAX_CHOICES:
      raise ApiError(400, f"{len(prompts)} prompts x n={o.n} = {len(prompts) * o.n} choices; at "
                     f"most {MAX_CHOICES} per request", "n")
    if o.stop_token_ids or o.ignore_eos:
      base = [] if o.ignore_eos else list(engine.default_stop)
      stop_tokens = list(dict.fromkeys(base + o.stop_token_ids))
    else:
      stop_tokens = None  # the engine's: the model's end-of-sequence tokens
    choices, arrival = [], time.perf_counter()
    try:
      for p, ids in enumerate(prompts):
        max_tokens = o.max_tokens or max(engine.max_seq_len - len(ids), 1)
        for j in range(o.n):
          i = p * o.n + j
          seed = random.getrandbits(32) if o.seed is None else (o.seed + i) % 2**32
          handle = engine.submit(
              ids, lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev)),
              max_tokens=max_tokens, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
              seed=seed, stop_tokens=stop_tokens, **o.engine_kwargs,
              **({"images": images} if images else {}))
          server.open_handles[id(handle)] = handle
          detok = Detokenizer(server.tokenizer, handle.stop_ids, o.stops, o.include_stop,
                              o.skip_special, o.engine_kwargs["min_tokens"])
          echo = server.tokenizer.decode(ids, skip_special_tokens=o.skip_special) if o.echo \
              else None
          choices.append(_Choice(i, handle, detok, arrival, list(ids), echo=echo))
    except BaseException as e:
      for c in choices:
        engine.cancel(c.handle)
        server.open_handles.pop(id(c.handle), None)
      if isinstance(e, ValueError):  # a RequestError names the request field at fault
        param = getattr(e, "param", None) or ("stop_token_ids" if "stop token" in str(e) else None)
        param = {"prompt": "messages" if chat else "prompt",
                 "max_tokens": o.max_tokens_name}.get(param, param)
        raise ApiError(400, str(e), param, getattr(e, "code", None)) from None
      if isinstance(e, RuntimeError):  # the engine stopped on an error (also in /health)
        raise ApiError(500, str(e), kind="server_error") from None
      raise
    metrics.prompt_tokens.inc(sum(map(len, prompts)))
    return choices

  async def generate(request: Request, chat: bool):
    body, size = await parse(request)
    o = params.parse_options(body, chat)
    images = None
    if chat:
      ids, images = await chat_ids(body, size, o.add_generation_prompt, o.continue_final)
      prompts = [ids]
    else:
      prompts = await prompt_ids(body, size, o.add_special)
    if o.truncate is not None and images:
      raise ApiError(400, "truncate_prompt_tokens is not supported with images (it could cut an "
                     "image's tokens apart)", "truncate_prompt_tokens")
    if o.truncate is not None:  # vLLM's truncate_prompt_tokens: the last k tokens
      prompts = [p[-o.truncate:] for p in prompts]
    state = request.scope.setdefault("state", {})  # the access log line reads it
    usage = state.setdefault("usage", {})
    if o.user is not None:
      state["user"] = o.user
    usage.update(prompt_tokens=sum(map(len, prompts)), completion_tokens=0)
    usage["total_tokens"] = usage["prompt_tokens"]
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    choices = submit_all(prompts, o, chat, events, loop, images)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{o.request_id or uuid.uuid4().hex}"
    obj = "chat.completion" if chat else "text_completion"
    created = int(time.time())
    fmt = Formatter(server.tokenizer, o.logprobs, o.prompt_logprobs, o.tokens_as_ids)

    async def pieces():
      """(choice, text delta, returned token ids, (token ids, engine logprob entries) to report)
      until every choice has its finish reason."""
      running = len(choices)
      try:
        while running:
          i, ev = await events.get()
          c = choices[i]
          if c.reason is not None:  # past a stop string: already ended
            continue
          if ev.finish_reason == "error":
            raise RuntimeError("the engine failed; see the server log")
          text, toks = c.detok.push(ev.tokens, ev.done)
          c.reason = "stop" if c.detok.stopped else ev.finish_reason
          if ev.prompt_logprobs is not None:
            c.prompt_lp = ev.prompt_logprobs
          # only the returned tokens (up to a stop string's) have logprobs
          lp = ([], []) if o.logprobs is None else (toks, ev.logprobs[:len(toks)])
          if c.echo is not None:  # the first piece starts with the prompt
            text, c.echo = c.echo + text, None
            if o.logprobs is not None:
              lp = (c.prompt + lp[0], c.prompt_lp + lp[1])
          metrics.observe_tokens(c, len(toks), time.perf_counter())
          c.text += text
          c.ids += toks
          c.lp_ids += lp[0]
          c.lp += lp[1]
          usage["completion_tokens"] += len(toks)
          usage["total_tokens"] += len(toks)
          if c.reason is not None:
            running -= 1
            if not c.handle.finished:  # a stop string: the engine would go on
              engine.cancel(c.handle)
            server.open_handles.pop(id(c.handle), None)
            metrics.finished.labels(c.reason).inc()
            if getattr(ev, "rounds", 0):
              metrics.acceptance.observe(ev.accepted / ev.rounds)
          yield c, text, toks, lp
      finally:
        for c in choices:  # client gone, or an error: free the slots
          if not c.handle.finished:
            engine.cancel(c.handle)
          server.open_handles.pop(id(c.handle), None)

    def choice(c: _Choice, text, token_ids, lp, delta, reason):
      out: dict[str, Any] = {"index": c.index, "finish_reason": reason}
      if chat:
        out["delta" if delta else "message"] = ({"content": text} if delta else
                                                {"role": "assistant", "content": text})
      else:
        out["text"] = text
      out["logprobs"] = None
      if o.logprobs is not None and (lp[0] or not delta):
        if chat:
          out["logprobs"] = fmt.chat(*lp)
        else:
          out["logprobs"], c.offset = fmt.completion(*lp, c.offset)
      if o.prompt_logprobs is not None and not chat:  # vLLM's place; chat: the response's
        out["prompt_logprobs"] = fmt.prompt(c.prompt, c.prompt_lp)
      if o.return_ids:
        out["token_ids"] = token_ids
      return out

    if not o.stream:
      async def collect():
        async for _ in pieces():
          pass
        answer = {"id": rid, "object": obj, "created": created, "model": server.model_name,
                  "choices": [choice(c, c.text, c.ids, (c.lp_ids, c.lp), False, c.reason)
                              for c in choices], "usage": dict(usage)}
        if o.prompt_logprobs is not None and chat:  # one prompt: every choice's are the same
          answer["prompt_logprobs"] = fmt.prompt(choices[0].prompt, choices[0].prompt_lp)
        return answer
      # A client that leaves cancels the collecting task, whose `pieces` frees the slots.
      answer = asyncio.ensure_future(collect())
      gone = asyncio.ensure_future(_client_disconnects(request))
      await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
      gone.cancel()
      if not answer.done():
        answer.cancel()
        await asyncio.wait((answer,))  # its `pieces` has cancelled the requests
        return Response(status_code=499)  # never sent: the client is gone
      return answer.result()

    async def sse():
      chunk_obj = "chat.completion.chunk" if chat else "text_completion"
      head = {"id": rid, "object": chunk_obj, "created": created, "model": server.model_name}
      send = lambda **kw: f"data: {json.dumps(dict(head, **kw))}\n\n"
      if chat:
        for c in choices:
          first = dict(choice(c, "", [], ([], []), True, None),
                       delta={"role": "assistant", "content": ""})
          yield send(choices=[first])
      async for c, piece, toks, lp in pieces():
        if piece or toks or c.reason:
          yield send(choices=[choice(c, piece, toks, lp, True, c.reason)])
      if o.include_usage:
        yield send(choices=[], usage=dict(usage))
      yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await generate(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await generate(request, chat=True)

  @app.post("/tokenize")
  async def tokenize_endpoint(request: Request):
    """vLLM's /tokenize: {"prompt"} or {"messages"} -> {count, max_model_len, tokens, token_strs}."""
    body, size = await parse(request, need_engine=False)
    unknown = sorted(set(body) - TOKENIZE_NAMES)
    if unknown:
      raise ApiError(400, f"'{unknown[0]}' is not a parameter of /tokenize", unknown[0])
    chat = "messages" in body
    if chat == ("prompt" in body):
      raise ApiError(400, "/tokenize takes either 'prompt' or 'messages'", "prompt")
    add_special = params.boolean(body, "add_special_tokens", not chat)
    if chat:
      if add_special:
        raise ApiError(400, "'add_special_tokens' = true is not supported with 'messages': the "
                       "chat template adds them", "add_special_tokens")
      ids, _ = await chat_ids(body, size, params.boolean(body, "add_generation_prompt", True),
                              params.boolean(body, "continue_final_message"))
    else:
      prompt = body.get("prompt")
      if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string", "prompt")
      ids = await encode(prompt, size, add_special)
    strs = None
    if params.boolean(body, "return_token_strs"):
      strs = [server.tokenizer.hf_tokenizer.id_to_token(t) for t in ids]
    return {"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids,
            "token_strs": strs}

  @app.post("/detokenize")
  async def detokenize_endpoint(request: Request):
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    body, _ = await parse(request, need_engine=False)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
      raise ApiError(400, f"'{unknown[0]}' is not a parameter of /detokenize", unknown[0])
    tokens, vocab = body.get("tokens"), server.tokenizer.vocab_size
    if not (isinstance(tokens, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)):
      raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": server.tokenizer.decode(tokens)}

  return app


async def _client_disconnects(request: Request) -> None:
  """Returns once the client has closed the connection (after the body was read, uvicorn's
  receive() waits for exactly that)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def startup_failure(server: Server) -> str:
  """One line on why the server could not start: what was compiling and the error."""
  e = server.compile_error
  text = " ".join(str(e).split()) or "(no message)"
  return f"start-up compile failed at {server.progress or 'the start'}: {type(e).__name__}: {text}"


def start_compiling(server: Server, progress=None, on_error=None) -> threading.Thread:
  """Runs `server.compile_and_start(progress)` in a daemon thread and returns it. A failure is
  kept in `server.compile_error` (GET /health answers 500 with it), passed to on_error(exception)
  in that thread (scripts/serve.py closes its progress bar and stops serving there), then logged:
  one line, then its traceback."""
  def run():
    try:
      server.compile_and_start(progress)
    except BaseException as e:  # noqa: BLE001  (a thread's exception would die with it)
      try:
        if on_error is not None:
          on_error(e)
      finally:
        log.error("%s", startup_failure(server), exc_info=e)

  t = threading.Thread(target=run, name="maverick-compile", daemon=True)
  t.start()
  return t
