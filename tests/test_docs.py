"""The README and every documentation page: their examples run against a real server and
answer as shown, their blocks follow the convention, and the README stays an introduction."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import leasekeeper
from tests._docs import DOCS_URL, README, ROOT, Block, blocks, page_name, pages
from tests._server import running_server

pytestmark = pytest.mark.slow

SEPARATOR = "@@@ end of block @@@"
#: Fields of a shown answer that the real one must repeat exactly; the others (tokens,
#: times, fences) must only have the same type.
EXACT = ("ok", "status", "error", "result", "ttl_seconds", "retry_after_seconds")
BIN = str(Path(sys.executable).parent)


def runnable(path: Path) -> bool:
    return any(b.title is None and b.language in ("sh", "python") for b in blocks(path))


RUNNABLE = [path for path in pages() if runnable(path)]


def test_every_page_with_examples_is_run() -> None:
    """The pages whose examples run are the ones a newcomer reads first, and more."""
    names = {page_name(path) for path in RUNNABLE}
    assert {
        "README.md",
        "docs/getting-started.md",
        "docs/http-api.md",
        "docs/python-client.md",
        "docs/cli.md",
        "docs/mcp.md",
        "docs/operations.md",
        "docs/deployment.md",
        "docs/recipes/scheduled-jobs.md",
        "docs/middleware.md",
    } <= names


@pytest.mark.parametrize("path", pages(), ids=page_name)
def test_every_block_follows_the_convention(path: Path) -> None:
    """An untitled block is sh, python, text, or json right after sh; titled blocks are
    tests/test_examples.py's to prove."""
    previous: Block | None = None
    for block in blocks(path):
        if block.title is None:
            assert block.language in ("sh", "python", "json", "text"), block
            if block.language == "json":
                assert previous is not None, block
                assert previous.language == "sh" and previous.title is None, (
                    f"{block}: a json block shows the output of the sh block just before it"
                )
        previous = block


def same_shape(actual: dict[str, Any], shown: dict[str, Any], where: str) -> None:
    assert set(actual) == set(shown), where
    for field, value in shown.items():
        if field in EXACT:
            assert actual[field] == value, (where, field)
        else:
            assert type(actual[field]) is type(value), (where, field)


def shell_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", "HOME": str(tmp_path)}


def run_shell(page: list[Block], url: str, cwd: Path) -> list[str]:
    """The page's untitled sh blocks as one bash session; each block's output."""
    script = ["set -euo pipefail"]
    for block in page:
        if block.language == "sh" and block.title is None:
            script += [block.body.replace(DOCS_URL, url), f"echo; echo '{SEPARATOR}'"]
    if not os.environ.get("CI"):  # CI installs them all (.ci/run)
        for tool in ("bash", "curl", "jq", "sqlite3"):
            if re.search(rf"\b{tool}\b", "\n".join(script[1:]) + " bash") and not shutil.which(
                tool
            ):
                pytest.skip(f"the shell examples need {tool}")
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=cwd,
        env=shell_env(cwd),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split(SEPARATOR)[:-1]


def check_outputs(page: list[Block], outputs: list[str]) -> None:
    """Each json block against the last line its sh block printed."""
    sh_index = -1
    for block in page:
        if block.title is not None:
            continue
        if block.language == "sh":
            sh_index += 1
        elif block.language == "json":
            lines = [line for line in outputs[sh_index].splitlines() if line.strip()]
            assert lines, f"{block}: its sh block printed nothing"
            same_shape(json.loads(lines[-1]), json.loads(block.body), str(block))


def run_python(page: list[Block], url: str) -> dict[str, Any]:
    """The page's untitled python blocks, in order, in one namespace."""
    scope: dict[str, Any] = {"__name__": "docs_example"}
    try:
        for block in page:
            if block.language == "python" and block.title is None:
                code = compile(block.body.replace(DOCS_URL, url), block.page, "exec")
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(code, scope)  # noqa: S102 - the documentation's own examples
    finally:
        for value in scope.values():  # what the examples left open
            if isinstance(value, leasekeeper.LeaseClient):
                value.close()
    return scope


def check_python_client(cwd: Path, outputs: list[str], scope: dict[str, Any]) -> None:
    assert scope["receipt"]["receipt_id"] == 4817
    rows = scope["db"].execute("SELECT status FROM invoices WHERE id = 4817").fetchall()
    assert rows == [("paid",)]
    assert scope["guard"].current("invoice:4817") is not None
    scope["db"].close()


def check_cli(cwd: Path, outputs: list[str], scope: dict[str, Any]) -> None:
    assert (cwd / "reports.log").read_text() == "report\n"  # the job ran once
    assert (cwd / "ns.json").stat().st_mode & 0o077 == 0  # umask 077
    assert json.loads((cwd / "lease.json").read_text())["status"] == "held"


def check_mcp(cwd: Path, outputs: list[str], scope: dict[str, Any]) -> None:
    """The piped stdio calls, with and without a handshake, each mint a namespace."""
    answers = [json.loads(line) for line in outputs[0].splitlines() if line.strip()]
    assert [answer["id"] for answer in answers] == [0, 1, 1]
    for answer in answers[1:]:
        minted = answer["result"]["structuredContent"]
        assert minted["ok"] is True and minted["namespace"].startswith("ns_")


