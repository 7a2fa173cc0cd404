"""The middleware's pure decisions (leasekeeper.web's _policy, _request, _stored and
_problems): no I/O, no clock."""

from __future__ import annotations

import ast
import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import leasekeeper
import leasekeeper.web
from leasekeeper import (
    FingerprintConflict,
    InternalError,
    InvalidRequest,
    LeaseHeld,
    RateLimited,
    ServiceUnavailable,
    ServiceUnreachable,
)
from leasekeeper._core.validation import redact
from leasekeeper.web import IdempotentRequest, default_fingerprint
from leasekeeper.web._policy import Policy
from leasekeeper.web._problems import Reply, refusal
from leasekeeper.web._request import read_key
from leasekeeper.web._stored import (
    MAX_RESULT_BYTES,
    ResponseRecorder,
    UnreadableResult,
    replay,
    result_size,
    results_to_store,
    stored_result,
)

KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"
AT = "2026-09-06T10:00:00Z"
HELD = LeaseHeld(
    retry_after_seconds=25, fencing_token=9, lease_expires_at=AT, absolute_expires_at=AT
)
REUSED = FingerprintConflict(absolute_expires_at=AT)


def policy(**options: Any) -> Policy:
    return Policy.build(namespace="ns_x", **options)


def request(
    method: str = "POST",
    path: str = "/orders",
    query: str = "",
    body: bytes = b"{}",
    headers: tuple[tuple[str, str], ...] = (),
) -> IdempotentRequest:
    return IdempotentRequest(method, path, query, headers, body, raw={})


def problem(reply: Reply) -> dict[str, Any]:
    assert ("content-type", "application/problem+json") in reply.headers
    body: dict[str, Any] = json.loads(reply.body)
    assert body["status"] == reply.status
    return body


# -- the header -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "key"),
    [
        (f'"{KEY}"', KEY),
        (KEY, KEY),
        (f'  "{KEY}"\t', KEY),
        ('"a \\"quoted\\" \\\\ key"', 'a "quoted" \\ key'),
        ('"with spaces inside"', "with spaces inside"),
        ("order:17/retry=2", "order:17/retry=2"),
        ('"a,b"', "a,b"),  # a comma inside the string is the key's own
    ],
)
def test_a_key_is_a_structured_field_string_or_a_bare_token(value: str, key: str) -> None:
    """The draft's sf-string and the bare token most clients send both give the key."""
    assert read_key([value], policy()) == key


@pytest.mark.parametrize(
    ("values", "why"),
    [
        (['""'], "visible ASCII"),
        (['"unterminated'], "visible ASCII"),
        (['"bad \\n escape"'], "visible ASCII"),
        (['"key";param=1'], "visible ASCII"),
        (['"key" trailing'], "visible ASCII"),
        (["café"], "visible ASCII"),
        (['"café"'], "visible ASCII"),
        (['"tab\tinside"'], "visible ASCII"),
        (["two words"], "visible ASCII"),
        ([""], "visible ASCII"),
        ([KEY, KEY], "more than once"),
        ([f"{KEY},{KEY}"], "more than once"),
        ([f'"{KEY}", "{KEY}"'], "more than once"),
    ],
)
def test_a_malformed_or_repeated_key_is_a_400_that_does_not_echo_it(
    values: list[str], why: str
) -> None:
    """A malformed key, or several (the draft forbids more than one), is 400
    problem+json saying why, without the value."""
    reply = read_key(values, policy())
    assert isinstance(reply, Reply) and reply.status == 400
    body = problem(reply)
    assert why in body["detail"]
    for value in values:
        if len(value) > 2:
            assert value.strip('"') not in reply.body.decode()


def test_a_missing_key_is_a_400_problem() -> None:
    """No header where one is needed: 400, with a detail a client can act on."""
    reply = read_key([], policy())
    assert isinstance(reply, Reply) and reply.status == 400
    assert "Idempotency-Key header" in problem(reply)["detail"]


# -- keys, scopes and fingerprints ---------------------------------------------------------------


def test_a_scope_prefixes_the_key_so_that_two_users_keys_never_meet() -> None:
    """With key_scope, equal keys of two scopes differ, and no scope and key can be
    chosen to give another scope's key."""
    scoped = policy(key_scope=lambda r: r.header("x-account"))
    alice = request(headers=(("x-account", "alice"),))
    bob = request(headers=(("x-account", "bob"),))
    assert scoped.lease_key("k", alice) == "5:alice:k"
    assert scoped.lease_key("k", bob) != scoped.lease_key("k", alice)
    # "alice" + "x:k" must not meet "alice:x" + "k", nor an anonymous "5:alice:k".
    odd = request(headers=(("x-account", "alice:x"),))
    assert scoped.lease_key("k", odd) != scoped.lease_key("x:k", alice)
    assert scoped.lease_key("5:alice:k", request()) == "0::5:alice:k"
    assert policy().lease_key("k", alice) == "k"


