"""The README's curl session runs against a real server and answers as shown; its MCP
configurations start servers with the tools its table lists."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client, StdioServerParameters

import leasekeeper
from leasekeeper._service import OPERATIONS
from leasekeeper.mcp import TOOL_OPERATIONS
from tests._server import running_server

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```(sh|json)\n(.*?)```", re.DOTALL)
SEPARATOR = "@@@ end of block @@@"

pytestmark = pytest.mark.slow


def api_section() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text[text.index("## The HTTP API") : text.index("### Values and rules")]
    return BLOCK.findall(section)


def same_shape(actual: dict[str, Any], shown: dict[str, Any]) -> None:
    assert set(actual) == set(shown)
    for field in ("ok", "status", "error", "result", "ttl_seconds", "retry_after_seconds"):
        if field in shown:
            assert actual[field] == shown[field], field


@pytest.mark.skipif(  # CI has both: there a missing one fails the run
    not os.environ.get("CI") and not (shutil.which("jq") and shutil.which("curl")),
    reason="needs jq and curl",
)
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


def test_the_mcp_configurations_in_the_readme_serve_the_tools_of_its_table(tmp_path: Path) -> None:
    """The README's two client configurations, streamable HTTP and stdio, each reach a
    server with the five tools of its table, each running the operation of its route."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## MCP for AI agents") : text.index("**An agent's flow.**")]
    table = dict(re.findall(r"^\| `(\w+)` \| `(/lease[^`]*)` \|", section, re.MULTILINE))
    assert len(table) == 5
    http, stdio = (
        json.loads(block)["mcpServers"]["leasekeeper"]
        for block in re.findall(r"```json\n(.*?)```", section, re.DOTALL)
    )
    assert stdio["args"][:2] == ["mcp", "--store"]
    store = stdio["args"][2]
    assert store.startswith("sqlite:////")  # an absolute path, as the README asks
    stdio_server = StdioServerParameters(
        # The README's .venv/bin/leasekeeper, run with this checkout's sources.
        command=str(Path(sys.executable).parent / "leasekeeper"),
        args=[*stdio["args"][:2], f"sqlite:///{tmp_path / 'leases.db'}"],
        env={"PYTHONPATH": str(Path(leasekeeper.__file__).parents[1])},
    )

    async def arguments(server: str | StdioServerParameters) -> dict[str, list[str]]:
        async with Client(server) as client:
            tools = (await client.list_tools()).tools
        return {tool.name: sorted(tool.input_schema.get("properties", {})) for tool in tools}

    with running_server(f"sqlite:///{tmp_path / 'http.db'}", tmp_path / "log") as server:
        assert http["url"].startswith("http://127.0.0.1:8787/")
        over_http = anyio.run(arguments, http["url"].replace("http://127.0.0.1:8787", server.url))
        document = httpx.get(server.url + "/openapi.json").json()
    over_stdio = anyio.run(arguments, stdio_server)
    assert over_http == over_stdio
    assert set(over_http) == set(table)
    for tool, route in table.items():
        body = document["paths"]["/services/v1" + route]["post"]["requestBody"]
        name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        assert OPERATIONS[TOOL_OPERATIONS[tool]][0].__name__ == name, tool
