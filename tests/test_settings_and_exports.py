"""Settings from the environment, the store URL scheme, and the curated public API."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import leasekeeper
from leasekeeper import Settings, SettingsError
from leasekeeper._settings import unknown_variables
from leasekeeper.store import Durable, MemoryStore, SqliteStore, StoreURLError, open_store


def test_defaults_follow_the_spec() -> None:
    """Without variables: SQLite in ./leasekeeper.db, 24 h lifecycle, hourly cleanup, limits."""
    settings = Settings.from_env({})
    assert settings.store == "sqlite:///./leasekeeper.db"
    assert (settings.host, settings.port) == ("127.0.0.1", 8787)
    assert settings.lifecycle_seconds == 86_400
    assert settings.cleanup_interval_seconds == 3600
    assert settings.max_body_bytes == 65_536
    assert settings.max_connections == 1000
    assert (settings.namespace_rate, settings.namespace_burst) == (10, 100)
    assert settings.address_rate == 0 and settings.namespace_request_rate == 0
    assert settings.postgres_pool_size == 10


def test_variables_are_read_and_flags_win() -> None:
    """LEASEKEEPER_* variables set values; explicit overrides (CLI flags) win over them."""
    env = {
        "LEASEKEEPER_STORE": "memory://",
        "LEASEKEEPER_PORT": "9000",
        "LEASEKEEPER_LIFECYCLE_SECONDS": "120",
        "LEASEKEEPER_CLEANUP_INTERVAL_SECONDS": "0.5",
        "LEASEKEEPER_ADDRESS_RATE": "50",
        "LEASEKEEPER_POSTGRES_POOL_SIZE": " 2 ",
    }
    settings = Settings.from_env(env, port=9100, host=None)
    assert settings.store == "memory://"
    assert settings.port == 9100
    assert settings.lifecycle_seconds == 120
    assert settings.cleanup_interval_seconds == 0.5
    assert settings.address_rate == 50.0
    assert settings.postgres_pool_size == 2


def test_an_empty_variable_gives_the_default() -> None:
    """``LEASEKEEPER_PORT=`` (set, empty) is the same as unset, as the README says; so is
    one of spaces alone (``LEASEKEEPER_HOST="  "`` had listened on every interface)."""
    names = ["LEASEKEEPER_STORE", "LEASEKEEPER_PORT", "LEASEKEEPER_LIFECYCLE_SECONDS"]
    assert Settings.from_env(dict.fromkeys(names, "")) == Settings.from_env({})
    spaces = Settings.from_env(dict.fromkeys([*names, "LEASEKEEPER_HOST"], "  \t"))
    assert spaces == Settings.from_env({}) and spaces.host == "127.0.0.1"


@pytest.mark.parametrize("host", ["", "   "])
def test_an_empty_host_flag_is_refused_not_every_interface(host: str) -> None:
    """``--host ""`` would have uvicorn listen on every interface: refused, naming what to
    write for that."""
    with pytest.raises(SettingsError, match=r"^--host must .*0\.0\.0\.0"):
        Settings.from_env({}, host=host)


def test_a_refused_flag_is_named_as_the_flag_and_a_variable_as_the_variable() -> None:
    """The error names where the value came from: ``serve --host ''`` had been told that
    LEASEKEEPER_HOST was wrong, a variable that was not even set."""
    from click.testing import CliRunner

    from leasekeeper.cli import main

    done = CliRunner().invoke(main, ["serve", "--host", " "], env={"LEASEKEEPER_HOST": None})
    assert done.exit_code == 2
    assert "--host must be an address to listen on" in done.output
    assert "LEASEKEEPER_HOST" not in done.output
    with pytest.raises(SettingsError, match=r"^LEASEKEEPER_PORT must be"):
        Settings.from_env({"LEASEKEEPER_PORT": "70000"})
    with pytest.raises(SettingsError, match=r"^--port must be"):
        Settings.from_env({"LEASEKEEPER_PORT": "8000"}, port=70000)
    with pytest.raises(SettingsError, match=r"^LEASEKEEPER_LIFECYCLE_SECONDS must be greater"):
        Settings.from_env({"LEASEKEEPER_LIFECYCLE_SECONDS": "0"}, port=8000)


def test_unknown_leasekeeper_variables_are_named_with_the_closest_setting() -> None:
    """A misspelled LEASEKEEPER_* name is reported (never its value), with the setting it
    is closest to; the client's variables and the tests' are not unknown."""
    environ = {
        "LEASEKEEPER_STORE_URL": "sqlite:////elsewhere.db",
        "LEASEKEEPER_CLEANUP_BATCHES": "10",
        "LEASEKEEPER_WHATEVER": "x",
        "LEASEKEEPER_URL": "http://127.0.0.1:8787",
        "LEASEKEEPER_NAMESPACE": "ns_x",
        "LEASEKEEPER_TEST_POSTGRES_URL": "postgresql://",
        "LEASEKEEPER_PORT": "8788",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        ("LEASEKEEPER_CLEANUP_BATCHES", "LEASEKEEPER_CLEANUP_BATCH"),
        ("LEASEKEEPER_STORE_URL", "LEASEKEEPER_STORE"),
        ("LEASEKEEPER_WHATEVER", None),
    ]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LEASEKEEPER_PORT", "eighty"),
        ("LEASEKEEPER_PORT", "70000"),
        ("LEASEKEEPER_LIFECYCLE_SECONDS", "1.5"),
        ("LEASEKEEPER_LIFECYCLE_SECONDS", "0"),
        ("LEASEKEEPER_LIFECYCLE_SECONDS", "9300000000000000"),  # every acquire was a 500
        ("LEASEKEEPER_LIFECYCLE_SECONDS", "315360001"),
        ("LEASEKEEPER_STORE_TIMEOUT_SECONDS", "32768"),  # no PostgreSQL connection opened
        ("LEASEKEEPER_NAMESPACE_RATE", "-1"),
        ("LEASEKEEPER_NAMESPACE_RATE", "nan"),  # passed every comparison: no limit at all
        ("LEASEKEEPER_REQUEST_TIMEOUT_SECONDS", "inf"),
        ("LEASEKEEPER_CLEANUP_INTERVAL_SECONDS", "-inf"),
        ("LEASEKEEPER_LOG_LEVEL", "LOUD"),
        ("LEASEKEEPER_POSTGRES_POOL_SIZE", "0"),
        ("LEASEKEEPER_POSTGRES_POOL_SIZE", "-3"),
        ("LEASEKEEPER_POSTGRES_POOL_SIZE", "2.5"),
        ("LEASEKEEPER_POSTGRES_POOL_SIZE", "ten"),
        ("LEASEKEEPER_CLEANUP_BATCH", "99999999999999999999"),  # every cleanup failed
        ("LEASEKEEPER_CLEANUP_BATCH", "100001"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    """A value leasekeeper cannot use is refused at start, naming the variable."""
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: value})


@pytest.mark.parametrize(
    "name",
    [
        "LEASEKEEPER_LIFECYCLE_SECONDS",
        "LEASEKEEPER_CLEANUP_INTERVAL_SECONDS",
        "LEASEKEEPER_CLEANUP_BATCH",
        "LEASEKEEPER_STORE_TIMEOUT_SECONDS",
        "LEASEKEEPER_POSTGRES_POOL_SIZE",
        "LEASEKEEPER_MAX_BODY_BYTES",  # every request body would be 413
        "LEASEKEEPER_MAX_CONNECTIONS",  # every request would be 503
        "LEASEKEEPER_REQUEST_TIMEOUT_SECONDS",  # no time at all to send headers or a body
        "LEASEKEEPER_KEEP_ALIVE_SECONDS",
        "LEASEKEEPER_NAMESPACE_BURST",  # no namespace could ever be minted
        "LEASEKEEPER_ADDRESS_BURST",
        "LEASEKEEPER_NAMESPACE_REQUEST_BURST",
        "LEASEKEEPER_PORT",  # uvicorn would listen on a port of the kernel's choosing
    ],
)
def test_a_zero_is_refused_where_a_setting_must_be_positive(name: str) -> None:
    """Each size, count, length of time and burst that only works above 0 refuses 0 at
    start, naming the variable, rather than start a server that refuses everything."""
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: "0"})
    assert Settings.from_env({name: "1"})


def test_the_largest_lifecycle_and_store_timeout_are_accepted() -> None:
    """10 years, 32767 s and 100,000 records a cleanup step: the bounds themselves start."""
    settings = Settings.from_env(
        {
            "LEASEKEEPER_LIFECYCLE_SECONDS": "315360000",
            "LEASEKEEPER_STORE_TIMEOUT_SECONDS": "32767",
            "LEASEKEEPER_CLEANUP_BATCH": "100000",
        }
    )
    assert (settings.lifecycle_seconds, settings.store_timeout_seconds) == (315_360_000, 32_767)
    assert settings.cleanup_batch == 100_000


def test_the_log_level_refusal_names_every_level() -> None:
    with pytest.raises(SettingsError, match="DEBUG, INFO, WARNING, ERROR or CRITICAL"):
        Settings.from_env({"LEASEKEEPER_LOG_LEVEL": "LOUD"})


def test_store_by_url_scheme(tmp_path: object) -> None:
    """open_store picks the backend by scheme, in one place."""
    assert isinstance(open_store("memory://"), MemoryStore)
    store = open_store("sqlite:///./x.db")
    assert isinstance(store, SqliteStore) and str(store.path) == "x.db"
    absolute = open_store("sqlite:////var/lib/lk/abs.db")
    assert isinstance(absolute, SqliteStore) and str(absolute.path) == "/var/lib/lk/abs.db"
    for bad in ("redis://localhost", "sqlite://", "nonsense"):
        with pytest.raises(StoreURLError):
            open_store(bad)
    # What outlives the process, for the operator commands: not the memory store.
    postgres = open_store("postgresql://postgres:hunter2@127.0.0.1:5432/test")
    assert isinstance(store, Durable) and isinstance(postgres, Durable)
    assert not isinstance(open_store("memory://"), Durable)
    assert absolute.where == "at /var/lib/lk/abs.db" and "hunter2" not in postgres.where


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("sqlite://data/x.db", "no host"),  # had opened ./x.db: a new store, tokens from 1
        ("sqlite://localhost/x.db", "no host"),
        ("sqlite:///x.db?mode=ro", "no ?query"),  # had been dropped without a word
        ("sqlite:///x.db#backup", "no ?query"),
        ("sqlite:///x%00.db", "NUL"),  # had hung the start for ever
        ("memory:///x.db", "memory:// alone"),
        ("memory://host", "memory:// alone"),
    ],
)
def test_store_urls_that_would_open_another_store_are_refused(url: str, said: str) -> None:
    """A store URL that does not mean what it seems to (a host that would be dropped, a
    query that would be ignored, a path a memory store has not) is refused, saying so."""
    with pytest.raises(StoreURLError, match=re.escape(said)):
        open_store(url)


def test_a_postgres_url_with_a_parameter_libpq_does_not_know_names_it() -> None:
    """``?schema=`` (a common guess) is refused naming the parameter and how a schema is
    chosen; the rest of libpq's words, which may quote the URL, are not repeated."""
    pytest.importorskip("psycopg")
    with pytest.raises(StoreURLError) as refused:
        open_store("postgresql://postgres:hunter2@127.0.0.1/test?schema=leases")
    message = str(refused.value)
    assert "'schema'" in message and "options=-csearch_path%3D" in message
    assert "hunter2" not in message and "leases" not in message


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres:Xy@Secret9@127.0.0.1/test",  # libpq: password Xy, host Secret9@...
        "postgresql://postgres:ab/cd@127.0.0.1/test",
        "postgresql://postgres:ab#cd@127.0.0.1/test",
        # A ? before the @ is no query to libpq, which reads the user and password up to
        # the first @ before any /: password Xy7?k, host Secret9@127.0.0.1 (logged).
        "postgresql://postgres:Xy7?k@Secret9@127.0.0.1/test",
        "postgresql://postgres:Xy7?k=1@Secret9@127.0.0.1:5432/test?sslmode=disable",
        # A ? and then a / before the @: libpq sees no password, takes postgres for the host
        # and Ab for the port, and the rest for a query (repeated: a parameter libpq does
        # not know, or at connecting, the port or sslmode it refuses).
        "postgresql://postgres:Ab?sslmode=disable/cdSecret9@127.0.0.1/test",
        "postgresql://postgres:Ab?cdSecret9=x/y@127.0.0.1/test",
        # ?, @ and / in that order: password Xy7?k, host Secret9, database x@127.0.0.1/test.
        "postgresql://postgres:Xy7?k@Secret9/x@127.0.0.1/test",
    ],
)
def test_postgres_urls_with_an_unencoded_password_character_are_refused(url: str) -> None:
    """A password holding @, / or # unencoded splits the URL elsewhere than meant (a part
    of the password became the host, and was logged at each failed connection): refused,
    asking for percent-encoding, without repeating the URL."""
    pytest.importorskip("psycopg")
    with pytest.raises(StoreURLError, match="percent-encode") as refused:
        open_store(url)
    assert "Secret9" not in str(refused.value) and "cd" not in str(refused.value)
    assert "Ab" not in str(refused.value)


