"""``Reply.plain()``: the body with the stored result as Python values (what MCP returns);
reprs that show no secret."""

from __future__ import annotations

import json
import secrets

import orjson

from leasekeeper import Reply
from leasekeeper._core.secrets import format_namespace, format_owner_token
from leasekeeper._schemas import AcquireBody, CompleteBody, ReleaseBody, RenewBody, parse_body
from leasekeeper.client import LeaseClient
from leasekeeper.client.cli._commands import Target as _Target


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


def test_reprs_show_no_secret_and_no_caller_data() -> None:
    """A request body, a reply or a CLI target in a log line or a traceback shows no
    namespace, owner token, key, fingerprint, result or environment value."""
    namespace = format_namespace(secrets.token_bytes(32))
    owner_token = format_owner_token(secrets.token_bytes(32))
    data = {"namespace": namespace, "key": "key-canary", "owner_token": owner_token}
    bodies = [
        parse_body(AcquireBody, {"namespace": namespace, "key": "key-canary",
                                 "fingerprint": "fp-canary", "ttl_seconds": 5}),
        parse_body(RenewBody, {**data, "ttl_seconds": 5}),
        parse_body(ReleaseBody, data),
        parse_body(CompleteBody, {**data, "result": {"r": "result-canary"}}),
    ]  # fmt: skip
    reply = Reply({"ok": True, "status": "acquired", "owner_token": owner_token}, created=True)
    target = _Target(
        client=LeaseClient("http://127.0.0.1:9"), namespace=namespace, key="key-canary",
        fingerprint="fp-canary", environ={"LEASEKEEPER_OWNER_TOKEN": owner_token},
    )  # fmt: skip
    shown = [repr(body) for body in bodies] + [str(bodies[0]), repr(reply), repr(target)]
    assert "ttl_seconds=5" in shown[0] and "created=True" in shown[5]
    for text in shown:
        for canary in (namespace, owner_token, "key-canary", "fp-canary", "result-canary"):
            assert canary not in text, text
    target.client.close()
