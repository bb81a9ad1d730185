"""The request parameters of /v1/completions and /v1/chat/completions, read and checked.

Every name vLLM's CompletionRequest / ChatCompletionRequest takes is one of:
  - honoured: read into `Options` (and the parameter table in docs/guides/serving.md says how);
  - NEUTRAL_ONLY: taken at the value that changes nothing, refused with 400 otherwise.
Any other name is refused with 400 naming it: nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


# Taken only at a value that changes nothing (JSON null always is); why, for the README and errors.
NEUTRAL_ONLY: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "one choice is generated per 'n'"),
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1.0,), "it applies to beam search, which is not implemented"),
    "suffix": (("",), "insertion (fill-in-the-middle) is not implemented"),
    "response_format": (({"type": "text"},), "structured output is not implemented"),
    "tools": (([],), "tool calling is not implemented"),
    "tool_choice": (("none", "auto"), "tool calling is not implemented"),
    "reasoning_effort": ((), "the model has no reasoning mode"),
    "spaces_between_special_tokens": ((True,), "the tokenizer's decode has no such switch"),
    "allowed_token_ids": ((), "token masks are not implemented"),
    "bad_words": (([],), "bad-word filtering is not implemented"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "guided_json": ((), "guided decoding is not implemented"),
    "guided_regex": ((), "guided decoding is not implemented"),
    "guided_choice": ((), "guided decoding is not implemented"),
    "guided_grammar": ((), "guided decoding is not implemented"),
    "structural_tag": ((), "guided decoding is not implemented"),
    "guided_decoding_backend": ((), "guided decoding is not implemented"),
    "guided_whitespace_pattern": ((), "guided decoding is not implemented"),
    "priority": ((0,), "requests are served first come, first served"),
    "logits_processors": (([],), "custom logits processors are not loaded"),
    "kv_transfer_params": (({},), "disaggregated serving is not implemented"),
    "vllm_xargs": (({},), "there are no extension arguments"),
    "mm_processor_kwargs": (({},), "images are preprocessed with the checkpoint's own image "
                            "processor settings; per-request processor arguments are not taken"),
    "documents": (([],), "the chat template has no documents"),
    "chat_template": ((), "the model's own chat template is used"),
    "chat_template_kwargs": (({},), "the chat template takes no arguments"),
}
CHAT_ONLY_NEUTRAL = {"add_special_tokens": ((False,), "the chat template adds the special tokens"),
                     "echo": ((False,), "chat does not echo the last message; completions take "
                              "'echo'")}

# Read into Options (docs/guides/serving.md's table says how each is honoured).
COMMON = {"model", "max_tokens", "n", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
          "stream", "stream_options", "temperature", "top_p", "top_k", "ignore_eos", "user",
          "request_id", "skip_special_tokens", "truncate_prompt_tokens", "cache_salt",
          "return_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_p", "min_tokens", "logit_bias", "logprobs", "prompt_logprobs",
          "return_tokens_as_token_ids"}
COMPLETION_ONLY = {"prompt", "add_special_tokens", "echo"}
CHAT_ONLY = {"messages", "max_completion_tokens", "add_generation_prompt", "top_logprobs",
             "continue_final_message", "include_reasoning", "parallel_tool_calls"}


def known_names(chat: bool) -> set[str]:
  names = COMMON | set(NEUTRAL_ONLY)
  return names | (CHAT_ONLY | set(CHAT_ONLY_NEUTRAL) if chat else COMPLETION_ONLY)


@dataclasses.dataclass
class Options:
  """One request's parameters (the prompt itself is read by the server)."""
  max_tokens: int | None  # None: the room the prompt leaves
  max_tokens_name: str
  temperature: float
  top_p: float
  top_k: int
  seed: int | None
  n: int
  stops: list[str]
  include_stop: bool
  stop_token_ids: list[int]
  ignore_eos: bool
  stream: bool
  include_usage: bool
  return_ids: bool
  skip_special: bool
  add_special: bool
  truncate: int | None
  add_generation_prompt: bool
  continue_final: bool
  request_id: str | None
  user: str | None
  logprobs: int | None  # top-N alternatives per generated token; None: no logprobs
  prompt_logprobs: int | None  # vLLM's: top-N per prompt token; None: none
  echo: bool  # completions: the prompt first (with logprobs: its tokens' logprobs first)
  tokens_as_ids: bool  # logprob tokens written "token_id:<id>"
  engine_kwargs: dict[str, Any]  # sampling and logprob options in Engine.submit's keywords


