"""Write the sync client from the async one, as encode/httpcore does with its own unasync.

``src/leasekeeper/client/_async.py`` is the one source of both clients. Its text is
rewritten by ``SUBSTITUTIONS`` (``async def`` to ``def``, ``AsyncLeaseClient`` to
``LeaseClient``, ``asyncio.Lock`` to ``threading.Lock``, ...), given the sync module's
docstring, and passed through ruff (the imports only the async side uses are dropped, the
rest sorted, the whole formatted) into ``_sync.py``::

    python scripts/unasync.py           # after editing _async.py: writes _sync.py
    python scripts/unasync.py --check   # exit 1 if _sync.py is not what it would write

``make test`` runs the check, as does ``tests/test_client_unasync.py``. A substitution
that no longer changes anything is an error too, so that the list says what is used.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "leasekeeper" / "client" / "_async.py"
TARGET = ROOT / "src" / "leasekeeper" / "client" / "_sync.py"

DOCSTRING = '''"""The synchronous client: ``LeaseClient`` and the ``HeldLease`` of its ``lease()``.

Generated from ``_async.py`` by ``scripts/unasync.py``: edit that module, then run
``python scripts/unasync.py``; ``make test`` fails while this one is not current.
"""
'''

#: (pattern, replacement), applied in this order to the whole text (``re.MULTILINE``).
SUBSTITUTIONS: list[tuple[str, str]] = [
    # What has no one-word twin. The sync client's default event is threading.Event:
    # AsyncSignal's import line goes, then the default itself is renamed.
    (r"^    AsyncSignal,\n", ""),
    (r"\bAsyncSignal\b", "threading.Event"),
    (r"^import asyncio$", "import threading"),
    (r"\basyncio\.ensure_future\b", "threading.Thread"),
    (r"\basyncio\.(Event|Lock)\b", r"threading.\1"),
    # What may cut a request short in a thread, as cancellation does in a task.
    (r"\basyncio\.CancelledError\b", "KeyboardInterrupt"),
    (r"\bAwaitable\[Any\]", "Any"),
    # Articles that change with the word after them ("an async with block").
    (r"\ban (``)?async with\b", r"a \1with"),
    (r"\ban (``)?Async(?=[A-Z])", r"a \1"),
    # Syntax.
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\baclose\b", "close"),
    (r"\baiter_bytes\b", "iter_bytes"),
    (r"\bhandle_async_request\b", "handle_request"),
    # A callback the async client awaits when it returns an awaitable is simply called.
    (r"\basync_(?:notify|call_soon)\(([\w.]+), ", r"\1("),
    # Names: AsyncX is X, async_x is x (the twins in _http and _renewer).
    (r"\bAbstractAsyncContextManager\b", "AbstractContextManager"),
    (r"\bAsync(?=[A-Z])", ""),
    (r"\basync_(?=[a-z])", ""),
    (r"signal_factory\b", "event_factory"),
    (r"task_factory\b", "thread_factory"),
    (r"\bTaskFactory\b", "ThreadFactory"),
]


def _ruff(args: list[str], text: str) -> str:
    done = subprocess.run(  # noqa: S603 - this interpreter's ruff, on our own text
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(TARGET), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"ruff {' '.join(args)} failed on the generated code:\n{done.stderr}")
    return done.stdout


def generate(source: str) -> tuple[str, list[str]]:
    """The sync module for the async ``source``; and the patterns that changed nothing."""
    unused = []
    for pattern, replacement in SUBSTITUTIONS:
        source, count = re.subn(pattern, replacement, source, flags=re.MULTILINE)
        if not count:
            unused.append(pattern)
    docstring = ast.parse(source).body[0]
    assert isinstance(docstring, ast.Expr) and docstring.end_lineno is not None
    lines = source.splitlines(keepends=True)
    source = DOCSTRING + "".join(lines[docstring.end_lineno :])
    # Without the async side's trailing commas: what renaming made short fits one line.
    compact = ["--config", "format.skip-magic-trailing-comma=true"]
    compact += ["--config", "lint.isort.split-on-trailing-comma=false"]
    source = _ruff(["check", "--fix-only", "--select", "F401,I", *compact], source)
    return _ruff(["format", *compact], source), unused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    check = parser.parse_args().check
    expected, unused = generate(SOURCE.read_text(encoding="utf-8"))
    if unused:
        print(f"{Path(__file__).name}: substitutions that changed nothing: {unused}")
        return 1
    current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
    if current == expected:
        return 0
    if not check:
        TARGET.write_text(expected, encoding="utf-8")
        print(f"wrote {TARGET.relative_to(ROOT)}")
        return 0
    diff = difflib.unified_diff(
        current.splitlines(keepends=True),
        expected.splitlines(keepends=True),
        str(TARGET.relative_to(ROOT)),
        "generated from _async.py",
    )
    sys.stdout.writelines(diff)
    print(f"\n{TARGET.relative_to(ROOT)} is not current: run python scripts/unasync.py")
    return 1


if __name__ == "__main__":
    sys.exit(main())
