"""Both middlewares around real apps (Starlette, Flask), on the real service in-process.

Each test runs twice: the ASGI middleware around the Starlette shop, and the WSGI one
around the Flask shop (tests/web_apps.py), their lease clients talking to the service's
app through ``bridge`` (tests/client_fakes.py), whose ``fault`` may answer instead.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pytest
from flask.testing import FlaskClient
from starlette.testclient import TestClient

from leasekeeper import (
    AsyncLeaseClient,
    FakeClock,
    IdempotencyMiddleware,
    LeaseClient,
    WSGIIdempotencyMiddleware,
)
from leasekeeper.web import RequestLease
from tests.client_fakes import BASE_URL, FakeTime, bridge
from tests.conftest import Api
from tests.web_apps import BIG_CHUNK, BINARY, Shop, flask_app, starlette_app

KEY = "order-2026-09-05-0001"
Fault = Callable[[httpx.Request], httpx.Response | None]


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def json(self) -> Any:
        return json.loads(self.body)

    def replayed(self) -> bool:
        return self.header("idempotent-replayed") == "true"


class Site(Protocol):
    shop: Shop

    def post(
        self, path: str, body: Any = None, key: str | None = KEY, **headers: str
    ) -> Answer: ...

    def get(self, path: str) -> Answer: ...


def _headers(key: str | None, extra: dict[str, str]) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        **{k.replace("_", "-"): v for k, v in extra.items()},
    }
    if key is not None:
        headers["idempotency-key"] = key
    return headers


def _content(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body or {"amount": 500}).encode()


class AsgiSite:
    def __init__(
        self, api: Api, ns: str, fault: Fault | None, time: FakeTime | None, options: dict[str, Any]
    ) -> None:
        self.shop = Shop()
        timing: dict[str, Any] = {}
        if time is not None:
            timing = {"monotonic": time.monotonic, "signal_factory": time.signal}
        client = AsyncLeaseClient(BASE_URL, transport=bridge(api, fault), **timing)
        self.middleware = IdempotencyMiddleware(
            starlette_app(self.shop), client, namespace=ns, **options
        )
        self.client = TestClient(self.middleware, raise_server_exceptions=False)
        self.client.__enter__()

    def close(self) -> None:
        self.client.__exit__(None, None, None)

    def post(self, path: str, body: Any = None, key: str | None = KEY, **headers: str) -> Answer:
        r = self.client.post(path, content=_content(body), headers=_headers(key, headers))
        return Answer(r.status_code, list(r.headers.multi_items()), r.content)

    def get(self, path: str) -> Answer:
        r = self.client.get(path)
        return Answer(r.status_code, list(r.headers.multi_items()), r.content)


class WsgiSite:
    def __init__(
        self, api: Api, ns: str, fault: Fault | None, time: FakeTime | None, options: dict[str, Any]
    ) -> None:
        self.shop = Shop()
        app = flask_app(self.shop)
        timing: dict[str, Any] = {}
        if time is not None:
            timing = {"monotonic": time.monotonic, "event_factory": time.event}
        client = LeaseClient(BASE_URL, transport=bridge(api, fault), **timing)
        self.middleware = WSGIIdempotencyMiddleware(app.wsgi_app, client, namespace=ns, **options)
        app.wsgi_app = self.middleware  # type: ignore[method-assign]
        self.client: FlaskClient = app.test_client()

    def close(self) -> None:
        pass

    def post(self, path: str, body: Any = None, key: str | None = KEY, **headers: str) -> Answer:
        # buffered: the body is read and closed, as a server does (which ends the lease).
        r = self.client.post(
            path, data=_content(body), headers=_headers(key, headers), buffered=True
        )
        return Answer(r.status_code, [(k.lower(), v) for k, v in r.headers.items()], r.get_data())

    def get(self, path: str) -> Answer:
        r = self.client.get(path)
        return Answer(r.status_code, [(k.lower(), v) for k, v in r.headers.items()], r.get_data())


MakeSite = Callable[..., Site]


@pytest.fixture(params=["asgi", "wsgi"])
def make_site(request: pytest.FixtureRequest, api: Api, ns: str) -> Iterator[MakeSite]:
    """``make_site(fault=None, time=None, **options)``: the shop behind the middleware of
    this run; with ``time`` (a ``FakeTime``) its lease client waits on fake time."""
    made: list[AsgiSite | WsgiSite] = []

    def make(fault: Fault | None = None, time: FakeTime | None = None, **options: Any) -> Site:
        kind = AsgiSite if request.param == "asgi" else WsgiSite
        site = kind(api, ns, fault, time, options)
        made.append(site)
        return site

    yield make
    for site in made:
        site.close()


def in_parallel(*calls: Callable[[], Answer]) -> list[Answer]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(c) for c in calls]]


def is_problem(answer: Answer, status: int) -> dict[str, Any]:
    assert answer.status == status, answer
    assert answer.header("content-type") == "application/problem+json"
    body: dict[str, Any] = answer.json()
    assert body["status"] == status
    assert KEY not in answer.body.decode()
    return body


# -- the first request, and its retries -----------------------------------------------------------


def test_a_retry_gets_the_stored_response_byte_for_byte(make_site: MakeSite) -> None:
    """The handler runs once; a retry gets its status, body and body headers again, with
    Idempotent-Replayed: true, and never its Set-Cookie."""
    site = make_site()
    first = site.post("/orders", {"amount": 500})
    assert first.status == 201 and not first.replayed()
    assert first.header("set-cookie") == "session=s3cr3t"
    order = first.json()
    assert order["order"] == 1 and order["amount"] == 500  # the handler read the body
    assert isinstance(order["fence"], int) and order["fence"] > 0
    again = [site.post("/orders", {"amount": 500}) for _ in range(3)]
    for answer in again:
        assert answer.status == 201 and answer.replayed()
        assert answer.body == first.body
        assert answer.header("location") == "/orders/1"
        assert answer.header("content-type") == first.header("content-type")
        assert answer.header("set-cookie") is None
    assert again[0].headers == again[1].headers == again[2].headers
    assert site.shop.calls["orders"] == 1


def test_the_same_key_with_another_payload_is_422_and_the_handler_does_not_run(
    make_site: MakeSite,
) -> None:
    site = make_site()
    assert site.post("/orders", {"amount": 500}).status == 201
    is_problem(site.post("/orders", {"amount": 501}), 422)
    is_problem(site.post("/orders?coupon=1", {"amount": 500}), 422)
    is_problem(site.post("/binary", {"amount": 500}), 422)
    assert site.shop.calls == {"orders": 1}


def test_a_duplicate_while_the_first_runs_is_409_with_retry_after(make_site: MakeSite) -> None:
    site = make_site()
    site.shop.gate.clear()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(site.post, "/orders")
        assert site.shop.entered.wait(10)
        duplicate = site.post("/orders")
        site.shop.gate.set()
        assert first.result(10).status == 201
    body = is_problem(duplicate, 409)
    assert duplicate.header("retry-after") == "1"
    assert "still being processed" in body["detail"]
    assert site.post("/orders").replayed()
    assert site.shop.calls["orders"] == 1


def test_with_a_wait_a_duplicate_gets_the_first_response_once_it_is_stored(
    make_site: MakeSite,
) -> None:
    site = make_site(wait=10)
    site.shop.gate.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(site.post, "/orders")
        assert site.shop.entered.wait(10)
        waiting = pool.submit(site.post, "/orders")
        site.shop.gate.set()
        answers = [first.result(10), waiting.result(10)]
    assert [a.status for a in answers] == [201, 201]
    assert answers[1].replayed() and answers[1].body == answers[0].body
    assert site.shop.calls["orders"] == 1


def test_a_handler_that_raises_runs_again_on_retry(make_site: MakeSite) -> None:
    site = make_site()
    assert site.post("/crash").status == 500
    second = site.post("/crash")
    assert second.status == 201 and second.json() == {"attempt": 2}
    third = site.post("/crash")
    assert third.replayed() and third.body == second.body
    assert site.shop.calls["crash"] == 2


def test_a_5xx_is_not_stored_unless_configured(make_site: MakeSite) -> None:
    site = make_site()
    assert [site.post("/fail").json()["attempt"] for _ in range(2)] == [1, 2]
    stored = make_site(stored_statuses=lambda status: True)
    assert stored.post("/fail").status == 500
    replayed = stored.post("/fail")
    assert replayed.status == 500 and replayed.replayed() and replayed.json() == {"attempt": 1}


def test_a_body_too_large_to_store_keeps_status_and_headers_and_never_runs_twice(
    make_site: MakeSite,
) -> None:
    """A streamed 40,000-byte body reaches the first caller whole; a retry gets the status
    and the headers that do not describe the body, with a problem body saying so."""
    site = make_site()
    first = site.post("/big")
    assert first.status == 200 and first.body == BIG_CHUNK * 4 and not first.replayed()
    retry = site.post("/big")
    assert retry.status == 200 and retry.replayed()
    assert retry.header("etag") is None
    assert retry.header("content-type") == "application/problem+json"
    assert "too large to store" in retry.json()["detail"]
    assert site.shop.calls["big"] == 1


def test_a_binary_body_is_replayed_byte_for_byte(make_site: MakeSite) -> None:
    site = make_site()
    first = site.post("/binary")
    retry = site.post("/binary")
    assert first.body == retry.body == BINARY and retry.replayed()
    assert retry.header("content-type") == first.header("content-type")


def test_a_204_is_replayed_without_a_body_or_a_length(make_site: MakeSite) -> None:
    site = make_site()
    first = site.post("/nothing")
    retry = site.post("/nothing")
    assert (first.status, retry.status) == (204, 204) and retry.replayed()
    assert retry.body == b"" and retry.header("content-length") is None
    assert retry.header("etag") == '"none"'
    assert site.shop.calls["nothing"] == 1


# -- which requests are guarded -------------------------------------------------------------------


def test_a_missing_key_is_400_where_required_and_unguarded_otherwise(make_site: MakeSite) -> None:
    required = make_site(required=True)
    is_problem(required.post("/orders", key=None), 400)
    assert required.shop.calls["orders"] == 0
    optional = make_site()
    answers = [optional.post("/orders", key=None) for _ in range(2)]
    assert [a.json()["order"] for a in answers] == [1, 2]
    assert optional.shop.fences == [None, None]


def test_other_methods_and_paths_pass_through(make_site: MakeSite) -> None:
    site = make_site(paths=["/crash", "/fail*"], required=True)
    assert site.get("/orders").status == 200
    assert [site.post("/orders").json()["order"] for _ in range(2)] == [1, 2]
    is_problem(site.post("/fail", key=None), 400)


def test_a_malformed_key_is_400_and_not_echoed(make_site: MakeSite) -> None:
    site = make_site()
    is_problem(site.post("/orders", key=f"{KEY}, {KEY}"), 400)
    is_problem(site.post("/orders", key=f'"{KEY}'), 400)
    assert site.post("/orders", key=f'"{KEY}"').status == 201
    assert site.post("/orders", key=KEY).replayed()  # quoted or bare: the same key


def test_a_request_body_over_the_limit_is_413(make_site: MakeSite) -> None:
    site = make_site(max_request_bytes=10)
    is_problem(site.post("/orders", {"amount": 123456789}), 413)
    assert site.shop.calls["orders"] == 0


def test_a_key_scope_keeps_two_callers_equal_keys_apart(make_site: MakeSite) -> None:
    site = make_site(key_scope=lambda request: request.header("x-account"))
    alice = site.post("/orders", x_account="alice")
    bob = site.post("/orders", x_account="bob")
    assert (alice.json()["order"], bob.json()["order"]) == (1, 2)
    assert site.post("/orders", x_account="alice").body == alice.body
    assert site.post("/orders", x_account="bob").body == bob.body


def test_a_fingerprint_function_lets_a_retry_differ_where_it_says(make_site: MakeSite) -> None:
    site = make_site(fingerprint=lambda request: json.loads(request.body)["id"])
    first = site.post("/orders", {"id": "evt_1", "delivery": 1})
    retry = site.post("/orders", {"id": "evt_1", "delivery": 2})
    assert retry.replayed() and retry.body == first.body
    is_problem(site.post("/orders", {"id": "evt_2"}), 422)


def test_a_result_stored_by_something_else_is_a_500_problem(
    make_site: MakeSite, api: Api, ns: str
) -> None:
    site = make_site(fingerprint=lambda request: "fixed")
    client = LeaseClient(BASE_URL, transport=bridge(api))
    fingerprint = hashlib.sha256(b"fixed").hexdigest()
    lease = client.acquire(ns, KEY, fingerprint=fingerprint)
    client.complete(ns, KEY, lease.owner_token, {"receipt_id": 4817})  # type: ignore[union-attr]
    is_problem(site.post("/orders"), 500)
    assert site.shop.calls["orders"] == 0


# -- leasekeeper down, leases lost ----------------------------------------------------------------


def unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_leasekeeper_unreachable_is_503_with_retry_after(
    make_site: MakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    site = make_site(fault=unreachable)
    body = is_problem(site.post("/orders"), 503)
    assert "not processed" in body["detail"]
    assert site.shop.calls["orders"] == 0
    open_site = make_site(fault=unreachable, fail_open=True)
    with caplog.at_level(logging.WARNING, "leasekeeper.web"):
        answer = open_site.post("/orders")
    assert answer.status == 201 and answer.json()["fence"] is None
    assert "runs unguarded" in caplog.text
    assert KEY not in caplog.text


def answer(route: str, status: int, body: dict[str, Any]) -> Fault:
    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith(route):
            return httpx.Response(status, json=body)
        return None

    return fault


LOST = {"ok": False, "status": "lost", "error": "You do not hold this lease"}


def test_a_completion_refused_as_lost_still_answers_and_logs_the_fence_not_the_key(
    make_site: MakeSite, caplog: pytest.LogCaptureFixture
) -> None:
    site = make_site(fault=answer("/lease/complete", 409, LOST))
    with caplog.at_level(logging.WARNING):
        first = site.post("/orders")
    assert first.status == 201
    fence = first.json()["fence"]
    assert f"fencing token {fence}" in caplog.text and "not stored" in caplog.text
    assert KEY not in caplog.text


def test_a_lease_lost_to_failed_renewals_is_seen_by_the_handler(
    make_site: MakeSite, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewals answered lost: the handler's RequestLease says so, its response still goes
    out, and its completion is refused as lost (logged with the fence). The renewal's wait
    passes on fake time, at once."""
    site = make_site(time=FakeTime(clock), fault=answer("/lease/renew", 409, LOST))
    with caplog.at_level(logging.WARNING):
        first = site.post("/lost")
    assert first.status == 201 and first.json() == {"lost": True}
    fence = site.shop.fences[0]
    assert f"lease (fencing token {fence}) was lost" in caplog.text
    assert KEY not in caplog.text


