"""SPEC.md's Transport, Values, Lifecycle and Operations, sentence by sentence, over HTTP."""

from __future__ import annotations

import asyncio
import base64
import re
import secrets
import uuid
from typing import Any

import pytest

from leasekeeper import FakeClock
from leasekeeper._core import secrets as core_secrets
from tests.conftest import Api, ApiFactory

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\Z")
GRANTED_KEYS = {
    "ok",
    "status",
    "owner_token",
    "ttl_seconds",
    "fencing_token",
    "lease_expires_at_timestamp",
    "lease_expires_at",
    "absolute_expires_at_timestamp",
    "absolute_expires_at",
}
HELD_KEYS = {
    "ok",
    "status",
    "error",
    "retry_after_seconds",
    "fencing_token",
    "lease_expires_at",
    "absolute_expires_at",
}
COMPLETED_KEYS = {"ok", "status", "completed_at", "result", "fencing_token", "absolute_expires_at"}
KEY = "invoice:2026-09-05"
DAY = 86_400


def granted(response: Any) -> dict[str, Any]:
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == GRANTED_KEYS
    assert body["ok"] is True and body["status"] == "held"
    return body


def error(response: Any, code: int, status: str) -> dict[str, Any]:
    assert response.status_code == code, response.text
    body: dict[str, Any] = response.json()
    assert body["ok"] is False and body["status"] == status
    assert isinstance(body["error"], str) and body["error"]
    return body


class TestNamespace:
    def test_mint(self, api: Api) -> None:
        """Minting returns 201 with ns_ + 43 base64url characters and 256 entropy bits."""
        response = api.post("/lease/namespace", {})
        assert response.status_code == 201
        body = response.json()
        assert set(body) == {"ok", "namespace", "entropy_bits"}
        assert body["ok"] is True and body["entropy_bits"] == 256
        assert re.fullmatch(r"ns_[A-Za-z0-9_-]{43}", body["namespace"])
        assert len(base64.urlsafe_b64decode(body["namespace"][3:] + "=")) == 32

    def test_mints_differ_and_nothing_is_stored(self, make_api: ApiFactory) -> None:
        """Each mint is new, and the store keeps nothing for it."""
        api = make_api("memory")
        minted = {api.namespace() for _ in range(20)}
        assert len(minted) == 20
        assert api.service.store.records() == {}  # type: ignore[attr-defined]

    def test_an_empty_body_also_mints(self, api: Api) -> None:
        """curl -X POST with no body mints too."""
        assert api.post("/lease/namespace", content=b"").status_code == 201

    def test_any_well_formed_namespace_is_accepted(self, api: Api) -> None:
        """A namespace the service never minted works: nothing is kept at mint time."""
        ns = "ns_" + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
        granted(api.acquire(namespace=ns, key=KEY))

    @pytest.mark.parametrize(
        "bad",
        ["ns_short", "xx_" + "A" * 43, "ns_" + "A" * 42 + "B", 5, True, ["ns_"], ""],
    )
    def test_malformed_namespace_is_invalid(self, api: Api, bad: Any) -> None:
        """A malformed namespace is 400 invalid, and the message does not echo it."""
        body = error(api.acquire(namespace=bad, key=KEY), 400, "invalid")
        assert "namespace" in body["error"]
        if isinstance(bad, str) and bad:
            assert bad not in body["error"]


class TestKeys:
    @pytest.mark.parametrize("key", ["k", "x" * 200, "Rechnung:ä€ 2026/09", "a b\tc"[:3]])
    def test_readable_keys_in_a_namespace(self, api: Api, ns: str, key: str) -> None:
        """With a namespace any 1-200 character key without control characters works."""
        granted(api.acquire(namespace=ns, key=key))

    @pytest.mark.parametrize("key", ["", "x" * 201, "a\nb", "a\x00b", "a\x7fb", "a\x85b"])
    def test_bad_keys_in_a_namespace(self, api: Api, ns: str, key: str) -> None:
        """Empty, over 200 characters, or with control characters: 400 invalid."""
        body = error(api.acquire(namespace=ns, key=key), 400, "invalid")
        assert "key" in body["error"]

    @pytest.mark.parametrize(
        "key",
        [str(uuid.uuid4()), secrets.token_urlsafe(32), secrets.token_hex(32)],
    )
    def test_random_keys_without_a_namespace(self, api: Api, key: str) -> None:
        """uuid4, token_urlsafe(32) and token_hex(32) work without a namespace."""
        granted(api.acquire(key=key))

    @pytest.mark.parametrize("key", ["a" * 40, "order-0000000000000000000000000001", "short"])
    def test_guessable_keys_without_a_namespace(self, api: Api, key: str) -> None:
        """Guessable keys without a namespace are refused with advice, not echoed."""
        body = error(api.acquire(key=key), 400, "invalid")
        assert "uuid" in body["error"] and "namespace" in body["error"]
        assert key not in body["error"]

    def test_same_key_in_two_namespaces_is_independent(self, api: Api) -> None:
        """The same key in two namespaces is two different leases."""
        granted(api.acquire(namespace=api.namespace(), key=KEY))
        granted(api.acquire(namespace=api.namespace(), key=KEY))

    def test_stored_digests_are_keyed_by_the_namespace_secret(self, make_api: ApiFactory) -> None:
        """At rest, a key in a namespace and its fingerprint are digests keyed by the
        namespace secret: keyed by the readable key instead, a fingerprint could be
        guessed from the database by anyone who can guess the key."""
        api = make_api("memory")
        ns = api.namespace()
        granted(api.acquire(namespace=ns, key=KEY, fingerprint="fp-1"))
        secret = core_secrets.parse_namespace(ns)
        key_id = core_secrets.key_id(secret, KEY)
        (record,) = api.service.store.records().values()  # type: ignore[attr-defined]
        assert record.key_id == key_id
        assert record.fingerprint == core_secrets.fingerprint_digest(secret, KEY, key_id, "fp-1")


