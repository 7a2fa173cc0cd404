"""The history checker flags every kind of broken promise, and nothing in a clean history.

Hand-written histories use ``offset=0``: server seconds and client monotonic seconds
are the same numbers, so ``expires=10`` means a reported expiry of 10 s.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pytest
from starlette.testclient import TestClient

from leasekeeper import LeaseService, Settings
from leasekeeper._core.model import Command, Decision
from leasekeeper.http import create_app
from leasekeeper.store import MemoryStore
from tests.history import Check, History, Op, Recorder, check

K = "ns/k"
ABS = 1000  # the lifecycle's reported end, far after every operation below


def grant(
    token: str,
    fence: int,
    t0: float,
    t1: float | None,
    expires: int,
    *,
    key: str = K,
    fingerprint: str | None = "fp",
    absolute: int = ABS,
    outcome: str = "ok",
) -> Op:
    body = None
    if outcome == "ok":
        body = {
            "ok": True,
            "status": "held",
            "owner_token": token,
            "fencing_token": fence,
            "lease_expires_at_timestamp": expires,
            "absolute_expires_at_timestamp": absolute,
        }
    return Op(
        process="p",
        kind="acquire",
        key=key,
        invoke=t0,
        complete=t1,
        outcome=outcome,  # type: ignore[arg-type]
        status=201 if outcome == "ok" else None,
        body=body,
        token=token if outcome == "ok" else None,
        ttl=5,
        fingerprint=fingerprint,
    )


def waiter(token: str, fence: int, t0: float, t1: float, expires: int, instance: str = "a") -> Op:
    """A grant to an acquire that was sent with ``wait_seconds`` to ``instance``."""
    return replace(grant(token, fence, t0, t1, expires), wait=30, instance=instance)


def renew(
    token: str, fence: int, t0: float, t1: float | None, expires: int, *, outcome: str = "ok"
) -> Op:
    body = None
    if outcome == "ok":
        body = {"ok": True, "status": "held", "fencing_token": fence}
        body["lease_expires_at_timestamp"] = expires
    return _mutation("renew", token, t0, t1, outcome, 200 if outcome == "ok" else None, body)


def release(token: str, fence: int, t0: float, t1: float | None, *, outcome: str = "ok") -> Op:
    body = {"ok": True, "status": "released", "fencing_token": fence}
    return _mutation("release", token, t0, t1, outcome, 200 if outcome == "ok" else None, body)


def complete(
    token: str,
    fence: int,
    t0: float,
    t1: float | None,
    *,
    result: Any = "r",
    absolute: int = ABS,
    outcome: str = "ok",
) -> Op:
    body = _completed_body(fence, result, absolute)
    return _mutation("complete", token, t0, t1, outcome, 200 if outcome == "ok" else None, body)


def lost(kind: str, token: str, t0: float, t1: float) -> Op:
    body = {"ok": False, "status": "lost", "error": "lost"}
    return _mutation(kind, token, t0, t1, "fail", 409, body)


def answer(
    t0: float,
    t1: float,
    status: int,
    body: dict[str, Any],
    *,
    fingerprint: str | None = "fp",
    key: str = K,
) -> Op:
    """An acquire answered without a grant (held, conflict, completed)."""
    return Op(
        process="q",
        kind="acquire",
        key=key,
        invoke=t0,
        complete=t1,
        outcome="ok" if status < 300 else "fail",
        status=status,
        body=body,
        fingerprint=fingerprint,
    )


def held(t0: float, t1: float, fence: int) -> Op:
    return answer(t0, t1, 409, {"ok": False, "status": "held", "fencing_token": fence})


def replay(t0: float, t1: float, fence: int, result: Any = "r", absolute: int = ABS) -> Op:
    return answer(t0, t1, 200, _completed_body(fence, result, absolute))


def _completed_body(fence: int, result: Any, absolute: int) -> dict[str, Any]:
    return {
        "ok": True,
        "status": "completed",
        "completed_at": "2026-09-05T10:00:00Z",
        "result": result,
        "fencing_token": fence,
        "absolute_expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(absolute)),
    }


def _mutation(
    kind: str,
    token: str,
    t0: float,
    t1: float | None,
    outcome: str,
    status: int | None,
    body: dict[str, Any] | None,
) -> Op:
    return Op(
        process="p",
        kind=kind,  # type: ignore[arg-type]
        key=K,
        invoke=t0,
        complete=t1 if outcome != "unknown" else None,
        outcome=outcome,  # type: ignore[arg-type]
        status=status if outcome != "unknown" else None,
        body=body if outcome != "unknown" else None,
        token=token,
    )


def run(*ops: Op) -> Check:
    return check(History(list(ops), offset=0.0))


def kinds(result: Check) -> list[str]:
    return sorted({v.kind for v in result.violations})


# -- clean histories -----------------------------------------------------------------------


CLEAN: dict[str, list[Op]] = {
    "one owner through its life": [
        grant("A", 1, 0.0, 0.1, 5),
        renew("A", 1, 1.0, 1.1, 6),
        held(1.5, 1.6, 1),
        release("A", 1, 2.0, 2.1),
        grant("B", 2, 2.5, 2.6, 8),
        complete("B", 2, 3.0, 3.1),
        replay(4.0, 4.1, 2),
        lost("renew", "B", 4.2, 4.3),
        lost("renew", "A", 4.4, 4.5),
    ],
    "a grant just after the reported expiry (real expiry may be up to 1 s later)": [
        grant("A", 1, 0.0, 0.1, 10),
        grant("B", 2, 10.05, 10.2, 20),
    ],
    "a release whose answer was lost ends the proof of ownership where it was sent": [
        grant("A", 1, 0.0, 0.1, 10),
        release("A", 1, 4.0, None, outcome="unknown"),
        grant("B", 2, 5.0, 5.1, 20),
    ],
    "concurrent grants may carry their fences in either order": [
        grant("A", 7, 0.0, 2.0, 2),
        grant("B", 6, 1.0, 3.0, 3),
    ],
    "a renew that may still have been live is not stale": [
        grant("A", 1, 0.0, 0.1, 2),
        renew("A", 1, 2.9, 3.0, 5),
    ],
    "a renew whose answer was lost may have extended the lease": [
        grant("A", 1, 0.0, 0.1, 2),
        renew("A", 1, 1.5, None, 0, outcome="unknown"),
        renew("A", 1, 5.0, 5.1, 9),
    ],
    "a new lifecycle after the old one ended may grant again": [
        grant("A", 1, 0.0, 0.1, 5, absolute=100),
        complete("A", 1, 1.0, 1.1, absolute=100),
        replay(2.0, 2.1, 1, absolute=100),
        grant("B", 2, 101.0, 101.1, 106, absolute=201),
    ],
    "a conflict for another fingerprint after completion is expected": [
        grant("A", 1, 0.0, 0.1, 5),
        complete("A", 1, 1.0, 1.1),
        answer(2.0, 2.1, 409, {"ok": False, "status": "conflict"}, fingerprint="other"),
    ],
    "an acquire whose answer was lost proves nothing": [
        grant("A", 1, 0.0, 0.1, 10),
        grant("X", 0, 1.0, None, 0, outcome="unknown"),
        grant("B", 2, 10.5, 10.6, 20),
    ],
    "keys are independent": [
        grant("A", 1, 0.0, 0.1, 10),
        grant("B", 2, 1.0, 1.1, 10, key="other"),
    ],
    "waiters granted in the order they were sent": [
        grant("H", 1, 0.0, 0.1, 10),
        waiter("A", 2, 1.0, 4.1, 20),
        waiter("B", 3, 3.0, 6.1, 30),
        release("H", 1, 4.0, 4.05),
        release("A", 2, 6.0, 6.05),
    ],
    "waiters at two instances, or sent within the margin, in any order": [
        grant("H", 1, 0.0, 0.1, 10),
        waiter("A", 3, 1.0, 6.1, 30, instance="a"),
        waiter("B", 2, 3.0, 4.1, 20, instance="b"),
        waiter("C", 4, 2.5, 8.1, 40, instance="b"),
        release("H", 1, 4.0, 4.05),
        release("B", 2, 6.0, 6.05),
        release("A", 3, 8.0, 8.05),
    ],
    "a key held by an acquire whose outcome is unknown": [
        grant("X", 0, 1.0, None, 0, outcome="unknown"),
        held(2.0, 2.1, 5),
    ],
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_clean_histories_pass(name: str) -> None:
    """A history that keeps every promise has no violations."""
    result = run(*CLEAN[name])
    assert result.violations == [], [str(v) for v in result.violations]


# -- broken histories: each must be flagged --------------------------------------------------


BROKEN: dict[str, tuple[str, list[Op]]] = {
    "two live owners": (
        "overlap",
        [grant("A", 1, 0.0, 0.1, 10), grant("B", 2, 5.0, 5.1, 20)],
    ),
    "a new owner while a renewed lease is live": (
        "overlap",
        [
            grant("A", 1, 0.0, 0.1, 3),
            renew("A", 1, 2.0, 2.1, 12),
            grant("B", 2, 6.0, 6.1, 20),
        ],
    ),
    "a grant before the reported expiry": (
        "overlap",
        [grant("A", 1, 0.0, 0.1, 10), grant("B", 2, 9.5, 9.6, 20)],
    ),
    "a fence that does not rise": (
        "fence-order",
        [
            grant("A", 5, 0.0, 0.1, 2),
            release("A", 5, 0.5, 0.6),
            grant("B", 3, 5.0, 5.1, 8),
        ],
    ),
    "a fence handed out twice": (
        "fence-order",
        [
            grant("A", 5, 0.0, 0.1, 2),
            release("A", 5, 0.5, 0.6),
            grant("B", 5, 5.0, 5.1, 8),
        ],
    ),
    "a waiter overtaken at one instance": (
        "out-of-order",
        [
            grant("H", 1, 0.0, 0.1, 10),
            waiter("A", 3, 1.0, 6.1, 30),
            waiter("B", 2, 3.0, 4.1, 20),
            release("H", 1, 4.0, 4.05),
            release("B", 2, 6.0, 6.05),
        ],
    ),
    "a renew that changes the fence": (
        "fence-changed",
        [grant("A", 5, 0.0, 0.1, 5), renew("A", 6, 1.0, 1.1, 6)],
    ),
    "a held answer with an older fence": (
        "fence-went-back",
        [grant("A", 5, 0.0, 0.1, 5), held(1.0, 1.1, 3)],
    ),
    "a renew after the lease provably expired": (
        "stale-mutation",
        [grant("A", 1, 0.0, 0.1, 2), renew("A", 1, 3.5, 3.6, 6)],
    ),
    "a complete after the lease provably expired": (
        "stale-mutation",
        [grant("A", 1, 0.0, 0.1, 2), complete("A", 1, 3.5, 3.6)],
    ),
    "a renew after the owner's own release": (
        "stale-mutation",
        [
            grant("A", 1, 0.0, 0.1, 10),
            release("A", 1, 1.0, 1.1),
            renew("A", 1, 1.5, 1.6, 12),
        ],
    ),
    "a release by an owner superseded by a higher fence": (
        "stale-mutation",
        [
            grant("A", 1, 0.0, 0.1, 2),
            grant("B", 2, 3.0, 3.1, 10),
            release("A", 1, 4.0, 4.1),
        ],
    ),
    "a second complete after completion": (
        "stale-mutation",
        [
            grant("A", 1, 0.0, 0.1, 10),
            complete("A", 1, 1.0, 1.1),
            complete("A", 1, 2.0, 2.1, result="again"),
        ],
    ),
    "a new owner after the result was stored": (
        "completed-regranted",
        [
            grant("A", 1, 0.0, 0.1, 10),
            complete("A", 1, 1.0, 1.1),
            grant("B", 2, 2.0, 2.1, 12),
        ],
    ),
    "a result that changes": (
        "completed-changed",
        [
            grant("A", 1, 0.0, 0.1, 10),
            complete("A", 1, 1.0, 1.1, result={"n": 1}),
            replay(2.0, 2.1, 1, result={"n": 2}),
        ],
    ),
    "a key held by a fence no answer granted (a grant answered 503)": (
        "ghost-owner",
        [
            grant("A", 1, 0.0, 0.1, 10),
            release("A", 1, 1.0, 1.1),
            answer(2.0, 2.1, 503, {"ok": False, "status": "unavailable"}),
            held(3.0, 3.1, 2),
        ],
    ),
    "a result that vanishes into held": (
        "completed-lost",
        [grant("A", 1, 0.0, 0.1, 10), complete("A", 1, 1.0, 1.1), held(2.0, 2.1, 1)],
    ),
    "a result that vanishes into a conflict for its own fingerprint": (
        "completed-lost",
        [
            grant("A", 1, 0.0, 0.1, 10),
            complete("A", 1, 1.0, 1.1),
            answer(2.0, 2.1, 409, {"ok": False, "status": "conflict"}),
        ],
    ),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_histories_are_flagged(name: str) -> None:
    """Each hand-written violation is reported under its kind."""
    expected, ops = BROKEN[name]
    result = run(*ops)
    assert expected in kinds(result), [str(v) for v in result.violations]


def test_a_violation_names_its_operations_and_the_summary_counts_it() -> None:
    """A violation carries the operations that prove it; the summary line counts by kind."""
    result = run(grant("A", 1, 0.0, 0.1, 10), grant("B", 2, 5.0, 5.1, 20))
    (violation,) = result.violations
    assert [op.token for op in violation.ops] == ["A", "B"]
    assert result.summary("run") == (
        "run: operations=2 grants=2 completes=0 unknown=0 violations=1 (overlap=1)"
    )


def test_skew_makes_the_checker_more_careful() -> None:
    """A grant 50 ms before the reported expiry is flagged with no skew, not with 100 ms."""
    ops = [grant("A", 1, 0.0, 0.1, 10), grant("B", 2, 9.9, 9.95, 20)]
    assert kinds(check(History(ops, offset=0.0), skew=0.0)) == ["overlap"]
    assert kinds(check(History(ops, offset=0.0), skew=0.1)) == []


def test_histories_round_trip_through_files(tmp_path: Any) -> None:
    """A history written as JSON lines reads back identical, merged from several files."""
    first = History([grant("A", 1, 0.0, 0.1, 10)], offset=0.0)
    second = History([grant("B", 2, 5.0, 5.1, 20)], offset=0.0)
    first.dump(tmp_path / "a.jsonl")
    second.dump(tmp_path / "b.jsonl")
    merged = History.load([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], offset=0.0)
    assert merged.ops == first.ops + second.ops
    assert kinds(check(merged)) == ["overlap"]


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (503, {"ok": False, "status": "unavailable", "error": "x"}, "fail"),
        (
            503,
            {"ok": False, "status": "unavailable", "error": "x", "outcome": "unknown"},
            "unknown",
        ),
        (503, None, "unknown"),  # a proxy's page: not the service's word
        (502, {"ok": False, "status": "unavailable", "error": "x"}, "unknown"),
        (500, {"ok": False, "status": "internal", "error": "x"}, "unknown"),
        (409, {"ok": False, "status": "held", "error": "x"}, "fail"),
    ],
)
def test_the_service_s_503_is_recorded_as_no_effect_unless_its_outcome_is_unknown(
    status: int, body: dict[str, Any] | None, outcome: str
) -> None:
    """A 503 of the service means nothing was written; one saying "outcome": "unknown",
    a 500, or a 5xx that is not the service's may have taken effect."""
    import httpx

    content = b"<html>bad gateway</html>" if body is None else json.dumps(body).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content))
    with httpx.Client(transport=transport) as client:
        op = Recorder("p").call(client, "http://lk.test", "acquire", "k", {"key": "k"})
    assert op.outcome == outcome