def test_a_completion_that_gets_no_answer_is_tried_again(
    make_site: MakeSite, api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A complete whose answer is lost (it was stored) is tried again, found to be this
    owner's own, and the retry of the request is a replay."""
    monkeypatch.setattr("leasekeeper.web._asgi.COMPLETE_RETRY_DELAYS", (0.0,))
    monkeypatch.setattr("leasekeeper.web._wsgi.COMPLETE_RETRY_DELAYS", (0.0,))
    inner = bridge(api)
    lost_once = [1]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete") and lost_once[0]:
            lost_once[0] = 0
            inner.handle_request(request)
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return None

    site = make_site(fault=fault)
    first = site.post("/orders")
    assert first.status == 201
    assert site.post("/orders").replayed()
    assert site.shop.calls["orders"] == 1


# -- WSGI apps that are not Flask -----------------------------------------------------------------


def wsgi_call(app: Any, key: str = KEY) -> tuple[str, list[tuple[str, str]], bytes]:
    """Call a WSGI app as a server would: iterate, then close."""
    import io

    started: list[Any] = []
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/x",
        "QUERY_STRING": "",
        "CONTENT_LENGTH": "2",
        "wsgi.input": io.BytesIO(b"{}"),
        "HTTP_IDEMPOTENCY_KEY": key,
    }

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started[:] = [status, headers]
        return written.append

    written: list[bytes] = []
    result = app(environ, start_response)
    try:
        body = b"".join(written) + b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    return started[0], started[1], body