class TestFieldRules:
    @pytest.mark.parametrize("ttl", [0, 86_401, -1, True, False, 1.5, 60.0, "60", [60], {}])
    def test_bad_ttl_is_invalid(self, api: Api, ns: str, ttl: Any) -> None:
        """ttl_seconds is a JSON integer 1..86400: no floats, strings or booleans."""
        body = error(api.acquire(namespace=ns, key=KEY, ttl_seconds=ttl), 400, "invalid")
        assert "ttl_seconds" in body["error"]

    @pytest.mark.parametrize("wait", [-1, 61, True, False, 1.5, 0.0, "5", [5], {}])
    def test_bad_wait_is_invalid(self, api: Api, ns: str, wait: Any) -> None:
        """wait_seconds is a JSON integer 0..60: no floats, strings or booleans."""
        body = error(api.acquire(namespace=ns, key=KEY, wait_seconds=wait), 400, "invalid")
        assert body["error"] == "Invalid wait_seconds: must be a JSON integer from 0 to 60"

    @pytest.mark.parametrize("wait", [0, 60, None])
    def test_wait_on_a_free_key_is_a_plain_acquire(self, api: Api, ns: str, wait: Any) -> None:
        """On a key nobody holds, wait_seconds (0, 60 or null) changes nothing: 201 at once."""
        assert granted(api.acquire(namespace=ns, key=KEY, wait_seconds=wait))["fencing_token"]

    @pytest.mark.parametrize("ttl", [1, 86_400])
    def test_ttl_bounds_are_inclusive(self, api: Api, ns: str, ttl: int) -> None:
        """1 and 86400 are accepted and granted in full."""
        assert granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=ttl))["ttl_seconds"] == ttl

    def test_ttl_defaults_to_60(self, api: Api, ns: str) -> None:
        """Without ttl_seconds (or with null) a lease lasts 60 seconds."""
        assert granted(api.acquire(namespace=ns, key="a"))["ttl_seconds"] == 60
        assert granted(api.acquire(namespace=ns, key="b", ttl_seconds=None))["ttl_seconds"] == 60

    @pytest.mark.parametrize("fp", ["", "x" * 1025, 5, True, {"a": 1}])
    def test_bad_fingerprint_is_invalid(self, api: Api, ns: str, fp: Any) -> None:
        """fingerprint is a string of 1 to 1024 characters."""
        body = error(api.acquire(namespace=ns, key=KEY, fingerprint=fp), 400, "invalid")
        assert "fingerprint" in body["error"]

    def test_fingerprint_of_1024_characters(self, api: Api, ns: str) -> None:
        """1024 characters is the longest fingerprint."""
        granted(api.acquire(namespace=ns, key=KEY, fingerprint="f" * 1024))

    @pytest.mark.parametrize(
        "token",
        ["own_short", "own_" + "A" * 44, "own_" + "A" * 43 + "\n", "xyz_" + "A" * 43, 7, None],
    )
    def test_malformed_owner_token_is_invalid(self, api: Api, ns: str, token: Any) -> None:
        """A malformed owner token is 400 invalid before any lease is looked at."""
        granted(api.acquire(namespace=ns, key=KEY))
        body = error(api.renew(namespace=ns, key=KEY, owner_token=token), 400, "invalid")
        assert "owner_token" in body["error"]

    def test_missing_and_unknown_fields(self, api: Api, ns: str) -> None:
        """Missing required fields are named; an unknown field (a typo) is refused with
        the fields the request takes."""
        assert "key" in error(api.acquire(namespace=ns), 400, "invalid")["error"]
        body = error(api.acquire(namespace=ns, key=KEY, fingerprnt="x"), 400, "invalid")
        assert "fingerprnt" not in body["error"]
        assert body["error"].endswith(
            "takes namespace, key, ttl_seconds, fingerprint, wait_seconds"
        )
        complete = api.complete(namespace=ns, key=KEY, owner_token="own_" + "A" * 43)
        assert "result" in error(complete, 400, "invalid")["error"]


