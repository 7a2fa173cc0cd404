"""The files the documentation shows: examples/ runs against a real server, and every
titled block (a crontab line, a systemd unit, an nginx configuration, MCP client
configurations, the make targets, the PostgreSQL commands) is proved as it is installed."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import Client, StdioServerParameters

import leasekeeper
from leasekeeper._service import OPERATIONS
from leasekeeper.mcp import TOOL_OPERATIONS
from tests._docs import DOCS, EXAMPLES, ROOT, all_blocks, titled
from tests._server import Server, free_port, running_server
from tests._stores import store_target
from tests._tools import required, self_signed

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
LEASEKEEPER = str(BIN / "leasekeeper")
#: Where the documentation installs leasekeeper, and where its crontab line's job lives.
INSTALLED = "/opt/leasekeeper/.venv/bin/leasekeeper"
INSTALLED_JOB = "/opt/leasekeeper/examples/nightly_report.sh"
#: The environment cron gives a command (Debian's and cronie's): no PATH of yours.
CRON_ENV = {"PATH": "/usr/bin:/bin", "SHELL": "/bin/sh", "LOGNAME": "cron"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("examples")
    with running_server(f"sqlite:///{directory / 'leasekeeper.db'}", directory / "log") as s:
        yield s


def one(title: str) -> str:
    """The body of the block titled ``title``; where several pages show it, they agree."""
    bodies = {block.body for block in titled(title)}
    assert len(bodies) == 1, f"the blocks titled {title!r} differ (or there is none)"
    return bodies.pop()


# -- examples/ ---------------------------------------------------------------------------------

#: The examples that are servers, not scripts: each runs until it is stopped, so the runner
#: below leaves it to the test named here, which serves it and runs its page's session
#: against it ("path::test function").
SERVED = {
    "webhook_middleware.py": (
        "tests/test_web_example.py::test_the_curl_session_of_the_docs_runs_as_shown"
    ),
}


@pytest.mark.parametrize(
    "example",
    sorted(p for p in EXAMPLES.glob("*.py") if p.name not in SERVED),
    ids=lambda p: p.name,
)
def test_an_example_runs_against_a_real_server(
    example: Path, server: Server, tmp_path: Path
) -> None:
    """Each Python example but the served ones runs to its end (each asserts what it
    shows) and prints it."""
    done = subprocess.run(
        [sys.executable, str(example)],
        cwd=tmp_path,
        env={**os.environ, "LEASEKEEPER_URL": server.url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip()


@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_served_example_is_proved_by_a_test_that_exists(name: str) -> None:
    """Each served example is a file of examples/, and the test that claims it is a test
    function of its file that names the example."""
    assert (EXAMPLES / name).is_file(), name
    path, _, function = SERVED[name].partition("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    tests = {
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    assert function in tests, SERVED[name]
    assert f'"{name}"' in source, f"{path} does not name examples/{name}"


def test_every_example_is_shown_and_every_shown_file_is_an_example() -> None:
    """A block titled with an examples/ path includes that file, and each file is shown."""
    shown = set()
    for block in all_blocks():
        if block.title and block.title.startswith("examples/"):
            assert block.body.strip() == f'--8<-- "{block.title}"', block
            assert (ROOT / block.title).is_file(), block
            shown.add(block.title)
    assert shown == {f"examples/{p.name}" for p in EXAMPLES.iterdir() if p.is_file()}


# -- every titled block is proved here ---------------------------------------------------------

PROVED = {
    "make",
    "crontab",
    "MCP client configuration (HTTP)",
    "MCP client configuration (stdio)",
    "/etc/systemd/system/leasekeeper.service",
    "/etc/nginx/conf.d/leasekeeper.conf",
    "on every instance",
    "two instances, one database",
    # docs/middleware.md's session, run against its example by tests/test_web_example.py.
    "middleware curl session",
}


def test_every_titled_block_is_proved_by_a_test_of_this_file() -> None:
    """No titled block goes unchecked, and no check here outlives its block (one title
    is proved by tests/test_web_example.py, as PROVED says)."""
    titles = {block.title for block in all_blocks() if block.title}
    assert {t for t in titles if not t.startswith("examples/")} == PROVED


def test_the_make_targets_shown_exist() -> None:
    """`make serve` runs the server, `make test` the docs build and the tests (dry runs)."""
    targets = re.findall(r"^make (\w+)", one("make"), re.MULTILINE)
    assert targets == ["serve", "test"]
    plans = {}
    for target in targets:
        done = subprocess.run(
            ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        plans[target] = done.stdout
    assert "leasekeeper serve" in plans["serve"]
    assert "mkdocs build --strict" in plans["test"]
    # mkdocs 1.6 drops warnings before it counts them under --quiet: the build would pass.
    assert "--quiet" not in plans["test"]
    assert "pytest" in plans["test"]


# -- the crontab line --------------------------------------------------------------------------


def cron_command(line: str) -> tuple[str, str | None]:
    """A crontab entry's command and its standard input, as cron reads them: an unescaped
    ``%`` ends the command and the rest, each ``%`` a newline, is its input; ``\\%`` is ``%``."""
    fields = line.split(None, 5)
    assert len(fields) == 6, line
    for field in fields[:5]:
        assert re.fullmatch(r"[\d*/,-]+", field), field
    command, stdin, i, raw = [], None, 0, fields[5]
    while i < len(raw):
        if raw.startswith("\\%", i):
            command.append("%")
            i += 2
            continue
        if raw[i] == "%":
            stdin = raw[i + 1 :].replace("%", "\n")
            break
        command.append(raw[i])
        i += 1
    return "".join(command), stdin


def test_cron_reads_a_percent_sign_as_the_end_of_the_command() -> None:
    """Why the line escapes it: unescaped, the command stops in the middle of $(date +."""
    (line,) = one("crontab").splitlines()
    command, stdin = cron_command(line.replace("\\%", "%"))
    assert command.endswith("$(date +") and stdin is not None


def test_the_crontab_line_runs_the_job_once_from_two_machines(
    server: Server, tmp_path: Path
) -> None:
    """Parsed as cron parses it and run with cron's environment on two machines at once:
    the job runs on one; the other waits, then prints the job's stored output and the
    stored status, skipped."""
    (line,) = one("crontab").splitlines()
    command, stdin = cron_command(line)
    assert stdin is None  # every % escaped
    for installed in (INSTALLED, INSTALLED_JOB, "/etc/leasekeeper/namespace.json"):
        assert installed in command
    namespace = tmp_path / "namespace.json"
    with namespace.open("w") as out:
        subprocess.run([LEASEKEEPER, "namespace", "--url", server.url], stdout=out, check=True)
    logs = [tmp_path / f"machine-{n}.log" for n in (1, 2)]
    machines = []
    for log in logs:
        local = (
            command.replace(INSTALLED, LEASEKEEPER)
            .replace(INSTALLED_JOB, str(EXAMPLES / "nightly_report.sh"))
            .replace("/etc/leasekeeper/namespace.json", str(namespace))
            .replace("https://leases.example.com", server.url)
            .replace("/var/log/nightly-report.log", str(log))
        )
        machines.append(
            subprocess.Popen(
                ["/bin/sh", "-c", local],
                cwd=tmp_path,
                env={**CRON_ENV, "HOME": str(tmp_path)},
                stdin=subprocess.DEVNULL,
            )
        )
    assert [machine.wait(120) for machine in machines] == [0, 0]
    texts = sorted((log.read_text() for log in logs), key=lambda text: '"skipped"' in text)
    ran, skipped = texts
    assert re.fullmatch(r"report for \d{4}-\d\d-\d\d by .+, fencing token \d+\n", ran), ran
    printed, report = skipped.splitlines(keepends=True)
    assert printed == ran  # the job's output, stored by --store-output
    stored = json.loads(report)
    assert stored["skipped"] is True and stored["result"] == {"exit_code": 0, "output": ran}


# -- MCP client configurations ------------------------------------------------------------------


def test_the_mcp_configurations_serve_the_tools_of_the_table(tmp_path: Path) -> None:
    """The HTTP and stdio client configurations each reach a server with the five tools of
    the MCP page's table, each running the operation of its route."""
    section = (DOCS / "mcp.md").read_text(encoding="utf-8")
    table = dict(re.findall(r"^\| `(\w+)` \| `(/lease[^`]*)` \|", section, re.MULTILINE))
    assert len(table) == 5
    http = json.loads(one("MCP client configuration (HTTP)"))["mcpServers"]["leasekeeper"]
    stdio = json.loads(one("MCP client configuration (stdio)"))["mcpServers"]["leasekeeper"]
    assert stdio["command"].endswith("/.venv/bin/leasekeeper") and stdio["command"][0] == "/"
    assert stdio["args"][:2] == ["mcp", "--store"]
    assert stdio["args"][2].startswith("sqlite:////")  # an absolute path, as the page asks
    stdio_server = StdioServerParameters(
        # The configuration's .venv/bin/leasekeeper, run with this checkout's sources.
        command=LEASEKEEPER,
        args=[*stdio["args"][:2], f"sqlite:///{tmp_path / 'leases.db'}"],
        env={"PYTHONPATH": str(Path(leasekeeper.__file__).parents[1])},
    )

    async def arguments(target: str | StdioServerParameters) -> dict[str, list[str]]:
        async with Client(target) as client:
            tools = (await client.list_tools()).tools
        return {tool.name: sorted(tool.input_schema.get("properties", {})) for tool in tools}

    with running_server(f"sqlite:///{tmp_path / 'http.db'}", tmp_path / "log") as server:
        assert http["url"] == "http://127.0.0.1:8787/mcp"
        over_http = anyio.run(arguments, server.url + "/mcp")
        document = httpx.get(server.url + "/openapi.json").json()
    over_stdio = anyio.run(arguments, stdio_server)
    assert over_http == over_stdio
    assert set(over_http) == set(table)
    for tool, route in table.items():
        body = document["paths"]["/services/v1" + route]["post"]["requestBody"]
        name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        assert OPERATIONS[TOOL_OPERATIONS[tool]][0].__name__ == name, tool


# -- the systemd unit ---------------------------------------------------------------------------


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, **kwargs: Any) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=1, **kwargs).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} did not become ready: {log.read_text()}")