def test_a_postgres_password_holding_a_question_mark_alone_is_taken() -> None:
    """libpq reads a ? in the password as part of it (only an @ or a / ends the user and
    password), so such a URL is not refused, nor is an @ in a query parameter's value."""
    pytest.importorskip("psycopg")
    from leasekeeper.store._postgres import PostgresStore

    for url in (
        "postgresql://postgres:Xy7?k@127.0.0.1/test?sslmode=disable",
        "postgresql://postgres:Xy7?k@127.0.0.1/test?application_name=me@x/y",
        "postgresql://127.0.0.1/test?application_name=me@x",
    ):
        assert isinstance(open_store(url), PostgresStore)


def test_stores_without_a_pool_ignore_the_pool_size() -> None:
    """The pool size is PostgreSQL's; SQLite and memory stores are built the same with it."""
    assert isinstance(open_store("memory://", pool_size=1), MemoryStore)
    store = open_store("sqlite:///./x.db", pool_size=1)
    assert isinstance(store, SqliteStore) and str(store.path) == "x.db"


def test_public_api_is_curated() -> None:
    """Everything in __all__ exists, is sorted, and nothing private is exported."""
    assert list(leasekeeper.__all__) == sorted(leasekeeper.__all__)
    for name in leasekeeper.__all__:
        assert not name.startswith("_")
        member = getattr(leasekeeper, name)
        assert member.__module__.startswith("leasekeeper"), name