class TestAcquire:
    def test_first_acquisition(self, api: Api, ns: str, clock: FakeClock) -> None:
        """201 held with a secret owner token, a fence, and expiries in both forms."""
        body = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=60, fingerprint="fp"))
        now = clock.now_ms() // 1000
        assert re.fullmatch(r"own_[A-Za-z0-9_-]{43}", body["owner_token"])
        assert body["ttl_seconds"] == 60
        assert isinstance(body["fencing_token"], int) and 0 < body["fencing_token"] < 2**63
        assert body["lease_expires_at_timestamp"] == now + 60
        assert body["absolute_expires_at_timestamp"] == now + DAY
        # The seed's own example instant: 2026-09-05T10:00:00Z.
        assert body["lease_expires_at"] == "2026-09-05T10:01:00Z"
        assert body["absolute_expires_at"] == "2026-09-06T10:00:00Z"

    def test_acquire_alias(self, api: Api, ns: str) -> None:
        """POST /lease/acquire is the same operation as POST /lease."""
        granted(api.post("/lease/acquire", {"namespace": ns, "key": KEY}))
        error(api.post("/lease/acquire", {"namespace": ns, "key": KEY}), 409, "held")
        error(api.post("/lease", {"namespace": ns, "key": KEY}), 409, "held")

    def test_held(self, api: Api, ns: str, clock: FakeClock) -> None:
        """A live lease: 409 held with Retry-After, the fence, and no owner token."""
        first = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=60))
        clock.advance(16.5)
        response = api.acquire(namespace=ns, key=KEY)
        body = error(response, 409, "held")
        assert set(body) == HELD_KEYS
        assert body["error"] == "Lease is held"
        assert body["retry_after_seconds"] == 44  # 43.5 s left, rounded up
        assert response.headers["retry-after"] == "44"
        assert body["fencing_token"] == first["fencing_token"]
        assert body["lease_expires_at"] == first["lease_expires_at"]
        assert body["absolute_expires_at"] == first["absolute_expires_at"]
        assert first["owner_token"] not in response.text

    def test_retry_after_is_at_least_one(self, api: Api, ns: str, clock: FakeClock) -> None:
        """With 100 ms left the wait is reported as 1 second."""
        granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=1))
        clock.advance(0.9)
        response = api.acquire(namespace=ns, key=KEY)
        assert error(response, 409, "held")["retry_after_seconds"] == 1
        assert response.headers["retry-after"] == "1"

    def test_expiry_rounds_down(self, api: Api, ns: str, clock: FakeClock) -> None:
        """An expiry at x.7 s is reported as x: never later than the real one."""
        clock.advance(0.7)
        body = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=10))
        real_expiry_ms = clock.now_ms() + 10_000
        assert body["lease_expires_at_timestamp"] == real_expiry_ms // 1000
        assert body["lease_expires_at_timestamp"] * 1000 < real_expiry_ms

    def test_every_time_off_a_whole_second_rounds_down(
        self, api: Api, ns: str, clock: FakeClock
    ) -> None:
        """Every *_at is its instant rounded down to the second, as its *_timestamp is:
        absolute_expires_at in granted, held, completed and conflict answers, and
        completed_at (the fake clock starts on a whole second: moved off it first)."""
        clock.advance(0.7)
        lease = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        day_later = "2026-09-06T10:00:00Z"
        assert lease["absolute_expires_at"] == day_later
        held = error(api.acquire(namespace=ns, key=KEY, fingerprint="a"), 409, "held")
        assert held["absolute_expires_at"] == day_later
        clock.advance(0.2)  # 10:00:00.9
        token = lease["owner_token"]
        done = api.complete(namespace=ns, key=KEY, owner_token=token, result=1).json()
        assert done["completed_at"] == "2026-09-05T10:00:00Z"
        assert done["absolute_expires_at"] == day_later
        conflict = error(api.acquire(namespace=ns, key=KEY, fingerprint="b"), 409, "conflict")
        assert conflict["absolute_expires_at"] == day_later

    def test_expired_lease_goes_to_a_new_owner(self, api: Api, ns: str, clock: FakeClock) -> None:
        """After expiry the next acquire is 201 with a higher fence in the same lifecycle."""
        first = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=5))
        clock.advance(5)
        second = granted(api.acquire(namespace=ns, key=KEY))
        assert second["fencing_token"] > first["fencing_token"]
        assert second["owner_token"] != first["owner_token"]
        assert second["absolute_expires_at"] == first["absolute_expires_at"]

    def test_fingerprint_conflict(self, api: Api, ns: str) -> None:
        """A different fingerprint is 409 conflict with the lifecycle end and nothing else."""
        first = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        for other in ({"fingerprint": "b"}, {}):
            body = error(api.acquire(namespace=ns, key=KEY, **other), 409, "conflict")
            assert set(body) == {"ok", "status", "error", "absolute_expires_at"}
            assert body["absolute_expires_at"] == first["absolute_expires_at"]

    def test_absent_fingerprint_binds_too(self, api: Api, ns: str) -> None:
        """A key acquired without a fingerprint conflicts with one that brings one."""
        granted(api.acquire(namespace=ns, key=KEY))
        error(api.acquire(namespace=ns, key=KEY, fingerprint="a"), 409, "conflict")

    def test_conflict_does_not_leak_the_result(self, api: Api, ns: str) -> None:
        """After completion a different fingerprint gets conflict, never the result."""
        lease = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result="SECRETX")
        response = api.acquire(namespace=ns, key=KEY, fingerprint="b")
        error(response, 409, "conflict")
        assert "SECRETX" not in response.text

    def test_completed_replay(self, api: Api, ns: str, clock: FakeClock) -> None:
        """After completion the same key and fingerprint get 200 and the result, no token."""
        lease = granted(api.acquire(namespace=ns, key=KEY, fingerprint="charge-order-501"))
        clock.advance(38)
        done = api.complete(
            namespace=ns, key=KEY, owner_token=lease["owner_token"], result={"receipt_id": 4817}
        )
        assert done.status_code == 200
        response = api.acquire(namespace=ns, key=KEY, fingerprint="charge-order-501")
        assert response.status_code == 200
        body = response.json()
        assert set(body) == COMPLETED_KEYS
        assert body == {
            "ok": True,
            "status": "completed",
            "completed_at": "2026-09-05T10:00:38Z",
            "result": {"receipt_id": 4817},
            "fencing_token": lease["fencing_token"],
            "absolute_expires_at": lease["absolute_expires_at"],
        }


class TestRenew:
    def test_renew_moves_the_expiry_and_keeps_the_fence(
        self, api: Api, ns: str, clock: FakeClock
    ) -> None:
        """Renew: 200 held, expiry now + ttl, same fence, same lifecycle end."""
        lease = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=30))
        clock.advance(20)
        response = api.renew(
            namespace=ns, key=KEY, owner_token=lease["owner_token"], ttl_seconds=120
        )
        assert response.status_code == 200
        body = response.json()
        assert set(body) == GRANTED_KEYS - {"owner_token"}
        assert body["status"] == "held" and body["ttl_seconds"] == 120
        assert body["fencing_token"] == lease["fencing_token"]
        assert body["lease_expires_at_timestamp"] == clock.now_ms() // 1000 + 120
        assert body["absolute_expires_at"] == lease["absolute_expires_at"]
        assert lease["owner_token"] not in response.text

    def test_renew_defaults_to_60_and_may_shorten(self, api: Api, ns: str) -> None:
        """Without ttl_seconds a renew grants 60 s, even if the lease had longer."""
        lease = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=600))
        body = api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"]).json()
        assert body["ttl_seconds"] == 60

    def test_renew_never_moves_the_lifecycle_end(self, api: Api, ns: str, clock: FakeClock) -> None:
        """Renewals near the boundary are capped and report the reduced ttl."""
        lease = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=3600))
        for _ in range(24):
            clock.advance(3599)
            api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"], ttl_seconds=3600)
        # 24 * 3599 s elapsed: 24 s of the lifecycle are left.
        response = api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        body = response.json()
        assert body["ttl_seconds"] == 24
        assert body["lease_expires_at_timestamp"] == lease["absolute_expires_at_timestamp"]
        assert body["absolute_expires_at"] == lease["absolute_expires_at"]