# -- recorded through the real HTTP app ------------------------------------------------------


class AmnesiacStore(MemoryStore):
    """A broken store that forgets the key before every acquire: every acquire wins."""

    async def apply(self, command: Command) -> Decision:
        if type(command).__name__ == "Acquire":
            with self._lock:
                self._records.pop(command.key_id, None)
        return await super().apply(command)


class StuckFenceStore(MemoryStore):
    """A broken store whose fencing counter never moves."""

    def _next_fence(self) -> int:
        return 1


def record(store: MemoryStore) -> Check:
    """A short recorded session against the in-process app over ``store``."""
    app = create_app(LeaseService(store), Settings(), run_cleanup=False)
    recorder = Recorder("test")
    url = "http://testserver"
    with TestClient(app) as client:
        ns = client.post(f"{url}/services/v1/lease/namespace").json()["namespace"]
        body = {"namespace": ns, "key": "k", "ttl_seconds": 30, "fingerprint": "f"}
        first = recorder.call(client, url, "acquire", "k", body)
        recorder.call(client, url, "acquire", "k", body)
        token = first.token
        owner = {"namespace": ns, "key": "k", "owner_token": token}
        recorder.call(client, url, "renew", "k", {**owner, "ttl_seconds": 30})
        recorder.call(client, url, "release", "k", owner)
        second = recorder.call(client, url, "acquire", "k", body)
        done = {"namespace": ns, "key": "k", "owner_token": second.token, "result": {"x": 1}}
        recorder.call(client, url, "complete", "k", done)
        recorder.call(client, url, "acquire", "k", body)
    return check(History(recorder.ops))


def test_a_recorded_session_of_the_real_service_is_clean() -> None:
    """Through the real app, an acquire-renew-release-complete session has no violations."""
    result = record(MemoryStore())
    assert result.violations == [], [str(v) for v in result.violations]
    assert (result.operations, result.grants, result.completes) == (7, 2, 1)


@pytest.mark.parametrize(
    ("store", "expected"),
    [(AmnesiacStore, "overlap"), (StuckFenceStore, "fence-order")],
)
def test_a_broken_service_is_caught_from_its_recorded_history(
    store: type[MemoryStore], expected: str
) -> None:
    """A store that forgets leases, or never raises its fence, shows up in the history."""
    assert expected in kinds(record(store()))
