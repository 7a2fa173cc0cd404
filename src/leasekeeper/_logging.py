"""Structured logs: one JSON object per line on stderr, never holding a secret or a
result. A line logged during a request carries its ``request_id`` (drawn by the server,
never taken from the client, and returned as ``X-Request-Id``).
"""

from __future__ import annotations

import codecs
import contextvars
import json
import logging
import sys
import time

import orjson

__all__ = ["REQUEST_ID", "configure_logging"]

#: The request id of the request this task is handling ("" outside requests).
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "message": ...}`` per record.

    With ``ascii_only`` (a stderr not in UTF-8), characters past ASCII are ``\\uXXXX``
    escapes, so the line stays JSON.
    """

    def __init__(self, *, ascii_only: bool = False) -> None:
        super().__init__()
        self.ascii_only = ascii_only

    def format(self, record: logging.LogRecord) -> str:
        line = self._json(record)
        if self.ascii_only and not line.isascii():
            return json.dumps(orjson.loads(line), separators=(",", ":"))  # escapes past ASCII
        return line

    def _json(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(entry).decode()
        except TypeError:  # a lone surrogate: bytes that were not UTF-8 (a path, say)
            return orjson.dumps({k: _escaped(v) for k, v in entry.items()}).decode()


def _escaped(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates) written as ``\\udcXX``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def formatter_for(stream: object) -> JsonFormatter:
    """The formatter for ``stream``: ASCII only unless it writes UTF-8."""
    try:
        encoding = codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name
    except LookupError:
        encoding = "unknown"
    return JsonFormatter(ascii_only=encoding != "utf-8")


def configure_logging(level: str = "INFO") -> None:
    """Send every log record, uvicorn's included, to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(sys.stderr))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
