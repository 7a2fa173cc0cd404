"""A JSON-RPC message read by the API's rules, as both MCP transports read one (a
``/mcp`` body, a line of stdin), or why it is refused, with the ``id`` to answer."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcp import types

from leasekeeper._core.parsing import parse_json_object
from leasekeeper._core.validation import NOT_AN_OBJECT, UTF8_BOM
from leasekeeper._errors import InvalidRequest

__all__ = ["Refusal", "id_from_start", "id_of", "read_message"]

_NOT_JSON_RPC = "Validation error: the message is not a valid JSON-RPC request"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why ``read_message`` refused a message, and the ``id`` to answer it with."""

    id: int | str | None
    code: int
    message: str


def read_message(text: bytes) -> dict[str, Any] | Refusal:
    """One JSON-RPC message (a ``/mcp`` body or a stdin line, BOM stripped) read by the
    API's rules, or why it is refused: not strict JSON is -32700 (with the ``id`` a
    lenient reading finds); not one JSON-RPC message (a batch, an unknown shape, an
    ``id`` neither integer nor string) is -32600. The sentences quote no input.
    """
    try:
        message = parse_json_object(text)
    except InvalidRequest as error:
        if error.error == NOT_AN_OBJECT:  # JSON, but no JSON-RPC message
            return Refusal(None, types.INVALID_REQUEST, _NOT_JSON_RPC)
        return Refusal(_lenient_id(text), types.PARSE_ERROR, f"Parse error: {error.error}")
    try:
        types.jsonrpc_message_adapter.validate_python(message, by_name=False)
        if "id" in message and id_of(message) is None:
            raise ValueError("an id must be an integer or a string")
    except ValueError:  # pydantic's ValidationError; its text quotes the input
        return Refusal(id_of(message), types.INVALID_REQUEST, _NOT_JSON_RPC)
    return message


def id_of(message: Mapping[str, Any]) -> int | str | None:
    """A message's ``id`` when it is one JSON-RPC allows (an integer or a string)."""
    value = message.get("id")
    return value if type(value) is int or type(value) is str else None


def _lenient_id(line: bytes) -> int | str | None:
    """The ``id`` of a line refused as not strict JSON, where Python's lenient reading
    of it finds exactly one at its top level (else None)."""
    objects: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append(pairs)
        return dict(pairs)

    try:
        top = json.loads(line.decode("utf-8", "replace"), object_pairs_hook=keep)
    except (ValueError, RecursionError):
        return None
    if not isinstance(top, dict):
        return None
    ids = [value for name, value in objects[-1] if name == "id"]  # the top level's, made last
    if len(ids) != 1 or (type(ids[0]) is str and "\ufffd" in ids[0]):
        return None
    return id_of({"id": ids[0]})


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def id_from_start(start: bytes) -> int | str | None:
    """The ``id`` of a message known only by its start (a line too long), when the
    top-level members up to and including the ``id`` are whole in ``start``; else None."""
    text = start.removeprefix(UTF8_BOM).decode("utf-8", "replace")
    decoder = json.JSONDecoder()

    def after_space(at: int) -> int:
        found = _JSON_SPACE.match(text, at)
        return found.end() if found else at

    at = after_space(0)
    if text[at : at + 1] != "{":
        return None
    try:
        while True:
            name, at = decoder.raw_decode(text, after_space(at + 1))
            at = after_space(at)
            if not isinstance(name, str) or text[at : at + 1] != ":":
                return None
            value, at = decoder.raw_decode(text, after_space(at + 1))
            at = after_space(at)
            if text[at : at + 1] not in (",", "}"):  # cut off, or not JSON
                return None
            if name == "id":
                if type(value) is str and "\ufffd" in value:
                    return None
                return id_of({"id": value})
            if text[at] == "}":
                return None
    except ValueError:  # a member cut off, or not JSON
        return None
