"""The engine's logprobs (Event.logprobs / prompt_logprobs) in OpenAI's and vLLM's JSON shapes.

An engine entry is (logprob of the token, [(id, logprob)] of the most likely, best first); a
prompt's first token has None. JSON has no -inf: a filtered-out alternative (and any logprob
below it) is written as FLOOR, as vLLM does. A token's text is its own decode (special tokens
shown); `bytes` are that text's UTF-8 (U+FFFD where a token holds part of a character), as vLLM
writes them. `text_offset` counts those texts from the start of the choice's text, as vLLM does.
"""

from __future__ import annotations

FLOOR = -9999.0  # vLLM's stand-in for -inf


def value(lp: float) -> float:
  return lp if lp > FLOOR else FLOOR  # -inf (and NaN) too


class Formatter:
  """One request's logprob formatting: top = N alternatives per generated token, prompt_top = N
  per prompt token (vLLM's prompt_logprobs), as_ids = vLLM's return_tokens_as_token_ids."""

  def __init__(self, tokenizer, top: int | None, prompt_top: int | None, as_ids: bool):
    self.tok, self.top, self.prompt_top, self.as_ids = tokenizer, top, prompt_top, as_ids
    self._text: dict[int, str] = {}

  def token(self, t: int) -> str:
    if self.as_ids:
      return f"token_id:{t}"
    if t not in self._text:
      self._text[t] = self.tok.decode([t], skip_special_tokens=False)
    return self._text[t]

  def _item(self, t: int, lp: float) -> dict:
    s = self.token(t)
    return {"token": s, "logprob": value(lp), "bytes": list(s.encode("utf-8", "replace"))}

  def chat(self, ids, entries) -> dict:
    """choices[i].logprobs of chat: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [dict(self._item(t, lp), top_logprobs=[self._item(a, v)
                                                             for a, v in alts[:self.top]])
                        for t, (lp, alts) in zip(ids, entries)]}

  def completion(self, ids, entries, offset: int) -> tuple[dict, int]:
    """choices[i].logprobs of completions for these tokens (entries may hold None: a prompt's first
    token) and the text offset after them. top_logprobs holds the N best and the token itself."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(ids, entries):
      s = self.token(t)
      out["tokens"].append(s)
      out["text_offset"].append(offset)
      offset += len(s)
      if entry is None:
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        continue
      lp, alts = entry
      out["token_logprobs"].append(value(lp))
      top = {self.token(a): value(v) for a, v in alts[:self.top]}
      top.setdefault(s, value(lp))
      out["top_logprobs"].append(top)
    return out, offset

  def prompt(self, ids, entries) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} of the token and the N best. rank: 1-based among the N best; the prompt
    token's own rank is null when it is not among them (the engine computes no ranks)."""
    out = []
    for t, entry in zip(ids, entries):
      if entry is None:
        out.append(None)
        continue
      lp, alts = entry
      alts = alts[:self.prompt_top]
      d = {str(a): {"logprob": value(v), "rank": r + 1, "decoded_token": self.token(a)}
           for r, (a, v) in enumerate(alts)}
      d.setdefault(str(t), {"logprob": value(lp), "rank": None, "decoded_token": self.token(t)})
      out.append(d)
    return out
