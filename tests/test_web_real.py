"""The middlewares against a real ``leasekeeper serve``, with real apps on real servers.

The Starlette shop runs under uvicorn and the Flask shop under werkzeug's threaded
server, each in a thread of the test, with the middleware given leasekeeper's URL;
requests come over TCP from a pool of threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from werkzeug.serving import make_server

from leasekeeper import IdempotencyMiddleware, LeaseClient, WSGIIdempotencyMiddleware
from tests._server import Server, free_port, start_server
from tests.web_apps import Shop, flask_app, starlette_app

pytestmark = pytest.mark.slow

KINDS = ["starlette", "flask"]


@pytest.fixture(scope="module")
def leasekeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("web")
    server = start_server(f"sqlite:///{tmp / 'lk.db'}", tmp / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def namespace(leasekeeper_server: Server) -> str:
    with LeaseClient(leasekeeper_server.url) as client:
        return client.create_namespace()


@contextlib.contextmanager
def serving(kind: str, shop: Shop, url: str, ns: str, **options: Any) -> Iterator[str]:
    """The shop of ``kind`` behind its middleware (given leasekeeper's ``url``), served on
    a free port in a thread; yields its base URL."""
    port = free_port()
    if kind == "starlette":
        app = IdempotencyMiddleware(starlette_app(shop), url, namespace=ns, **options)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(10)
    else:
        flask = flask_app(shop)
        middleware = WSGIIdempotencyMiddleware(flask.wsgi_app, url, namespace=ns, **options)
        flask.wsgi_app = middleware  # type: ignore[method-assign]
        wsgi = make_server("127.0.0.1", port, flask, threaded=True)
        thread = threading.Thread(target=wsgi.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            wsgi.shutdown()
            thread.join(10)
            middleware.close()


Post = Callable[..., httpx.Response]


def poster(base: str, key: str) -> Post:
    def post(path: str = "/orders", body: Any = None, **headers: str) -> httpx.Response:
        return httpx.post(
            base + path,
            json=body if body is not None else {"amount": 500},
            headers={"idempotency-key": key, **headers},
            timeout=30,
        )

    return post


def comparable(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """What must be equal between two replays: all but the server's date."""
    headers = [(k, v) for k, v in response.headers.multi_items() if k not in ("date",)]
    return response.status_code, headers, response.content


@pytest.mark.parametrize("kind", KINDS)
def test_twenty_concurrent_duplicates_run_the_handler_once(
    kind: str, leasekeeper_server: Server, namespace: str
) -> None:
    """20 duplicates at once: one runs the handler, every other answer is that response
    or a 409 while it ran; after it, every replay is the same, byte for byte."""
    shop = Shop()
    shop.hold = 0.5
    with serving(kind, shop, leasekeeper_server.url, namespace) as base:
        post = poster(base, f'"{uuid.uuid4()}"')
        start = threading.Barrier(20)

        def duplicate() -> httpx.Response:
            start.wait(10)
            return post()

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda _: duplicate(), range(20)))
        assert shop.calls["orders"] == 1
        stored = [a for a in answers if a.status_code == 201]
        originals = [a for a in stored if "idempotent-replayed" not in a.headers]
        assert len(originals) == 1
        for answer in answers:
            assert answer.status_code in (201, 409), answer.text
            if answer.status_code == 409:
                assert answer.headers["content-type"] == "application/problem+json"
                assert answer.headers["retry-after"] == "1"
            else:
                assert answer.content == originals[0].content
        replays = [post() for _ in range(5)]
        assert all(r.headers["idempotent-replayed"] == "true" for r in replays)
        assert len({repr(comparable(r)) for r in replays}) == 1
        assert replays[0].content == originals[0].content
        assert replays[0].headers["location"] == originals[0].headers["location"]
        assert "set-cookie" not in replays[0].headers
        assert shop.calls["orders"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_another_payload_is_422_and_a_crash_runs_again(
    kind: str, leasekeeper_server: Server, namespace: str
) -> None:
    shop = Shop()
    with serving(kind, shop, leasekeeper_server.url, namespace) as base:
        post = poster(base, str(uuid.uuid4()))
        assert post(body={"amount": 1}).status_code == 201
        reused = post(body={"amount": 2})
        assert reused.status_code == 422
        assert reused.headers["content-type"] == "application/problem+json"
        crash = poster(base, str(uuid.uuid4()))
        assert crash("/crash").status_code == 500
        assert crash("/crash").json() == {"attempt": 2}
        assert crash("/crash").headers["idempotent-replayed"] == "true"
        assert (shop.calls["orders"], shop.calls["crash"]) == (1, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_handler_slower_than_three_ttls_keeps_its_lease(
    kind: str, leasekeeper_server: Server, namespace: str
) -> None:
    """ttl=2 and a 6.5 s handler: renewed all along, a duplicate after 4.5 s is still
    refused, and the handler's lease is held at its end. (Not ttl=1: a renewal every
    third of a second can be late on a loaded machine.)"""
    shop = Shop()
    shop.hold = 6.5
    with serving(kind, shop, leasekeeper_server.url, namespace, ttl=2) as base:
        post = poster(base, str(uuid.uuid4()))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post)
            assert shop.entered.wait(10)
            time.sleep(4.5)
            duplicate = post()
            assert first.result(10).status_code == 201
        assert duplicate.status_code == 409
        assert shop.held_at_end == [True]
        assert post().headers["idempotent-replayed"] == "true"
        assert shop.calls["orders"] == 1


def test_leasekeeper_stopped_is_503_and_fail_open_lets_requests_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both apps, before and after their leasekeeper stops (one server for both, as
    starting one is the slow part)."""
    server = start_server(f"sqlite:///{tmp_path / 'lk.db'}", tmp_path / "server.log")
    try:
        with LeaseClient(server.url) as client:
            ns = client.create_namespace()
        shops = {kind: Shop() for kind in KINDS}
        with contextlib.ExitStack() as stack:
            closed = {k: stack.enter_context(serving(k, shops[k], server.url, ns)) for k in KINDS}
            opened = {
                k: stack.enter_context(serving(k, shops[k], server.url, ns, fail_open=True))
                for k in KINDS
            }
            done = {k: poster(closed[k], str(uuid.uuid4())) for k in KINDS}
            assert [done[k]().status_code for k in KINDS] == [201, 201]
            server.stop()
            for kind in KINDS:
                for post in (done[kind], poster(closed[kind], str(uuid.uuid4()))):
                    refused = post()
                    assert refused.status_code == 503, kind
                    assert refused.headers["content-type"] == "application/problem+json"
                    assert int(refused.headers["retry-after"]) >= 1
                assert shops[kind].calls["orders"] == 1
                caplog.clear()
                with caplog.at_level(logging.WARNING, "leasekeeper.web"):
                    through = poster(opened[kind], str(uuid.uuid4()))()
                assert through.status_code == 201 and through.json()["fence"] is None
                assert "runs unguarded" in caplog.text
                assert shops[kind].calls["orders"] == 2
    finally:
        server.stop()
