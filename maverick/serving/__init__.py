"""Serving: a continuous-batching engine (engine.py) and an OpenAI-compatible HTTP app (server.py)."""

from maverick.serving.engine import Engine, Event, Handle, RequestError

__all__ = ["Engine", "Event", "Handle", "RequestError"]
