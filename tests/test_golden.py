"""A fixed conversation with a real server answers byte for byte as recorded.

The HTTP API, the MCP tools (over streamable HTTP and over stdio) and the command
line are driven through one fixed script each; every answer is compared with
``tests/golden/conversation.json``. Only what differs from run to run by design is
normalized: secrets (``ns_…``, ``own_…``), times and waits, request ids, ``Date``
headers and ``Content-Length`` where it counts a normalized body. A change to what a client sees
fails here; a deliberate one re-records the file with ``LEASEKEEPER_RECORD_GOLDEN=1``
and the diff of that file is the review of the change.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._server import Server, running_server

GOLDEN = Path(__file__).resolve().parent / "golden" / "conversation.json"
RECORD = bool(os.environ.get("LEASEKEEPER_RECORD_GOLDEN"))

pytestmark = pytest.mark.slow

BARE_KEY = "Zq3vK9xW2mT7pL4sB8nD1fH6jR5cY0gA-uE_oI"  # 38 random-looking characters
API = "/services/v1"


class Normalizer:
    """Replaces what changes between runs with stable placeholders, numbering each
    distinct secret by its first appearance so that equal secrets stay equal."""

    _SECRET = re.compile(r"\b(ns|own)_[A-Za-z0-9_-]{43}")
    _RULES: tuple[tuple[re.Pattern[str], str], ...] = (
        (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), "<iso>"),
        (re.compile(r"(_timestamp[\\\\\"]*\s*:\s*)\d{9,}"), r"\1<ts>"),
        (re.compile(r"(?im)^(date|x-request-id): [^\r\n]*"), r"\1: <varies>"),
        (re.compile(r"\"request_id\":\s*\"[0-9a-f]+\""), '"request_id":"<varies>"'),
        (re.compile(r"leasekeeper \d+\.\d+\.\d+\S*"), "leasekeeper <version>"),
        # The wait left shrinks while a loaded machine starts the next process.
        (re.compile(r"(retry_after_seconds[\\\"]*\s*:\s*)\d+"), r"\1<s>"),
        (re.compile(r"(?im)^(retry-after): \d+"), r"\1: <s>"),
    )

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        def secret(match: re.Match[str]) -> str:
            value = match.group(0)
            if value not in self.seen:
                count = sum(1 for v in self.seen if v.startswith(match.group(1)))
                self.seen[value] = f"<{match.group(1)}{count}>"
            return self.seen[value]

        text = self._SECRET.sub(secret, text)
        for pattern, replacement in self._RULES:
            text = pattern.sub(replacement, text)
        return text


def raw_exchange(server: Server, request: bytes) -> str:
    """Send one request on a new connection and read the whole answer (until close)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "backslashreplace")


