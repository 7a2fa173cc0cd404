"""The public surface of leasekeeper and leasekeeper.client is what __all__ says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import leasekeeper
import leasekeeper.client


def test_all_is_sorted_and_importable() -> None:
    """Each __all__ is sorted and names only attributes that exist."""
    for module in (leasekeeper, leasekeeper.client):
        assert module.__all__ == sorted(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__)


def test_the_clients_are_exported_from_the_top() -> None:
    """from leasekeeper import LeaseClient, AsyncLeaseClient works, with the client errors."""
    for name in ("AsyncLeaseClient", "LeaseClient", "ServiceUnreachable", "StaleFence"):
        assert name in leasekeeper.__all__
    assert leasekeeper.LeaseClient is leasekeeper.client.LeaseClient


def test_implementation_modules_are_private() -> None:
    """Every public name of leasekeeper.client is defined in a _-prefixed module."""
    for name in leasekeeper.client.__all__:
        module = getattr(leasekeeper.client, name).__module__
        assert module.rsplit(".", 1)[-1].startswith("_"), (name, module)


def test_a_users_code_is_type_checked_against_the_package(tmp_path: Path) -> None:
    """The package ships ``py.typed`` (PEP 561): mypy in a user's project reads
    leasekeeper's annotations instead of refusing it as an untyped library, catches a
    wrong call to the client, and finds nothing wrong in the Python client page's examples
    (run as one module, as they are written: later ones use the first one's names)."""
    page = Path(__file__).resolve().parent.parent / "docs" / "python-client.md"
    examples = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    assert len(examples) >= 4
    (tmp_path / "readme_examples.py").write_text("\n".join(examples))
    (tmp_path / "job.py").write_text(
        "from leasekeeper import LeaseClient\n"
        "client = LeaseClient('http://127.0.0.1:8787')\n"
        "reveal_type(client.create_namespace())\n"
        "client.create_namespace(42)\n"
    )
    files = ["job.py", "readme_examples.py"]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the project: its configuration and src/ are not the user's
        check=False,
    )
    out = done.stdout
    assert "missing library stubs or py.typed marker" not in out, out
    assert re.search(r'job.py:3: note: Revealed type is "(builtins\.)?str"', out), out
    assert 'job.py:4: error: Too many arguments for "create_namespace"' in out, out
    assert "Found 1 error in 1 file (checked 2 source files)" in out, out
