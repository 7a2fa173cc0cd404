"""The README's curl session runs against a real server and answers as shown."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests._server import running_server

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```(sh|json)\n(.*?)```", re.DOTALL)
SEPARATOR = "@@@ end of block @@@"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(  # CI has both: there a missing one fails the run
        not os.environ.get("CI") and not (shutil.which("jq") and shutil.which("curl")),
        reason="needs jq and curl",
    ),
]


def api_section() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text[text.index("## The HTTP API") : text.index("### Values and rules")]
    return BLOCK.findall(section)


def same_shape(actual: dict[str, Any], shown: dict[str, Any]) -> None:
    assert set(actual) == set(shown)
    for field in ("ok", "status", "error", "result", "ttl_seconds", "retry_after_seconds"):
        if field in shown:
            assert actual[field] == shown[field], field


def test_the_curl_session_in_the_readme(tmp_path: Path) -> None:
    """Each sh block's last output line is JSON with the keys and values of the block after it."""
    blocks = api_section()
    assert len(blocks) >= 10
    with running_server(f"sqlite:///{tmp_path / 'readme.db'}", tmp_path / "log") as server:
        script = ["set -euo pipefail"]
        for lang, body in blocks:
            if lang == "sh":
                body = body.replace("http://127.0.0.1:8787", server.url)
                script += [body, f"echo; echo '{SEPARATOR}'"]
        run = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert run.returncode == 0, run.stderr
    outputs = run.stdout.split(SEPARATOR)
    checked = 0
    sh_index = -1
    for lang, body in blocks:
        if lang == "sh":
            sh_index += 1
            continue
        lines = [line for line in outputs[sh_index].splitlines() if line.strip()]
        same_shape(json.loads(lines[-1]), json.loads(body))
        checked += 1
    assert checked >= 10
