"""Operations: request ids in headers and log lines, and the metrics an operator reads."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from leasekeeper import FakeClock
from leasekeeper._logging import JsonFormatter, formatter_for
from leasekeeper.store import MemoryStore
from tests.conftest import STORE_KINDS, Api, ApiFactory, ManualSleep, metric

KEY = "invoice:2026-09-05"


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """leasekeeper's log records at DEBUG, formatted as in production, one JSON per line."""
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("leasekeeper")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield sink
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "utf-8"])
def test_log_lines_stay_json_on_a_stderr_that_is_not_utf8(encoding: str) -> None:
    """Where stderr's encoding is not UTF-8 (an ASCII or Latin-1 locale), a line holding
    characters past ASCII (a path, a PostgreSQL message in another language) is still
    one line of JSON that a UTF-8 reader parses, those characters as \\u escapes; on a
    UTF-8 stderr they are written as they are."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding=encoding, errors="backslashreplace")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter_for(stream))
    logger = logging.getLogger("leasekeeper.test_encoding")
    logger.addHandler(handler)
    try:
        logger.warning("created a new store at /srv/ünï/leasekeeper.db (日本)")
    finally:
        logger.removeHandler(handler)
    stream.flush()
    (line,) = raw.getvalue().decode("utf-8").splitlines()
    assert json.loads(line)["message"] == "created a new store at /srv/ünï/leasekeeper.db (日本)"
    assert line.isascii() is (encoding != "utf-8")


def test_every_response_has_its_own_request_id(api: Api) -> None:
    """X-Request-Id: 16 hex characters, drawn fresh for each response, errors included."""
    responses = [
        api.post("/lease/namespace", {}),
        api.post("/lease", {"key": "short"}),
        api.client.get("/nothing"),
        api.post("/lease", content=b"x" * 70_000),
        api.client.get("/metrics"),
    ]
    ids = [r.headers["x-request-id"] for r in responses]
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_client_cannot_choose_its_request_id(api: Api) -> None:
    """An incoming X-Request-Id is ignored: a client could put a secret into the logs."""
    response = api.post("/lease/namespace", {}, headers={"x-request-id": "ns_secret"})
    assert response.headers["x-request-id"] != "ns_secret"
    assert response.headers.get_list("x-request-id") == [response.headers["x-request-id"]]


def test_a_log_line_with_undecodable_text_is_still_one_json_line(
    log_lines: io.StringIO,
) -> None:
    """A path from bytes that are not UTF-8 (os.fsdecode keeps them as surrogates) in a
    message or a traceback: still one JSON line, the bytes escaped, not a "Logging
    error" traceback in place of the line that says what failed."""
    path = os.fsdecode(b"/srv/nodir\xe9/x.db")
    log = logging.getLogger("leasekeeper.test")
    try:
        raise OSError(f"cannot open {path}")
    except OSError:
        log.exception("Cannot open the SQLite store at %s", path)
    (line,) = log_lines.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["message"] == "Cannot open the SQLite store at /srv/nodir\\udce9/x.db"
    assert "cannot open /srv/nodir\\udce9/x.db" in entry["exception"]


def test_log_lines_carry_the_request_id(api: Api, ns: str, log_lines: io.StringIO) -> None:
    """Every line logged while a request is handled names that request's id, no path."""
    response = api.acquire(namespace=ns, key=KEY)
    missing = api.client.get(f"/services/v1/lease/{ns}")
    lines = [json.loads(line) for line in log_lines.getvalue().splitlines()]
    by_id = {line.get("request_id"): line for line in lines}
    access = by_id[response.headers["x-request-id"]]
    assert access["logger"] == "leasekeeper.access"
    assert access["message"].startswith("POST acquire 201 ")
    assert by_id[missing.headers["x-request-id"]]["message"].startswith("GET other 404 ")
    assert ns not in log_lines.getvalue() and KEY not in log_lines.getvalue()


