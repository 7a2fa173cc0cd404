"""A real server process: durability across kill -9, secrets at rest, concurrency, cleanup."""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from leasekeeper import FakeClock, LeaseError, LeaseService, ServiceUnavailable, Settings
from leasekeeper._core import secrets as lk_secrets
from leasekeeper.cli import main
from leasekeeper.http import create_app
from leasekeeper.store import SqliteStore
from tests._server import free_port, running_server, start_server
from tests._stores import STORES, store_target
from tests.conftest import ManualSleep, metric

pytestmark = pytest.mark.slow


def post(base: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/services/v1{route}", json=body, timeout=10)


def test_acknowledged_writes_survive_kill_9(tmp_path: Path) -> None:
    """Every acknowledged acquire, renew, release and complete is there after SIGKILL."""
    db = tmp_path / "durable.db"
    store = f"sqlite:///{db}"
    server = start_server(store, tmp_path / "log1.txt")
    try:
        ns = post(server.url, "/lease/namespace", {}).json()["namespace"]
        held = post(server.url, "/lease", {"namespace": ns, "key": "held", "ttl_seconds": 3600})
        done = post(server.url, "/lease", {"namespace": ns, "key": "done", "fingerprint": "f"})
        rel = post(server.url, "/lease", {"namespace": ns, "key": "rel"})
        assert held.status_code == done.status_code == rel.status_code == 201
        token = held.json()["owner_token"]
        renewed = post(
            server.url,
            "/lease/renew",
            {"namespace": ns, "key": "held", "owner_token": token, "ttl_seconds": 7200},
        )
        assert renewed.status_code == 200
        completed = post(
            server.url,
            "/lease/complete",
            {
                "namespace": ns,
                "key": "done",
                "owner_token": done.json()["owner_token"],
                "result": {"receipt": 42},
            },
        )
        assert completed.status_code == 200
        released = post(
            server.url,
            "/lease/release",
            {"namespace": ns, "key": "rel", "owner_token": rel.json()["owner_token"]},
        )
        assert released.status_code == 200
    finally:
        server.kill()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with running_server(store, tmp_path / "log2.txt") as again:
        still_held = post(again.url, "/lease", {"namespace": ns, "key": "held"})
        assert still_held.status_code == 409
        assert still_held.json()["lease_expires_at"] == renewed.json()["lease_expires_at"]
        replay = post(again.url, "/lease", {"namespace": ns, "key": "done", "fingerprint": "f"})
        assert replay.status_code == 200 and replay.json()["result"] == {"receipt": 42}
        retaken = post(again.url, "/lease", {"namespace": ns, "key": "rel"})
        assert retaken.status_code == 201
        assert retaken.json()["fencing_token"] > rel.json()["fencing_token"]
        renew_again = post(
            again.url, "/lease/renew", {"namespace": ns, "key": "held", "owner_token": token}
        )
        assert renew_again.status_code == 200


def _encodings(secret: str | bytes) -> list[bytes]:
    raw = secret.encode() if isinstance(secret, str) else secret
    forms = [
        raw,
        binascii.hexlify(raw),
        binascii.hexlify(raw).upper(),
        base64.b64encode(raw),
        base64.b64encode(raw).rstrip(b"="),
        base64.urlsafe_b64encode(raw).rstrip(b"="),
    ]
    return [form for form in forms if len(form) >= 8]


CANARY_RESULT = {
    "password": "canary-password-P4s5",
    "nested": [
        {"access_token": "canary-token-T0k3n"},
        {"Cookie": "canary-cookie-C00k"},
        {"deeper": [{"Authorization": "canary-auth-Au7h", "passwd": "canary-passwd-Pw9d"}]},
    ],
    "client_secret": "canary-secret-S3cr",
    "Private Key": "canary-privkey-Pr1v",
    "api.key": "canary-apikey-Ap1k",
    "Set-Cookie": ["canary-setcookie-Sc00"],
}


def _secret_values(value: Any) -> list[str]:
    """Every string in a canary result."""
    if isinstance(value, dict):
        return [s for child in value.values() for s in _secret_values(child)]
    if isinstance(value, list):
        return [s for child in value for s in _secret_values(child)]
    return [value] if isinstance(value, str) else []


@pytest.mark.parametrize("kind", STORES)
def test_no_secret_reaches_disk_logs_or_responses(tmp_path: Path, kind: str) -> None:
    """Canaries in every secret field, through a full workload at DEBUG, appear in no store
    file (or table dump), no log line and no response, raw, hex or base64; the only
    exceptions are the namespace in its own mint answer and each owner token in its own
    grant."""
    import socket

    log = tmp_path / "server.log"
    key = "canary-key-7Qw9zX"
    fingerprint, other_fp = "canary-fp-K2m8vB", "canary-fp2-Lq3nV7"
    bare_key = "canary-bare-" + "Zq8Wn3Lp5Rt7Yv2Xk4Mj6Hg9Fd1Sa0Qe"
    answers: list[tuple[bytes, set[str]]] = []  # each response, and the secrets it may show
    env = {
        "LEASEKEEPER_LOG_LEVEL": "DEBUG",
        "LEASEKEEPER_REQUEST_TIMEOUT_SECONDS": "1",
        "LEASEKEEPER_LIVE_LEASES_INTERVAL_SECONDS": "0.2",
    }
    with (
        store_target(kind, tmp_path) as target,
        running_server(target.url, log, env) as server,
        httpx.Client(timeout=10) as client,
    ):

        def call(
            route: str, body: Any, *, method: str = "POST", allow: tuple[str, ...] = ()
        ) -> httpx.Response:
            response = client.request(method, f"{server.url}{route}", json=body)
            head = "".join(f"{k}: {v}\n" for k, v in response.headers.items()).encode()
            answers.append((head + response.content, set(allow)))
            return response

        minted = call("/services/v1/lease/namespace", {})
        ns = minted.json()["namespace"]
        answers[-1][1].add(ns)
        tokens: list[str] = []

        def grant(body: dict[str, Any]) -> str:
            response = call("/services/v1/lease", body)
            assert response.status_code == 201, response.text
            token = str(response.json()["owner_token"])
            answers[-1][1].add(token)
            tokens.append(token)
            return token

        for k, scope in ((key, {"namespace": ns}), (bare_key, {})):
            lease = {**scope, "key": k, "fingerprint": fingerprint}
            first = grant({**lease, "ttl_seconds": 30})
            assert call("/services/v1/lease", lease).status_code == 409  # held
            conflict = call("/services/v1/lease", {**lease, "fingerprint": other_fp})
            assert conflict.json()["status"] == "conflict"
            owner = {**scope, "key": k, "owner_token": first}
            assert call("/services/v1/lease/renew", owner).status_code == 200
            assert call("/services/v1/lease/release", owner).status_code == 200
            second = grant(lease)
            done = {**scope, "key": k, "owner_token": second, "result": CANARY_RESULT}
            assert call("/services/v1/lease/complete", done).status_code == 200
            replay = call("/services/v1/lease", lease)
            stored = _secret_values(replay.json()["result"])
            assert stored == ["[redacted]"] * len(_secret_values(CANARY_RESULT))
            for token in (first, second):
                lost = call("/services/v1/lease/renew", {**scope, "key": k, "owner_token": token})
                assert lost.json()["status"] == "lost"
        # A lease that expires under its owner, and a result too large (with canaries).
        short = {"namespace": ns, "key": key + "-short", "fingerprint": fingerprint}
        third = grant({**short, "ttl_seconds": 1})
        owner = {"namespace": ns, "key": key + "-short", "owner_token": third}
        big = {**owner, "result": {"password": "canary-big-Bg1x", "pad": ["canary-pad"] * 4000}}
        assert call("/services/v1/lease/complete", big).status_code == 413
        time.sleep(1.2)
        assert "expired" in call("/services/v1/lease/renew", owner).json()["error"]
        # Bad input carrying secrets, everywhere a secret can be misplaced.
        for bad in (
            {"namespace": ns, "key": key, "ttl_seconds": "x"},
            {"namespace": ns, "key": key + "\n", "fingerprint": fingerprint},
            {"namespace": ns, "key": key, key: fingerprint},
            {"namespace": ns + key, "key": key},
            {"namespace": ns, "key": key, "owner_token": "own_" + key},
            {"key": key, "fingerprint": fingerprint},  # a bare key too guessable
        ):
            assert call("/services/v1/lease/renew", bad).status_code == 400
            assert call("/services/v1/lease", bad).status_code == 400
        call(f"/services/v1/lease/{ns}/{key}?fingerprint={fingerprint}", None, method="GET")
        call(f"/{key}", None, method="DELETE")
        for route in ("/healthz", "/readyz", "/openapi.json", "/docs"):
            call(route, None, method="GET")
        # A body that never finishes (408) and malformed HTTP (400), both carrying secrets.
        port = int(server.url.rsplit(":", 1)[1])
        for raw in (
            b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
            + f'{{"namespace": "{ns}", "key": "{key}"'.encode(),
            f"POST /{ns}/{key} HTTP/1.1\r\nContent-Length: x{fingerprint}\r\n\r\n".encode(),
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(raw)
                chunks = []
                with contextlib.suppress(OSError):
                    while chunk := sock.recv(65536):
                        chunks.append(chunk)
                answers.append((b"".join(chunks), set()))
        time.sleep(0.3)  # let the live-lease count run once more
        call("/metrics", None, method="GET")
        snapshots = target.snapshot()
        assert kind != "sqlite" or any(name.endswith("-wal") for name in snapshots)
        assert kind != "postgres" or snapshots["table leasekeeper_leases"].count(b"\n") >= 3
        server.stop()
        snapshots |= {f"{name}@stopped": blob for name, blob in target.snapshot().items()}
    log_text = log.read_text()
    snapshots["server.log"] = log_text.encode()
    lines = [json.loads(line) for line in log_text.splitlines()]  # every line is JSON
    assert any(line["message"].startswith("leasekeeper starting") for line in lines)
    assert sum(1 for line in lines if "request_id" in line) >= len(answers) - 3
    assert [a for a, _ in answers if b"408" in a[:20] or b"400 Bad" in a[:20]]

    ns_raw = lk_secrets.parse_namespace(ns)
    assert ns_raw is not None
    secrets_to_find: list[str | bytes] = [ns, ns_raw, key, bare_key, fingerprint, other_fp]
    secrets_to_find += tokens + _secret_values(CANARY_RESULT) + ["canary-big-Bg1x"]
    secrets_to_find += [base64.urlsafe_b64decode(t[4:] + "=") for t in tokens]
    owners = {ns: [ns, ns_raw]} | {t: [t, base64.urlsafe_b64decode(t[4:] + "=")] for t in tokens}
    hits = [
        (name, secret)
        for name, blob in snapshots.items()
        for secret in secrets_to_find
        for form in _encodings(secret)
        if form in blob
    ]
    for index, (blob, allowed) in enumerate(answers):
        mine = [form for a in allowed for secret in owners[a] for form in _encodings(secret)]
        for secret in secrets_to_find:
            for form in _encodings(secret):
                if form in blob and form not in mine:
                    hits.append((f"response {index}", secret))
    assert hits == []


def test_64_concurrent_acquires_on_one_key_grant_exactly_one(tmp_path: Path) -> None:
    """64 simultaneous acquires of one key over real connections: one 201, 63 409."""
    with running_server(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "log.txt") as server:
        ns = post(server.url, "/lease/namespace", {}).json()["namespace"]
        for round_ in range(3):
            body = {"namespace": ns, "key": f"hot-{round_}", "ttl_seconds": 60}

            def attempt(_: int, body: dict[str, Any] = body) -> int:
                return post(server.url, "/lease", body).status_code

            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                codes = list(pool.map(attempt, range(64)))
            assert sorted(codes).count(201) == 1
            assert codes.count(409) == 63


def test_64_concurrent_acquires_in_process(tmp_path: Path) -> None:
    """The same through the ASGI app on one event loop, with many keys at once."""

    async def main() -> list[int]:
        service = LeaseService(SqliteStore(tmp_path / "p.db", FakeClock()))
        app = create_app(service, Settings(), run_cleanup=False)
        await service.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                ns = (await client.post("/services/v1/lease/namespace")).json()["namespace"]
                requests = [
                    client.post("/services/v1/lease", json={"namespace": ns, "key": f"k{i % 4}"})
                    for i in range(256)
                ]
                return [r.status_code for r in await asyncio.gather(*requests)]
        finally:
            await service.stop()

    codes = asyncio.run(main())
    assert codes.count(201) == 4
    assert codes.count(409) == 252


def _expired_records(db: Path, count: int) -> None:
    """Records whose lifecycle ended long ago, written by a store on a clock in 2020."""

    async def write() -> None:
        store = SqliteStore(db, FakeClock(1_577_836_800_000))
        service = LeaseService(store)
        await service.start()
        try:
            for i in range(count):
                await service.handle(
                    "acquire", {"namespace": "ns_" + "C" * 42 + "A", "key": f"{i}"}
                )
        finally:
            await service.stop()

    asyncio.run(write())


def _count(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT count(*) FROM leases").fetchone()[0])


def test_cleanup_command_deletes_finished_lifecycles_once(tmp_path: Path) -> None:
    """`leasekeeper cleanup` deletes every record whose lifecycle is over and says how many."""
    db = tmp_path / "old.db"
    _expired_records(db, 2500)
    fence_before = SqliteStore(db).fencing_counter()
    out = subprocess.run(
        [sys.executable, "-m", "leasekeeper.cli", "cleanup", "--store", f"sqlite:///{db}"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == {"ok": True, "deleted": 2500}
    assert _count(db) == 0
    assert SqliteStore(db).fencing_counter() == fence_before


def test_operator_commands_log_json_and_name_unknown_variables(tmp_path: Path) -> None:
    """`cleanup` logs as the server does, JSON lines on stderr, and warns of a
    LEASEKEEPER_* name no setting reads (by name: its value may be a secret), with the
    setting it is closest to; it had gone unsaid that the store came from elsewhere."""
    db = tmp_path / "ops.db"
    _expired_records(db, 1)
    env = {**os.environ, "LEASEKEEPER_STORE_URL": "sqlite:////secret/elsewhere.db"}
    out = subprocess.run(
        [sys.executable, "-m", "leasekeeper.cli", "cleanup", "--store", f"sqlite:///{db}"],
        capture_output=True,
        check=True,
        timeout=60,
        env=env,
    )
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    warned = [line for line in lines if line["level"] == "WARNING"]
    assert [line["message"] for line in warned] == [
        "LEASEKEEPER_STORE_URL is not a leasekeeper setting and is ignored "
        "(did you mean LEASEKEEPER_STORE?)"
    ]
    assert b"elsewhere" not in out.stderr
    assert json.loads(out.stdout) == {"ok": True, "deleted": 1}


def _fence_command(db: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-m", "leasekeeper.cli", "fence", "--store", f"sqlite:///{db}"]
    return subprocess.run([*argv, *args], capture_output=True, check=False, timeout=60)


def test_fence_command_prints_and_raises_the_counter_never_lowering_it(tmp_path: Path) -> None:
    """`leasekeeper fence` prints the counter; `--raise-to N` raises it to N unless it is
    higher; an N out of range, or a path with no store, is a usage error that changes
    nothing; the next grant on the file is above the counter."""
    db = tmp_path / "restored.db"
    _expired_records(db, 3)
    assert SqliteStore(db).fencing_counter() == 3

    def counter(*args: str) -> int:
        done = _fence_command(db, *args)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert body.keys() == {"ok", "fencing_counter"} and body["ok"] is True
        return int(body["fencing_counter"])

    assert counter() == 3
    assert counter("--raise-to", "2") == 3
    assert counter("--raise-to", "1000") == 1000
    assert counter("--raise-to", "999") == 1000
    for wrong in ("-1", str(2**62 + 1), "9223372036854775807", "1e3", "many"):
        refused = _fence_command(db, "--raise-to", wrong)
        assert refused.returncode == 2 and b"--raise-to" in refused.stderr, refused
        assert refused.stdout == b""
    assert SqliteStore(db).fencing_counter() == 1000
    # A path with no store (a typo, the wrong directory) is refused, not created and raised.
    missing = tmp_path / "elsewhere.db"
    refused = _fence_command(missing, "--raise-to", "5")
    assert refused.returncode == 2 and b"no leasekeeper store at" in refused.stderr, refused
    assert not missing.exists()

    async def grant() -> int:
        service = LeaseService(SqliteStore(db))
        await service.start()
        try:
            reply = await service.handle(
                "acquire", {"namespace": "ns_" + "C" * 42 + "A", "key": "k"}
            )
        finally:
            await service.stop()
        return int(reply.body["fencing_token"])

    assert asyncio.run(grant()) == 1001


def test_fence_reads_a_counter_of_zero_without_raising_it(tmp_path: Path) -> None:
    """`leasekeeper fence` without --raise-to only reads: on a store that has granted
    nothing yet it prints 0 and leaves the counter at 0."""
    db = tmp_path / "new.db"
    _expired_records(db, 0)
    done = _fence_command(db)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ok": True, "fencing_counter": 0}
    assert SqliteStore(db).fencing_counter() == 0


def test_fence_raises_the_counter_to_2_to_the_62_the_largest_n(tmp_path: Path) -> None:
    """N may be at most 2^62 (README, Operations): that N itself is taken and printed."""
    db = tmp_path / "restored.db"
    _expired_records(db, 1)
    done = _fence_command(db, "--raise-to", str(2**62))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"ok": True, "fencing_counter": 2**62}
    assert SqliteStore(db).fencing_counter() == 2**62


@pytest.mark.parametrize("argv", [["fence", "--raise-to", "100"], ["cleanup"]])
def test_an_operator_command_the_store_refuses_says_so_on_stderr_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """A store that refuses the work (a full disk, say) is `fence failed: …` / `cleanup
    failed: …` on stderr with exit 1; stdout, which a script reads as the JSON answer,
    stays empty."""
    db = tmp_path / "lk.db"
    _expired_records(db, 1)

    async def refuse(self: LeaseService, *args: Any) -> int:
        raise ServiceUnavailable("The lease store is refusing writes (database or disk is full)")

    monkeypatch.setattr(LeaseService, "raise_fence", refuse)
    monkeypatch.setattr(LeaseService, "cleanup", refuse)
    done = CliRunner().invoke(main, [*argv, "--store", f"sqlite:///{db}"])
    assert done.exit_code == 1, done.output
    assert done.stdout == ""
    assert f"{argv[0]} failed: The lease store is refusing writes" in done.stderr


@pytest.mark.parametrize("argv", [["fence", "--raise-to", "5"], ["fence"], ["cleanup"]])
def test_fence_and_cleanup_refuse_a_memory_store(argv: list[str]) -> None:
    """A memory store is empty in every process but the server's: `fence` would print
    0 and raise nothing that any server uses, so both commands refuse it (exit 2)."""
    done = CliRunner().invoke(main, [*argv, "--store", "memory://"])
    assert done.exit_code == 2, done.output
    assert "memory:// store lives only inside the server" in done.output
    assert "fencing_counter" not in done.output and "deleted" not in done.output


def test_cleanup_refuses_a_sqlite_path_with_no_store(tmp_path: Path) -> None:
    """A typo in the path is a usage error (exit 2), not a new empty store that
    answers "deleted 0" while the real one is never cleaned."""
    missing = tmp_path / "typo.db"
    done = CliRunner().invoke(main, ["cleanup", "--store", f"sqlite:///{missing}"])
    assert done.exit_code == 2 and "no leasekeeper store at" in done.output, done.output
    assert not missing.exists()


def test_fence_and_cleanup_leave_a_file_that_is_not_a_store_alone(tmp_path: Path) -> None:
    """An existing file that holds no leasekeeper store (an empty placeholder, another
    program's database, a text file) is refused too, and left exactly as it was."""
    empty = tmp_path / "empty.db"
    empty.touch()
    other = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")  # a WAL database, closed cleanly
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    text = tmp_path / "notes.db"
    text.write_text("not a database\n")
    for path in (empty, other, text):
        before = path.read_bytes()
        for argv in (["fence", "--raise-to", "100"], ["cleanup"]):
            done = CliRunner().invoke(main, [*argv, "--store", f"sqlite:///{path}"])
            assert done.exit_code == 2 and "no leasekeeper store at" in done.output, done.output
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "notes.db", "other.db"]


def test_fence_refuses_a_damaged_sqlite_store(tmp_path: Path) -> None:
    """A store damaged as a copy over a leftover WAL damages it: ``fence`` (run after
    every restore) says so and raises nothing, rather than bless the file."""
    db = tmp_path / "restored.db"
    _expired_records(db, 400)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    assert pages > 3
    with db.open("r+b") as file:  # the B-tree's pages past the first two, overwritten
        file.seek(2 * page)
        file.write(b"\xff" * page)
    before = db.read_bytes()
    done = CliRunner().invoke(main, ["fence", "--raise-to", "100", "--store", f"sqlite:///{db}"])
    assert done.exit_code == 1, done.output
    assert "the SQLite store is damaged" in done.output
    assert db.read_bytes() == before


@pytest.mark.parametrize("how", ["truncated", "first page damaged"])
def test_fence_calls_a_store_it_cannot_even_look_into_damaged(tmp_path: Path, how: str) -> None:
    """A store whose first page (the table list) is damaged, or which was cut short (a
    copy that stopped half-way): damaged, restore it, as for damage further in, not a
    bare "database disk image is malformed" (nor "no store")."""
    db = tmp_path / "restored.db"
    _expired_records(db, 400)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
    whole = db.read_bytes()
    if how == "truncated":
        db.write_bytes(whole[: 2 * page])
    else:
        db.write_bytes(whole[:200] + b"\xab" * (page - 200) + whole[page:])
    for argv in (["fence"], ["fence", "--raise-to", "100"]):
        done = CliRunner().invoke(main, [*argv, "--store", f"sqlite:///{db}"])
        assert done.exit_code == 1, done.output
        assert "fence refused: the SQLite store is damaged" in done.output
        assert "restore it from a backup" in done.output


def test_fence_on_a_sound_store_it_cannot_check_does_not_call_it_damaged(tmp_path: Path) -> None:
    """A sound store in a directory that cannot be written (a read-only account: SQLite
    cannot make the ``-shm`` a reader of a WAL store needs) is not "damaged, restore it
    from a backup", which would throw away every result completed since the backup."""
    home = tmp_path / "ro"
    home.mkdir()
    db = home / "lk.db"
    _expired_records(db, 3)
    assert not (home / "lk.db-wal").exists()  # closed cleanly
    locked = ["chattr", "+i"] if os.geteuid() == 0 else ["chmod", "0555"]  # root ignores modes
    unlocked = ["chattr", "-i"] if os.geteuid() == 0 else ["chmod", "0755"]
    subprocess.run([*locked, str(home)], check=True)
    try:
        done = CliRunner().invoke(main, ["fence", "--store", f"sqlite:///{db}"])
    finally:
        subprocess.run([*unlocked, str(home)], check=True)
    assert done.exit_code == 1, done.output
    assert "fence failed: Cannot check the SQLite store at" in done.output, done.output
    assert "damaged" not in done.output and "backup" not in done.output
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def _insert_rows(db: Path, first: int, count: int, *, seed: int, prefix: bytes = b"") -> None:
    """``count`` records with tokens from ``first``, their key ids ``prefix`` and then
    random bytes from ``seed``: the same pages every run."""
    keys = random.Random(seed)
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        rows = [(prefix + keys.randbytes(32 - len(prefix)), None, 1, first + i, None, 1, None,
                 "x" * 200, 1) for i in range(count)]  # fmt: skip
        conn.executemany("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


def _read_fence(db: Path) -> int:
    """The fencing counter as a reader sees it, changing nothing."""
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT value FROM meta WHERE name = 'fence'").fetchone()[0])


def _crash_leaving_a_wal(db: Path, statements: str) -> None:
    """A writer commits ``statements`` and dies without a checkpoint: its WAL stays."""
    crash = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
        f"c.executescript('BEGIN; ' + {statements!r} + '; COMMIT;')\n"
        "os._exit(0)\n"  # no checkpoint, no cleanup
    )
    subprocess.run([sys.executable, "-c", crash, str(db)], check=True, timeout=60)
    assert (db.parent / f"{db.name}-wal").stat().st_size > 0


def test_fence_refuses_a_backup_copied_over_a_leftover_wal(tmp_path: Path) -> None:
    """The wrong restore the README warns of: a backup copied over the store while a
    crashed writer's WAL is beside it. SQLite applies that WAL to the copy; the damage
    (a table without rowids out of key order) is found, and nothing is raised."""
    db = tmp_path / "lk.db"
    _expired_records(db, 1)
    _insert_rows(db, 10, 3000, seed=1)  # checkpointed when the last connection closes
    backup = tmp_path / "backup.db"
    backup.write_bytes(db.read_bytes())
    _insert_rows(db, 10_000, 3000, seed=2)
    _crash_leaving_a_wal(
        db,
        "UPDATE leases SET result = 'z' WHERE fencing_token IN (1500, 11500); "
        "INSERT INTO leases VALUES (x'00aa', NULL, 1, 1000000, NULL, 1, NULL, 'y', 1)",
    )
    db.write_bytes(backup.read_bytes())  # the wrong restore
    done = CliRunner().invoke(main, ["fence", "--raise-to", "100", "--store", f"sqlite:///{db}"])
    assert done.exit_code == 1, done.output
    assert "the SQLite store is damaged" in done.output
    assert _read_fence(db) < 100


def test_fence_refuses_a_backup_whose_leftover_wal_can_never_be_folded_in(
    tmp_path: Path,
) -> None:
    """The same wrong restore where the dead writer changed only pages past the copy's
    end: every read sees the copy intact (its first page says how long it is), but the
    WAL's commit says the file is twice that, so no checkpoint can ever copy it in. A
    server would fail every checkpoint and its WAL would grow for good: refused as
    damaged, as when the pages land inside the copy. (With random key ids the test above
    landed here about one run in 25, and fence let the store pass.)"""
    db = tmp_path / "lk.db"
    _expired_records(db, 1)
    _insert_rows(db, 10, 3000, seed=1)
    backup = tmp_path / "backup.db"
    backup.write_bytes(db.read_bytes())
    # Key ids past every one in the copy: their pages are all after its last page.
    _insert_rows(db, 10_000, 3000, seed=2, prefix=b"\xff")
    _crash_leaving_a_wal(db, "UPDATE leases SET result = 'z' WHERE fencing_token = 12999")
    db.write_bytes(backup.read_bytes())  # the wrong restore
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)  # reads pass
    done = CliRunner().invoke(main, ["fence", "--raise-to", "100", "--store", f"sqlite:///{db}"])
    assert done.exit_code == 1, done.output
    assert "the SQLite store is damaged (database disk image is malformed)" in done.output
    assert _read_fence(db) < 100


def test_fence_through_a_symbolic_link_reads_the_store_as_a_server_would(
    tmp_path: Path,
) -> None:
    """Through a link, the WAL is looked for beside the linked file, where SQLite keeps
    it: a store whose tables are still only in its WAL (a crashed first start) is a store,
    not "no store" (nor, while a server writes, a false "damaged")."""
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    db = real_dir / "store.db"
    crash = (
        "import os, sqlite3, sys\n"
        "from leasekeeper.store._sqlite_sql import SCHEMA as _SCHEMA, SCHEMA_VERSION\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode = WAL')\n"
        "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
        "c.executescript('BEGIN;' + _SCHEMA + 'COMMIT;')\n"
        "c.execute(\"INSERT INTO meta VALUES ('schema_version', ?)\", (SCHEMA_VERSION,))\n"
        "os._exit(0)\n"  # the tables are in the WAL only
    )
    subprocess.run([sys.executable, "-c", crash, str(db)], check=True, timeout=60)
    assert (real_dir / "store.db-wal").stat().st_size > 0
    link = tmp_path / "link.db"
    link.symlink_to(db)
    done = CliRunner().invoke(main, ["fence", "--raise-to", "7", "--store", f"sqlite:///{link}"])
    assert done.exit_code == 0, done.output
    assert '"fencing_counter":7' in done.output


def test_server_cleans_up_on_its_interval(tmp_path: Path) -> None:
    """The server's cleanup task runs every LEASEKEEPER_CLEANUP_INTERVAL_SECONDS."""
    db = tmp_path / "interval.db"
    _expired_records(db, 30)
    env = {"LEASEKEEPER_CLEANUP_INTERVAL_SECONDS": "0.2"}
    with running_server(f"sqlite:///{db}", tmp_path / "log.txt", env) as server:
        deadline = 100
        while _count(db) and deadline:
            deadline -= 1
            httpx.get(server.url + "/healthz")

            time.sleep(0.05)
        assert _count(db) == 0
        metrics = httpx.get(server.url + "/metrics").text
        assert 'leasekeeper_cleanup_runs_total{result="ok"}' in metrics


def test_the_first_cleanup_runs_within_the_first_interval(tmp_path: Path) -> None:
    """The first pass runs at a random point of the first interval, not after a whole
    one: a server restarted more often than hourly still cleans up. Then one pass per
    interval."""
    from starlette.testclient import TestClient

    db = tmp_path / "first.db"
    _expired_records(db, 30)
    service = LeaseService(SqliteStore(db))
    sleep = ManualSleep()
    app = create_app(
        service, Settings(cleanup_interval_seconds=3600, live_leases_interval_seconds=0),
        sleep=sleep,
    )  # fmt: skip
    with TestClient(app) as client:
        client.portal.call(sleep.until_asleep, 1)
        (first,) = sleep.pauses
        assert 0 <= first < 3600
        assert _count(db) == 30  # not before the first pause ends
        client.portal.call(sleep.wake)
        client.portal.call(sleep.until_asleep, 1)
        assert _count(db) == 0
        assert sleep.pauses == [first, 3600]


def test_requests_over_the_in_flight_cap_get_json_503(tmp_path: Path) -> None:
    """Past LEASEKEEPER_MAX_CONNECTIONS requests in flight, the rest get 503 unavailable."""

    async def main() -> tuple[list[httpx.Response], str]:
        service = LeaseService(SqliteStore(tmp_path / "cap.db", FakeClock()))
        app = create_app(service, Settings(max_connections=1), run_cleanup=False)
        await service.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                body = {"namespace": "ns_" + "D" * 42 + "A", "key": "k"}
                calls = [client.post("/services/v1/lease", json=body) for _ in range(20)]
                responses = list(await asyncio.gather(*calls))
                return responses, (await client.get("/metrics")).text
        finally:
            await service.stop()

    responses, metrics = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 503]
    assert refused, "some requests must find the cap reached"
    assert [r.status_code for r in responses].count(201) == 1
    for response in refused:
        assert response.json()["status"] == "unavailable"
        assert response.headers["retry-after"] == "1"
        assert response.headers["cache-control"] == "no-store"
    # Counted and timed as every answer is.
    assert metric(metrics, "leasekeeper_requests_total", route="acquire", status="503") == len(
        refused
    )
    assert metric(metrics, "leasekeeper_request_seconds_count", route="acquire") == 20


def test_the_in_flight_cap_is_max_connections_exactly() -> None:
    """With LEASEKEEPER_MAX_CONNECTIONS=2, two requests in flight (held by the store) are
    the cap: a third is refused 503 at once, and once they are answered one is served."""
    from leasekeeper.store import MemoryStore

    class Holding(MemoryStore):
        """Holds every decision until ``go``; ``arrived`` once two are waiting."""

        def __init__(self) -> None:
            super().__init__(FakeClock())
            self.go = asyncio.Event()
            self.arrived = asyncio.Event()
            self.waiting = 0

        async def apply(self, command: Any) -> Any:
            self.waiting += 1
            if self.waiting == 2:
                self.arrived.set()
            await self.go.wait()
            return await super().apply(command)

    async def main() -> tuple[list[int], int, int]:
        store = Holding()
        service = LeaseService(store)
        app = create_app(service, Settings(max_connections=2), run_cleanup=False)
        await service.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                ns = "ns_" + "D" * 42 + "A"
                held = [
                    asyncio.create_task(
                        client.post("/services/v1/lease", json={"namespace": ns, "key": key})
                    )
                    for key in ("a", "b")
                ]
                await asyncio.wait_for(store.arrived.wait(), 10)
                third = (await client.get("/healthz")).status_code
                store.go.set()
                codes = [(await task).status_code for task in held]
                return codes, third, (await client.get("/healthz")).status_code
        finally:
            await service.stop()

    codes, third, after = asyncio.run(main())
    assert codes == [201, 201] and third == 503 and after == 200


def test_connections_over_the_cap_get_json_503(tmp_path: Path) -> None:
    """LEASEKEEPER_MAX_CONNECTIONS connections are served, one more is not; uvicorn's own
    connection-limit answer is JSON too (its plain-text default is replaced), with every
    response's headers."""
    import socket

    env = {"LEASEKEEPER_MAX_CONNECTIONS": "2"}
    with running_server(f"sqlite:///{tmp_path / 'conn.db'}", tmp_path / "log", env) as server:
        port = int(server.url.rsplit(":", 1)[1])
        answers = []
        for open_already in (1, 2):
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(open_already)]
            try:
                time.sleep(0.2)  # let the server accept the idle connections
                answers.append(httpx.get(server.url + "/healthz", timeout=5))
            finally:
                for sock in idle:
                    sock.close()
            time.sleep(0.2)  # and see them closed
        served, refused = answers
        assert served.status_code == 200  # the second of two
        assert refused.status_code == 503  # the third
        assert refused.json()["status"] == "unavailable"
        # The headers of every response, though uvicorn answers it without the app.
        assert refused.headers["cache-control"] == "no-store"
        assert refused.headers["x-content-type-options"] == "nosniff"
        assert len(refused.headers["x-request-id"]) == 16
        assert refused.headers["retry-after"] == "1"
        # Counted as every answer is, so that an operator sees clients turned away.
        text = httpx.get(server.url + "/metrics", timeout=5).text
        assert metric(text, "leasekeeper_requests_total", route="healthz", status="503") == 1


def test_sqlite_writer_survives_a_failing_batch(tmp_path: Path) -> None:
    """A fault in a batch's COMMIT, outside any single operation, fails that batch only:
    nothing of it is kept, and the store keeps serving."""

    class Flaky:
        """The writer's connection, as the event loop uses it: its first COMMIT fails."""

        def __init__(self, conn: Any) -> None:
            self.conn = conn
            self.commits = 0

        def execute(self, sql: str, *args: Any) -> Any:
            if sql == "COMMIT":
                self.commits += 1
                if self.commits == 1:
                    raise RuntimeError("simulated fault")
            return self.conn.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.conn, name)

    async def main() -> None:
        store = SqliteStore(tmp_path / "w.db", FakeClock())
        service = LeaseService(store)
        await service.start()
        flaky = Flaky(store._conn)
        store._conn = flaky  # type: ignore[assignment]
        body = {"namespace": "ns_" + "E" * 42 + "A", "key": "k"}
        with pytest.raises(LeaseError) as first:
            await service.handle("acquire", body)
        assert first.value.status == "internal"
        # The failed batch's grant was rolled back: the key is free, not held.
        assert (await service.handle("acquire", body)).created
        assert flaky.commits == 2
        await service.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("argv", "code"),
    [(["serve", "--port", str(free_port())], 3), (["mcp"], 1)],
    ids=["serve", "mcp"],
)
@pytest.mark.parametrize(
    ("store", "why"),
    [
        ("sqlite:///{tmp}/no/such/directory/leases.db", "Cannot open the SQLite store at {tmp}"),
        ("postgresql://postgres@127.0.0.1:9/leasekeeper", "Connection refused"),  # none listens
    ],
    ids=["sqlite", "postgresql"],
)
def test_a_store_that_cannot_be_opened_is_said_in_one_line(
    tmp_path: Path, argv: list[str], code: int, store: str, why: str
) -> None:
    """``serve`` (exit 3) and ``mcp`` (exit 1) with a store they cannot open log one
    ERROR line that says why, with no traceback after it."""
    env = {
        **os.environ,
        "LEASEKEEPER_STORE": store.format(tmp=tmp_path),
        "LEASEKEEPER_STORE_TIMEOUT_SECONDS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "leasekeeper.cli", *argv],
        env=env, input=b"", capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert b"Traceback" not in done.stderr
    errors = [
        record["message"]
        for record in map(json.loads, done.stderr.decode().splitlines())
        if record["level"] == "ERROR"
        and record["message"] != "Application startup failed. Exiting."
    ]
    assert len(errors) == 1, errors
    assert errors[0].startswith("Cannot open the ") and why.format(tmp=tmp_path) in errors[0]


def _break_the_schema(target: Any) -> str:
    """Change the store's lease table under its servers (a column gone); what the
    refusals then say."""
    if target.kind == "sqlite":
        with contextlib.closing(sqlite3.connect(target.db, isolation_level=None)) as conn:
            conn.executescript(
                "ALTER TABLE leases RENAME TO kept; CREATE TABLE leases (key_id BLOB PRIMARY KEY);"
            )
        return "its table leases is not leasekeeper's (it lacks the columns fingerprint"
    import psycopg

    with psycopg.connect(target.admin_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'ALTER TABLE "{target.schema}".leasekeeper_leases DROP COLUMN owner')
    return "its table leasekeeper_leases is not leasekeeper's (it lacks the column owner)"


@pytest.mark.parametrize("kind", STORES)
def test_a_store_that_cannot_decide_is_not_ready_and_is_not_served(
    tmp_path: Path, kind: str
) -> None:
    """/readyz checks that a decision can be made, not only that the store answers: with
    the lease table changed under a running server it is 503 saying what is wrong, and
    ``serve`` then refuses to start on that store, in one ERROR line that says it."""
    with store_target(kind, tmp_path) as target:
        with running_server(target.url, tmp_path / "server.log") as server:
            assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
            why = _break_the_schema(target)
            ready = httpx.get(f"{server.url}/readyz", timeout=10)
            assert ready.status_code == 503
            body = ready.json()
            assert body["status"] == "unavailable"
            assert body["error"].startswith("The lease store cannot decide: ")
            assert why in body["error"]
        env = {**os.environ, "LEASEKEEPER_STORE": target.url}
        done = subprocess.run(
            [sys.executable, "-m", "leasekeeper.cli", "serve", "--port", str(free_port())],
            env=env, capture_output=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 3, done.stderr
    errors = [
        record["message"]
        for record in map(json.loads, done.stderr.decode().splitlines())
        if record["level"] == "ERROR"
        and record["message"] != "Application startup failed. Exiting."
    ]
    assert len(errors) == 1, errors
    assert errors[0].startswith("Cannot open the ") and why in errors[0]


@pytest.mark.parametrize("closed", ["<&-", ">&-"])
def test_mcp_over_stdio_with_a_stream_closed_says_so_in_one_line(
    tmp_path: Path, closed: str
) -> None:
    """``leasekeeper mcp`` started with stdin or stdout closed (Python has no stream for
    it) exits 1 with one ERROR line, not a traceback, and opens no store."""
    command = f"'{sys.executable}' -m leasekeeper.cli mcp --store 'sqlite:///{tmp_path}/lk.db'"
    done = subprocess.run(
        ["bash", "-c", f"{command} {closed}"], capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 1, done.stderr
    assert b"Traceback" not in done.stderr
    records = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert [r["message"] for r in records if r["level"] == "ERROR"] == [
        "MCP over stdio needs stdin and stdout; one of them is closed"
    ]
    assert not (tmp_path / "lk.db").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_the_store_is_being_opened_is_not_kept_waiting(
    tmp_path: Path, signum: int
) -> None:
    """SIGTERM or SIGINT while ``serve`` waits for a store that does not answer (here up
    to 60 s) stops it then, with a WARNING and exit 3, not once the store timeout ends."""
    log = tmp_path / "serve.log"
    env = {
        **os.environ,
        "LEASEKEEPER_STORE": "postgresql://postgres@127.0.0.1:9/leasekeeper",  # none listens
        "LEASEKEEPER_STORE_TIMEOUT_SECONDS": "60",
    }
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "leasekeeper.cli", "serve", "--port", str(free_port())],
            env=env, stdout=sink, stderr=sink,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while b"error connecting" not in log.read_bytes():  # the store is being opened
            assert time.monotonic() < deadline and server.poll() is None, log.read_text()
            time.sleep(0.05)
        server.send_signal(signum)
        assert server.wait(timeout=30) == 3  # well before the 60 s store timeout
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    stopped = [r for r in records if r["message"] == "stopped while the store was being opened"]
    assert [r["level"] for r in stopped] == ["WARNING"]
    assert "Traceback" not in log.read_text()


def wait_until_one_request_is_in_flight(url: str) -> None:
    """Until the server at ``url`` is running one request (its /metrics says so)."""
    deadline = time.monotonic() + 10
    while "leasekeeper_requests_in_flight 2.0" not in httpx.get(url + "/metrics").text:
        assert time.monotonic() < deadline  # (the /metrics request counts itself)
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 0)]
)
def test_a_stop_signal_answers_the_request_in_flight_then_exits(
    tmp_path: Path, signum: int, status: int
) -> None:
    """SIGTERM or SIGINT stops ``serve`` gracefully: no new connection is accepted, a
    request whose body is still arriving is answered (its connection then closed), and
    the store is closed. After SIGTERM the process ends by that signal, as uvicorn does
    (status 143 in a shell); after SIGINT (Ctrl-C) it exits 0."""
    log = tmp_path / "server.log"
    server = start_server(f"sqlite:///{tmp_path}/graceful.db", log)
    try:
        ns = httpx.post(server.api + "/lease/namespace", json={}, timeout=5).json()["namespace"]
        body = json.dumps({"namespace": ns, "key": "in-flight", "ttl_seconds": 60}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body[:10]
            )
            wait_until_one_request_is_in_flight(server.url)
            server.process.send_signal(signum)
            deadline = time.monotonic() + 10
            while "Shutting down" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            with pytest.raises(ConnectionRefusedError):  # the listening socket is closed
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            sock.sendall(body[10:])
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        answer = b"".join(chunks)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 201"), answer
        assert b"connection: close" in head.lower()
        assert json.loads(payload)["owner_token"].startswith("own_")
        assert server.process.wait(10) == status
    finally:
        server.stop()
    assert "Application shutdown complete" in log.read_text()
    with contextlib.closing(sqlite3.connect(tmp_path / "graceful.db")) as conn:
        assert conn.execute("SELECT count(*) FROM leases").fetchone() == (1,)