def check_scheduled_jobs(cwd: Path, outputs: list[str], scope: dict[str, Any]) -> None:
    assert scope["processed"] == ["invoice:1001", "invoice:1002", "invoice:1003"]
    namespace = json.loads((cwd / "namespace.json").read_text())["namespace"]
    assert namespace.startswith("ns_")


def check_deployment(cwd: Path, outputs: list[str], scope: dict[str, Any]) -> None:
    with contextlib.closing(sqlite3.connect(cwd / "leasekeeper-backup.db")) as backup:
        assert backup.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert backup.execute("SELECT count(*) FROM leases").fetchone()[0] > 0


#: What a page's examples leave behind that its json blocks cannot show.
PAGE_CHECKS: dict[str, Callable[[Path, list[str], dict[str, Any]], None]] = {
    "docs/python-client.md": check_python_client,
    "docs/cli.md": check_cli,
    "docs/mcp.md": check_mcp,
    "docs/recipes/scheduled-jobs.md": check_scheduled_jobs,
    "docs/deployment.md": check_deployment,
}


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One server for every page, as `make serve` runs it: its store is ./leasekeeper.db in
    the directory the examples run in. Each page mints its own namespace."""
    directory = tmp_path_factory.mktemp("docs")
    store = f"sqlite:///{directory / 'leasekeeper.db'}"
    with running_server(store, directory / "server.log") as server:
        yield server.url, directory


@pytest.mark.parametrize("path", RUNNABLE, ids=page_name)
def test_the_examples_of_a_page_run_as_shown(path: Path, docs_server: tuple[str, Path]) -> None:
    """A page's shell session and Python session run against a real server, and each
    answer has the shape shown."""
    url, directory = docs_server
    page = blocks(path)
    name = page_name(path)
    outputs = run_shell(page, url, directory)
    check_outputs(page, outputs)
    with working_directory(directory):
        scope = run_python(page, url)
    if name in PAGE_CHECKS:
        PAGE_CHECKS[name](directory, outputs, scope)


def test_the_readme_is_an_introduction() -> None:
    """At most 200 lines, with the two commands, every quickstart, and links into the docs."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for needed in ("make serve", "make test", "client.once", "leasekeeper run", "mcpServers"):
        assert needed in text, needed
    assert "docs/getting-started.md" in text


@pytest.mark.parametrize("path", pages(), ids=page_name)
def test_relative_links_lead_to_files(path: Path) -> None:
    """A link to a file of the repository names one that exists (mkdocs checks the pages'
    links into the site; this also covers the README's, which mkdocs does not build)."""
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = (path.parent / target.split("#", 1)[0]).resolve()
        assert file.exists(), f"{page_name(path)}: {target}"


@pytest.mark.parametrize("path", pages(), ids=page_name)
def test_no_project_internal_notes(path: Path) -> None:
    """The docs stand alone: no pointer to a contract file that is not shipped, no issue
    numbers, no private module names."""
    text = path.read_text(encoding="utf-8")
    assert "SPEC.md" not in text
    assert not re.search(r"\(issue \d+\)|the hardening issue", text)
    # The history is a record, modules named as each run named them; the performance
    # page's register of speed tricks names each trick by the code it lives in.
    if path.name not in ("performance-history.md", "performance.md"):
        assert not re.search(r"leasekeeper\._|\bstore/_|\b_core\b", text), page_name(path)


def load_hooks() -> Any:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts/mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_table_is_rendered_from_settings() -> None:
    """Every field of Settings is one row, with its variable, default and docstring; the
    page holds the marker the hook replaces, not a copy of the table."""
    hooks = load_hooks()
    table = hooks.settings_table()
    rows = table.splitlines()[2:]
    fields = leasekeeper.Settings.__dataclass_fields__
    assert len(rows) == len(fields)
    for row, field in zip(rows, fields.values(), strict=True):
        assert row.startswith(f"| `LEASEKEEPER_{field.name.upper()}` |"), row
    assert "`--store` (cleanup, fence, mcp, serve)" in table
    page = (ROOT / "docs/operations.md").read_text(encoding="utf-8")
    assert hooks.SETTINGS_MARKER in page
    assert "| `LEASEKEEPER_STORE`" not in page
    assert hooks.on_page_markdown(page).count("LEASEKEEPER_CLEANUP_BATCH") >= 2


def test_the_request_fields_table_is_rendered_from_the_models() -> None:
    """Every field of every request model is in one row of the HTTP API page's table, with
    the operations that take it; the page holds the marker, not a copy of the table."""
    from leasekeeper._service import OPERATIONS

    hooks = load_hooks()
    rows = hooks.fields_table().splitlines()[2:]
    taken: dict[str, set[str]] = {}
    for row in rows:
        field, _, operations = (cell.strip() for cell in row.strip("|").split("|")[:3])
        taken.setdefault(field.strip("`"), set()).update(operations.split(", "))
    expected: dict[str, set[str]] = {}
    for operation, (model, _) in OPERATIONS.items():
        for name in model.model_fields:
            expected.setdefault(name, set()).add(operation)
    assert taken == expected
    page = (ROOT / "docs/http-api.md").read_text(encoding="utf-8")
    assert hooks.FIELDS_MARKER in page
    assert "| `ttl_seconds` |" not in page