def test_metrics_follow_decisions_store_calls_and_lease_times(
    api: Api, ns: str, clock: FakeClock
) -> None:
    """Outcomes by operation, store latency, granted lengths, waits and work time."""
    first = api.acquire(namespace=ns, key=KEY, ttl_seconds=30).json()
    api.acquire(namespace=ns, key=KEY)  # held: told to wait 30 s
    owner = {"namespace": ns, "key": KEY, "owner_token": first["owner_token"]}
    api.renew(**owner, ttl_seconds=120)
    clock.advance(200)
    api.renew(**owner)  # lost: expired
    second = api.acquire(namespace=ns, key=KEY, ttl_seconds=120).json()
    clock.advance(90)
    api.complete(namespace=ns, key=KEY, owner_token=second["owner_token"], result=1)
    api.acquire(namespace=ns, key=KEY)  # the result
    text = api.client.get("/metrics").text

    decisions = "leasekeeper_decisions_total"
    assert metric(text, decisions, operation="acquire", outcome="granted") == 2
    assert metric(text, decisions, operation="acquire", outcome="held") == 1
    assert metric(text, decisions, operation="acquire", outcome="completed") == 1
    assert metric(text, decisions, operation="renew", outcome="renewed") == 1
    assert metric(text, decisions, operation="renew", outcome="lost_expired") == 1
    assert metric(text, decisions, operation="complete", outcome="completed") == 1
    assert metric(text, "leasekeeper_store_seconds_count", operation="acquire") == 4
    assert metric(text, "leasekeeper_store_seconds_count", operation="renew") == 2
    granted = "leasekeeper_lease_granted_seconds"
    assert metric(text, granted + "_sum", operation="acquire") == 30 + 120
    assert metric(text, granted + "_sum", operation="renew") == 120
    assert metric(text, "leasekeeper_lease_wait_seconds_sum") == 30
    # The lifecycle started at the first acquire; the result came 290 s later.
    assert metric(text, "leasekeeper_work_seconds_sum") == 290
    assert metric(text, "leasekeeper_work_seconds_bucket", le="300.0") == 1
    assert ns not in text and KEY not in text and first["owner_token"] not in text


def test_store_failures_are_counted(api: Api, ns: str) -> None:
    """A store that cannot be reached shows in leasekeeper_store_failures_total."""
    api.client.portal.call(api.service.store.close)  # type: ignore[union-attr]
    assert api.acquire(namespace=ns, key=KEY).status_code == 503
    text = api.client.get("/metrics").text
    assert metric(text, "leasekeeper_store_failures_total", operation="acquire") == 1


@pytest.mark.parametrize("store_kind", STORE_KINDS)
def test_live_leases_are_counted_by_the_store(
    make_api: ApiFactory, clock: FakeClock, store_kind: str
) -> None:
    """The gauge counts held leases only: not released, completed or expired ones, and
    is counted again after each pause of LEASEKEEPER_LIVE_LEASES_INTERVAL_SECONDS."""
    sleep = ManualSleep()
    api = make_api(store_kind, live_leases_interval_seconds=15, sleep=sleep)
    ns = api.namespace()

    def live() -> float:
        return metric(api.client.get("/metrics").text, "leasekeeper_live_leases")

    api.client.portal.call(sleep.until_asleep, 1)  # the count at start, of an empty store
    assert live() == 0 and sleep.pauses == [15]
    tokens = [api.acquire(namespace=ns, key=f"k{i}", ttl_seconds=60).json() for i in range(5)]
    api.acquire(namespace=ns, key="short", ttl_seconds=1)
    api.release(namespace=ns, key="k0", owner_token=tokens[0]["owner_token"])
    api.complete(namespace=ns, key="k1", owner_token=tokens[1]["owner_token"], result=None)
    clock.advance(2)  # "short" expires
    assert live() == 0  # not counted again before the pause ends
    api.client.portal.call(sleep.wake)
    api.client.portal.call(sleep.until_asleep, 1)
    assert live() == 3 and sleep.pauses == [15, 15]
    counted = metric(
        api.client.get("/metrics").text, "leasekeeper_live_leases_counted_timestamp_seconds"
    )
    assert counted > time.time() - 5


def test_a_store_that_cannot_count_shows_no_gauge(make_api: ApiFactory) -> None:
    """Without a count from the store there is no live-lease gauge, rather than a false 0;
    nor with the interval at 0."""

    class Uncounted:
        def __init__(self) -> None:
            self.inner = MemoryStore()

        def __getattr__(self, name: str) -> Any:
            if name == "count_live":
                raise AttributeError(name)
            return getattr(self.inner, name)

    api = make_api(store=Uncounted(), live_leases_interval_seconds=15)  # type: ignore[arg-type]
    assert "leasekeeper_live_leases" not in api.client.get("/metrics").text
    assert api.acquire(namespace=api.namespace(), key=KEY).status_code == 201
    never = make_api("memory", live_leases_interval_seconds=0)
    assert "leasekeeper_live_leases" not in never.client.get("/metrics").text
    assert "leasekeeper_requests_total" in never.client.get("/metrics").text