def number(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
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


def boolean(body, name, default=False) -> bool:
  """A JSON true/false (null: the default); the string "false" is refused, not read as true."""
  v = body.get(name)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise ApiError(400, f"'{name}' must be true or false, got {v!r}", name)
  return v


def _same(v, neutral) -> bool:
  """JSON equality that keeps false apart from 0 (Python's False == 0)."""
  if isinstance(v, bool) or isinstance(neutral, bool):
    return v is neutral
  return v == neutral


def _stop_strings(body) -> list[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  if isinstance(stop, str):
    stop = [stop]
  if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
    raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
  return stop


def _token_ids(body, name) -> list[int]:
  v = body.get(name)
  if v is None:
    return []
  if not (isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                      for t in v)):
    raise ApiError(400, f"'{name}' must be a list of token ids (integers >= 0), got {v!r}", name)
  return v


def _sampling(body, chat: bool, max_tokens: int | None) -> dict[str, Any]:
  """The sampling options, checked, as Engine.submit keywords."""
  kw: dict[str, Any] = {
      "presence_penalty": float(number(body, "presence_penalty", 0.0, lo=-2, hi=2)),
      "frequency_penalty": float(number(body, "frequency_penalty", 0.0, lo=-2, hi=2)),
      "repetition_penalty": float(number(body, "repetition_penalty", 1.0, lo=0, lo_open=True)),
      "min_p": float(number(body, "min_p", 0.0, lo=0, hi=1)),
      "min_tokens": number(body, "min_tokens", 0, lo=0, integer=True)}
  if max_tokens is not None and kw["min_tokens"] > max_tokens:
    raise ApiError(400, f"'min_tokens' ({kw['min_tokens']}) must be at most max_tokens "
                   f"({max_tokens})", "min_tokens")
  bias = body.get("logit_bias") or {}
  if not isinstance(bias, dict):
    raise ApiError(400, "'logit_bias' must be an object of token id -> bias", "logit_bias")
  kw["logit_bias"] = {}
  for key, value in bias.items():
    if not (isinstance(key, str) and key.isdigit()):
      raise ApiError(400, f"'logit_bias' keys are token ids, got {key!r}", "logit_bias")
    kw["logit_bias"][int(key)] = float(number(bias, key, 0.0, lo=-100, hi=100))
  return kw


def _logprob_options(body, chat: bool) -> tuple[int | None, int | None, bool]:
  """(top-N per generated token or None, top-N per prompt token or None, echo)."""
  if chat:
    want = boolean(body, "logprobs")
    top = number(body, "top_logprobs", 0, lo=0, hi=20, integer=True)
    if top and not want:
      raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = top if want else None
  else:
    logprobs = number(body, "logprobs", None, lo=0, hi=20, integer=True)
  prompt_logprobs = number(body, "prompt_logprobs", None, lo=0, hi=20, integer=True)
  if prompt_logprobs is not None and body.get("stream") is True:  # as vLLM
    raise ApiError(400, "'prompt_logprobs' is not available with 'stream': true; leave one out",
                   "prompt_logprobs")
  return logprobs, prompt_logprobs, not chat and boolean(body, "echo")


def parse_options(body: dict, chat: bool) -> Options:
  """Checks every name in the body; raises ApiError (400) naming the first one at fault."""
  known = known_names(chat)
  for name in body:
    if name not in known:
      where = "chat completions" if chat else "completions"
      raise ApiError(400, f"'{name}' is not a parameter of {where} on this server (see the "
                     "parameter table in docs/guides/serving.md)", name)
  neutral_only = dict(NEUTRAL_ONLY, **(CHAT_ONLY_NEUTRAL if chat else {}))
  n = number(body, "n", 1, lo=1, hi=128, integer=True)
  for name, (values, why) in neutral_only.items():
    v = body.get(name)
    if name == "best_of":
      values = (n,)
    if v is not None and not any(_same(v, d) for d in values):
      raise ApiError(400, f"'{name}' = {v!r} is not supported by this server: {why}", name)
  limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
      else "max_tokens"
  max_tokens = number(body, limit, None if chat else 16, lo=1, integer=True)
  stream = boolean(body, "stream")
  opts = body.get("stream_options")
  if opts is not None:
    if not isinstance(opts, dict):
      raise ApiError(400, "'stream_options' must be an object", "stream_options")
    if not stream:
      raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    extra = set(opts) - {"include_usage", "continuous_usage_stats"}
    if extra:
      raise ApiError(400, f"'stream_options' has no field {sorted(extra)[0]!r}", "stream_options")
    if boolean(opts, "continuous_usage_stats"):
      raise ApiError(400, "'stream_options.continuous_usage_stats' is not supported by this "
                     "server: usage comes in the last chunk", "stream_options")
  for key in ("user", "request_id", "cache_salt"):
    v = body.get(key)
    if v is not None and not (isinstance(v, str) and (v or key == "user")):
      raise ApiError(400, f"'{key}' must be a non-empty string, got {v!r}", key)
  add_generation_prompt = boolean(body, "add_generation_prompt", True)
  continue_final = boolean(body, "continue_final_message")
  if continue_final and body.get("add_generation_prompt") is True:
    raise ApiError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                   "continue_final_message")
  boolean(body, "include_reasoning")  # no reasoning content is ever produced: both values hold
  boolean(body, "parallel_tool_calls")  # no tools: nothing to call, in parallel or not
  logprobs, prompt_logprobs, echo = _logprob_options(body, chat)
  kw = _sampling(body, chat, max_tokens)
  # The engine takes one top-N for both; each list is cut to what was asked for.
  kw["logprobs"] = max((k for k in (logprobs, prompt_logprobs) if k is not None), default=None)
  kw["prompt_logprobs"] = prompt_logprobs is not None or (echo and logprobs is not None)
  return Options(
      max_tokens=max_tokens, max_tokens_name=limit,
      temperature=float(number(body, "temperature", 1.0, lo=0, hi=2)),
      top_p=float(number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
      top_k=max(int(number(body, "top_k", 0, lo=-1, integer=True)), 0),
      seed=number(body, "seed", None, lo=0, hi=2**32 - 1, integer=True), n=n,
      stops=_stop_strings(body), include_stop=boolean(body, "include_stop_str_in_output"),
      stop_token_ids=_token_ids(body, "stop_token_ids"), ignore_eos=boolean(body, "ignore_eos"),
      stream=stream, include_usage=boolean(opts or {}, "include_usage"),
      return_ids=boolean(body, "return_token_ids"),
      skip_special=boolean(body, "skip_special_tokens", True),
      add_special=boolean(body, "add_special_tokens", not chat),
      truncate=number(body, "truncate_prompt_tokens", None, lo=1, integer=True),
      add_generation_prompt=add_generation_prompt and not continue_final,
      continue_final=continue_final, request_id=body.get("request_id"), user=body.get("user"),
      logprobs=logprobs, prompt_logprobs=prompt_logprobs, echo=echo,
      tokens_as_ids=boolean(body, "return_tokens_as_token_ids"), engine_kwargs=kw)
