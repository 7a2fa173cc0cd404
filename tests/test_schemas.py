"""The request declarations' field tables (for the docs) say what the models take."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from leasekeeper._core.validation import (
    DEFAULT_TTL_SECONDS,
    MAX_FINGERPRINT_CHARS,
    MAX_KEY_CHARS,
    MAX_RESULT_BYTES,
    MAX_TTL_SECONDS,
    MAX_WAIT_SECONDS,
    MIN_BARE_KEY_BITS,
    MIN_BARE_KEY_CHARS,
)
from leasekeeper._schemas import FieldRow, field_table
from leasekeeper._service import OPERATIONS

#: What each field's rule must state, in the words the docs show.
STATED = {
    "namespace": ["ns_", "43 base64url"],
    "key": [str(MAX_KEY_CHARS), str(MIN_BARE_KEY_CHARS), f"{MIN_BARE_KEY_BITS:.0f} bits"],
    "ttl_seconds": [str(MAX_TTL_SECONDS), f"default {DEFAULT_TTL_SECONDS}"],
    "fingerprint": [str(MAX_FINGERPRINT_CHARS)],
    "wait_seconds": [str(MAX_WAIT_SECONDS), "default 0"],
    "owner_token": ["own_", "43 base64url"],
    "result": [f"{MAX_RESULT_BYTES:,} bytes"],
}
JSON_TYPES = {str: "string", int: "integer"}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_each_operation_s_field_table_lists_its_model_s_fields(operation: str) -> None:
    model: type[BaseModel] = OPERATIONS[operation][0]
    rows = field_table(model)
    assert [row.field for row in rows] == list(model.model_fields)
    for row, (name, info) in zip(rows, model.model_fields.items(), strict=True):
        assert isinstance(row, FieldRow)
        if info.is_required():
            assert row.presence == "required", name
        elif info.default is None:
            assert row.presence == "optional", name
        else:
            assert row.presence == f"optional, default {info.default}", name
        accepted = [kind for kind in (str, int) if kind in _types(info.annotation)]
        assert row.type == (JSON_TYPES[accepted[0]] if accepted else "any JSON value"), name
        for words in STATED[name]:
            assert words in row.rule, (name, words)


def _types(annotation: object) -> set[object]:
    """The plain types an annotation admits (``str | None`` -> {str, None})."""
    args = getattr(annotation, "__args__", None)
    if args is None:
        return {getattr(annotation, "__origin__", annotation)}
    return {kind for arg in args for kind in _types(arg)}


def test_the_tables_cover_every_request_field() -> None:
    fields = {row.field for model, _ in OPERATIONS.values() for row in field_table(model)}
    assert fields == set(STATED)
    assert field_table(OPERATIONS["namespace"][0]) == []
