"""The pure core: rules, times, secrets and input checks, without any I/O."""

from __future__ import annotations

import ast
import enum
import json
import secrets as random_secrets
import types
import typing
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import leasekeeper._core
from leasekeeper import FakeClock, InvalidRequest, PayloadTooLarge
from leasekeeper._core import keyguess, model, parsing, rules, secrets, times, validation
from leasekeeper._core.model import (
    Acquire,
    Complete,
    CompletedOutcome,
    Conflict,
    Decision,
    Granted,
    Held,
    LeaseState,
    Lost,
    LostReason,
    Release,
    Released,
    Renew,
    Renewed,
)
from leasekeeper._schemas import AcquireBody, parse_body
from leasekeeper.client._http import decode
from leasekeeper.store import decide_with_fence

KEY = b"k" * 32
OWNER_A = b"a" * 32
OWNER_B = b"b" * 32
DAY_MS = 86_400_000
T0 = 1_000_000_000_500


def acquire(owner: bytes = OWNER_A, fp: bytes | None = None, ttl_ms: int = 60_000) -> Acquire:
    return Acquire(KEY, fp, ttl_ms, owner, DAY_MS)


class Fences:
    """A store-wide counter for the pure tests."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        self.value += 1
        return self.value


def granted(decision: Decision) -> Granted:
    assert isinstance(decision.outcome, Granted)
    return decision.outcome


class TestRules:
    def test_first_acquire_starts_a_lifecycle(self) -> None:
        """A first acquire grants a new owner with lifecycle end now + 24 h."""
        d = decide_with_fence(None, acquire(), T0, Fences())
        g = granted(d)
        assert d.write == g.record
        assert g.record.fencing_token == 1
        assert g.record.absolute_expires_ms == T0 + DAY_MS
        assert g.record.lease_expires_ms == T0 + 60_000
        assert rules.state_at(g.record, T0) is LeaseState.HELD

    def test_live_lease_is_held_and_writes_nothing(self) -> None:
        """A second acquire during a live lease is Held and changes nothing."""
        record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
        d = rules.decide(record, acquire(OWNER_B), T0 + 1000)
        assert isinstance(d.outcome, Held)
        assert d.write is None

    def test_fingerprint_is_checked_before_completed_and_held(self) -> None:
        """A different fingerprint is a conflict whatever the lease state."""
        fences = Fences()
        record = granted(decide_with_fence(None, acquire(fp=b"f1"), T0, fences)).record
        assert isinstance(rules.decide(record, acquire(fp=b"f2"), T0).outcome, Conflict)
        assert isinstance(rules.decide(record, acquire(fp=None), T0).outcome, Conflict)
        done = rules.decide(record, Complete(KEY, OWNER_A, "1"), T0).write
        assert isinstance(rules.decide(done, acquire(fp=b"f2"), T0).outcome, Conflict)
        assert isinstance(rules.decide(done, acquire(fp=b"f1"), T0).outcome, CompletedOutcome)

    def test_absent_fingerprint_is_a_binding_too(self) -> None:
        """A key first acquired without a fingerprint refuses one that brings a fingerprint."""
        record = granted(decide_with_fence(None, acquire(fp=None), T0, Fences())).record
        assert isinstance(rules.decide(record, acquire(fp=b"x"), T0).outcome, Conflict)

    def test_expired_and_released_leases_go_to_a_new_owner_with_a_higher_fence(self) -> None:
        """After expiry or release the next owner gets the next fence in the same lifecycle."""
        fences = Fences()
        first = granted(decide_with_fence(None, acquire(), T0, fences)).record
        second = granted(decide_with_fence(first, acquire(OWNER_B), T0 + 60_000, fences)).record
        assert second.fencing_token == 2
        assert second.absolute_expires_ms == first.absolute_expires_ms
        released = rules.decide(second, Release(KEY, OWNER_B), T0 + 61_000).write
        assert released is not None
        third = granted(decide_with_fence(released, acquire(), T0 + 61_000, fences)).record
        assert third.fencing_token == 3

    def test_lease_expiry_is_capped_by_the_lifecycle(self) -> None:
        """Near the lifecycle end a grant and a renew get only the time that is left."""
        fences = Fences()
        record = granted(decide_with_fence(None, acquire(), T0, fences)).record
        near_end = record.absolute_expires_ms - 10_000
        released = rules.decide(record, Release(KEY, OWNER_A), T0).write
        again = granted(decide_with_fence(released, acquire(), near_end, fences)).record
        assert again.lease_expires_ms == record.absolute_expires_ms
        renewed = rules.decide(again, Renew(KEY, OWNER_A, 60_000), near_end + 5_000)
        assert isinstance(renewed.outcome, Renewed)
        assert renewed.outcome.record.lease_expires_ms == record.absolute_expires_ms
        assert renewed.outcome.record.absolute_expires_ms == record.absolute_expires_ms

    @pytest.mark.parametrize(
        ("setup", "reason"),
        [
            ("none", LostReason.NO_LEASE),
            ("wrong_owner", LostReason.NOT_OWNER),
            ("expired", LostReason.EXPIRED),
            ("released", LostReason.RELEASED),
            ("completed", LostReason.COMPLETED),
            ("lifecycle_over", LostReason.NO_LEASE),
        ],
    )
    def test_only_the_live_owner_may_mutate(self, setup: str, reason: LostReason) -> None:
        """Renew, release and complete by anyone but the live owner are Lost, by state."""
        record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
        now, owner = T0 + 1000, OWNER_A
        if setup == "none":
            record = None
        elif setup == "wrong_owner":
            owner = OWNER_B
        elif setup == "expired":
            now = T0 + 60_000
        elif setup == "released":
            record = rules.decide(record, Release(KEY, OWNER_A), T0).write
        elif setup == "completed":
            record = rules.decide(record, Complete(KEY, OWNER_A, "1"), T0).write
        else:
            now = T0 + DAY_MS
        for command in (Renew(KEY, owner, 1000), Release(KEY, owner), Complete(KEY, owner, "1")):
            outcome = rules.decide(record, command, now).outcome
            assert outcome == Lost(reason)

    def test_release_and_complete_remove_the_owner(self) -> None:
        """Release and complete store no owner digest any more."""
        record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
        released = rules.decide(record, Release(KEY, OWNER_A), T0 + 5)
        assert isinstance(released.outcome, Released)
        assert released.write is not None and released.write.owner is None
        done = rules.decide(record, Complete(KEY, OWNER_A, '{"a":1}'), T0 + 5)
        assert isinstance(done.outcome, CompletedOutcome)
        assert done.write is not None and done.write.owner is None
        assert done.write.result == '{"a":1}' and done.write.completed_ms == T0 + 5

    def test_a_clock_stepping_back_never_revives_an_expired_lease(self) -> None:
        """Once a decision saw the lease expired, an earlier clock cannot renew it."""
        record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
        seen = rules.decide(record, Renew(KEY, OWNER_A, 1000), T0 + 61_000)
        assert seen.outcome == Lost(LostReason.EXPIRED)
        assert seen.write is not None  # the observation is persisted
        later = rules.decide(seen.write, Renew(KEY, OWNER_A, 1000), T0 + 30_000)
        assert later.outcome == Lost(LostReason.EXPIRED)

    def test_decisions_never_run_before_the_last_one(self) -> None:
        """effective_now is the later of the clock and the record's last decision."""
        record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
        assert rules.effective_now(record, T0 - 5000) == T0
        assert rules.effective_now(record, T0 + 5) == T0 + 5
        assert rules.effective_now(None, 7) == 7

    def test_lifecycle_over_is_as_if_never_seen(self) -> None:
        """At the lifecycle end an acquire starts a new lifecycle with a new binding."""
        fences = Fences()
        record = granted(decide_with_fence(None, acquire(fp=b"f1"), T0, fences)).record
        done = rules.decide(record, Complete(KEY, OWNER_A, "1"), T0).write
        fresh = granted(decide_with_fence(done, acquire(fp=b"f2"), T0 + DAY_MS, fences)).record
        assert fresh.fencing_token == 2
        assert fresh.absolute_expires_ms == T0 + 2 * DAY_MS
        assert fresh.result is None and fresh.fingerprint == b"f2"

    def test_with_fence_refuses_decisions_without_a_new_owner(self) -> None:
        """Only a grant takes a fencing token."""
        with pytest.raises(ValueError, match="new owner"):
            Decision(Lost(LostReason.NO_LEASE)).with_fence(5)

    def test_a_fenced_grant_takes_no_second_fence(self) -> None:
        """A grant takes its fencing token once: the decision a store gets back asks for
        no other, and refuses one, so a token once drawn is never replaced."""
        fenced = decide_with_fence(None, acquire(), T0, Fences())
        assert granted(fenced).record.fencing_token == 1
        assert not fenced.new_owner
        with pytest.raises(ValueError, match="new owner"):
            fenced.with_fence(7)

    def test_fence_counter_overflow_is_refused(self) -> None:
        """A counter past 2**63 - 1 is an error, never a wrapped token."""
        with pytest.raises(OverflowError):
            decide_with_fence(None, acquire(), T0, lambda: 2**63)


