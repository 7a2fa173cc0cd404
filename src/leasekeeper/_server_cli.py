"""The server's commands of ``leasekeeper``: ``serve``, ``mcp``, ``cleanup`` and ``fence``.

``leasekeeper.cli`` loads them on first use: they need ``leasekeeper[server]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
import orjson

from leasekeeper._errors import LeaseError
from leasekeeper._logging import configure_logging
from leasekeeper._service import LeaseService
from leasekeeper._settings import Settings, SettingsError, unknown_variables
from leasekeeper.http import (
    LeaseApp,
    create_app,
    guard_protocol,
    serve_connection_limit_with,
    uvicorn_protocol,
)
from leasekeeper.store import (
    MAX_RAISED_FENCE,
    Durable,
    StoreURLError,
    describe_store,
    open_store,
)

__all__ = ["SERVER_COMMANDS", "serve_app", "uvicorn_options"]

log = logging.getLogger("leasekeeper")

T = TypeVar("T")


def _settings(**overrides: Any) -> Settings:
    """The settings of a server command (``overrides``: its flags), its logging set up as
    they say, and a WARNING for each ``LEASEKEEPER_*`` name that no setting reads."""
    try:
        settings = Settings.from_env(os.environ, **overrides)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    configure_logging(settings.log_level)
    for name, closest in unknown_variables():
        hint = f" (did you mean {closest}?)" if closest else ""
        log.warning("%s is not a leasekeeper setting and is ignored%s", name, hint)
    return settings


def _service(settings: Settings) -> LeaseService:
    try:
        store = open_store(
            settings.store,
            timeout_seconds=settings.store_timeout_seconds,
            pool_size=settings.postgres_pool_size,
        )
    except StoreURLError as exc:
        raise click.UsageError(f"--store / LEASEKEEPER_STORE: {exc}") from None
    return LeaseService(
        store,
        lifecycle_seconds=settings.lifecycle_seconds,
        cleanup_batch=settings.cleanup_batch,
    )


#: ``--store`` of the commands that open a store themselves.
_STORE_OPTION = click.option(
    "--store",
    default=None,
    help="Store URL [LEASEKEEPER_STORE, sqlite:///./leasekeeper.db].",
)


@click.command()
@click.option("--host", default=None, help="Listen address [LEASEKEEPER_HOST, 127.0.0.1].")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Listen port [LEASEKEEPER_PORT, 8787].",
)
@_STORE_OPTION
def serve(host: str | None, port: int | None, store: str | None) -> None:
    """Run the HTTP API (and MCP at /mcp)."""
    import uvicorn

    from leasekeeper.mcp import quiet_sdk_logs

    settings = _settings(host=host, port=port, store=store)
    address = "http://{}:{}".format(
        f"[{settings.host}]" if ":" in settings.host else settings.host,  # an IPv6 address
        settings.port,
    )
    listening = _listen(settings.host, settings.port, address)  # before anything starts
    service = _service(settings)
    quiet_sdk_logs()
    app = serve_app(service, settings)
    # Past uvicorn's connection limit: the JSON 503 of the in-flight cap, counted.
    serve_connection_limit_with(app.at_connection_limit())
    slow_headers = app.metrics.slow_clients.labels("headers")
    protocol = guard_protocol(
        uvicorn_protocol(),
        settings.request_timeout_seconds,
        on_timeout=slow_headers.inc,
        on_stop=service.stop_waiting,
    )
    log.info("leasekeeper starting on %s (store: %s)", address, describe_store(service.store))
    _tune_gc()
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, **uvicorn_options(settings, protocol)
    )
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run does
        server.run(sockets=listening)
    if not server.started:  # the application's startup failed and said why: uvicorn's 3
        sys.exit(3)


def _listen(host: str, port: int, address: str) -> list[socket.socket]:
    """Sockets bound to every address ``host`` resolves to (as uvicorn would bind them),
    before the application starts: a port in use, or an address that is not this
    machine's, is one line and exit 1, rather than a startup completed and then the
    error. uvicorn listens on them."""
    sockets: list[socket.socket] = []
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, *_, where in dict.fromkeys(found):
            sockets.append(socket.create_server(where, family=family))
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = " (another server is listening there; choose a port with --port)"
        # Not create_server's message, which repeats the address as a Python tuple.
        why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or exc
        log.error("cannot listen on %s: %s%s", address, why, hint)
        sys.exit(1)
    return sockets


def serve_app(
    service: LeaseService,
    settings: Settings,
    *,
    monotonic: Callable[[], float] = time.monotonic,
    run_cleanup: bool = True,
) -> LeaseApp:
    """The application ``serve`` runs: the HTTP API with MCP at /mcp beside it.

    One set of rate limits serves both, so that requests (and mints) from one
    client address, or for one namespace, over HTTP and over MCP add up.
    ``monotonic`` drives the rate limits (tests pass a fake).
    """
    from leasekeeper._limits import Limits
    from leasekeeper.mcp import streamable_http_mount

    limits = Limits.from_settings(settings, monotonic=monotonic)
    mcp = streamable_http_mount(service, settings, limits=limits)
    return create_app(
        service,
        settings,
        monotonic=monotonic,
        run_cleanup=run_cleanup,
        extra_routes=mcp.routes,
        lifespan_hooks=mcp.lifespan_hooks,
        limits=limits,
    )


def _tune_gc() -> None:
    """Keep the cyclic garbage collector off the request path's tail latency.

    Everything loaded by now (modules, schemas, the app) lives as long as the
    process: ``gc.freeze`` takes it out of every later collection, which would
    otherwise scan it in full, a pause on every request in flight, each time the
    oldest generation is collected. Requests allocate many short-lived containers;
    a larger first-generation threshold collects them less often. Reference
    counting still frees almost everything at once.
    """
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(10_000, second, third)


def uvicorn_options(
    settings: Settings, protocol: type[asyncio.Protocol] | None = None
) -> dict[str, Any]:
    """How ``serve`` runs uvicorn (beside host and port); the benchmark's reference app
    runs with the very same options, so the two are compared on one stack."""
    if protocol is None:
        protocol = guard_protocol(uvicorn_protocol(), settings.request_timeout_seconds)
    return {
        "loop": "uvloop" if _has("uvloop") else "asyncio",
        "http": protocol,
        # uvicorn counts the connection asking among the open ones (refusing at
        # ``len(connections) >= limit``): one more lets max_connections be open.
        "limit_concurrency": settings.max_connections + 1,
        "access_log": False,
        "log_config": None,
        "timeout_keep_alive": settings.keep_alive_seconds,
        "server_header": False,
    }


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@click.command("mcp")
@_STORE_OPTION
def mcp_command(store: str | None) -> None:
    """Serve the MCP tools over stdio, for desktop agents.

    stdout carries the protocol; logs go to stderr and never contain tool
    arguments or results.
    """
    from leasekeeper.mcp import quiet_sdk_logs, serve_stdio

    settings = _settings(store=store)
    quiet_sdk_logs()
    if sys.stdin is None or sys.stdout is None:  # started with fd 0 or 1 closed
        log.error("MCP over stdio needs stdin and stdout; one of them is closed")
        sys.exit(1)
    service = _service(settings)
    log.info("leasekeeper MCP on stdio (store: %s)", describe_store(service.store))
    try:
        asyncio.run(
            serve_stdio(
                service,
                cleanup_interval_seconds=settings.cleanup_interval_seconds,
                max_message_bytes=settings.max_body_bytes,
            )
        )
    except KeyboardInterrupt:
        pass
    except LeaseError as error:  # a store that cannot be opened: said in one line
        log.error("%s", error.error)
        sys.exit(1)
    except Exception:
        log.exception("MCP stdio server failed")
        sys.exit(1)


def _once(
    command: str,
    store: str | None,
    work: Callable[[LeaseService], Awaitable[T]],
    *,
    existing: bool = False,
) -> T:
    """Open the store, ``await work(service)``, close it; on failure say so and exit 1.
    With ``existing``, a store that is not there (no SQLite file; no leasekeeper tables
    in the PostgreSQL schema) is a usage error, not a new store. A memory store is
    always one: it is empty in every process but the server's."""
    service = _service(_settings(store=store))
    durable = service.store
    if not isinstance(durable, Durable):
        raise click.UsageError(
            f"{command} needs a store that outlives a process: a memory:// store "
            "lives only inside the server that holds it"
        )
    if existing:
        try:
            found = asyncio.run(durable.exists())
        except Exception as exc:
            click.echo(f"{command} failed: {exc}", err=True)
            sys.exit(1)
        if not found:
            raise click.UsageError(
                f"there is no leasekeeper store {durable.where}; none is created"
            )
        # After a restore, before anything else (fence only: cleanup runs from cron
        # beside servers, and the check reads the whole file in one read transaction).
        if command == "fence":
            try:
                damage = asyncio.run(durable.damage())
            except Exception as exc:
                click.echo(f"{command} failed: {exc}", err=True)
                sys.exit(1)
            if damage is not None:
                click.echo(
                    f"{command} refused: {damage}; "
                    "restore it from a backup (the docs: Operations, Durability)",
                    err=True,
                )
                sys.exit(1)

    async def run() -> T:
        await service.start()
        try:
            return await work(service)
        finally:
            await service.stop()

    try:
        return asyncio.run(run())
    except Exception as exc:
        click.echo(f"{command} failed: {exc}", err=True)
        sys.exit(1)


