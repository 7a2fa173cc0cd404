"""How a client command ends: what it prints, and its exit code (docs/cli.md, "Exit codes").

A command prints the service's JSON body on stdout (an error's on stdout too, or on
stderr for ``run``, whose stdout is its command's). ``run`` exits with its command's
status when the command ran (128 + N when a signal N ended it), with the stored status
when a completed run is reused, and with the codes below for its own outcomes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import click

from leasekeeper._errors import (
    FingerprintConflict,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    OutcomeUnknown,
    RateLimited,
    RequestError,
    RequestTimeout,
    ServiceUnavailable,
)
from leasekeeper.client._http import encode

__all__ = [
    "EXIT_COMPLETED",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_HELD",
    "EXIT_INVALID",
    "EXIT_LOST",
    "EXIT_NOT_STARTED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_UNKNOWN",
    "OutputLost",
    "client_command",
    "exit_code",
    "fail",
    "log_warnings",
    "print_json",
    "report",
    "say_output_lost",
]

EXIT_OK = 0  # done; after acquire: you hold the lease
EXIT_ERROR = 1  # an internal error or an unexpected response (a 404: a wrong URL path)
# 2 is click's usage error: bad options, a missing secret, an unreadable file, bad JSON
EXIT_HELD = 10  # another owner holds the lease (after --wait, if given)
EXIT_LOST = 11  # not (or no longer) the owner; run: the command was stopped
EXIT_CONFLICT = 12  # the key is bound to another fingerprint
EXIT_INVALID = 13  # the service refused the request as invalid or too large
EXIT_UNAVAILABLE = 14  # unreachable, unavailable, rate limited, or a 408: retry
EXIT_COMPLETED = 15  # acquire: the key's work is already done; the JSON has the result
# The service could not learn whether the request took effect ("outcome": "unknown"): an
# acquire may hold the key under a token nobody received until its TTL ends.
EXIT_UNKNOWN = 16
EXIT_NOT_STARTED = 127  # run: the command could not be started (the shell's "not found")


def exit_code(error: LeaseError) -> int:
    """The exit code for ``error``."""
    if isinstance(error, LeaseHeld):
        return EXIT_HELD
    if isinstance(error, LeaseLost):
        return EXIT_LOST
    if isinstance(error, FingerprintConflict):
        return EXIT_CONFLICT
    if isinstance(error, OutcomeUnknown):
        return EXIT_UNKNOWN
    if isinstance(error, RateLimited | ServiceUnavailable | RequestTimeout):
        return EXIT_UNAVAILABLE  # 408: the request was slow to arrive; sent again, it may not be
    if isinstance(error, NotFound | MethodNotAllowed):
        return EXIT_ERROR  # no such route: a wrong --url path, not a bad request of ours
    if isinstance(error, RequestError):
        return EXIT_INVALID
    return EXIT_ERROR


class _StderrHandler(logging.Handler):
    """Client warnings as ``leasekeeper: ...`` on the current stderr (click's, in tests)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"leasekeeper: {record.getMessage()}", err=True)


def log_warnings() -> None:
    """Send the client's WARNINGs to stderr, once per process."""
    logger = logging.getLogger("leasekeeper.client")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler(logging.WARNING))


class OutputLost(Exception):
    """The answer could not be written (a full disk, a closed pipe): the caller never saw it."""


def print_json(body: Mapping[str, Any], *, err: bool = False) -> None:
    """Write ``body`` as one line of JSON on stdout (``err``: stderr); ``OutputLost`` if
    it cannot be written."""
    stream = sys.stderr if err else sys.stdout
    # Started with the descriptor closed, Python has None for the stream, and click.echo
    # would write nothing and say nothing: the answer (an owner token) would be lost.
    if stream is None:
        raise OutputLost(f"cannot write the {'error' if err else 'output'}: it is closed")
    # The client's own encoding (Python's json): a result may hold integers past 64 bits.
    # Written as UTF-8 bytes whatever the locale: JSON is UTF-8, and a Latin-1 stdout
    # could not encode a result's "日本" at all. A stream with no bytes beneath it (a
    # StringIO put in its place) takes the text.
    data = encode(dict(body))
    try:
        click.echo(data if hasattr(stream, "buffer") else data.decode("utf-8"), err=err)
    except OSError as error:  # BrokenPipeError included
        raise OutputLost(f"cannot write the {'error' if err else 'output'}: {error}") from None


def report(body: Mapping[str, Any]) -> None:
    """Write ``body`` to stderr if it can be: the exit code says the same where it cannot."""
    with contextlib.suppress(OutputLost):
        print_json(body, err=True)


def fail(error: LeaseError, *, err: bool = False) -> NoReturn:
    """Print ``error``'s body (on stderr with ``err``) and exit with its code."""
    try:
        print_json(error.body(), err=err)
    except OutputLost as lost:  # the exit code still tells what happened
        say_output_lost(lost)
    sys.exit(exit_code(error))


def say_output_lost(lost: OutputLost) -> None:
    """One line on stderr if it can be written; stdout pointed at /dev/null, so Python's own
    flush at exit does not fail a second time ("Exception ignored ... BrokenPipeError")."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # None: closed at start
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    with contextlib.suppress(OSError):
        click.echo(f"leasekeeper: {lost}", err=True)


def client_command(
    name: str, context_settings: dict[str, Any] | None = None
) -> Callable[[Callable[..., Any]], click.Command]:
    """``click.command``, its callback changed so that a Ctrl-C that reaches Python (while
    waiting, say) exits 130, as a shell reports SIGINT, rather than click's "Aborted!"
    with 1, and an answer that could not be written exits 1 with one line on stderr."""

    def decorate(callback: Callable[..., Any]) -> click.Command:
        @functools.wraps(callback)
        def interruptible(*args: Any, **kwargs: Any) -> Any:
            try:
                return callback(*args, **kwargs)
            except KeyboardInterrupt as stop:  # _run._Interrupted carries its own signal
                sys.exit(128 + getattr(stop, "signum", signal.SIGINT))
            except OutputLost as lost:  # the caller did not get the answer it asked for
                say_output_lost(lost)
                sys.exit(1)

        command = click.command(name, context_settings=context_settings)(callback)
        command.callback = interruptible
        return command

    return decorate