def http_request(
    method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def without_length(answer: str) -> str:
    """The answer with its Content-Length dropped: it counts bytes that were normalized."""
    return re.sub(r"(?im)^content-length: \d+\r\n", "", answer)


class Recorder:
    """Collects (name, answer) pairs; compares with or records the golden file."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}

    def add(self, name: str, answer: Any) -> None:
        assert name not in self.answers, name
        self.answers[name] = answer


@pytest.fixture(scope="module")
def recorded() -> Iterator[dict[str, Any]]:
    """The golden file's sections; at the end of the module, a recording run writes them."""
    sections: dict[str, Any] = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    fresh: dict[str, Any] = {}
    yield fresh if RECORD else sections
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        merged = {**sections, **fresh}
        GOLDEN.write_text(json.dumps(merged, indent=1, ensure_ascii=False, sort_keys=True) + "\n")


def compare(recorded: dict[str, Any], section: str, recorder: Recorder) -> None:
    if RECORD:
        recorded[section] = recorder.answers
        return
    assert section in recorded, f"no recording of {section}: run with LEASEKEEPER_RECORD_GOLDEN=1"
    expected = recorded[section]
    for name in expected.keys() | recorder.answers.keys():
        assert recorder.answers.get(name) == expected.get(name), name


def http_conversation(server: Server, norm: Normalizer) -> Recorder:
    rec = Recorder()

    def ask(name: str, method: str, path: str, body: bytes | None = None, **headers: str) -> str:
        answer = norm(raw_exchange(server, http_request(method, path, body, headers)))
        rec.add(name, without_length(answer))
        return answer

    def post(name: str, route: str, document: Any) -> dict[str, Any]:
        data = document if isinstance(document, bytes) else json.dumps(document).encode()
        raw = raw_exchange(server, http_request("POST", API + route, data))
        answer = norm(raw)
        rec.add(name, without_length(answer))
        payload: dict[str, Any] = json.loads(raw.split("\r\n\r\n", 1)[1])
        return payload

    ask("healthz", "GET", "/healthz")
    ask("readyz", "GET", "/readyz")
    ask("docs", "GET", "/docs")
    openapi = raw_exchange(server, http_request("GET", "/openapi.json"))
    head, document = openapi.split("\r\n\r\n", 1)
    rec.add("openapi.head", without_length(norm(head)))
    rec.add("openapi.document", json.loads(document))
    metrics = raw_exchange(server, http_request("GET", "/metrics"))
    rec.add(
        "metrics.declared",
        sorted(line for line in metrics.splitlines() if line.startswith(("# HELP", "# TYPE"))),
    )

    ns = post("namespace", "/lease/namespace", {})["namespace"]
    post("namespace.empty_body", "/lease/namespace", b"")
    post("namespace.array", "/lease/namespace", [])
    post("namespace.field", "/lease/namespace", {"a": 1})
    lease = {"namespace": ns, "key": "invoice:2026-09-05"}
    first = post("acquire", "/lease", {**lease, "ttl_seconds": 60, "fingerprint": "charge-501"})
    post("acquire.held", "/lease", {**lease, "fingerprint": "charge-501"})
    post("acquire.alias.held", "/lease/acquire", {**lease, "fingerprint": "charge-501"})
    post("acquire.conflict", "/lease", {**lease, "fingerprint": "charge-502"})
    post("acquire.conflict.absent", "/lease", lease)
    token = first["owner_token"]
    post("renew", "/lease/renew", {**lease, "owner_token": token, "ttl_seconds": 120})
    post("renew.default_ttl", "/lease/renew", {**lease, "owner_token": token})
    post("renew.malformed_token", "/lease/renew", {**lease, "owner_token": "own_nope"})
    stranger = "own_" + "A" * 43
    post("renew.not_owner", "/lease/renew", {**lease, "owner_token": stranger})
    post("release.not_owner", "/lease/release", {**lease, "owner_token": stranger})
    result = {"receipt_id": 4817, "api_key": "k", "nested": [{"Pass-Word": 1, "x": "日本"}]}
    post("complete", "/lease/complete", {**lease, "owner_token": token, "result": result})
    post("acquire.completed", "/lease", {**lease, "fingerprint": "charge-501"})
    post("acquire.completed.conflict", "/lease", {**lease, "fingerprint": "other"})
    post("release.completed", "/lease/release", {**lease, "owner_token": token})
    post("complete.again", "/lease/complete", {**lease, "owner_token": token, "result": 1})
    post("renew.completed", "/lease/renew", {**lease, "owner_token": token})

    other = {"namespace": ns, "key": "job:2"}
    second = post("acquire.other", "/lease/acquire", {**other, "ttl_seconds": 5})
    post("release", "/lease/release", {**other, "owner_token": second["owner_token"]})
    post("release.again", "/lease/release", {**other, "owner_token": second["owner_token"]})
    post("acquire.after_release", "/lease", {**other, "ttl_seconds": 86400})

    bare = post("acquire.bare", "/lease", {"key": BARE_KEY})
    post("acquire.bare.held", "/lease", {"key": BARE_KEY})
    post("release.bare", "/lease/release", {"key": BARE_KEY, "owner_token": bare["owner_token"]})
    post("acquire.bare.short", "/lease", {"key": "short"})
    post("acquire.bare.repeated", "/lease", {"key": "a" * 40})
    post("acquire.bare.space", "/lease", {"key": "a b" * 20})

    invalid: dict[str, bytes | Any] = {
        "not_json": b"{nope",
        "nan": b'{"key": "k", "namespace": NaN}',
        "duplicate": b'{"key": "a", "key": "b"}',
        "deep": b'{"key": ' + b"[" * 70 + b"]" * 70 + b"}",
        "not_object": b"[1, 2]",
        "empty": b"",
        "utf8": b'{"key": "\xff"}',
        "surrogate": b'{"namespace": "' + ns.encode() + b'", "key": "\\ud800"}',
        "ttl_true": {**lease, "ttl_seconds": True},
        "ttl_string": {**lease, "ttl_seconds": "60"},
        "ttl_zero": {**lease, "ttl_seconds": 0},
        "ttl_large": {**lease, "ttl_seconds": 86401},
        "ttl_float": {**lease, "ttl_seconds": 1.5},
        "unknown_api_field": {**lease, "owner_token": stranger},
        "unknown_field": {**lease, "fingerprnt": "x"},
        "two_unknown_fields": {**lease, "a": 1, "b": 2},
        "missing_key": {"namespace": ns},
        "key_control": {"namespace": ns, "key": "a\nb"},
        "key_long": {"namespace": ns, "key": "k" * 201},
        "key_empty": {"namespace": ns, "key": ""},
        "key_not_string": {"namespace": ns, "key": 5},
        "fingerprint_empty": {**lease, "fingerprint": ""},
        "fingerprint_long": {**lease, "fingerprint": "f" * 1025},
        "namespace_malformed": {"namespace": "ns_short", "key": "k"},
        "null_fields": {**lease, "ttl_seconds": None, "fingerprint": None},
    }
    for name, document in invalid.items():
        post(f"acquire.invalid.{name}", "/lease", document)
    post("acquire.bom", "/lease", b"\xef\xbb\xbf" + json.dumps(other).encode())
    post("complete.missing_result", "/lease/complete", {**lease, "owner_token": token})
    post(
        "complete.too_large",
        "/lease/complete",
        {**other, "owner_token": stranger, "result": "x" * 40_000},
    )
    ask("body.too_large", "POST", API + "/lease", b"{" + b" " * 70_000 + b"}")
    ask(
        "text_plain",
        "POST",
        API + "/lease",
        json.dumps(lease).encode(),
        **{"Content-Type": "text/plain"},
    )
    ask("not_found", "POST", API + "/lease/nope", b"{}")
    ask("method_not_allowed", "GET", API + "/lease")
    ask("method_not_allowed.put", "PUT", API + "/lease/renew", b"{}")
    ask("root", "GET", "/")
    rec.add(
        "malformed_http",
        norm(raw_exchange(server, b"GARBAGE\r\n\r\n")),
    )
    # A head that has passed 64 KiB without ending: answered before it is all read.
    unfinished_head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * 70_000
    rec.add("head_too_large", norm(raw_exchange(server, unfinished_head)))
    return rec


MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def jsonrpc(method: str, params: Any = None, ident: int | None = 1) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if ident is not None:
        message["id"] = ident
    return json.dumps(message).encode()


INITIALIZE = {
    "protocolVersion": "2025-06-18",
    "capabilities": {},
    "clientInfo": {"name": "golden", "version": "1"},
}


def mcp_calls(ns_placeholder: str) -> list[tuple[str, str, Any]]:
    """The tool calls of both MCP conversations; ``<ns>`` and ``<own>`` are filled in."""
    lease = {"namespace": ns_placeholder, "key": "report:2026-09"}
    return [
        ("acquire", "acquire_lease", {**lease, "fingerprint": "a", "ttl_seconds": 30}),
        ("acquire.held", "acquire_lease", {**lease, "fingerprint": "a"}),
        ("acquire.conflict", "acquire_lease", {**lease, "fingerprint": "b"}),
        ("renew", "renew_lease", {**lease, "owner_token": "<own>", "ttl_seconds": 90}),
        ("renew.string_ttl", "renew_lease", {**lease, "owner_token": "<own>", "ttl_seconds": "60"}),
        ("renew.true_ttl", "renew_lease", {**lease, "owner_token": "<own>", "ttl_seconds": True}),
        ("release.bad", "release_lease", {**lease, "owner_token": "own_nope"}),
        ("complete", "complete_lease", {**lease, "owner_token": "<own>", "result": {"token": 1}}),
        ("acquire.completed", "acquire_lease", {**lease, "fingerprint": "a"}),
        ("acquire.unknown_field", "acquire_lease", {**lease, "extra": 1}),
        ("acquire.bare_short", "acquire_lease", {"key": "short"}),
        ("unknown_tool", "no_such_tool", {}),
    ]


def fill(arguments: Any, ns: str, own: str) -> Any:
    text = json.dumps(arguments).replace("<ns>", ns).replace("<own>", own)
    return json.loads(text)


def mcp_http_conversation(server: Server, norm: Normalizer) -> Recorder:
    rec = Recorder()

    def ask(
        name: str, body: bytes, headers: dict[str, str] = MCP_HEADERS, method: str = "POST"
    ) -> str:
        raw = raw_exchange(server, http_request(method, "/mcp/", body, headers))
        rec.add(name, without_length(norm(raw)))
        return raw.split("\r\n\r\n", 1)[1]

    ask("initialize", jsonrpc("initialize", INITIALIZE))
    ask("tools.list", jsonrpc("tools/list", {}, 2))
    answer = json.loads(
        ask(
            "namespace",
            jsonrpc("tools/call", {"name": "create_lease_namespace", "arguments": {}}, 3),
        )
    )
    ns = json.loads(answer["result"]["content"][0]["text"])["namespace"]
    own = ""
    for ident, (name, tool, arguments) in enumerate(mcp_calls("<ns>"), start=10):
        text = ask(
            name,
            jsonrpc("tools/call", {"name": tool, "arguments": fill(arguments, ns, own)}, ident),
        )
        if name == "acquire":
            own = json.loads(json.loads(text)["result"]["content"][0]["text"])["owner_token"]
    ask("not_json", b"{nope")
    ask("not_jsonrpc", b'{"hello": 1}')
    ask(
        "wrong_accept",
        jsonrpc("tools/list", {}, 4),
        {"Content-Type": "application/json", "Accept": "text/html"},
    )
    ask("get", b"", {"Accept": "text/event-stream"}, method="GET")
    ask(
        "too_large",
        b'{"jsonrpc": "2.0", "id": 1, "method": "x", "params": {"p": "' + b"x" * 70_000 + b'"}}',
    )
    return rec


def mcp_stdio_conversation(store: str, norm: Normalizer) -> Recorder:
    rec = Recorder()
    process = subprocess.Popen(
        [sys.executable, "-m", "leasekeeper.cli", "mcp", "--store", store],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdin is not None
    assert process.stdout is not None

    def ask(name: str, line: bytes, answered: bool = True) -> Any:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(line + b"\n")
        process.stdin.flush()
        if not answered:
            return None
        reply = process.stdout.readline().decode()
        rec.add(name, norm(reply))
        return json.loads(reply)

    try:
        ask("initialize", jsonrpc("initialize", INITIALIZE))
        ask("initialized", jsonrpc("notifications/initialized", None, None), answered=False)
        ask("tools.list", jsonrpc("tools/list", {}, 2))
        answer = ask(
            "namespace",
            jsonrpc("tools/call", {"name": "create_lease_namespace", "arguments": {}}, 3),
        )
        ns = json.loads(answer["result"]["content"][0]["text"])["namespace"]
        own = ""
        for ident, (name, tool, arguments) in enumerate(mcp_calls("<ns>"), start=10):
            reply = ask(
                name,
                jsonrpc("tools/call", {"name": tool, "arguments": fill(arguments, ns, own)}, ident),
            )
            if name == "acquire":
                own = json.loads(reply["result"]["content"][0]["text"])["owner_token"]
        ask("not_json", b"{nope")
        ask("nan", b'{"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {"x": NaN}}')
        ask("duplicate", b'{"jsonrpc": "2.0", "id": 8, "id": 9, "method": "tools/list"}')
    finally:
        process.stdin.close()
        process.wait(20)
        process.stdout.close()
    return rec


def cli_conversation(server: Server, tmp_path: Path, norm: Normalizer) -> Recorder:
    rec = Recorder()
    env = {
        **os.environ,
        "LEASEKEEPER_URL": server.url,
        "COLUMNS": "80",
        "LC_ALL": "C.UTF-8",
    }
    env.pop("LEASEKEEPER_NAMESPACE", None)

    def run(name: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        done = subprocess.run(
            [sys.executable, "-m", "leasekeeper.cli", *args],
            input=stdin,
            capture_output=True,
            env=env,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )
        rec.add(
            name,
            {
                "exit": done.returncode,
                "stdout": norm(done.stdout.decode()),
                "stderr": norm(done.stderr.decode()),
            },
        )
        return done

    run("help", "--help")
    for command in (
        "serve",
        "mcp",
        "cleanup",
        "fence",
        "namespace",
        "acquire",
        "renew",
        "release",
        "complete",
        "run",
    ):
        run(f"help.{command}", command, "--help")
    minted = run("namespace", "namespace")
    env["LEASEKEEPER_NAMESPACE"] = json.loads(minted.stdout)["namespace"]
    key = ["--key", "nightly-report"]
    acquired = run("acquire", "acquire", *key, "--fingerprint", "f")
    token = json.loads(acquired.stdout)["owner_token"]
    run("acquire.held", "acquire", *key, "--fingerprint", "f")
    run("acquire.conflict", "acquire", *key, "--fingerprint", "g")
    run(
        "renew",
        "renew",
        *key,
        "--ttl",
        "90",
        "--owner-token-file",
        "-",
        stdin=token.encode(),
    )
    env["LEASEKEEPER_OWNER_TOKEN"] = token
    run("renew.env", "renew", *key)
    run("complete", "complete", *key, "--result", '{"rows": 3}')
    run("acquire.completed", "acquire", *key, "--fingerprint", "f")
    run("release.lost", "release", *key)
    run("acquire.invalid", "acquire", "--key", "short", "--namespace-env", "NO_SUCH_VARIABLE")
    run("run.ok", "run", "--key", "job-1", "--complete", "--", sys.executable, "-c", "print('hi')")
    run(
        "run.skipped",
        "run",
        "--key",
        "job-1",
        "--complete",
        "--",
        sys.executable,
        "-c",
        "print('hi')",
    )
    run("run.fails", "run", "--key", "job-2", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    run("run.not_found", "run", "--key", "job-3", "--", "no-such-command-here")
    return rec


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("golden")
    with running_server(f"sqlite:///{where / 'golden.db'}", where / "log") as running:
        yield running


def test_http_answers_as_recorded(server: Server, recorded: dict[str, Any]) -> None:
    """The HTTP API's answers to a fixed conversation are the recorded bytes."""
    compare(recorded, "http", http_conversation(server, Normalizer()))


def test_mcp_over_http_answers_as_recorded(server: Server, recorded: dict[str, Any]) -> None:
    """MCP at /mcp answers a fixed conversation with the recorded bytes."""
    compare(recorded, "mcp_http", mcp_http_conversation(server, Normalizer()))


def test_mcp_over_stdio_answers_as_recorded(tmp_path: Path, recorded: dict[str, Any]) -> None:
    """``leasekeeper mcp`` answers a fixed conversation with the recorded lines."""
    store = f"sqlite:///{tmp_path / 'stdio.db'}"
    compare(recorded, "mcp_stdio", mcp_stdio_conversation(store, Normalizer()))


def test_cli_answers_as_recorded(server: Server, tmp_path: Path, recorded: dict[str, Any]) -> None:
    """The command line prints and exits as recorded for a fixed session."""
    compare(recorded, "cli", cli_conversation(server, tmp_path, Normalizer()))