def test_a_stop_is_not_held_up_by_a_body_that_stopped_coming(tmp_path: Path) -> None:
    """A request whose body stops arriving gets its 408 after the request timeout (3 s
    here); when the server is stopping, that connection then closes at once, though its
    client keeps it open: a stop waits for every connection, and did so for one more
    request timeout, while the server read and dropped what the client might still send."""
    log = tmp_path / "server.log"
    env = {"LEASEKEEPER_REQUEST_TIMEOUT_SECONDS": "3"}
    server = start_server(f"sqlite:///{tmp_path}/stop.db", log, env)
    try:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /services/v1/lease HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"na")  # fmt: skip
            wait_until_one_request_is_in_flight(server.url)
            stopped = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(10) == -signal.SIGTERM
            took = time.monotonic() - stopped
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408 ") and took < 4.5
    finally:
        server.stop()


def test_serve_on_a_port_in_use_says_so_before_any_startup(tmp_path: Path) -> None:
    """A port another process listens on: one ERROR line naming the address, exit 1,
    and nothing logged as started (the application's startup does not even run)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "leasekeeper.cli", "serve", "--port", str(port),
             "--store", f"sqlite:///{tmp_path}/lk.db"],
            env={**os.environ, "LEASEKEEPER_LOG_LEVEL": "INFO"}, capture_output=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    records = [json.loads(line) for line in done.stderr.decode().splitlines()]
    assert [(r["level"], r["message"]) for r in records] == [
        (
            "ERROR",
            f"cannot listen on http://127.0.0.1:{port}: Address already in use "
            "(another server is listening there; choose a port with --port)",
        )
    ]
    assert not (tmp_path / "lk.db").exists()  # no store opened either


@pytest.mark.parametrize("kind", STORES)
def test_serve_logs_the_store_in_use_at_every_start(tmp_path: Path, kind: str) -> None:
    """Every start logs the store: the SQLite file's whole path, or PostgreSQL's database,
    host and port, never the URL's password or user."""
    with store_target(kind, tmp_path) as target:
        url = target.url
        if kind == "postgres":  # trust authentication: the password is never asked for
            url = url.replace("://postgres@", "://postgres:hunter2@", 1)
            assert "hunter2" in url
        for _ in range(2):  # the first start creates the store, the second finds it there
            with running_server(url, tmp_path / "server.log"):
                pass
    text = (tmp_path / "server.log").read_text()
    starts = [
        record["message"]
        for record in map(json.loads, text.splitlines())
        if record["message"].startswith("leasekeeper starting on")
    ]
    if kind == "sqlite":
        where = f"SQLite file {tmp_path.resolve() / 'run.db'}"
    else:
        where = "PostgreSQL database test on 127.0.0.1 port 5432"
    assert len(starts) == 2, starts
    assert all(start.endswith(f"(store: {where})") for start in starts), starts
    assert "hunter2" not in text
