"""A hypothesis state machine: the service must agree with a small model of SPEC.md.

The model below is written from the spec's sentences, independently of
``leasekeeper._core.rules``: it is a second opinion, not a copy. Every step
compares the service's full response with the model's prediction, and the
invariants check the promises users rely on: at most one live owner per key,
fences strictly rising per key, a completed result never lost or changed.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from leasekeeper import FakeClock, LeaseError, LeaseService
from leasekeeper.store import MemoryStore, SqliteStore, Store
from tests.conftest import drop_schema, new_schema_name, postgres_url

NS = "ns_" + "S" * 42 + "A"
KEYS = ["alpha", "beta", "gamma"]
LIFECYCLE_S = 20
FINGERPRINTS = [None, "fp-1", "fp-2"]


@dataclass
class ModelKey:
    fingerprint: str | None
    absolute_ms: int
    fence: int
    owner: str | None
    lease_ms: int
    completed_ms: int | None = None
    result: Any = None


@dataclass
class Model:
    """SPEC.md's lifecycle of a key, in the most direct form."""

    keys: dict[str, ModelKey] = field(default_factory=dict)
    counter: int = 0

    def live(self, key: str, now: int) -> ModelKey | None:
        entry = self.keys.get(key)
        if entry is None or now >= entry.absolute_ms:
            return None
        return entry

    def acquire(self, key: str, fp: str | None, ttl_s: int, now: int) -> tuple[str, ModelKey]:
        entry = self.live(key, now)
        if entry is None:
            self.counter += 1
            absolute = now + LIFECYCLE_S * 1000
            entry = ModelKey(fp, absolute, self.counter, "?", min(now + ttl_s * 1000, absolute))
            self.keys[key] = entry
            return "granted", entry
        if entry.fingerprint != fp:
            return "conflict", entry
        if entry.completed_ms is not None:
            return "completed", entry
        if entry.owner is not None and now < entry.lease_ms:
            return "held", entry
        self.counter += 1
        entry.fence = self.counter
        entry.owner = "?"
        entry.lease_ms = min(now + ttl_s * 1000, entry.absolute_ms)
        return "granted", entry

    def owns(self, key: str, token: str, now: int) -> ModelKey | None:
        entry = self.live(key, now)
        if entry is None or entry.owner != token or now >= entry.lease_ms:
            return None
        return entry