def test_a_key_too_long_for_the_service_is_a_400() -> None:
    """The service takes keys of at most 200 characters: a longer one is refused here."""
    assert policy().lease_key("k" * 200, request()) == "k" * 200
    reply = policy().lease_key("k" * 201, request())
    assert isinstance(reply, Reply) and reply.status == 400
    scoped = policy(key_scope=lambda r: "acct")
    assert isinstance(scoped.lease_key("k" * 195, request()), Reply)


def test_a_scope_function_returning_a_control_character_is_a_bug_said_at_once() -> None:
    with pytest.raises(TypeError, match="key_scope"):
        policy(key_scope=lambda r: "a\nb").lease_key("k", request())


def test_the_fingerprint_covers_method_path_query_and_body() -> None:
    """Each part changes the fingerprint; moving bytes between parts does too."""
    base = default_fingerprint(request())
    assert base == default_fingerprint(request())
    assert len(base) == 64
    others = [
        request(method="PATCH"),
        request(path="/orders/1"),
        request(query="a=1"),
        request(body=b'{"a": 1}'),
        request(path="/orders{}", body=b""),  # the same bytes, split otherwise
    ]
    prints = {default_fingerprint(r) for r in others}
    assert base not in prints and len(prints) == len(others)
    assert default_fingerprint(request(headers=(("x-a", "1"),))) == base  # not the headers


def test_a_fingerprint_function_replaces_the_default_and_is_hashed() -> None:
    """A function's value (of any length) is sent as its SHA-256; equal values match."""
    subset = policy(fingerprint=lambda r: json.loads(r.body)["id"])
    one = subset.fingerprint_of(request(body=b'{"id": "a", "sent_at": 1}'))
    two = subset.fingerprint_of(request(body=b'{"id": "a", "sent_at": 2}'))
    assert one == two and len(one) == 64
    assert subset.fingerprint_of(request(body=b'{"id": "b"}')) != one
    long = policy(fingerprint=lambda r: b"x" * 5000).fingerprint_of(request())
    assert len(long) == 64


# -- which requests are guarded ------------------------------------------------------------------


def test_paths_are_exact_or_prefixes_with_a_star_or_a_function() -> None:
    chosen = policy(paths=["/orders", "/webhooks/*"])
    assert chosen.guards_path("/orders")
    assert not chosen.guards_path("/orders/1")
    assert chosen.guards_path("/webhooks/stripe")
    assert not chosen.guards_path("/webhook")
    assert policy(paths=(p for p in ["/a"])).guards_path("/a")  # any iterable, read once
    assert policy(paths=lambda p: p.endswith("/pay")).guards_path("/x/pay")
    assert policy().guards_path("/anything")
    assert policy(methods=["post", "put"]).methods == {"POST", "PUT"}