@click.command()
@_STORE_OPTION
def cleanup(store: str | None) -> None:
    """Delete every record whose lifecycle is over, once, and print how many.

    It creates no store: a SQLite path where there is no file, or a PostgreSQL schema
    without leasekeeper's tables, is an error."""
    deleted = _once("cleanup", store, LeaseService.cleanup, existing=True)
    click.echo(orjson.dumps({"ok": True, "deleted": deleted}))


@click.command()
@_STORE_OPTION
@click.option(
    "--raise-to",
    type=click.IntRange(0, MAX_RAISED_FENCE),
    default=None,
    metavar="N",
    help="First raise the counter to N, unless it is higher already.",
)
def fence(store: str | None, raise_to: int | None) -> None:
    """Print the store's fencing counter; every token granted later is above it.

    After restoring a backup, or moving records to another store, run it with
    --raise-to N, N at least the highest token handed out before (the highest your
    FenceGuard tables hold: SELECT max(fence) FROM leasekeeper_fences). Otherwise a
    new owner could be given a token that a stale owner still holds. It never lowers
    the counter, and is safe while servers use the store. It creates no store: a SQLite
    path where there is no file, or a PostgreSQL schema without leasekeeper's tables,
    is an error.
    """
    counter = _once(
        "fence", store, lambda service: service.raise_fence(raise_to or 0), existing=True
    )
    click.echo(orjson.dumps({"ok": True, "fencing_counter": counter}))


#: By name; ``leasekeeper.cli`` lists these names without importing this module.
SERVER_COMMANDS: dict[str, click.Command] = {
    "cleanup": cleanup,
    "fence": fence,
    "mcp": mcp_command,
    "serve": serve,
}
