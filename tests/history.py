"""Client-side histories of lease operations, and a checker for leasekeeper's promises.

A *history* is every operation clients sent, each with the monotonic time it was
invoked, the time its answer arrived, and what the answer was. The checker reads a
merged history (several threads and processes) and reports, per key, every place
where the service provably broke one of its promises:

``overlap``
    two owners' leases were live at one instant;
``fence-order``
    a grant acknowledged before another grant was invoked does not have a lower
    fencing token, or two grants of one key share a token;
``fence-changed``
    a renew, release or complete answered with another fence than its owner's grant;
``fence-went-back``
    a ``held`` or ``completed`` answer shows a fence lower than one already granted;
``ghost-owner``
    a ``held`` or ``completed`` answer shows a fence that no acquire of the key was
    granted in an answer, while no acquire whose outcome is unknown had been sent: a
    lease granted to a request answered 503 (which says nothing was written);
``stale-mutation``
    a renew, release or complete was accepted from an owner that had provably lost
    the lease: it had expired, it was released or completed, or a newer owner (a
    higher fence) had been acknowledged;
``completed-regranted`` / ``completed-lost`` / ``completed-changed``
    within a lifecycle, after a result was acknowledged, an acquire got a new owner,
    got ``held`` (or a ``conflict`` for the same fingerprint), or a different result;
``out-of-order``
    two waiting acquires (``wait_seconds`` > 0) sent to one instance were both
    granted, the one sent at least ``ARRIVAL_MARGIN`` seconds earlier after the
    other (a lower fence): waiters at one instance are served in arrival order.

How time is read (the assumptions; each makes the checker *conservative*: it flags
only what is certain under them, so a clean history proves nothing more than that
no break was observable, and a flagged one is a real break)::

    client A   |--acquire--|                        |--renew--|
    server          ^ decided somewhere in here          ^ ...
    lease                  [====== provably live =====)
                    ^ invoke   ^ complete        T - offset - skew
                                                 (T = reported expiry, whole seconds)

1. Client times are ``time.monotonic()`` seconds. On one host every process shares
   that clock (Linux ``CLOCK_MONOTONIC``), so merged histories order correctly.
2. An operation takes effect at one instant between its invocation and its
   completion. One whose answer was lost (timeout, connection dropped), or answered
   a 5xx that is not the service's 503 saying nothing was written (a 500, a 503 with
   ``"outcome": "unknown"``, a proxy's page) is ``unknown``: it may have taken effect
   at any instant after its invocation, or never. One refused before it was sent
   (connection refused), answered 4xx, or answered the service's plain 503 had no
   effect (the contract: a 503 means nothing was written).
3. The server's clock is wall-clock time; ``offset`` (``time.time() -
   time.monotonic()`` on the recording host) maps server seconds into the
   clients' monotonic frame, and the two clocks agree to within ``skew`` seconds
   (same host, no clock steps during the run).
4. A reported expiry ``*_timestamp`` (or ``*_at``) ``T`` is the real expiry rounded
   down: the real one lies in ``[T, T + 1)``. So a lease acknowledged by an answer
   that arrived at ``c`` is provably live during ``[c, T - offset - skew)``,
   unless another operation of the same owner (renew, release, complete) that
   succeeded or might have may have changed it: the window then ends where that
   operation was invoked. A lease has provably expired after
   ``T + 1 - offset + skew`` for the latest expiry any operation of its owner that
   succeeded (or might have, which has no upper bound) could have set.
5. Lifecycles end at the reported ``absolute_expires_at`` (rounded down, so the real
   end is no earlier): an acquire that completed before ``A - offset - skew`` was
   decided inside the lifecycle that ends at ``A``.
6. A request reaches its instance, and waits there if it must, within
   ``ARRIVAL_MARGIN`` seconds of its invocation (the one assumption that is not
   certain: a stalled client or a slow first decision could break it; 1 s is far
   beyond what loopback runs show).
7. Owner tokens identify owners: the grant that returned a token is that owner's
   start, and only requests carrying the token act for it. An acquire whose
   answer was lost created an owner nobody knows; it can hide breaks, never
   invent one.
"""

from __future__ import annotations

import bisect
import calendar
import json
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx

Kind = Literal["acquire", "renew", "release", "complete"]
Outcome = Literal["ok", "fail", "unknown"]
INF = math.inf
#: Seconds by which a request is surely queued at its instance after it was sent.
ARRIVAL_MARGIN = 1.0

