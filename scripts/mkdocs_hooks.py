"""mkdocs hooks: parts of the documentation rendered from the code they describe.

``<!-- settings-table -->`` in a page becomes the table of every setting, built from
``leasekeeper.Settings``: the variable from the field's name, the default from the
field, the meaning from the field's docstring, and the flag from the ``leasekeeper``
commands that take one. A field without a docstring fails the build.

``<!-- request-fields -->`` becomes the table of every request body's fields, built from
the request models where each field's type and bounds are declared (``field_table``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
from importlib.metadata import entry_points
from typing import Any

import click

import leasekeeper
from leasekeeper._schemas import field_table
from leasekeeper._service import OPERATIONS

SETTINGS_MARKER = "<!-- settings-table -->"
FIELDS_MARKER = "<!-- request-fields -->"
_PREFIX = "LEASEKEEPER_"


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs' hook: replace the settings marker with the table."""
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, settings_table())
    if FIELDS_MARKER in markdown:
        markdown = markdown.replace(FIELDS_MARKER, fields_table())
    return markdown


def field_docs(cls: type) -> dict[str, str]:
    """Each annotated field's docstring (the string literal right after it), by name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field, after in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = " ".join(after.value.value.split())
    return docs


def _flags() -> dict[str, list[str]]:
    """For each setting with a command-line flag, ``--flag`` and the commands taking it."""
    (script,) = (ep for ep in entry_points(group="console_scripts") if ep.name == "leasekeeper")
    main = script.load()
    found: dict[str, list[str]] = {}
    context = click.Context(main)  # the server's commands load through it, on first use
    for name in main.list_commands(context):
        command = main.get_command(context, name)
        for param in command.params:
            if isinstance(param, click.Option) and param.name:
                found.setdefault(param.name, []).append(name)
    return found


def _default(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def settings_table() -> str:
    """The markdown table of every field of ``leasekeeper.Settings``."""
    docs = field_docs(leasekeeper.Settings)
    flags = _flags()
    rows = [
        "| variable | flag | default | meaning |",
        "|---|---|---|---|",
    ]
    for field in dataclasses.fields(leasekeeper.Settings):
        if field.name not in docs:
            raise ValueError(f"Settings.{field.name} has no docstring to document it")
        meaning = re.sub(r"``(.+?)``", r"`\1`", docs[field.name])
        commands = flags.get(field.name, [])
        flag = f"`--{field.name.replace('_', '-')}` ({', '.join(commands)})" if commands else ""
        variable = f"`{_PREFIX}{field.name.upper()}`"
        rows.append(f"| {variable} | {flag} | {_default(field.default)} | {meaning} |")
    return "\n".join(rows)


def fields_table() -> str:
    """The markdown table of every request field: its type, the operations that take
    it, whether it is required, and its rule, as the request models declare them."""
    rows: dict[tuple[str, ...], list[str]] = {}
    for operation, (model, _) in OPERATIONS.items():
        for row in field_table(model):
            rows.setdefault((row.field, row.type, row.presence, row.rule), []).append(operation)
    lines = ["| field | type | in | presence | rule |", "|---|---|---|---|---|"]
    for (field, kind, presence, rule), operations in rows.items():
        lines.append(f"| `{field}` | {kind} | {', '.join(operations)} | {presence} | {rule} |")
    return "\n".join(lines)
