"""``Reply.plain()``: the body with the stored result as Python values (what MCP returns)."""

from __future__ import annotations

import json

import orjson

from leasekeeper import Reply


def test_plain_parses_the_stored_result_losslessly() -> None:
    """A stored result comes back as the values it encodes, big integers included."""
    stored = json.dumps({"n": 2**70, "f": 0.1, "s": "é", "l": [None, True]}, ensure_ascii=False)
    body = {"ok": True, "status": "completed", "result": orjson.Fragment(stored)}
    reply = Reply(body, result_text=stored)
    plain = reply.plain()
    assert plain == {"ok": True, "status": "completed", "result": json.loads(stored)}
    assert plain["result"]["n"] == 2**70
    assert json.loads(reply.json_bytes()) == plain
    assert isinstance(reply.body["result"], orjson.Fragment)  # the reply itself is unchanged


def test_plain_without_a_result_is_the_body() -> None:
    """A body without a stored result is returned as it is."""
    body = {"ok": True, "status": "released", "fencing_token": 3}
    assert Reply(body).plain() == body