def test_the_systemd_unit_verifies_and_its_exec_start_serves(tmp_path: Path) -> None:
    """`systemd-analyze verify` finds nothing to say about the unit (with ExecStart pointing
    at this checkout's command), and ExecStart with the unit's environment and umask serves,
    writes a private store, and stops cleanly on SIGTERM."""
    unit = one("/etc/systemd/system/leasekeeper.service")
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.MULTILINE)
    assert exec_start == f"{INSTALLED} serve"
    local = tmp_path / "leasekeeper.service"
    local.write_text(unit.replace(INSTALLED, LEASEKEEPER))
    analyze = required("systemd-analyze")
    verified = subprocess.run(
        [analyze, "verify", str(local)], capture_output=True, text=True, timeout=60, check=False
    )
    assert verified.returncode == 0, verified.stderr
    assert "leasekeeper.service" not in verified.stderr, verified.stderr  # no warning about it

    environment = dict(re.findall(r"^Environment=(\w+)=(.*)$", unit, re.MULTILINE))
    assert environment["LEASEKEEPER_STORE"] == "sqlite:////var/lib/leasekeeper/leasekeeper.db"
    assert "StateDirectory=leasekeeper" in unit and "UMask=0077" in unit
    state = tmp_path / "state"  # what StateDirectory= makes: /var/lib/leasekeeper
    state.mkdir()
    port = free_port()
    environment |= {
        "LEASEKEEPER_STORE": f"sqlite:///{state / 'leasekeeper.db'}",
        "LEASEKEEPER_PORT": str(port),
    }
    log = tmp_path / "journal.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    with log.open("wb") as journal:
        process = subprocess.Popen(
            exec_start.replace(INSTALLED, LEASEKEEPER).split(),
            env={**env, **environment},
            stdout=journal,
            stderr=journal,
            umask=0o077,
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz", process, log)
        assert (state / "leasekeeper.db").stat().st_mode & 0o077 == 0
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(30)
    assert returncode == -signal.SIGTERM, log.read_text()  # what systemd counts as a clean stop


# -- the nginx configuration --------------------------------------------------------------------


@contextlib.contextmanager
def nginx_in_front(conf: str, directory: Path) -> Iterator[tuple[int, int]]:
    """nginx with ``conf`` as its only server configuration; (http port, https port)."""
    nginx = required("nginx")
    http_port, https_port = free_port(), free_port()
    site = directory / "leasekeeper.conf"
    site.write_text(
        conf.replace("listen 80;", f"listen 127.0.0.1:{http_port};").replace(
            "listen 443 ssl;", f"listen 127.0.0.1:{https_port} ssl;"
        )
    )
    temp = "\n".join(
        f"    {kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = directory / "nginx.conf"
    main.write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"worker_processes 1;\npid {directory / 'nginx.pid'};\n"
        + "events { worker_connections 64; }\n"
        + f"http {{\n    access_log {directory / 'access.log'};\n{temp}\n"
        + f"    include {site};\n}}\n"
    )
    log = directory / "error.log"
    process = subprocess.Popen(
        [nginx, "-p", str(directory), "-c", str(main), "-e", str(log), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{http_port}/", timeout=1)
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield http_port, https_port
    finally:
        process.send_signal(signal.SIGQUIT)  # nginx's graceful stop
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_the_nginx_configuration_terminates_tls_in_front_of_a_real_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a self-signed certificate: the API and /mcp answer through HTTPS, and plain
    HTTP is refused rather than redirected."""
    conf = one("/etc/nginx/conf.d/leasekeeper.conf")
    cert, key = self_signed(tmp_path)
    conf = conf.replace(
        "/etc/letsencrypt/live/leases.example.com/fullchain.pem", str(cert)
    ).replace("/etc/letsencrypt/live/leases.example.com/privkey.pem", str(key))
    with running_server(f"sqlite:///{tmp_path / 'lk.db'}", tmp_path / "server.log") as server:
        conf = conf.replace("http://127.0.0.1:8787", server.url)
        with nginx_in_front(conf, tmp_path) as (http_port, https_port):
            base = f"https://127.0.0.1:{https_port}"
            verify = ssl.create_default_context(cafile=str(cert))
            with httpx.Client(base_url=base, verify=verify, timeout=10) as https:
                minted = https.post("/services/v1/lease/namespace")
                assert minted.status_code == 201, minted.text
                namespace = minted.json()["namespace"]
                body = {"namespace": namespace, "key": "invoice:2026-09-05"}
                acquired = https.post("/services/v1/lease", json=body)
                assert acquired.status_code == 201 and acquired.json()["status"] == "held"
                assert https.get("/readyz").status_code == 200
            plain = httpx.post(
                f"http://127.0.0.1:{http_port}/services/v1/lease/namespace", timeout=10
            )
            assert plain.status_code == 403 and "https://" in plain.text

            monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the MCP SDK's httpx trusts it

            async def tools() -> list[str]:
                async with Client(base + "/mcp") as client:
                    return sorted(tool.name for tool in (await client.list_tools()).tools)

            assert len(anyio.run(tools)) == 5  # Host passes /mcp's check through the proxy


# -- PostgreSQL: several instances ---------------------------------------------------------------


@pytest.mark.postgres
def test_two_instances_on_one_database_answer_as_one(tmp_path: Path) -> None:
    """The page's commands, on a database schema of the test's own: each instance serves
    (`on every instance`), and a lease taken at one is held, released and re-granted with
    a higher fence across both (`two instances, one database`)."""
    required("curl")
    required("jq")
    every = one("on every instance")
    two = one("two instances, one database")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    with store_target("postgres", tmp_path) as target:
        # on every instance: the URL is the database's, the port a free one
        one_port = free_port()
        script = re.sub(r"LEASEKEEPER_STORE=\S+", f"LEASEKEEPER_STORE='{target.url}'", every)
        script = script.replace("--port 8787", f"--port {one_port}")
        log = tmp_path / "instance.log"
        with log.open("wb") as sink:
            instance = subprocess.Popen(
                ["bash", "-c", f"set -e\n{script.rstrip()}"],
                env=env,
                stdout=sink,
                stderr=sink,
                start_new_session=True,
            )
        try:
            wait_ready(f"http://127.0.0.1:{one_port}/readyz", instance, log)
        finally:
            os.killpg(instance.pid, signal.SIGTERM)
            instance.wait(30)

        ports = free_port(), free_port()
        script = re.sub(r"LEASEKEEPER_STORE=\S+", f"LEASEKEEPER_STORE='{target.url}'", two)
        script = script.replace("8787", str(ports[0])).replace("8788", str(ports[1]))
        done = subprocess.run(
            ["bash", "-c", "set -euo pipefail\ntrap 'kill $(jobs -p)' EXIT\n" + script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    answers = [json.loads(line) for line in done.stdout.replace("}{", "}\n{").splitlines()]
    held, released, regranted = answers[-3:]
    assert held["status"] == "held" and held["ok"] is False and held["fencing_token"] == 1
    assert released == {"ok": True, "status": "released", "fencing_token": 1}
    assert regranted["status"] == "held" and regranted["fencing_token"] == 2