class TestReleaseAndComplete:
    def test_release(self, api: Api, ns: str) -> None:
        """Release: 200 released with the fence; the key can be acquired at once."""
        lease = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        response = api.release(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        assert response.status_code == 200
        assert response.json() == {
            "ok": True,
            "status": "released",
            "fencing_token": lease["fencing_token"],
        }
        again = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        assert again["fencing_token"] > lease["fencing_token"]
        assert again["absolute_expires_at"] == lease["absolute_expires_at"]

    def test_release_keeps_the_fingerprint_binding(self, api: Api, ns: str) -> None:
        """After release the lifecycle's fingerprint binding stays."""
        lease = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        api.release(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        error(api.acquire(namespace=ns, key=KEY, fingerprint="b"), 409, "conflict")

    def test_complete_stores_the_result_and_removes_the_owner(self, api: Api, ns: str) -> None:
        """Complete: 200 completed with the result as stored; the token is then lost."""
        lease = granted(api.acquire(namespace=ns, key=KEY))
        result = {"z": 1, "a": [1, 2.5, None, True, "é"], "big": 2**70}
        response = api.complete(
            namespace=ns, key=KEY, owner_token=lease["owner_token"], result=result
        )
        assert response.status_code == 200
        body = response.json()
        assert set(body) == COMPLETED_KEYS
        assert body["result"] == result
        assert '"big":1180591620717411303424' in response.text
        assert list(body["result"]) == ["z", "a", "big"]
        again = api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        error(again, 409, "lost")

    @pytest.mark.parametrize("result", [None, 0, "text", [], {}, False, [{"a": {"b": [None]}}]])
    def test_any_json_value_is_a_result(self, api: Api, ns: str, result: Any) -> None:
        """Any JSON value, null included, is stored and returned exactly."""
        lease = granted(api.acquire(namespace=ns, key=KEY))
        done = api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result=result)
        assert done.json()["result"] == result
        assert api.acquire(namespace=ns, key=KEY).json()["result"] == result

    def test_result_redaction(self, api: Api, ns: str) -> None:
        """Secret-named fields are stored and returned as [redacted]."""
        lease = granted(api.acquire(namespace=ns, key=KEY))
        result = {"receipt": 1, "items": [{"api_key": "K1", "name": "n"}], "Password": {"x": 1}}
        api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result=result)
        stored = api.acquire(namespace=ns, key=KEY)
        assert stored.json()["result"] == {
            "receipt": 1,
            "items": [{"api_key": "[redacted]", "name": "n"}],
            "Password": "[redacted]",
        }
        assert "K1" not in stored.text

    def test_result_too_large_leaves_the_lease(self, api: Api, ns: str) -> None:
        """A result over 32,768 bytes is 413 too_large and the lease stays as it was."""
        lease = granted(api.acquire(namespace=ns, key=KEY))
        big = "x" * 32_767  # 32,769 bytes as JSON
        response = api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result=big)
        error(response, 413, "too_large")
        renewed = api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        assert renewed.status_code == 200
        fits = "x" * 32_766
        done = api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result=fits)
        assert done.status_code == 200

    def test_result_size_counts_utf8_bytes_not_escapes(self, api: Api, ns: str) -> None:
        """The limit is on compact UTF-8: 16,383 "é" (2 bytes each, 32,768 with the
        quotes) fit, though written as \\u00e9 escapes they would be six times as long."""
        lease = granted(api.acquire(namespace=ns, key=KEY))
        token = lease["owner_token"]
        one_more = api.complete(namespace=ns, key=KEY, owner_token=token, result="é" * 16_384)
        error(one_more, 413, "too_large")
        done = api.complete(namespace=ns, key=KEY, owner_token=token, result="é" * 16_383)
        assert done.status_code == 200 and done.json()["result"] == "é" * 16_383

    def test_result_too_large_is_413_before_ownership_is_looked_at(self, api: Api, ns: str) -> None:
        """The size is checked before the store: a non-owner's big result is 413, not lost."""
        lease = granted(api.acquire(namespace=ns, key=KEY))
        stranger = "own_" + "A" * 43
        big = "x" * 32_767
        refused = api.complete(namespace=ns, key=KEY, owner_token=stranger, result=big)
        error(refused, 413, "too_large")
        small = api.complete(namespace=ns, key=KEY, owner_token=stranger, result="x")
        error(small, 409, "lost")
        assert api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"]).status_code == 200


