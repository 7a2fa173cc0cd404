"""schemathesis against /openapi.json: every phase, valid and invalid data, every check.

In-process over ASGI (the real app on a memory store; input handling does not depend
on the store). Phases: examples (the document's request examples), coverage
(boundary and negative values derived from each schema) and fuzzing (positive and
negative, i.e. mutated, data). The stateful phase has nothing to run: the document
declares no links. Checks: every built-in one, except that a schema-valid request may
be refused for the two rules JSON Schema cannot state (the document's descriptions
say them): a key without a namespace needs 100 bits of entropy, and ``ttl_seconds`` and
``wait_seconds`` must be written as integers (``60.0`` is an integer to JSON Schema); and
a mint body of JSON whitespace only counts as no body.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from leasekeeper import FakeClock, LeaseService, Settings
from leasekeeper.http import create_app
from leasekeeper.store import MemoryStore
from tests import conftest

# Minting is limited per address by default; the fuzzer is one address minting a lot.
# An acquire with wait_seconds waits on timers that jump the store's fake clock, not for
# up to a minute of real time.
_CLOCK = FakeClock()
APP = create_app(
    LeaseService(MemoryStore(_CLOCK), timers=conftest.JumpingTimers(_CLOCK)),
    Settings(namespace_rate=1_000_000.0, namespace_burst=1_000_000),
    run_cleanup=False,
)


def _config(max_examples: int) -> Any:
    return schemathesis.Config.from_dict(
        {
            "generation": {"mode": "all", "max-examples": max_examples},
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
            },
        }
    )


FAST = schemathesis.openapi.from_asgi("/openapi.json", APP, config=_config(25))
SOAK = schemathesis.openapi.from_asgi("/openapi.json", APP, config=_config(1000))


@schemathesis.check
def positive_data_acceptance_but_entropy(ctx: Any, response: Any, case: Any) -> bool | None:
    """positive_data_acceptance, except for the two rules JSON Schema cannot state.

    A key without a namespace needs 100 bits of entropy; ``ttl_seconds`` and
    ``wait_seconds`` must be written as integers (``60.0`` is an integer to JSON Schema,
    and a float to the spec).
    """
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive and response.status_code == 400:
        error = str(response.json().get("error", ""))
        if "at least 100 bits of entropy" in error:
            return None
        body = case.body if isinstance(case.body, dict) else {}
        field = error.removeprefix("Invalid ").partition(":")[0]
        if error.startswith("Invalid ") and isinstance(body.get(field), float):
            return None  # ttl_seconds or wait_seconds written as 60.0
    result: bool | None = positive_data_acceptance(ctx, response, case)
    return result


@schemathesis.check
def negative_data_rejection_but_blank_mint(ctx: Any, response: Any, case: Any) -> bool | None:
    """negative_data_rejection, except that a mint body of JSON whitespace only (``echo |
    curl -d @-`` sends one) is taken as no body, as README's decisions say."""
    body = case.body.encode() if isinstance(case.body, str) else case.body
    blank = isinstance(body, bytes) and not body.strip(b" \t\r\n")
    if blank and case.path.endswith("/lease/namespace") and response.status_code == 201:
        return None
    result: bool | None = negative_data_rejection(ctx, response, case)
    return result


load_all_checks()
_REPLACED = {positive_data_acceptance, negative_data_rejection}
_OURS = [positive_data_acceptance_but_entropy, negative_data_rejection_but_blank_mint]
CHECK_SET = [c for c in CHECKS.get_all() if c not in _REPLACED and c not in _OURS] + _OURS

#: What the runs saw, for their summary lines: (run, mode) -> count, (run, status) -> count.
SEEN: dict[str, Counter[str]] = {"fast": Counter(), "soak": Counter()}


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Iterator[None]:
    yield
    for run, seen in SEEN.items():
        if not seen:
            continue
        statuses = " ".join(f"{k[7:]}:{v}" for k, v in sorted(seen.items()) if k[:7] == "status=")
        fivexx = sum(v for k, v in seen.items() if k.startswith("status=5"))
        conftest.RUN_SUMMARIES.append(
            f"schemathesis {run}: cases={seen['cases']} positive={seen['positive']} "
            f"negative={seen['negative']} 5xx={fivexx} statuses {statuses}"
        )


def _run(run: str, case: Any) -> None:
    response = case.call()
    seen = SEEN[run]
    seen["cases"] += 1
    seen["positive" if case.meta.generation.mode.is_positive else "negative"] += 1
    seen[f"status={response.status_code}"] += 1
    case.validate_response(response, checks=CHECK_SET)
    assert response.status_code < 500
    assert response.headers.get("cache-control") == ["no-store"]


@FAST.parametrize()
def test_the_api_survives_generated_input(case: Any) -> None:
    """No generated or mutated request gets a 5xx or an answer outside the document."""
    _run("fast", case)


@pytest.mark.soak
@pytest.mark.timeout(1800)
@SOAK.parametrize()
def test_the_api_survives_generated_input_soak(case: Any) -> None:
    """The same with up to 1000 fuzzed cases per operation."""
    _run("soak", case)


def test_the_document_states_the_rules_the_service_checks() -> None:
    """Request schemas carry the namespace and owner token shapes and the two key rules."""
    import jsonschema

    from leasekeeper.http._openapi import openapi_document

    document = openapi_document("/services/v1")
    schemas = document["components"]["schemas"]
    validator = jsonschema.Draft202012Validator
    renew = schemas["RenewBody"]
    example = document["paths"]["/services/v1/lease/renew"]["post"]["requestBody"]["content"]
    assert validator(renew).is_valid(example["application/json"]["example"])
    ns, token = "ns_" + "A" * 43, "own_" + "A" * 43
    good = [
        {"namespace": ns, "key": "invoice:2026-09-05", "owner_token": token},
        {"key": "9b2c4e1a-5d3f-4a7b-8c6e-0f1d2a3b4c5d", "owner_token": token},
    ]
    bad = [
        {"namespace": "ns_" + "A" * 42 + "B", "key": "k", "owner_token": token},  # not canonical
        {"namespace": ns, "key": "k\n", "owner_token": token},  # control character
        {"namespace": ns, "key": "", "owner_token": token},
        {"key": "short", "owner_token": token},  # a bare key needs 32 characters
        {"key": "x" * 31 + " ", "owner_token": token},  # and no whitespace
        {"namespace": ns, "key": "k", "owner_token": "own_short"},
        {"namespace": ns + "\n", "key": "k", "owner_token": token},  # Python's $ allows "\n"
        {"namespace": ns, "key": "k", "owner_token": token + "\n"},
        {"key": "9b2c4e1a-5d3f-4a7b-8c6e-0f1d2a3b4c5d\n", "owner_token": token},
    ]
    assert [validator(renew).is_valid(body) for body in good] == [True, True]
    assert [validator(renew).is_valid(body) for body in bad] == [False] * len(bad)
