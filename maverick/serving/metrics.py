"""What a deployment needs around the API: Prometheus metrics, an API key, an access log.

`Metrics` holds one registry per app (two apps in a process never share counters). `Gateway` is
plain ASGI middleware (not BaseHTTPMiddleware, which would buffer the streaming responses and hide
the client's disconnect from the handlers): it checks the bearer key, then writes one access-log
line and counts the request once the response has been sent (for a stream: once it ends).
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

# serve.py lets this logger through at INFO (absl's handler prints it) while absl's own stay quiet.
access_log = logging.getLogger("maverick.access")

OPEN_PATHS = ("/health",)  # answered without the API key: load balancers probe it
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                   5.12, 10.24, 20.48, 40.96)


class Metrics:
  """The server's metrics (names prefixed maverick_). Engine counters are read at scrape time."""

  def __init__(self, server):
    r = self.registry = CollectorRegistry()
    self.requests = Counter("maverick_requests", "HTTP requests answered, by path and status",
                            ["path", "status"], registry=r)
    self.prompt_tokens = Counter("maverick_prompt_tokens", "Prompt tokens of admitted requests "
                                 "(each prompt once, whatever n is)", registry=r)
    self.generation_tokens = Counter("maverick_generation_tokens", "Generated tokens returned "
                                     "(as usage.completion_tokens counts them)", registry=r)
    self.finished = Counter("maverick_request_finished", "Choices finished, by finish reason",
                            ["reason"], registry=r)
    self.ttft = Histogram("maverick_time_to_first_token_seconds", "From the request's arrival "
                          "to its first token (per choice)", buckets=LATENCY_BUCKETS, registry=r)
    self.itl = Histogram("maverick_inter_token_latency_seconds", "Between consecutive tokens of "
                         "a choice (a step's tokens share its gap)", buckets=LATENCY_BUCKETS,
                         registry=r)
    self.acceptance = Histogram("maverick_spec_acceptance_length", "Speculative decoding: tokens "
                                "committed per verify round, per finished choice",
                                buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12), registry=r)
    engine = server.engine
    Gauge("maverick_slots", "Slots (the batch)", registry=r).set_function(lambda: engine.slots)
    Gauge("maverick_slots_busy", "Slots running a request",
          registry=r).set_function(lambda: engine.active)
    Gauge("maverick_queue_length", "Requests submitted and not yet in a slot",
          registry=r).set_function(server.queued)
    r.register(_EngineCounters(engine))

  def observe_tokens(self, state, count: int, now: float) -> None:
    """count new tokens of one choice at `now`; state: the choice's (arrival, last) times."""
    if count <= 0:
      return
    self.generation_tokens.inc(count)
    if state.last is None:
      self.ttft.observe(now - state.arrival)
    else:
      gap = (now - state.last) / count  # a step's tokens arrive together: its gap, shared
      for _ in range(count):
        self.itl.observe(gap)
    state.last = now


class _EngineCounters:
  """The engine's own counters (steps, speculative rounds) as Prometheus counters."""

  def __init__(self, engine):
    self.engine = engine

  def collect(self):
    e = self.engine
    for name, doc, value in (
        ("maverick_engine_steps", "Device steps dispatched", e.steps),
        ("maverick_spec_rounds", "Speculative verify rounds of finished requests", e.spec_rounds),
        ("maverick_spec_accepted_tokens", "Tokens committed by those rounds", e.spec_accepted)):
      yield CounterMetricFamily(name, doc, value=value)


class Gateway:
  """ASGI middleware: API key, access log, request counter."""

  def __init__(self, app, server):
    self.app, self.server = app, server

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    start, status = time.perf_counter(), [0]
    usage = scope.setdefault("state", {}).setdefault("usage", {})
    key = self.server.api_key
    refused = key is not None and scope["path"] not in OPEN_PATHS and not _authorized(scope, key)

    logged = [False]

    def done():
      if not logged[0]:
        logged[0] = True
        self._done(scope, status[0], usage, start)

    async def sending(message):
      if message["type"] == "http.response.start":
        status[0] = message["status"]
      elif not message.get("more_body", False):
        done()  # before the last byte: a client that has its answer finds the request counted
      await send(message)
    try:
      await (_unauthorized(sending) if refused else self.app(scope, receive, sending))
    except BaseException:
      status[0] = status[0] or 500
      raise
    finally:
      done()  # the client left mid-answer, or the app failed

  def _done(self, scope, status, usage, start):
    path = scope["path"]
    self.server.metrics.requests.labels(path, str(status)).inc()
    user = scope["state"].get("user")
    access_log.info("%s %s %d prompt_tokens=%s completion_tokens=%s latency=%.3fs%s",
                    scope["method"], path, status, usage.get("prompt_tokens", "-"),
                    usage.get("completion_tokens", "-"), time.perf_counter() - start,
                    "" if user is None else f" user={json.dumps(user)}")


def _authorized(scope, key: str) -> bool:
  for name, value in scope.get("headers", ()):
    if name == b"authorization":
      scheme, _, token = value.decode("latin-1").partition(" ")
      return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                key.encode())
  return False


async def _unauthorized(send):
  body = json.dumps({"error": {
      "message": "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                 "the key given to serve.py --api_key", "type": "invalid_request_error",
      "param": None, "code": "invalid_api_key"}}).encode()
  await send({"type": "http.response.start", "status": 401,
              "headers": [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode()),
                          (b"www-authenticate", b"Bearer")]})
  await send({"type": "http.response.body", "body": body})