def test_stored_statuses_default_to_below_500() -> None:
    assert policy().stores_status(499) and not policy().stores_status(500)
    assert policy(stored_statuses=[200, 201]).stores_status(201)
    assert not policy(stored_statuses=[200, 201]).stores_status(400)
    assert policy(stored_statuses=lambda s: s != 429).stores_status(500)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": 1.5}, "ttl"),
        ({"ttl": True}, "ttl"),
        ({"wait": -1}, "wait"),
        ({"wait": float("inf")}, "wait"),
        ({"wait": "1"}, "wait"),
        ({"methods": []}, "methods"),
        ({"stored_headers": ["Set-Cookie"]}, "set-cookie"),
        ({"stored_headers": ["content-length"]}, "content-length"),
        ({"max_request_bytes": -1}, "max_request_bytes"),
        ({"docs_url": "https://exämple.com"}, "docs_url"),
    ],
)
def test_settings_are_checked_when_the_middleware_is_built(
    options: dict[str, Any], error: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        policy(**options)


# -- storing and replaying a response -----------------------------------------------------------


def test_a_text_response_round_trips_byte_for_byte_with_the_replayed_header() -> None:
    body = '{"id": 7, "name": "café \\u00e9", "token": "abc"}'.encode()
    headers = [
        ("Content-Type", "application/json"),
        ("Location", "/orders/7"),
        ("Set-Cookie", "session=secret"),
        ("X-Request-Id", "r1"),
        ("Content-Length", str(len(body))),
    ]
    result = stored_result(policy(), 201, headers, body)
    assert result["body_encoding"] == "text"
    assert result["headers"] == [["content-type", "application/json"], ["location", "/orders/7"]]
    reply = replay(policy(), json.loads(json.dumps(result)))
    assert reply.status == 201 and reply.body == body
    assert reply.headers == [
        ("content-type", "application/json"),
        ("location", "/orders/7"),
        ("idempotent-replayed", "true"),
    ]


def test_a_binary_body_is_stored_as_base64() -> None:
    body = bytes(range(256)) * 4
    result = stored_result(policy(), 200, [("content-type", "application/octet-stream")], body)
    assert result["body_encoding"] == "base64"
    assert base64.b64decode(result["body"]) == body
    assert replay(policy(), result).body == body


def test_the_stored_result_is_never_touched_by_the_services_redaction() -> None:
    """Field names are the middleware's own; headers and bodies named like secrets are
    values in lists and strings, which the service does not rewrite."""
    body = json.dumps({"token": "t", "password": "p", "api_key": "k"}).encode()
    headers = [("content-type", "application/json"), ("etag", '"token"')]
    for result in results_to_store(policy(), 200, headers, body):
        assert redact(result) == result


def test_the_size_is_counted_as_the_service_counts_it() -> None:
    """Compact UTF-8 JSON: escapes and multi-byte characters count as written."""
    assert result_size({"a": "é"}) == len('{"a":"é"}'.encode())
    assert result_size({"a": '"\n'}) == len('{"a":"\\"\\n"}')


def test_a_body_that_does_not_fit_is_stored_as_omitted_and_replayed_as_a_problem() -> None:
    """Over 32 KiB once encoded (quotes double under JSON escaping): status and headers
    are stored, and a retry gets them with a problem body saying the body was not kept."""
    body = b'"' * (MAX_RESULT_BYTES // 2 + 10)  # under the limit raw, over it escaped
    headers = [("content-type", "text/plain"), ("location", "/x"), ("etag", '"1"')]
    result = stored_result(policy(), 201, headers, body)
    assert result["body_encoding"] == "omitted" and result["body"] is None
    assert result_size(result) < 200
    reply = replay(policy(), result)
    assert reply.status == 201
    assert ("location", "/x") in reply.headers
    assert ("idempotent-replayed", "true") in reply.headers
    assert not any(
        name in ("etag", "content-type") and value != "application/problem+json"
        for name, value in reply.headers
    )
    assert "too large to store" in problem(reply)["detail"]
    fits = b"x" * (MAX_RESULT_BYTES - 200)
    assert stored_result(policy(), 200, [], fits)["body_encoding"] == "text"


def test_the_fallbacks_go_from_the_response_to_its_status_alone() -> None:
    stored = list(results_to_store(policy(), 201, [("location", "/x")], b"body"))
    assert [r["body_encoding"] for r in stored] == ["text", "omitted", "omitted"]
    assert stored[1]["headers"] and not stored[2]["headers"]


@pytest.mark.parametrize(
    "result",
    [
        None,
        {"receipt_id": 4817},
        {"http_response": 1, "status": 200, "headers": [], "body": "x", "body_encoding": "zip"},
        {"http_response": 1, "status": 99, "headers": [], "body": "x", "body_encoding": "text"},
        {"http_response": 1, "status": True, "headers": [], "body": "", "body_encoding": "text"},
        {
            "http_response": 1,
            "status": 200,
            "headers": [["a"]],
            "body": "",
            "body_encoding": "text",
        },
        {"http_response": 1, "status": 200, "headers": [], "body": None, "body_encoding": "text"},
        {"http_response": 1, "status": 200, "headers": [], "body": "!", "body_encoding": "base64"},
    ],
)
def test_a_result_the_middleware_did_not_store_is_unreadable(result: Any) -> None:
    with pytest.raises(UnreadableResult):
        replay(policy(), result)


def test_the_recorder_keeps_the_body_up_to_the_limit() -> None:
    recorder = ResponseRecorder(limit=10)
    recorder.start(200, [("a", "b")])
    assert recorder.add(b"12345") and recorder.add(b"") and recorder.add(b"67890")
    assert not recorder.add(b"x")
    assert recorder.overflowed and recorder.body() == b"1234567890x"


# -- problems -----------------------------------------------------------------------------------


def test_refusals_follow_the_draft() -> None:
    """Held: 409 with Retry-After; another payload: 422; a key the service refuses: 400
    with its reason; leasekeeper unavailable: 503 with Retry-After, or None (fail open)."""
    held = refusal(policy(), HELD)
    assert held is not None and held.status == 409
    assert ("retry-after", "1") in held.headers
    conflict = refusal(policy(), REUSED)
    assert conflict is not None and conflict.status == 422
    invalid = refusal(policy(), InvalidRequest("key: must have 100 bits of entropy"))
    assert invalid is not None and invalid.status == 400
    assert "100 bits" in problem(invalid)["detail"]
    for error, wait in [
        (ServiceUnavailable(retry_after_seconds=7), "7"),
        (ServiceUnreachable("Could not reach"), "1"),
        (RateLimited(retry_after_seconds=3600), "60"),
        (InternalError(), "1"),
    ]:
        down = refusal(policy(), error)
        assert down is not None and down.status == 503
        assert ("retry-after", wait) in down.headers
        problem(down)
        assert refusal(policy(fail_open=True), error) is None
    assert refusal(policy(fail_open=True), HELD) is not None  # never unguarded


def test_a_problem_type_is_the_docs_page_when_given_else_about_blank() -> None:
    """Without docs_url the type is about:blank, so the title is the status phrase (RFC
    9457); with it, the type is its anchor and a Link header points there (the draft)."""
    plain = problem(refusal(policy(), REUSED) or Reply(0, [], b""))
    assert "type" not in plain and plain["title"] == "Unprocessable Content"  # RFC 9110
    linked_reply = refusal(policy(docs_url="https://api.example.com/idem"), REUSED)
    assert linked_reply is not None
    linked = problem(linked_reply)
    assert linked["type"] == "https://api.example.com/idem#key-reused"
    assert linked["title"] == "Idempotency-Key is already used"
    assert ("link", '<https://api.example.com/idem>; rel="describedby"; type="text/html"') in (
        linked_reply.headers
    )


# -- what the package imports ---------------------------------------------------------------------

SRC = Path(leasekeeper.__file__).parent / "web"
#: ``_typeshed``: the type checker's own (under ``TYPE_CHECKING``, never imported).
ALLOWED = {"leasekeeper", "httpx", "_typeshed"} | set(sys.stdlib_module_names)


def test_the_middleware_imports_only_the_standard_library_and_the_client() -> None:
    """Nothing of the server: the base install (the client) is enough for the middleware."""
    for path in sorted(SRC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module or ""]
            else:
                continue
            for root in roots:
                assert root.split(".")[0] in ALLOWED, (path.name, root)
                if root.startswith("leasekeeper"):
                    assert root in ("leasekeeper", "leasekeeper.client") or root.startswith(
                        "leasekeeper.web"
                    ), (path.name, root)


def test_the_middleware_imports_without_any_web_framework() -> None:
    """With Starlette, uvicorn, Flask and werkzeug unimportable, the middleware loads."""
    code = (
        "import sys\n"
        "for name in ('starlette', 'uvicorn', 'flask', 'werkzeug'):\n"
        "    sys.modules[name] = None\n"
        "from leasekeeper.web import IdempotencyMiddleware, WSGIIdempotencyMiddleware\n"
        "from leasekeeper import IdempotencyMiddleware as again\n"
        "assert again is IdempotencyMiddleware\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_web_package_exports_what_its_all_says() -> None:
    assert leasekeeper.web.__all__ == sorted(leasekeeper.web.__all__)
    for name in leasekeeper.web.__all__:
        assert getattr(leasekeeper.web, name).__module__.startswith("leasekeeper.web._")
    assert leasekeeper.WSGIIdempotencyMiddleware is leasekeeper.web.WSGIIdempotencyMiddleware


def test_import_leasekeeper_loads_the_middlewares_on_first_use() -> None:
    """A worker that only takes leases does not import the web package; the two names
    still come from the top, as the same classes, and an unknown name is still an error."""
    code = (
        "import sys\n"
        "import leasekeeper\n"
        "assert 'leasekeeper.web' not in sys.modules\n"
        "assert {'IdempotencyMiddleware', 'WSGIIdempotencyMiddleware'} <= set(dir(leasekeeper))\n"
        "from leasekeeper import IdempotencyMiddleware\n"
        "from leasekeeper import web\n"
        "assert IdempotencyMiddleware is web.IdempotencyMiddleware\n"
        "assert leasekeeper.WSGIIdempotencyMiddleware is web.WSGIIdempotencyMiddleware\n"
        "try:\n"
        "    from leasekeeper import NoSuchName\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an unknown name was imported')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_type_checkers_see_the_middlewares_and_no_module_getattr(tmp_path: Path) -> None:
    """mypy in a user's project types the lazily loaded names as the classes, and still
    refuses a name the package does not have (a module ``__getattr__`` it could see would
    make every unknown name ``Any``)."""
    (tmp_path / "app.py").write_text(
        "import leasekeeper\n"
        "from leasekeeper import IdempotencyMiddleware\n"
        "reveal_type(leasekeeper.WSGIIdempotencyMiddleware)\n"
        "IdempotencyMiddleware(None, 'http://127.0.0.1:8787', namespace=None)\n"
        "leasekeeper.NoSuchName\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "app.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the project: its configuration is not the user's
        check=False,
    )
    out = done.stdout
    assert 'app.py:3: note: Revealed type is "def (' in out, out
    assert "-> leasekeeper.web._wsgi.WSGIIdempotencyMiddleware" in out, out
    assert 'app.py:4: error: Argument 1 to "IdempotencyMiddleware" has incompatible type' in out
    assert 'app.py:5: error: Module has no attribute "NoSuchName"' in out, out