class Closing:
    """A WSGI body that records being closed."""

    def __init__(self, chunks: Iterable[bytes], log: list[str]) -> None:
        self.chunks = chunks
        self.log = log

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.chunks)

    def close(self) -> None:
        self.log.append("closed")


def test_a_wsgi_app_that_raises_runs_again_and_its_body_is_closed(api: Api, ns: str) -> None:
    runs: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        runs.append("run")
        if len(runs) == 1:
            raise RuntimeError("crash")
        start_response("201 Created", [("content-type", "text/plain")])
        return Closing([b"made ", b"it"], runs)

    guarded = WSGIIdempotencyMiddleware(
        app, LeaseClient(BASE_URL, transport=bridge(api)), namespace=ns
    )
    with pytest.raises(RuntimeError):
        wsgi_call(guarded)
    assert wsgi_call(guarded)[::2] == ("201 Created", b"made it")
    assert runs == ["run", "run", "closed"]
    status, headers, body = wsgi_call(guarded)
    assert (status, body) == ("201 Created", b"made it")
    assert ("idempotent-replayed", "true") in headers


def test_a_wsgi_app_using_write_and_a_lazy_generator_is_recorded_in_order(
    api: Api, ns: str
) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        write = start_response("200 OK", [("content-type", "text/plain")])
        write(b"one ")
        write(b"two ")

        def rest() -> Iterator[bytes]:
            yield b"three"

        return rest()

    guarded = WSGIIdempotencyMiddleware(
        app, LeaseClient(BASE_URL, transport=bridge(api)), namespace=ns
    )
    assert wsgi_call(guarded)[2] == b"one two three"
    assert wsgi_call(guarded)[2] == b"one two three"


def test_a_wsgi_5xx_streams_through_and_releases_when_closed(api: Api, ns: str) -> None:
    log: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        log.append("run")
        start_response("502 Bad Gateway", [("content-type", "text/plain")])
        return Closing([b"upstream ", b"down"], log)

    guarded = WSGIIdempotencyMiddleware(
        app, LeaseClient(BASE_URL, transport=bridge(api)), namespace=ns
    )
    assert wsgi_call(guarded)[::2] == ("502 Bad Gateway", b"upstream down")
    assert wsgi_call(guarded)[::2] == ("502 Bad Gateway", b"upstream down")
    assert log == ["run", "closed", "run", "closed"]


def test_the_asgi_lease_is_in_the_scope_state(api: Api, ns: str) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["state"]["leasekeeper"])
        seen.append(scope.get("extensions"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    client = AsyncLeaseClient(BASE_URL, transport=bridge(api))
    test = TestClient(IdempotencyMiddleware(app, client, namespace=ns))  # no lifespan
    assert test.post("/", headers={"idempotency-key": KEY}).content == b"ok"
    lease, extensions = seen
    assert isinstance(lease, RequestLease) and lease.fencing_token > 0
    assert not any(name.startswith("http.response.") for name in extensions or {})