class TestTimes:
    def test_expiries_round_down_and_waits_round_up(self) -> None:
        """Reported expiry <= real expiry; reported wait >= real wait and >= 1."""
        assert times.floor_seconds(1_999) == 1
        assert times.iso(1_788_602_460_999) == "2026-09-05T10:01:00Z"
        assert times.retry_after_seconds(10_001, 0) == 11
        assert times.retry_after_seconds(10_000, 0) == 10
        assert times.retry_after_seconds(10, 0) == 1
        assert times.ttl_seconds(60_999, 1_000) == 59
        assert times.ttl_seconds(61_000, 1_000) == 60


class TestKeys:
    def test_random_keys_pass_the_entropy_rule(self) -> None:
        """uuid4, token_urlsafe(32) and token_hex(32) keys are accepted."""
        for _ in range(2000):
            validation.check_bare_key(str(uuid.uuid4()))
            validation.check_bare_key(random_secrets.token_urlsafe(32))
            validation.check_bare_key(random_secrets.token_hex(32))

    @pytest.mark.parametrize(
        "key",
        ["a" * 40, "order-0000000000000000000000000001", "ab" * 49, "0" * 39 + "1"],
    )
    def test_low_entropy_keys_are_refused_with_advice(self, key: str) -> None:
        """A visibly non-random key is refused, and the message says how to make a good one."""
        with pytest.raises(InvalidRequest) as caught:
            validation.check_bare_key(key)
        assert "entropy" in caught.value.error
        assert "uuid" in caught.value.error and "namespace" in caught.value.error
        assert key not in caught.value.error

    def test_a_refused_keys_estimate_is_never_shown_as_enough(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The message gives the estimate rounded down to a tenth: 99.96 bits is not "100.0"
        beside "at least 100"."""
        monkeypatch.setattr(validation, "estimate_below", lambda key, bits: 99.96)
        with pytest.raises(InvalidRequest) as caught:
            validation.check_bare_key("k" * 32)
        assert "at least 100 bits of entropy" in caught.value.error
        assert "estimated at 99.9 bits)" in caught.value.error
        monkeypatch.undo()
        with pytest.raises(InvalidRequest) as caught:
            validation.check_bare_key("order-0000000000000000000000000001")  # 17.58 bits
        assert "estimated at 17.5 bits)" in caught.value.error

    @pytest.mark.parametrize(
        "key",
        [
            random_secrets.token_hex(15) + "a",  # 31 characters
            random_secrets.token_urlsafe(160)[:201],  # 201 characters
            str(uuid.uuid4()) + " x",  # whitespace
            str(uuid.uuid4()) + "é",  # not ASCII
        ],
    )
    def test_bare_keys_must_be_32_to_200_printable_ascii(self, key: str) -> None:
        """Length, ASCII and whitespace rules for keys without a namespace."""
        with pytest.raises(InvalidRequest, match="32 to 200 printable ASCII"):
            validation.check_bare_key(key)

    @pytest.mark.parametrize(
        ("key", "rule"),
        [("a\ud800", "lone surrogates"), ("\udfffb", "lone surrogates"), ("k\x00", "control")],
    )
    def test_namespaced_keys_refuse_what_has_no_utf8(self, key: str, rule: str) -> None:
        """A key in a namespace with a control character or a lone surrogate is invalid,
        checked by the model itself: a program calling ``LeaseService`` directly skips
        the adapters' JSON checks, and no key id can be taken of text UTF-8 cannot carry."""
        body = {"namespace": secrets.format_namespace(bytes(32)), "key": key}
        with pytest.raises(InvalidRequest, match=rule):
            parse_body(AcquireBody, body)

    def test_a_key_of_exactly_100_bits_is_random_enough(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The rule is "at least 100 bits": an estimate of exactly 100.0 is accepted."""
        monkeypatch.setattr(keyguess, "guessing_bits", lambda key: 100.0)
        validation.check_bare_key("k" * 32)

    @pytest.mark.parametrize("key", ["a\x7fb", "a\x85b", "a\x9fb"])
    def test_del_and_c1_controls_are_refused_as_control_characters(self, key: str) -> None:
        """DEL and the C1 controls (U+007F-U+009F) are control characters: the message
        names that rule, not another one."""
        with pytest.raises(InvalidRequest) as refused:
            validation.check_namespaced_key(key)
        assert refused.value.error == "Invalid key: must not contain control characters"


class TestResults:
    def test_secret_named_fields_are_redacted_at_any_depth(self) -> None:
        """Fields named like secrets become [redacted] in objects at any depth, arrays too."""
        result = {
            "receipt_id": 4817,
            "Authorization": "Bearer x",
            "nested": {"db_password": {"deep": 1}, "PASSWD": None, "note": "token inside"},
            "list": [{"API-Key": 1}, {"private.key": [1]}, {"Set-Cookie": "c"}, "plain"],
            "Client Secret": True,
            "refreshToken": "r",
            "tokens_used": 5,
            "keep": {"ok": [1, 2, {"x": "y"}]},
        }
        stored = json.loads(validation.encode_result(result))
        assert stored == {
            "receipt_id": 4817,
            "Authorization": "[redacted]",
            "nested": {"db_password": "[redacted]", "PASSWD": "[redacted]", "note": "token inside"},
            "list": [
                {"API-Key": "[redacted]"},
                {"private.key": "[redacted]"},
                {"Set-Cookie": "[redacted]"},
                "plain",
            ],
            "Client Secret": "[redacted]",
            "refreshToken": "[redacted]",
            "tokens_used": "[redacted]",
            "keep": {"ok": [1, 2, {"x": "y"}]},
        }

    def test_every_kind_of_space_in_a_name_counts_as_a_space(self) -> None:
        """The spec removes spaces before looking for the words: a tab, a no-break space
        or an ideographic space hides a secret's name no better than a space does."""
        result = {"api\u00a0key": 1, "pass\tword": 2, "client\u3000secret": 3, "to\u2028ken": 4}
        assert json.loads(validation.encode_result(result)) == dict.fromkeys(result, "[redacted]")
        plain = {"api key": 1, "private key": 2, "pass word": 3}  # the plain space itself
        assert json.loads(validation.encode_result(plain)) == dict.fromkeys(plain, "[redacted]")
        assert json.loads(validation.encode_result({"a\u200bb": 1})) == {"a\u200bb": 1}

    def test_names_are_lower_cased_not_folded(self) -> None:
        """The spec lower-cases names; it does not fold or normalise them (the README's
        decision): upper case of any script is found, look-alike letters are other names."""
        found = {"TOKEN": 1, "ApiKey": 2, "PASSWORD": 3}
        assert json.loads(validation.encode_result(found)) == dict.fromkeys(found, "[redacted]")
        kept = {"\uff34\uff2f\uff2b\uff25\uff2e": 1, "\u017fecret": 2, "api\u2010key": 3}
        assert json.loads(validation.encode_result(kept)) == kept

    def test_size_limit_is_on_the_compact_submitted_encoding(self) -> None:
        """32,768 bytes of compact UTF-8 JSON pass; one byte more is too large."""
        fits = "x" * (32_768 - 2)
        assert validation.encode_result(fits) == json.dumps(fits)
        with pytest.raises(PayloadTooLarge):
            validation.encode_result(fits + "x")
        multibyte = "é" * ((32_768 - 2) // 2 + 1)  # 2 bytes each in UTF-8
        with pytest.raises(PayloadTooLarge):
            validation.encode_result(multibyte)

    def test_the_size_limit_counts_secret_fields_before_they_are_redacted(self) -> None:
        """The limit is on the submitted result: a 40 KB password is too large, though
        "[redacted]" in its place would fit."""
        with pytest.raises(PayloadTooLarge):
            validation.encode_result({"password": "x" * 40_000})

    def test_objects_in_a_tuple_are_redacted_as_in_a_list(self) -> None:
        """A program calling ``LeaseService`` directly may pass a tuple, which is stored as
        a JSON array: the objects in it are redacted like those in a list (their secrets
        were stored as sent)."""
        result = ({"password": "hunter2"}, {"a": ({"api_key": "sk_live"}, 1)})
        stored = validation.encode_result(result)
        assert json.loads(stored) == [
            {"password": "[redacted]"},
            {"a": [{"api_key": "[redacted]"}, 1]},
        ]
        assert "hunter2" not in stored and "sk_live" not in stored

    @pytest.mark.parametrize(
        "result",
        [
            float("nan"),
            {"a": [float("-inf")]},
            "a\ud800",
            {"\udfff": 1},
            {"a": {1, 2}},
            b"bytes",
            {1: "x"},  # json.dumps would write {"1":"x"}; {1: .., "1": ..} twice "1"
            {"a": [{None: 1}]},
            pytest.param(10**5000, id="an-integer-of-5001-digits"),
        ],
    )
    def test_a_value_json_cannot_carry_is_invalid(self, result: Any) -> None:
        """What no JSON body can hold, a program calling ``LeaseService`` directly can
        pass: it is 400 invalid, as over HTTP, not a TypeError, ValueError or
        AttributeError from inside the service (a 500 or a traceback)."""
        with pytest.raises(InvalidRequest) as refused:
            validation.encode_result(result)
        assert refused.value.error.startswith("Invalid result: must be a JSON value")

    def test_a_result_that_holds_itself_is_invalid(self) -> None:
        """A cycle (possible only in Python) is invalid too."""
        cycle: list[Any] = []
        cycle.append(cycle)
        with pytest.raises(InvalidRequest, match="Invalid result"):
            validation.encode_result({"a": cycle})

    def test_results_keep_order_and_big_integers(self) -> None:
        """Key order, big integers and NUL characters survive encoding."""
        text = validation.encode_result({"b": 2**70, "a": "\u0000", "c": [1.5, None]})
        assert text == '{"b":1180591620717411303424,"a":"\\u0000","c":[1.5,null]}'


# Half the bodies are what the flat path takes (plain names and text, JSON's whitespace),
# half anything: escapes, control characters, non-JSON whitespace, floats, nesting.
_PLAIN_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters='"\\'), max_size=6
)
_PLAIN = {
    "names": st.sampled_from(["key", "namespace", "ttl_seconds", "a", "\u00e9"]),
    "scalars": st.one_of(
        _PLAIN_TEXT, st.integers(-(2**63), 2**64), st.integers(), st.booleans(), st.none()
    ),
    "whitespace": st.sampled_from(["", " ", "\t", "\r\n"]),
}
_WILD = {
    "names": st.sampled_from(["key", "a", "\u00e9", 'q"', "b\\", "\x00", "\u2028"]),
    "scalars": st.one_of(
        st.text(max_size=4),
        st.integers(-(2**70), 2**70),
        st.sampled_from(["\\u0041", "\ud800", 1.5, 1e300, [], {"x": 1}, True, None]),
    ),
    "whitespace": st.sampled_from(["", " ", "\x0c", "\xa0", "\x0b"]),
}
_EDITS = st.sampled_from(["none", "none", "none", "none", "change", "insert", "drop"])


def _json_ish(data: Any) -> bytes:
    """Flat JSON objects, often with repeated members, then often one byte changed,
    inserted or dropped: bodies at the margins of what the two parsers agree on."""
    kind = data.draw(st.sampled_from([_PLAIN, _WILD]))
    unique = data.draw(st.booleans())
    members = data.draw(
        st.lists(
            st.tuples(kind["names"], kind["scalars"]),
            max_size=5,
            unique_by=(lambda member: member[0]) if unique else None,
        )
    )
    ascii_only = kind is _WILD and data.draw(st.booleans())
    parts = []
    for name, value in members:
        ws = data.draw(kind["whitespace"])
        encoded = json.dumps(value, ensure_ascii=ascii_only)
        parts.append(f"{ws}{json.dumps(name, ensure_ascii=ascii_only)}{ws}:{encoded}")
    text = "{" + ",".join(parts) + data.draw(kind["whitespace"]) + "}"
    body = text.encode("utf-8", "surrogatepass")
    edit = data.draw(_EDITS)
    if edit != "none" and body:
        at = data.draw(st.integers(0, len(body) - 1))
        byte = bytes([data.draw(st.sampled_from(b'"\\,:{}\xc3\x001'))])
        if edit == "change":
            body = body[:at] + byte + body[at + 1 :]
        elif edit == "insert":
            body = body[:at] + byte + body[at:]
        else:
            body = body[:at] + body[at + 1 :]
    return body


class TestStrictJson:
    @pytest.mark.parametrize(
        ("body", "message"),
        [
            (b'{"a": NaN}', "NaN"),
            (b'{"a": Infinity}', "Infinity"),
            (b'{"a": -Infinity}', "Infinity"),
            (b'{"a": 1e400}', "too large"),
            (b'{"a": 1, "a": 2}', "duplicate"),
            (b'{"a": "\\ud800"}', "surrogate"),
            (b'{"\\udfff": 1}', "surrogate"),
            (b"[1]", "JSON object"),
            (b'"x"', "JSON object"),
            (b"\xff\xfe", "UTF-8"),
            (b'{"a": ', "not valid JSON"),
            (b"[" * 100_000, "deeper"),
            (b'{"a": ' + b"7" * 4301 + b"}", "more than 4300 digits"),
            (b'{"a": [-' + b"1" * 50_000 + b"]}", "more than 4300 digits"),
        ],
    )
    def test_bad_json_is_invalid(self, body: bytes, message: str) -> None:
        """Each non-strict JSON body is refused with a reason."""
        with pytest.raises(InvalidRequest, match=message):
            parsing.parse_json_object(body)

    @pytest.mark.parametrize(
        ("body", "message"),
        [
            (b'{"a": ', "Expecting value at position 6"),
            (b'{"a": "x\ny"}', "Invalid control character at position 8"),
            (b'{"a": "xy', "Unterminated string starting at position 6"),
        ],
    )
    def test_a_parse_error_says_what_and_where_once(self, body: bytes, message: str) -> None:
        """The decoder's words and the position, not "at at": some of its words end in "at"."""
        with pytest.raises(InvalidRequest) as refused:
            parsing.parse_json_object(body)
        assert refused.value.error == f"Body is not valid JSON: {message}"
        with pytest.raises(ValueError, match=f"^{message}$"):
            decode(body)

    def test_nesting_limit_is_64_levels(self) -> None:
        """64 levels of nesting pass; 65 do not."""
        ok = b'{"a":' + b"[" * 63 + b"]" * 63 + b"}"
        assert parsing.parse_json_object(ok)
        too_deep = b'{"a":' + b"[" * 64 + b"]" * 64 + b"}"
        with pytest.raises(InvalidRequest, match="deeper than 64"):
            parsing.parse_json_object(too_deep)

    def test_a_byte_order_mark_is_tolerated(self) -> None:
        """A UTF-8 BOM before the object is ignored."""
        assert parsing.parse_json_object("\ufeff{}".encode()) == {}

    def test_the_usual_lease_body_takes_the_flat_path(self) -> None:
        """An acquire body is parsed by orjson; what that path cannot vouch for is not."""
        usual = b'{"namespace": "ns_x", "key": "k\xc3\xa9", "ttl_seconds": 60, "fingerprint": null}'
        assert parsing._flat_object(usual) == {
            "namespace": "ns_x",
            "key": "k\u00e9",
            "ttl_seconds": 60,
            "fingerprint": None,
        }
        for other in (
            b'{"key": "a\\u0041"}',  # an escape
            b'{"key": "k", "key": "k"}',  # a repeated member
            b'{"key": "k", "result": {"a": 1}}',  # nested
            b'{"key": "k", "ttl_seconds": 6e1}',  # a float
            b'{"key": "k", "ttl_seconds": 18446744073709551616}',  # past 64 bits
            b"\xef\xbb\xbf{}",  # a byte order mark
            b"[]",
        ):
            assert parsing._flat_object(other) is None, other

    # No deadline: this checks answers, not speed, and a loaded machine once failed it
    # (DeadlineExceeded, as far as could be told: no falsifying example was kept).
    @settings(max_examples=400, deadline=None)
    @given(st.data())
    @example(data=None)
    def test_the_flat_path_returns_what_the_strict_parser_returns(self, data: Any) -> None:
        """Differential: whenever the orjson path answers, the strict parser accepts the
        same body and returns the same members, values and types, in the same order."""
        body = _json_ish(data) if data is not None else b'{"a": "x", "a": "x"}'
        flat = parsing._flat_object(body)
        if flat is None:
            return
        strict = parsing._parse_strict(body)
        assert [(k, type(v), v) for k, v in flat.items()] == [
            (k, type(v), v) for k, v in strict.items()
        ]


class TestSecrets:
    def test_namespace_format(self) -> None:
        """ns_ + 43 base64url characters that decode to the 32 random bytes."""
        raw = bytes(range(32))
        ns = secrets.format_namespace(raw)
        assert len(ns) == 46 and ns.startswith("ns_")
        assert secrets.parse_namespace(ns) == raw

    @pytest.mark.parametrize(
        "bad",
        [
            "ns_" + "A" * 42,
            "ns_" + "A" * 44,
            "NS_" + "A" * 43,
            "ns_" + "A" * 42 + "B",  # not a canonical encoding of 32 bytes
            "ns_" + "A" * 42 + "=",
            "ns_" + "A" * 41 + "+A",
            "ns_" + "A" * 43 + "\n",
            "",
        ],
    )
    def test_malformed_namespaces_are_refused(self, bad: str) -> None:
        """Anything but a canonical ns_ + 43 base64url string is not a namespace."""
        assert secrets.parse_namespace(bad) is None

    def test_only_text_of_a_namespaces_length_is_kept_in_the_cache(self) -> None:
        """parse_namespace keeps its answers, but a client's 60 KB "namespace" (the body
        limit is 64 KiB) must not stay in memory: 1,024 of them would be 60 MB."""
        kept = secrets._parse_namespace.cache_info().currsize
        huge = "ns_" + "A" * 60_000
        assert secrets.parse_namespace(huge) is None
        assert secrets._parse_namespace.cache_info().currsize == kept
        ns = secrets.format_namespace(bytes(range(1, 33)))
        assert secrets.parse_namespace(ns) == bytes(range(1, 33))
        assert secrets.parse_namespace(ns) == bytes(range(1, 33))  # answered from the cache
        assert secrets._parse_namespace.cache_info().hits >= 1

    def test_key_ids_are_unrelated_across_namespaces_and_bare_keys(self) -> None:
        """The same key in two namespaces, or bare, has three different ids."""
        a, b = b"\x01" * 32, b"\x02" * 32
        ids = {secrets.key_id(a, "k"), secrets.key_id(b, "k"), secrets.key_id(None, "k")}
        assert len(ids) == 3
        assert secrets.key_id(a, "k") == secrets.key_id(a, "k")

    def test_fingerprint_digests_are_keyed_and_bound_to_the_key(self) -> None:
        """The same fingerprint digests differently per namespace and per key."""
        ns = b"\x01" * 32
        kid = secrets.key_id(ns, "k")
        one = secrets.fingerprint_digest(ns, "k", kid, "fp")
        assert one != secrets.fingerprint_digest(b"\x02" * 32, "k", kid, "fp")
        assert one != secrets.fingerprint_digest(ns, "k2", secrets.key_id(ns, "k2"), "fp")
        bare = secrets.key_id(None, "k")
        assert secrets.fingerprint_digest(None, "k", bare, "fp") != secrets.fingerprint_digest(
            None, "k2", bare, "fp"
        )

    def test_stored_digests_are_made_as_they_always_were(self) -> None:
        """The digests are the stored ids: made any other way after an upgrade, every key
        would look never seen (completed work runs again, every owner is told lost). Each
        is written out here from its primitives, and one is pinned to its bytes."""
        import hashlib
        import hmac

        def mac(key: bytes, message: bytes) -> bytes:
            return hmac.digest(key, message, "sha256")

        tag = b"leasekeeper/v1/"
        ns, key, fp = bytes(range(32)), "invoice:2026-09-05", "fp-1"
        kid = secrets.key_id(ns, key)
        assert kid == mac(mac(ns, tag + b"namespace-key-id"), tag + b"key\x00" + key.encode())
        assert kid.hex() == "2f00fc96ebcc1d028875b34e221b60ef3137ad0bfba60cdb33eddfbc6679408e"
        fp_key = mac(ns, tag + b"namespace-fingerprint")
        assert secrets.fingerprint_digest(ns, key, kid, fp) == mac(
            fp_key, tag + b"fingerprint\x00" + kid + fp.encode()
        )
        # Each namespace's keyed HMAC states are kept and copied per use: again, the same.
        assert secrets.key_id(ns, key) == kid
        assert secrets.fingerprint_digest(ns, key, kid, fp) == mac(
            fp_key, tag + b"fingerprint\x00" + kid + fp.encode()
        )
        bare = "0123456789abcdef0123456789abcdef-K"
        bare_id = secrets.key_id(None, bare)
        assert bare_id == hashlib.sha256(tag + b"bare-key\x00" + bare.encode()).digest()
        assert secrets.fingerprint_digest(None, bare, bare_id, fp) == mac(
            bare.encode(), tag + b"fingerprint\x00" + bare_id + fp.encode()
        )
        token = secrets.format_owner_token(b"\x07" * 32)
        assert (
            secrets.owner_digest(token)
            == hashlib.sha256(tag + b"owner\x00" + token.encode()).digest()
        )

    def test_owner_digests_are_compared_in_constant_time(self) -> None:
        """The spec names hmac.compare_digest: an == would let timing tell how much of a
        guessed owner token's digest is right."""
        from unittest import mock

        token = secrets.format_owner_token(b"\x07" * 32)
        digest = secrets.owner_digest(token)
        with mock.patch.object(
            secrets.hmac, "compare_digest", wraps=secrets.hmac.compare_digest
        ) as spy:
            assert secrets.digests_equal(digest, secrets.owner_digest(token))
            assert not secrets.digests_equal(digest, secrets.owner_digest(token[:-1] + "A"))
        assert spy.call_count == 2

    def test_owner_tokens(self) -> None:
        """Owner tokens are own_ + 43 base64url characters; digests compare equal only to self."""
        token = secrets.format_owner_token(b"\x07" * 32)
        assert secrets.valid_owner_token(token)
        assert not secrets.valid_owner_token(token[:-1])
        assert secrets.digests_equal(secrets.owner_digest(token), secrets.owner_digest(token))
        other = secrets.format_owner_token(b"\x08" * 32)
        assert not secrets.digests_equal(secrets.owner_digest(token), secrets.owner_digest(other))


class TestFakeClock:
    def test_it_moves_only_forward_when_told(self) -> None:
        """advance moves forward; set refuses the past; jump_back is explicit."""
        clock = FakeClock(1000)
        assert clock.now_ms() == 1000
        assert clock.advance(1.5) == 2500
        with pytest.raises(ValueError, match="non-negative"):
            clock.advance(-1)
        with pytest.raises(ValueError, match="backwards"):
            clock.set(10)
        clock.jump_back(2)
        assert clock.now_ms() == 500


def test_records_are_immutable() -> None:
    """Records are frozen: a decision cannot mutate what a store holds."""
    record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
    with pytest.raises(AttributeError):
        record.owner = None  # type: ignore[misc]


def test_the_model_types_equal_only_their_own_and_hold_no_cycle() -> None:
    """Two outcomes of different types never compare equal, nor a record a tuple; and no
    field of a model type can hold a container, so no reference cycle can form through
    one and leaving them out of the garbage collector (``gc=False``) leaks nothing."""
    record = granted(decide_with_fence(None, acquire(), T0, Fences())).record
    assert Granted(record, T0) != Held(record, T0)
    assert record != tuple(getattr(record, name) for name in record.__struct_fields__)

    def leaves(kind: Any) -> list[Any]:
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            return [leaf for arg in typing.get_args(kind) for leaf in leaves(arg)]
        return [kind]

    structs = [getattr(model, name) for name in model.__all__]
    structs = [kind for kind in structs if isinstance(kind, type)]
    structs = [kind for kind in structs if issubclass(kind, msgspec.Struct)]
    assert len(structs) == 13
    for struct in structs:
        assert struct.__struct_config__.gc is False, struct
        for field in msgspec.structs.fields(struct):
            for leaf in leaves(field.type):
                assert leaf in (bytes, int, str, bool, type(None)) or issubclass(
                    leaf, enum.Enum | msgspec.Struct
                ), (struct, field.name, leaf)


def test_the_core_reads_no_clock_and_does_no_io() -> None:
    """The core's modules name no clock, randomness, thread, file or socket: the lease
    rules are functions of record, command and time, and nothing else."""
    core = Path(leasekeeper._core.__file__).parent
    forbidden = {
        "time.time", "time.time_ns", "time.monotonic", "time.monotonic_ns",
        "time.perf_counter", "datetime.now", "datetime.utcnow", "os.urandom",
        "random", "secrets.token_bytes", "threading", "socket", "open", "asyncio",
        "sqlite3", "psycopg", "subprocess",
    }  # fmt: skip
    for module in sorted(core.glob("*.py")):
        tree = ast.parse(module.read_text(), str(module))
        names = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not names & forbidden, (module.name, names & forbidden)