__all__ = [
    "Check",
    "History",
    "Op",
    "Recorder",
    "Violation",
    "check",
]


@dataclass(frozen=True, slots=True)
class Op:
    """One client operation and what became of it."""

    process: str
    kind: Kind
    #: The lease key's identity in this history (a namespace label and the key).
    key: str
    invoke: float
    #: When the answer arrived; None when it never did (``unknown``).
    complete: float | None
    outcome: Outcome
    status: int | None = None
    body: Mapping[str, Any] | None = None
    #: The owner token sent (renew, release, complete) or granted (acquire, 201).
    token: str | None = None
    ttl: int | None = None
    fingerprint: str | None = None
    #: The result a complete submitted (to recognise it when its answer was lost).
    result: Any = None
    #: An acquire's ``wait_seconds``, and the instance (base URL) it was sent to.
    wait: int | None = None
    instance: str | None = None

    @property
    def end(self) -> float:
        """The latest instant this operation may have taken effect."""
        if self.outcome == "unknown" or self.complete is None:
            return INF
        return self.complete

    @property
    def fence(self) -> int | None:
        value = (self.body or {}).get("fencing_token")
        return value if isinstance(value, int) else None

    @property
    def granted(self) -> bool:
        return self.kind == "acquire" and self.outcome == "ok" and self.status == 201

    @property
    def completed_answer(self) -> bool:
        """A 200 ``completed`` answer (an acquire that found a result, or a complete)."""
        return (
            self.outcome == "ok"
            and self.status == 200
            and (self.body or {}).get("status") == "completed"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Op:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    key: str
    message: str
    ops: tuple[Op, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind} on {self.key}: {self.message}"


@dataclass
class Check:
    """What the checker found: counts for the summary line, and every violation."""

    operations: int = 0
    grants: int = 0
    completes: int = 0
    unknown: int = 0
    violations: list[Violation] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        kinds: dict[str, int] = defaultdict(int)
        for violation in self.violations:
            kinds[violation.kind] += 1
        return dict(sorted(kinds.items()))

    def summary(self, label: str) -> str:
        """One line: the run, its figures and the violation counts (0 when clean)."""
        counts = self.counts()
        shown = ", ".join(f"{k}={v}" for k, v in counts.items()) if counts else "none"
        return (
            f"{label}: operations={self.operations} grants={self.grants} "
            f"completes={self.completes} unknown={self.unknown} "
            f"violations={len(self.violations)} ({shown})"
        )


@dataclass
class History:
    """Operations from any number of clients, and the clock offset to read server times."""

    ops: list[Op] = field(default_factory=list)
    #: ``time.time() - time.monotonic()`` on the recording host.
    offset: float = field(default_factory=lambda: time.time() - time.monotonic())

    def extend(self, ops: Iterable[Op]) -> None:
        self.ops.extend(ops)

    def dump(self, path: Path) -> None:
        with path.open("w") as sink:
            for op in self.ops:
                sink.write(json.dumps(op.to_json()) + "\n")

    @classmethod
    def load(cls, paths: Iterable[Path], offset: float) -> History:
        ops = [
            Op.from_json(json.loads(line))
            for path in paths
            for line in path.read_text().splitlines()
            if line
        ]
        return cls(ops, offset)


class Recorder:
    """Sends lease requests with an ``httpx.Client`` and records each as an ``Op``.

    Thread-safe: worker threads share one recorder. ``ops`` is the history so far.
    """

    def __init__(self, process: str) -> None:
        self.process = process
        self.ops: list[Op] = []
        self._lock = threading.Lock()

    def call(
        self,
        client: httpx.Client,
        url: str,
        kind: Kind,
        key: str,
        body: Mapping[str, Any],
    ) -> Op:
        """POST ``body`` to the ``kind`` route under ``url`` and record what happened."""
        route = "/lease" if kind == "acquire" else f"/lease/{kind}"
        invoke = time.monotonic()
        try:
            response = client.post(f"{url}/services/v1{route}", json=dict(body))
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
            # Never sent: no effect.
            op = self._op(kind, key, body, invoke, time.monotonic(), "fail", None, None)
        except httpx.TransportError:
            # Sent, answer lost: it may or may not have taken effect.
            op = self._op(kind, key, body, invoke, None, "unknown", None, None)
        else:
            complete = time.monotonic()
            try:
                parsed = response.json()
            except ValueError:
                parsed = None
            code = response.status_code
            outcome: Outcome = "ok" if code < 300 else "fail" if code < 500 else "unknown"
            if code == 503 and _nothing_written(parsed):
                outcome = "fail"
            op = self._op(kind, key, body, invoke, complete, outcome, code, parsed)
        op = replace(op, wait=body.get("wait_seconds"), instance=url)
        with self._lock:
            self.ops.append(op)
        return op

    def _op(
        self,
        kind: Kind,
        key: str,
        body: Mapping[str, Any],
        invoke: float,
        complete: float | None,
        outcome: Outcome,
        status: int | None,
        parsed: Any,
    ) -> Op:
        token = body.get("owner_token")
        if kind == "acquire" and status == 201 and isinstance(parsed, dict):
            token = parsed.get("owner_token")
        return Op(
            process=self.process,
            kind=kind,
            key=key,
            invoke=invoke,
            complete=complete,
            outcome=outcome,
            status=status,
            body=parsed if isinstance(parsed, dict) else None,
            token=token,
            ttl=body.get("ttl_seconds"),
            fingerprint=body.get("fingerprint"),
            result=body.get("result"),
        )


def _nothing_written(body: Any) -> bool:
    """Whether a 503's body is the service's saying nothing was written: ``unavailable``,
    without ``"outcome": "unknown"``."""
    return (
        isinstance(body, dict)
        and body.get("status") == "unavailable"
        and body.get("outcome") != "unknown"
    )


# -- the checker ---------------------------------------------------------------------------


def check(history: History, *, skew: float = 0.1) -> Check:
    """Check ``history`` (see the module docstring for what and how)."""
    result = Check(operations=len(history.ops))
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in history.ops:
        by_key[op.key].append(op)
        result.grants += op.granted
        result.completes += op.kind == "complete" and op.outcome == "ok"
        result.unknown += op.outcome == "unknown"
    for key in sorted(by_key):
        ops = sorted(by_key[key], key=lambda op: op.invoke)
        _Key(key, ops, history.offset, skew, result.violations).run()
    return result


def _timestamp(value: Any) -> float | None:
    """Seconds from an ``*_timestamp`` integer or an ``*_at`` ISO string."""
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        return float(calendar.timegm(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")))
    return None


class _Key:
    """The checks for one key's operations (sorted by invocation)."""

    def __init__(
        self, key: str, ops: list[Op], offset: float, skew: float, out: list[Violation]
    ) -> None:
        self.key = key
        self.ops = ops
        self.offset = offset
        self.skew = skew
        self.out = out
        self.grants = [op for op in ops if op.granted and op.token and op.fence is not None]
        self.grant_of: dict[str, Op] = {op.token: op for op in self.grants if op.token}
        self.by_token: dict[str, list[Op]] = defaultdict(list)
        for op in ops:
            if op.kind != "acquire" and op.token:
                self.by_token[op.token].append(op)
        # Grants by completion time, with the highest fence acknowledged so far.
        self.acked = sorted(self.grants, key=lambda op: op.end)
        self.acked_ends = [op.end for op in self.acked]
        self.max_fence_so_far: list[int] = []
        highest = 0
        for op in self.acked:
            highest = max(highest, op.fence or 0)
            self.max_fence_so_far.append(highest)

    def flag(self, kind: str, message: str, *ops: Op) -> None:
        self.out.append(Violation(kind, self.key, message, ops))

    def run(self) -> None:
        self.check_fences()
        self.check_overlap()
        self.check_stale_mutations()
        self.check_completed()
        self.check_arrival_order()

    def check_arrival_order(self) -> None:
        """Waiters granted at one instance in the order they were sent (``out-of-order``)."""
        waiters: dict[str, list[Op]] = defaultdict(list)
        for grant in self.grants:
            if grant.wait and grant.instance is not None:
                waiters[grant.instance].append(grant)
        for grants in waiters.values():
            for later in grants:
                for earlier in grants:
                    if earlier.invoke + ARRIVAL_MARGIN >= later.invoke:
                        break  # sorted by invocation: the rest were sent later still
                    if (earlier.fence or 0) > (later.fence or 0):
                        self.flag(
                            "out-of-order",
                            f"a waiter sent {later.invoke - earlier.invoke:.2f} s earlier was "
                            f"granted fence {earlier.fence} after fence {later.fence}",
                            earlier,
                            later,
                        )

    # -- server seconds in the clients' frame --------------------------------------------

    def live_until(self, server_seconds: float) -> float:
        """The monotonic instant until which server time is surely before ``server_seconds``."""
        return server_seconds - self.offset - self.skew

    def over_after(self, server_seconds: float) -> float:
        """The first monotonic instant from which server time is surely past ``server_seconds``."""
        return server_seconds - self.offset + self.skew

    def highest_fence_before(self, instant: float) -> tuple[int, Op | None]:
        """The highest fence among grants acknowledged before ``instant``."""
        index = bisect.bisect_left(self.acked_ends, instant)
        if index == 0:
            return 0, None
        best = self.max_fence_so_far[index - 1]
        witness = next(op for op in self.acked[:index] if op.fence == best)
        return best, witness

    # -- fences ----------------------------------------------------------------------------

    def check_fences(self) -> None:
        seen: dict[int, Op] = {}
        for grant in self.grants:
            fence = grant.fence or 0
            if fence in seen and seen[fence].token != grant.token:
                self.flag("fence-order", f"two grants share fence {fence}", seen[fence], grant)
            seen.setdefault(fence, grant)
            before, witness = self.highest_fence_before(grant.invoke)
            if witness is not None and fence <= before:
                self.flag(
                    "fence-order",
                    f"grant with fence {fence} after a grant with fence {before} was acknowledged",
                    witness,
                    grant,
                )
        for op in self.ops:
            if op.outcome != "ok" or op.fence is None:
                continue
            owner = self.grant_of.get(op.token or "")
            if op.kind != "acquire" and owner is not None and owner.fence != op.fence:
                self.flag(
                    "fence-changed",
                    f"{op.kind} answered fence {op.fence}, its grant had {owner.fence}",
                    owner,
                    op,
                )
        granted = {grant.fence for grant in self.grants}
        unknown = [op.invoke for op in self.ops if op.kind == "acquire" and op.outcome == "unknown"]
        first_unknown = min(unknown, default=INF)
        for op in self.ops:
            shows_current = op.completed_answer or (
                op.kind == "acquire"
                and op.status == 409
                and (op.body or {}).get("status") == "held"
            )
            if not shows_current or op.fence is None:
                continue
            if op.fence not in granted and op.end <= first_unknown:
                self.flag(
                    "ghost-owner",
                    f"{op.kind} showed fence {op.fence}, which no acquire was granted in an "
                    "answer, and no acquire whose outcome is unknown was sent before",
                    op,
                )
            before, witness = self.highest_fence_before(op.invoke)
            if witness is not None and op.fence < before:
                self.flag(
                    "fence-went-back",
                    f"{op.kind} showed fence {op.fence} after fence {before} was granted",
                    witness,
                    op,
                )

    # -- ownership windows -----------------------------------------------------------------

    def windows(self, token: str) -> list[tuple[float, float, Op]]:
        """Intervals during which ``token``'s lease was provably live."""
        grant = self.grant_of[token]
        mutations = self.by_token.get(token, [])
        starts = [grant] + [
            op for op in mutations if op.kind == "renew" and op.outcome == "ok" and op.status == 200
        ]
        found = []
        for start in starts:
            expiry = _timestamp((start.body or {}).get("lease_expires_at_timestamp"))
            if expiry is None or start.complete is None:
                continue
            end = self.live_until(expiry)
            for other in mutations:
                if other is start or other.outcome == "fail":
                    continue
                if other.end > start.invoke:  # it may have taken effect after ``start``
                    end = min(end, other.invoke)
            if end > start.complete:
                found.append((start.complete, end, start))
        found.sort(key=lambda w: w[0])
        merged: list[tuple[float, float, Op]] = []
        for window in found:
            if merged and window[0] <= merged[-1][1]:
                last = merged[-1]
                merged[-1] = (last[0], max(last[1], window[1]), last[2])
            else:
                merged.append(window)
        return merged

    def check_overlap(self) -> None:
        every = [w for token in self.grant_of for w in self.windows(token)]
        every.sort(key=lambda w: w[0])
        reach: tuple[float, float, Op] | None = None
        for window in every:
            if reach is not None and window[0] < reach[1]:
                self.flag(
                    "overlap",
                    f"fence {window[2].fence} was live while fence {reach[2].fence} still was",
                    reach[2],
                    window[2],
                )
            if reach is None or window[1] > reach[1]:
                reach = window

    # -- stale owners ----------------------------------------------------------------------

    def expiry_bound(self, token: str, mutation: Op) -> float:
        """The latest instant ``token``'s lease may have lasted, as seen by ``mutation``."""
        grant = self.grant_of[token]
        bound = -INF
        for op in [grant, *self.by_token.get(token, [])]:
            if op is mutation or op.kind not in ("acquire", "renew") or op.outcome == "fail":
                continue
            if op.invoke >= mutation.end:  # invoked after the mutation: cannot precede it
                continue
            if op.outcome == "unknown":
                return INF
            expiry = _timestamp((op.body or {}).get("lease_expires_at_timestamp"))
            if expiry is None:
                return INF
            bound = max(bound, self.over_after(expiry + 1))
        return bound

    def check_stale_mutations(self) -> None:
        for op in self.ops:
            if op.kind == "acquire" or op.outcome != "ok" or not op.token:
                continue
            grant = self.grant_of.get(op.token)
            if grant is None:
                continue
            newer = [
                g for g in self.grants if (g.fence or 0) > (grant.fence or 0) and g.end < op.invoke
            ]
            if newer:
                self.flag(
                    "stale-mutation",
                    f"{op.kind} by fence {grant.fence} accepted after fence {newer[0].fence} "
                    "was granted",
                    newer[0],
                    op,
                )
                continue
            ended = [
                m
                for m in self.by_token[op.token]
                if m.kind in ("release", "complete") and m.outcome == "ok" and m.end < op.invoke
            ]
            if ended:
                self.flag(
                    "stale-mutation",
                    f"{op.kind} accepted after the owner's {ended[0].kind} was acknowledged",
                    ended[0],
                    op,
                )
                continue
            bound = self.expiry_bound(op.token, op)
            if op.invoke > bound:
                self.flag(
                    "stale-mutation",
                    f"{op.kind} by fence {grant.fence} accepted "
                    f"{op.invoke - bound:.3f} s after its lease had provably expired",
                    grant,
                    op,
                )

    # -- completed results -----------------------------------------------------------------

    def check_completed(self) -> None:
        lifecycles: dict[float, list[Op]] = defaultdict(list)
        for op in self.ops:
            if op.completed_answer:
                end = _timestamp((op.body or {}).get("absolute_expires_at"))
                if end is not None:
                    lifecycles[end].append(op)
        for end, seen in lifecycles.items():
            first = min(seen, key=lambda op: op.end)
            reference = _result_identity(first)
            for op in seen:
                if _result_identity(op) != reference:
                    self.flag(
                        "completed-changed",
                        f"completed answers in one lifecycle differ ({op.kind} vs {first.kind})",
                        first,
                        op,
                    )
            fingerprint = self._completer_fingerprint(first)
            inside = self.live_until(end)
            for op in self.ops:
                if op.kind != "acquire" or op.invoke <= first.end or op.complete is None:
                    continue
                if op.complete >= inside or op.outcome == "unknown":
                    continue
                body = op.body or {}
                status = body.get("status")
                if op.status == 201:
                    self.flag(
                        "completed-regranted", "a new owner after the result was stored", first, op
                    )
                elif op.status == 409 and status == "held":
                    self.flag("completed-lost", "held after the result was stored", first, op)
                elif op.status == 409 and status == "conflict" and op.fingerprint == fingerprint:
                    self.flag(
                        "completed-lost", "conflict for the fingerprint of the result", first, op
                    )
                elif op.completed_answer and _timestamp(body.get("absolute_expires_at")) != end:
                    self.flag("completed-lost", "another lifecycle inside this one", first, op)

    def _completer_fingerprint(self, answer: Op) -> str | Literal[False] | None:
        """The fingerprint the lifecycle is bound to, if this history shows it (else False)."""
        if answer.kind == "complete" and answer.token in self.grant_of:
            return self.grant_of[answer.token].fingerprint
        if answer.kind == "acquire":
            return answer.fingerprint
        return False


def _result_identity(op: Op) -> tuple[str, Any, Any]:
    body = op.body or {}
    return (
        json.dumps(body.get("result"), sort_keys=False),
        body.get("fencing_token"),
        body.get("completed_at"),
    )