def test_exception_tree() -> None:
    """Every error is a LeaseError; 409s are LeaseConflicts; bodies carry ok/status/error."""
    assert issubclass(leasekeeper.LeaseHeld, leasekeeper.LeaseConflict)
    assert issubclass(leasekeeper.LeaseLost, leasekeeper.LeaseConflict)
    assert issubclass(leasekeeper.FingerprintConflict, leasekeeper.LeaseConflict)
    assert issubclass(leasekeeper.InvalidRequest, leasekeeper.RequestError)
    assert issubclass(leasekeeper.ServiceUnavailable, leasekeeper.ServerError)
    held = leasekeeper.LeaseHeld(
        retry_after_seconds=3,
        fencing_token=9,
        lease_expires_at="2026-09-05T10:01:00Z",
        absolute_expires_at="2026-09-06T10:00:00Z",
    )
    assert held.body()["status"] == "held" and held.retry_after == 3
    assert leasekeeper.LeaseLost().body() == {
        "ok": False,
        "status": "lost",
        "error": "You do not hold this lease",
    }


def test_modules_import_from_each_other_only_what_they_export() -> None:
    """A name one leasekeeper module imports from another is in that module's
    ``__all__`` (or is a submodule): no module reaches into another's private names."""
    root = Path(leasekeeper.__file__).parent
    reached = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("leasekeeper")
            ):
                continue
            module = importlib.import_module(str(node.module))
            exported = getattr(module, "__all__", None)
            for alias in node.names:
                if exported is None or alias.name in exported:
                    continue
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(
                    f"{node.module}.{alias.name}"
                )
                if not submodule:
                    reached.append(f"{path.relative_to(root)}: {node.module}.{alias.name}")
    assert reached == []


@pytest.mark.parametrize("port", ["-1", "0", "65536"])
def test_a_bad_port_flag_is_named_as_the_flag(port: str) -> None:
    """``serve --port -1`` is the flag's usage error, not the environment variable's."""
    from click.testing import CliRunner

    from leasekeeper.cli import main

    done = CliRunner().invoke(main, ["serve", "--port", port], env={"LEASEKEEPER_PORT": ""})
    assert done.exit_code == 2
    assert "Invalid value for '--port'" in done.output
    assert "LEASEKEEPER_PORT" not in done.output


def test_a_sqlite_store_whose_path_cannot_be_opened_says_so_rather_than_hang(
    tmp_path: Path,
) -> None:
    """A path SQLite cannot take (a NUL in it) is a ServiceUnavailable from open(): the
    thread that opens the file had died with it, and open() waited for ever."""
    import asyncio

    from leasekeeper import ServiceUnavailable

    async def main() -> None:
        store = SqliteStore(tmp_path / "x\x00y.db", timeout_seconds=1)
        with pytest.raises(ServiceUnavailable, match="Cannot open the SQLite store"):
            await asyncio.wait_for(store.open(), 10)

    asyncio.run(main())