def _outcome(reply_or_error: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(reply_or_error, LeaseError):
        return reply_or_error.status, reply_or_error.body()
    body = reply_or_error.plain()
    return ("granted" if reply_or_error.created else body["status"]), body


class LeaseMachine(RuleBasedStateMachine):
    store_kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(1_788_602_400_000)
        self.tmp = tempfile.TemporaryDirectory()
        self.store = self.make_store()
        self.service = LeaseService(self.store, lifecycle_seconds=LIFECYCLE_S)
        self.loop.run_until_complete(self.service.start())
        self.model = Model()
        self.tokens: dict[str, list[str]] = {key: [] for key in KEYS}
        self.fences: dict[str, list[int]] = {key: [] for key in KEYS}
        self.results: dict[str, tuple[int, Any]] = {}

    def make_store(self) -> Store:
        if self.store_kind == "sqlite":
            return SqliteStore(Path(self.tmp.name) / "machine.db", self.clock)
        return MemoryStore(self.clock)

    def teardown(self) -> None:
        self.loop.run_until_complete(self.service.stop())
        self.loop.close()
        self.tmp.cleanup()

    def call(self, operation: str, **body: Any) -> tuple[str, dict[str, Any]]:
        body = {"namespace": NS, **{k: v for k, v in body.items() if v is not None}}
        try:
            reply: Any = self.loop.run_until_complete(self.service.handle(operation, body))
        except LeaseError as error:
            reply = error
        return _outcome(reply)

    @property
    def now(self) -> int:
        return self.clock.now_ms()

    @initialize()
    def start(self) -> None:
        pass

    @rule(
        key=st.sampled_from(KEYS),
        fp=st.sampled_from(FINGERPRINTS),
        ttl=st.sampled_from([1, 2, 5, 30]),
    )
    def acquire(self, key: str, fp: str | None, ttl: int) -> None:
        now = self.now
        expected, entry = self.model.acquire(key, fp, ttl, now)
        status, body = self.call("acquire", key=key, fingerprint=fp, ttl_seconds=ttl)
        assert status == expected, (status, expected, body)
        if status == "granted":
            entry.owner = body["owner_token"]
            self.tokens[key].append(body["owner_token"])
            assert body["fencing_token"] == entry.fence
            assert body["ttl_seconds"] == (entry.lease_ms - now) // 1000
            assert body["lease_expires_at_timestamp"] == entry.lease_ms // 1000
            assert body["absolute_expires_at_timestamp"] == entry.absolute_ms // 1000
            self.fences[key].append(body["fencing_token"])
        elif status == "held":
            assert body["fencing_token"] == entry.fence
            assert body["retry_after_seconds"] == max(1, -(-(entry.lease_ms - now) // 1000))
        elif status == "completed":
            assert body["result"] == entry.result
            assert body["fencing_token"] == entry.fence
            assert "owner_token" not in body

    def _token(self, key: str, pick: int) -> str:
        tokens = self.tokens[key]
        return tokens[pick % len(tokens)]

    @precondition(lambda self: any(self.tokens.values()))
    @rule(key=st.sampled_from(KEYS), pick=st.integers(-3, 0), ttl=st.sampled_from([1, 3, 10]))
    def renew(self, key: str, pick: int, ttl: int) -> None:
        if not self.tokens[key]:
            return
        token, now = self._token(key, pick), self.now
        entry = self.model.owns(key, token, now)
        status, body = self.call("renew", key=key, owner_token=token, ttl_seconds=ttl)
        if entry is None:
            assert status == "lost", body
            return
        assert status == "held", body
        entry.lease_ms = min(now + ttl * 1000, entry.absolute_ms)
        assert body["fencing_token"] == entry.fence
        assert body["lease_expires_at_timestamp"] == entry.lease_ms // 1000

    @precondition(lambda self: any(self.tokens.values()))
    @rule(key=st.sampled_from(KEYS), pick=st.integers(-3, 0))
    def release(self, key: str, pick: int) -> None:
        if not self.tokens[key]:
            return
        token, now = self._token(key, pick), self.now
        entry = self.model.owns(key, token, now)
        status, body = self.call("release", key=key, owner_token=token)
        if entry is None:
            assert status == "lost", body
            return
        assert status == "released" and body["fencing_token"] == entry.fence
        entry.owner = None

    @precondition(lambda self: any(self.tokens.values()))
    @rule(
        key=st.sampled_from(KEYS),
        pick=st.integers(-3, 0),
        result=st.one_of(st.integers(), st.text(max_size=5), st.none()),
    )
    def complete(self, key: str, pick: int, result: Any) -> None:
        if not self.tokens[key]:
            return
        token, now = self._token(key, pick), self.now
        entry = self.model.owns(key, token, now)
        status, body = self.call("complete", key=key, owner_token=token, result={"r": result})
        if entry is None:
            assert status == "lost", body
            return
        assert status == "completed" and body["result"] == {"r": result}
        entry.owner, entry.completed_ms, entry.result = None, now, {"r": result}
        self.results[key] = (entry.absolute_ms, entry.result)

    @rule(ms=st.integers(0, 4000))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms=ms)

    @rule(key=st.sampled_from(KEYS), lifecycle=st.booleans(), offset=st.sampled_from([-1, 0, 1]))
    def advance_to_boundary(self, key: str, lifecycle: bool, offset: int) -> None:
        """Land exactly on (or 1 ms around) a lease expiry or lifecycle end: the edges."""
        entry = self.model.keys.get(key)
        if entry is None:
            return
        target = (entry.absolute_ms if lifecycle else entry.lease_ms) + offset
        if target > self.now:
            self.clock.set(target)

    @rule()
    def cross_lifecycle(self) -> None:
        self.clock.advance(LIFECYCLE_S / 2)

    @rule()
    def cleanup(self) -> None:
        self.loop.run_until_complete(self.service.cleanup())

    @rule(delta=st.integers(-2, 5))
    def raise_fence(self, delta: int) -> None:
        """An operator raises the counter (or asks for less than it is): never lowered,
        and the model's next grant, one above it, is checked by ``acquire``."""
        target = max(0, self.model.counter + delta)
        counter = self.loop.run_until_complete(self.service.raise_fence(target))
        self.model.counter = max(self.model.counter, target)
        assert counter == self.model.counter

    @invariant()
    def fences_rise_per_key(self) -> None:
        for fences in self.fences.values():
            assert all(a < b for a, b in itertools.pairwise(fences))

    @invariant()
    def only_the_live_owner_owns(self) -> None:
        """At most one live owner per key, by the service's answers: a renew with any
        recent token that the model says owns nothing is lost (which changes nothing)."""
        now = self.now
        for key in KEYS:
            for token in self.tokens[key][-3:]:
                if self.model.owns(key, token, now) is None:
                    status, body = self.call("renew", key=key, owner_token=token, ttl_seconds=1)
                    assert status == "lost", body

    @invariant()
    def completed_results_stay(self) -> None:
        """Until its lifecycle ends, a completed key answers a replay (an acquire with its
        fingerprint, which changes nothing) with its result, whatever ran since."""
        now = self.now
        for key, (absolute, result) in self.results.items():
            if now < absolute:
                entry = self.model.live(key, now)
                assert entry is not None
                status, body = self.call("acquire", key=key, fingerprint=entry.fingerprint)
                assert status == "completed" and body["result"] == result, body


class SqliteLeaseMachine(LeaseMachine):
    store_kind = "sqlite"


class PostgresLeaseMachine(LeaseMachine):
    """The same machine on PostgreSQL: a fresh schema per example, dropped after it."""

    store_kind = "postgres"

    def __init__(self) -> None:
        url = postgres_url()
        if url is None:
            pytest.skip("PostgreSQL tests need LEASEKEEPER_TEST_POSTGRES_URL (make test sets it)")
        self.url, self.schema = url, new_schema_name()
        super().__init__()

    def make_store(self) -> Store:
        from leasekeeper.store._postgres import PostgresStore

        return PostgresStore(
            self.url, clock=self.clock, schema=self.schema, application_name=self.schema
        )

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            drop_schema(self.url, self.schema)


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemoryMachine = LeaseMachine.TestCase
TestMemoryMachine.settings = _settings
TestSqliteMachine = SqliteLeaseMachine.TestCase
TestSqliteMachine.settings = _settings
TestPostgresMachine = pytest.mark.postgres(PostgresLeaseMachine.TestCase)
TestPostgresMachine.settings = _settings