def test_serve_takes_startup_objects_out_of_the_garbage_collectors_scans() -> None:
    """``serve`` freezes what is loaded before it listens and collects the young less often."""
    import gc

    from leasekeeper import _server_cli

    threshold = gc.get_threshold()
    try:
        _server_cli._tune_gc()
        assert gc.get_freeze_count() > 1000
        assert gc.get_threshold() == (10_000, threshold[1], threshold[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_cleanup_walks_the_store_and_pauses_after_each_step_as_long_as_it_took() -> None:
    """A cleanup follows the store's walk to its end, even past a step that deleted nothing,
    and leaves the store to requests between steps: pause = step time x ratio."""
    import asyncio

    from leasekeeper import LeaseService
    from leasekeeper.store import Purged

    class Walking:
        """Three steps of 10 ms each (on the fake clock); the second finds nothing to delete."""

        def __init__(self) -> None:
            self.steps = [Purged(2, b"k1"), Purged(0, b"k2"), Purged(1, None)]
            self.asked: list[tuple[int, bytes | None]] = []

        async def purge(self, limit: int, after: bytes | None = None) -> Purged:
            nonlocal now
            now += 0.010
            self.asked.append((limit, after))
            return self.steps.pop(0)

    now = 0.0
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(round(seconds, 6))

    store = Walking()
    service = LeaseService(
        store,  # type: ignore[arg-type]
        cleanup_batch=2,
        cleanup_pause=1.5,
        sleep=sleep,
        monotonic=lambda: now,
    )
    assert asyncio.run(service.cleanup()) == 3
    assert store.asked == [(2, None), (2, b"k1"), (2, b"k2")]
    assert pauses == [0.015, 0.015]  # after the first two steps; none after the last


def test_a_failed_cleanup_pass_is_logged_and_the_next_one_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``clean_up_every`` (both ``serve`` and ``leasekeeper mcp``): a pass the store refuses
    is a WARNING and ``ran(None, …)``, and the loop goes on, one interval later, to a pass
    that deletes; the first pause is a random part of the interval, the rest whole ones."""
    import asyncio

    from leasekeeper._errors import ServiceUnavailable
    from leasekeeper._service import clean_up_every

    class Flaky:
        def __init__(self) -> None:
            self.answers: list[int | Exception] = [ServiceUnavailable("store down"), 7]

        async def cleanup(self) -> int:
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    pauses: list[float] = []
    ran: list[int | None] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 3:
            raise asyncio.CancelledError  # two passes are enough

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await clean_up_every(
                Flaky(),  # type: ignore[arg-type]
                600,
                sleep=sleep,
                ran=lambda deleted, seconds: ran.append(deleted),
            )

    with caplog.at_level(logging.INFO, logger="leasekeeper.service"):
        asyncio.run(main())
    assert ran == [None, 7]
    assert 0 <= pauses[0] < 600 and pauses[1:] == [600, 600]
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.WARNING, "cleanup failed: store down") in messages
    assert (logging.INFO, "cleanup deleted 7 records whose lifecycle was over") in messages


def test_raising_the_fence_counter_is_bounded_and_timed() -> None:
    """``LeaseService.raise_fence`` refuses a value outside 0 .. 2^62 (so the counter
    cannot be brought near running out) before the store is asked, and reports the call
    as a store call."""
    import asyncio

    from leasekeeper import LeaseService
    from leasekeeper._metrics import Metrics
    from leasekeeper.store import MAX_FENCING_TOKEN, MAX_RAISED_FENCE

    store = MemoryStore(FakeClock(0))
    service = LeaseService(store)
    metrics = Metrics()
    service.add_observer(metrics)
    for wrong in (-1, MAX_RAISED_FENCE + 1, MAX_FENCING_TOKEN - 1, MAX_FENCING_TOKEN):
        with pytest.raises(ValueError, match="at_least"):
            asyncio.run(service.raise_fence(wrong))
    assert asyncio.run(service.raise_fence(0)) == 0
    assert asyncio.run(service.raise_fence(MAX_RAISED_FENCE)) == MAX_RAISED_FENCE == 2**62
    observed = metrics.registry.get_sample_value(
        "leasekeeper_store_seconds_count", {"operation": "raise_fence"}
    )
    assert observed == 2


@pytest.mark.parametrize(
    ("host", "shown"),
    [("::1", "http://[::1]:8799"), ("127.0.0.1", "http://127.0.0.1:8799")],
)
def test_serve_logs_an_address_a_browser_or_curl_can_take(
    host: str, shown: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An IPv6 host is logged in brackets: ``http://::1:8799`` is no URL at all."""
    import uvicorn
    from click.testing import CliRunner

    from leasekeeper import _server_cli, cli

    served: list[tuple[str, int]] = []

    def run(server: uvicorn.Server, sockets: list[object]) -> None:
        served.append((server.config.host, server.config.port))
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(_server_cli, "_listen", lambda host, port, address: [])
    monkeypatch.setattr(_server_cli, "_tune_gc", lambda: None)
    # keeps caplog's handler
    monkeypatch.setattr(_server_cli, "configure_logging", lambda level: None)
    with caplog.at_level("INFO", logger="leasekeeper"):
        done = CliRunner().invoke(
            cli.main, ["serve", "--host", host, "--port", "8799", "--store", "memory://"]
        )
    assert done.exit_code == 0, done.output
    assert served == [(host, 8799)]
    stored = "memory (nothing is kept after the process ends)"
    assert f"leasekeeper starting on {shown} (store: {stored})" in caplog.text