class TestLost:
    @pytest.mark.parametrize("operation", ["renew", "release", "complete"])
    @pytest.mark.parametrize(
        "case", ["unknown", "wrong_token", "expired", "expired_taken", "released", "completed"]
    )
    def test_not_the_live_owner(
        self, api: Api, ns: str, clock: FakeClock, operation: str, case: str
    ) -> None:
        """Any owner that is not the current live owner gets 409 lost."""
        token = "own_" + "A" * 43
        if case != "unknown":
            lease = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=10))
            token = lease["owner_token"]
        if case == "wrong_token":
            token = "own_" + "B" * 42 + "A"
        elif case in ("expired", "expired_taken"):
            clock.advance(10)
            if case == "expired_taken":
                granted(api.acquire(namespace=ns, key=KEY))
        elif case == "released":
            api.release(namespace=ns, key=KEY, owner_token=token)
        elif case == "completed":
            api.complete(namespace=ns, key=KEY, owner_token=token, result=1)
        body: dict[str, Any] = {"namespace": ns, "key": KEY, "owner_token": token}
        if operation == "complete":
            body["result"] = {"late": True}
        response = api.post(f"/lease/{operation}", body)
        lost = error(response, 409, "lost")
        assert set(lost) == {"ok", "status", "error"}
        if case == "completed":
            replay = api.acquire(namespace=ns, key=KEY).json()
            assert replay["result"] == 1  # a stale complete never replaces the result

    def test_old_owner_cannot_touch_the_new_lease(
        self, api: Api, ns: str, clock: FakeClock
    ) -> None:
        """An old owner's renew, release and complete do not affect a newer owner."""
        old = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=5))
        clock.advance(5)
        new = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=60))
        for route in ("renew", "release"):
            body = {"namespace": ns, "key": KEY, "owner_token": old["owner_token"]}
            error(api.post(f"/lease/{route}", body), 409, "lost")
        held = error(api.acquire(namespace=ns, key=KEY), 409, "held")
        assert held["fencing_token"] == new["fencing_token"]


class TestLifecycle:
    def test_a_key_after_its_lifecycle_is_as_if_never_seen(
        self, api: Api, ns: str, clock: FakeClock
    ) -> None:
        """After 24 h: new lifecycle, new binding, no old result, and a higher fence."""
        lease = granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        api.complete(namespace=ns, key=KEY, owner_token=lease["owner_token"], result="old")
        clock.advance(DAY - 0.001)
        assert api.acquire(namespace=ns, key=KEY, fingerprint="a").json()["result"] == "old"
        clock.advance(0.001)
        fresh = granted(api.acquire(namespace=ns, key=KEY, fingerprint="b"))
        assert fresh["fencing_token"] > lease["fencing_token"]
        assert (
            fresh["absolute_expires_at_timestamp"] == lease["absolute_expires_at_timestamp"] + DAY
        )

    def test_lifecycle_length_is_configurable(self, make_api: ApiFactory, clock: FakeClock) -> None:
        """LEASEKEEPER_LIFECYCLE_SECONDS sets the lifecycle (here 100 s)."""
        api = make_api("sqlite", lifecycle_seconds=100)
        ns = api.namespace()
        lease = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=3600))
        assert lease["ttl_seconds"] == 100
        assert lease["absolute_expires_at_timestamp"] == clock.now_ms() // 1000 + 100
        clock.advance(100)
        error(api.renew(namespace=ns, key=KEY, owner_token=lease["owner_token"]), 409, "lost")
        assert granted(api.acquire(namespace=ns, key=KEY))["fencing_token"] == 2

    def test_ttl_is_reduced_near_the_boundary(self, make_api: ApiFactory, clock: FakeClock) -> None:
        """A grant 10.5 s before the lifecycle end gets ttl 10 and expires at the end."""
        api = make_api("sqlite", lifecycle_seconds=100)
        ns = api.namespace()
        lease = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=1))
        api.release(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        clock.advance(89.5)
        again = granted(api.acquire(namespace=ns, key=KEY, ttl_seconds=60))
        assert again["ttl_seconds"] == 10
        assert again["lease_expires_at"] == again["absolute_expires_at"]

    def test_cleanup_deletes_only_finished_lifecycles(
        self, make_api: ApiFactory, clock: FakeClock
    ) -> None:
        """Cleanup removes records whose lifecycle is over; fences still rise afterwards."""
        api = make_api("memory", lifecycle_seconds=100)
        ns = api.namespace()
        old = granted(api.acquire(namespace=ns, key="old"))
        clock.advance(50)
        granted(api.acquire(namespace=ns, key="young"))
        clock.advance(50)
        deleted = api.client.portal.call(api.service.cleanup)  # type: ignore[union-attr]
        assert deleted == 1
        assert len(api.service.store.records()) == 1  # type: ignore[attr-defined]
        fresh = granted(api.acquire(namespace=ns, key="old"))
        assert fresh["fencing_token"] > old["fencing_token"]


class TestFencingTokens:
    def test_fences_rise_across_everything(
        self, make_api: ApiFactory, make_store: Any, clock: FakeClock, tmp_path: Any
    ) -> None:
        """Releases, expiries, lifecycles, cleanups and restarts all give higher fences."""
        from leasekeeper.store import SqliteStore

        path = tmp_path / "fences.db"
        api = make_api(store=SqliteStore(path, clock), lifecycle_seconds=100)
        ns = api.namespace()
        seen = []

        def take(**kw: Any) -> dict[str, Any]:
            body = granted(api.acquire(namespace=ns, key=KEY, **kw))
            seen.append(body["fencing_token"])
            return body

        lease = take(ttl_seconds=5)
        api.release(namespace=ns, key=KEY, owner_token=lease["owner_token"])
        take(ttl_seconds=5)
        clock.advance(5)
        take(ttl_seconds=5)
        clock.advance(100)
        take()
        clock.advance(100)
        api.client.portal.call(api.service.cleanup)  # type: ignore[union-attr]
        take()
        api.client.__exit__(None, None, None)
        restarted = make_api(store=SqliteStore(path, clock), lifecycle_seconds=100)
        clock.advance(100)
        seen.append(granted(restarted.acquire(namespace=ns, key=KEY))["fencing_token"])
        assert seen == sorted(seen) and len(set(seen)) == len(seen)


class _Broken:
    """A store that fails as no store should: ``apply`` and ``ping`` raise unforeseen
    errors, whose text must reach no client."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def ping(self) -> None:
        raise RuntimeError("boom in ping")

    async def purge(self, limit: int, after: bytes | None = None) -> Any:
        return None

    async def apply(self, command: Any) -> Any:
        raise RuntimeError("boom with detail /etc/secret")


class TestTransport:
    @pytest.mark.parametrize(
        "content_type", [None, "text/plain", "application/x-www-form-urlencoded"]
    )
    def test_body_is_json_whatever_the_content_type(
        self, api: Api, ns: str, content_type: str | None
    ) -> None:
        """curl without -H works: the body is parsed as JSON regardless of Content-Type."""
        headers = {"content-type": content_type} if content_type else {}
        content = f'{{"namespace":"{ns}","key":"k-{content_type}"}}'.encode()
        response = api.post("/lease", content=content, headers=headers)
        granted(response)

    @pytest.mark.parametrize(
        "content",
        [
            b"",
            b"not json",
            b"[]",
            b'{"key": NaN}',
            b'{"key": "a", "key": "b"}',
            b'{"key": "\\ud800"}',
            b'{"result": ' + b"[" * 70 + b"]" * 70 + b"}",
            b"[" * 50_000,
            b"\xff",
        ],
    )
    def test_bad_bodies_are_invalid(self, api: Api, content: bytes) -> None:
        """Every malformed body is 400 invalid JSON error, never a 500."""
        for route in ("/lease", "/lease/renew", "/lease/release", "/lease/complete"):
            error(api.post(route, content=content), 400, "invalid")

    def test_errors_never_echo_input(self, api: Api, ns: str) -> None:
        """Error messages name the field and rule, never the submitted value."""
        canary = "CANARY-9f8e7d"
        cases = [
            {"namespace": ns, "key": canary, "ttl_seconds": canary},
            {"namespace": ns, "key": canary + "\n"},
            {"namespace": canary, "key": "k"},
            {"key": canary},
            {"namespace": ns, "key": "k", "fingerprint": canary * 200},
            {"namespace": ns, "key": "k", canary: 1},
        ]
        for body in cases:
            response = api.acquire(**body)
            assert response.status_code == 400
            assert canary not in response.text

    def test_an_unknown_field_name_is_not_echoed(self, api: Api, ns: str) -> None:
        """An unknown field's name is not repeated, as it may be a key or token sent as a
        name; the message lists the fields the route takes, and names the API's own
        field names sent to a route that does not take them."""
        secret_name = uuid.uuid4().hex  # a bare key's shape: letters and digits only
        body = error(api.acquire(namespace=ns, key="k", **{secret_name: 1}), 400, "invalid")
        assert secret_name not in body["error"]
        assert "namespace, key, ttl_seconds, fingerprint" in body["error"]
        lease = granted(api.acquire(namespace=ns, key="k"))
        sent = {"namespace": ns, "key": "k", "owner_token": lease["owner_token"], "result": 1}
        body = error(api.post("/lease/renew", json=sent), 400, "invalid")
        assert body["error"] == 'Unknown field "result" for this request'
        many = {f"x{n}": n for n in range(2_000)}
        body = error(api.acquire(namespace=ns, key="k", **many), 400, "invalid")
        assert body["error"] == (  # one problem for them all, not the list 2,000 times
            "2000 unknown fields (names are not repeated); "
            "this request takes namespace, key, ttl_seconds, fingerprint, wait_seconds"
        )

    def test_oversized_bodies(self, api: Api, ns: str) -> None:
        """Bodies over 64 KiB are 413 too_large, declared or streamed."""
        big = b'{"key": "' + b"x" * 70_000 + b'"}'
        error(api.post("/lease", content=big), 413, "too_large")

        def chunks() -> Any:
            yield b'{"key": "'
            for _ in range(100):
                yield b"x" * 1000
            yield b'"}'

        error(api.post("/lease", content=chunks()), 413, "too_large")

    def test_unknown_route_and_wrong_method(self, api: Api) -> None:
        """404 not_found and 405 method_not_allowed are JSON like everything else."""
        error(api.client.get("/services/v1/nothing"), 404, "not_found")
        error(api.client.post("/nothing"), 404, "not_found")
        error(api.client.get("/services/v1/lease"), 405, "method_not_allowed")
        error(api.client.delete("/services/v1/lease/renew"), 405, "method_not_allowed")

    def test_a_trailing_slash_changes_nothing(self, api: Api, ns: str) -> None:
        """/lease/ is /lease, served as it is: no redirect (with the empty body of one)
        that a client might not follow; the other routes likewise."""
        lease = {"namespace": ns, "key": "slash"}
        held = api.client.post("/services/v1/lease/", json=lease)
        assert held.status_code == 201 and not held.history
        again = api.client.post("/services/v1/lease/acquire//", json=lease)
        assert (again.status_code, again.json()["status"]) == (409, "held")
        owner = {**lease, "owner_token": held.json()["owner_token"]}
        renewed = api.client.post("/services/v1/lease/renew/", json=owner)
        assert renewed.status_code == 200 and not renewed.history
        health = api.client.get("/healthz/")
        assert (health.status_code, health.json(), health.history) == (
            200,
            {"ok": True, "status": "alive"},
            [],
        )
        error(api.client.get("/services/v1/lease/"), 405, "method_not_allowed")
        error(api.client.post("/nothing/"), 404, "not_found")

    def test_every_response_has_the_security_headers(self, api: Api, ns: str) -> None:
        """Cache-Control: no-store and X-Content-Type-Options: nosniff on every response."""
        responses = [
            api.acquire(namespace=ns, key=KEY),
            api.acquire(namespace=ns, key=KEY),
            api.acquire(key="bad"),
            api.client.get("/nothing"),
            api.client.get("/services/v1/lease"),
            api.post("/lease", content=b"x" * 70_000),
            api.client.get("/healthz"),
            api.client.get("/readyz"),
            api.client.get("/metrics"),
            api.client.get("/openapi.json"),
            api.client.get("/docs"),
        ]
        for response in responses:
            assert response.headers["cache-control"] == "no-store"
            assert response.headers["x-content-type-options"] == "nosniff"

    def test_responses_carry_exactly_these_headers(self, api: Api, ns: str) -> None:
        """Lease answers and refusals (with Retry-After, or Connection: close when the body
        was not read) and Starlette's routes: every header, in order, and nothing more."""

        def headers(response: Any) -> list[tuple[str, str]]:
            raw = [(k.decode().lower(), v.decode()) for k, v in response.headers.raw]
            name, request_id = raw.pop()
            assert name == "x-request-id" and re.fullmatch(r"[0-9a-f]{16}", request_id)
            return raw

        def json_headers(response: Any, *extra: tuple[str, str]) -> list[tuple[str, str]]:
            return [
                ("content-length", str(len(response.content))),
                ("content-type", "application/json"),
                *extra,
                ("cache-control", "no-store"),
                ("x-content-type-options", "nosniff"),
            ]

        granted = api.acquire(namespace=ns, key=KEY)
        held = api.acquire(namespace=ns, key=KEY)
        too_large = api.post("/lease", content=b"x" * 70_000)
        invalid = api.acquire(key="bad")
        health = api.client.get("/healthz")
        not_found = api.client.get("/nothing")
        wrong_method = api.client.get("/services/v1/lease")
        assert (granted.status_code, held.status_code, too_large.status_code) == (201, 409, 413)
        assert headers(granted) == json_headers(granted)
        assert headers(held) == json_headers(held, ("retry-after", held.headers["retry-after"]))
        assert headers(too_large) == json_headers(too_large, ("connection", "close"))
        assert headers(invalid) == json_headers(invalid)
        assert headers(health) == json_headers(health)
        assert headers(not_found) == json_headers(not_found)
        assert headers(wrong_method) == json_headers(wrong_method, ("allow", "POST"))

    def test_health_and_readiness(self, api: Api) -> None:
        """/healthz says the process is alive, /readyz that the store answers."""
        assert api.client.get("/healthz").json() == {"ok": True, "status": "alive"}
        assert api.client.get("/readyz").json() == {"ok": True, "status": "ready"}

    def test_store_unreachable_is_503(self, api: Api, ns: str) -> None:
        """When the store cannot be reached: 503 unavailable with Retry-After, ready fails."""
        api.client.portal.call(api.service.store.close)  # type: ignore[union-attr]
        response = api.acquire(namespace=ns, key=KEY)
        error(response, 503, "unavailable")
        assert int(response.headers["retry-after"]) >= 1
        error(api.client.get("/readyz"), 503, "unavailable")
        assert api.client.get("/healthz").status_code == 200

    def test_unexpected_errors_are_500_without_details(
        self, make_api: ApiFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A fault inside the service is 500 internal with no details; the log names
        the route, not the path the client sent."""

        api = make_api(store=_Broken())  # type: ignore[arg-type]
        response = api.acquire(namespace=api.namespace(), key=KEY)
        body = error(response, 500, "internal")
        assert body == {"ok": False, "status": "internal", "error": "Internal error"}
        assert "boom" not in response.text and "Traceback" not in response.text
        caplog.clear()
        with caplog.at_level("ERROR"):
            ready = api.client.get("/readyz/")
        assert error(ready, 500, "internal") == body
        (logged,) = [r for r in caplog.records if r.name == "leasekeeper.http"]
        assert logged.getMessage() == "unhandled error on GET readyz"

    def test_an_unexpected_error_answered_is_not_passed_on_to_the_server(
        self, make_api: ApiFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A fault on a route Starlette serves (/readyz, /metrics, /mcp) is answered 500
        and logged once, by leasekeeper. Starlette raised it again after the answer, for
        the server: uvicorn logged it a second time ("Exception in ASGI application", a
        second traceback) and closed the connection. A server that sees the exception
        fails this test (TestClient raises it, as uvicorn logs it)."""
        from starlette.testclient import TestClient

        api = make_api(store=_Broken())  # type: ignore[arg-type]
        client = TestClient(api.app, raise_server_exceptions=True)
        caplog.clear()
        with caplog.at_level("ERROR"):
            ready = client.get("/readyz")
        assert error(ready, 500, "internal")["error"] == "Internal error"
        assert [r.getMessage() for r in caplog.records] == ["unhandled error on GET readyz"]
        assert client.get("/healthz").status_code == 200

    def test_openapi_describes_every_route_and_body(self, api: Api) -> None:
        """/openapi.json lists each route with its request body schema."""
        doc = api.client.get("/openapi.json").json()
        assert doc["openapi"].startswith("3.")
        for route in ("namespace", "", "/acquire", "/renew", "/release", "/complete"):
            path = "/services/v1/lease" + (f"/{route}" if route == "namespace" else route)
            assert "post" in doc["paths"][path], path
        schemas = doc["components"]["schemas"]
        assert schemas["AcquireBody"]["properties"]["ttl_seconds"]
        assert "owner_token" in schemas["CompleteBody"]["required"]
        assert api.client.get("/docs").headers["content-type"].startswith("text/html")
        # What no JSON Schema can say of a body is said in words.
        for rule in ("64 KiB", "a repeated name", "deeper than 64 levels", "byte-order mark"):
            assert rule in doc["info"]["description"], rule

    def test_openapi_serves_client_generators(self, api: Api, ns: str) -> None:
        """What generated clients need: a stable operationId per operation; request bodies
        as one flat object with every field (an anyOf of two partial objects loses them);
        int64 for the fencing token and timestamps (a bare integer is int32 in Java, Go
        and C#); ttl_seconds' real default; 500 and every other refusal in the Error shape;
        a 409 told apart by its status, each with the fields it always has."""
        import jsonschema

        doc = api.client.get("/openapi.json").json()
        operations = [op for path in doc["paths"].values() for op in path.values()]
        ids = [op["operationId"] for op in operations]
        assert len(ids) == len(set(ids)) == 8
        schemas = doc["components"]["schemas"]
        for name, fields in {
            "AcquireBody": {"namespace", "key", "ttl_seconds", "fingerprint", "wait_seconds"},
            "RenewBody": {"namespace", "key", "owner_token", "ttl_seconds"},
            "ReleaseBody": {"namespace", "key", "owner_token"},
            "CompleteBody": {"namespace", "key", "owner_token", "result"},
        }.items():
            assert set(schemas[name]["properties"]) == fields, name
            assert not {"anyOf", "oneOf", "allOf"} & set(schemas[name]), name
        assert schemas["AcquireBody"]["properties"]["ttl_seconds"]["default"] == 60
        for name in ("Granted", "Renewed", "Released", "Completed", "Held"):
            assert schemas[name]["properties"]["fencing_token"]["format"] == "int64", name
        assert schemas["Granted"]["properties"]["lease_expires_at_timestamp"]["format"] == "int64"
        for path, item in doc["paths"].items():
            if path.startswith("/services/v1/"):
                assert {"500", "default"} <= set(item["post"]["responses"]), path

        def valid(path: str, status: str, body: dict[str, Any]) -> bool:
            content = doc["paths"][path]["post"]["responses"][status]["content"]
            schema = {**content["application/json"]["schema"], "components": doc["components"]}
            return jsonschema.Draft202012Validator(schema).is_valid(body)

        lease, renew = "/services/v1/lease", "/services/v1/lease/renew"
        granted(api.acquire(namespace=ns, key=KEY, fingerprint="a"))
        held = error(api.acquire(namespace=ns, key=KEY, fingerprint="a"), 409, "held")
        conflict = error(api.acquire(namespace=ns, key=KEY, fingerprint="b"), 409, "conflict")
        lost = error(api.renew(namespace=ns, key=KEY, owner_token="own_" + "A" * 43), 409, "lost")
        assert valid(lease, "409", held) and valid(lease, "409", conflict)
        assert valid(renew, "409", lost)
        assert not valid(lease, "409", lost)  # a lost is not an acquire's answer
        for body, field in ((held, "retry_after_seconds"), (conflict, "absolute_expires_at")):
            incomplete = {k: v for k, v in body.items() if k != field}
            assert not valid(lease, "409", incomplete), field
        # One 409 for both, so its Retry-After says which of them carries it.
        header = doc["paths"][lease]["post"]["responses"]["409"]["headers"]["Retry-After"]
        assert header["description"].startswith("Seconds to wait: sent with held only")
        conflicting = api.acquire(namespace=ns, key=KEY, fingerprint="b")
        assert "retry-after" not in conflicting.headers
        assert api.acquire(namespace=ns, key=KEY, fingerprint="a").headers["retry-after"]

    def test_metrics_are_prometheus_text_without_secrets(self, api: Api, ns: str) -> None:
        """/metrics counts requests by route and status and names no key or namespace."""
        granted(api.acquire(namespace=ns, key=KEY))
        error(api.acquire(namespace=ns, key=KEY), 409, "held")
        text = api.client.get("/metrics").text
        assert 'leasekeeper_requests_total{route="acquire",status="201"} 1.0' in text
        assert 'leasekeeper_requests_total{route="acquire",status="409"} 1.0' in text
        assert ns not in text and KEY not in text


class TestLimits:
    def test_namespace_minting_is_rate_limited_per_address(self, api: Api, monotonic: Any) -> None:
        """Bursts of 100 mints, then 429 with Retry-After; tokens refill at 10 per second."""
        for _ in range(100):
            assert api.post("/lease/namespace", {}).status_code == 201
        response = api.post("/lease/namespace", {})
        body = error(response, 429, "rate_limited")
        assert response.headers["retry-after"] == "1"
        assert body["retry_after_seconds"] == 1
        monotonic.advance(0.1)
        assert api.post("/lease/namespace", {}).status_code == 201
        assert api.post("/lease/namespace", {}).status_code == 429

    def test_lease_requests_are_not_limited_by_default(self, api: Api, ns: str) -> None:
        """Per-address and per-namespace limits are off by default (NAT-shared workers)."""
        for i in range(1500):
            assert api.acquire(namespace=ns, key=f"k{i % 10}").status_code in (201, 409)

    def test_address_limit_when_switched_on(self, make_api: ApiFactory, monotonic: Any) -> None:
        """With LEASEKEEPER_ADDRESS_RATE set, an address over its burst gets 429."""
        api = make_api("memory", address_rate=1.0, address_burst=3)
        ns = "ns_" + "A" * 43
        codes = [api.acquire(namespace=ns, key="k").status_code for _ in range(4)]
        assert codes == [201, 409, 409, 429]
        monotonic.advance(1)
        assert api.acquire(namespace=ns, key="k").status_code == 409

    def test_namespace_limit_when_switched_on(self, make_api: ApiFactory) -> None:
        """With LEASEKEEPER_NAMESPACE_REQUEST_RATE set, one namespace over its burst gets 429."""
        api = make_api("memory", namespace_request_rate=1.0, namespace_request_burst=2)
        busy, quiet = "ns_" + "A" * 43, "ns_" + "Q" * 43
        codes = [api.acquire(namespace=busy, key="k").status_code for _ in range(3)]
        assert codes == [201, 409, 429]
        assert api.acquire(namespace=quiet, key="k").status_code == 201


def test_a_client_that_disconnects_mid_body_is_no_server_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A body cut off by a disconnect is no server error: nothing is sent, nothing logged."""
    from leasekeeper import LeaseService, Settings
    from leasekeeper.http import create_app
    from leasekeeper.store import MemoryStore

    app = create_app(LeaseService(MemoryStore(FakeClock())), Settings(), run_cleanup=False)
    messages = [
        {"type": "http.request", "body": b'{"key": "', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/services/v1/lease",
        "raw_path": b"/services/v1/lease",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }
    with caplog.at_level("WARNING"):
        asyncio.run(app(scope, receive, send))
    assert sent == []  # the client is gone: there is nobody to answer
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
