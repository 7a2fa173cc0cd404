"""The client commands of ``leasekeeper``: namespace, acquire, renew, release, complete, run.

A thin layer over ``LeaseClient``: parse options, call the client, print the
service's JSON body on stdout, and exit with a code that tells outcomes apart:

====  ===========  ===============================================================
code  meaning      when
====  ===========  ===============================================================
0     ok           done; for ``acquire``: you hold the lease now
1     error        an internal error or an unexpected response (404: a wrong URL path)
2     usage        bad options (missing secret, unreadable file, bad JSON)
10    held         another owner holds the lease (after ``--wait``, if given)
11    lost         you are not (or no longer) the owner; ``run``: the child was stopped
12    conflict     the key is bound to another fingerprint
13    invalid      the service refused the request as invalid or too large
14    unavailable  the service is unreachable, unavailable or rate limiting, or the
                   request timed out (408): retry
15    completed    ``acquire``: the key's work is already done; the JSON has the result
127   not started  ``run``: the command could not be started
====  ===========  ===============================================================

``run`` exits with its command's status when the command ran (128 + N when a
signal N ended it), with the stored status when a completed run is reused, and
with the codes above for its own outcomes.

Secrets never go on the command line, where ``ps`` would show them: the namespace
and owner token come from environment variables (``LEASEKEEPER_NAMESPACE``,
``LEASEKEEPER_OWNER_TOKEN`` by default, or ``--namespace-env NAME``) or files
(``--namespace-file PATH``, ``-`` for stdin). A file may hold the bare value or
the JSON that ``leasekeeper namespace`` / ``leasekeeper acquire`` printed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import click

from leasekeeper._core.validation import DEFAULT_TTL_SECONDS, MAX_TTL_SECONDS
from leasekeeper._errors import (
    FingerprintConflict,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    RateLimited,
    RequestError,
    RequestTimeout,
    ServiceUnavailable,
)
from leasekeeper.client._http import DEFAULT_TIMEOUT, DEFAULT_URL, decode, encode
from leasekeeper.client._results import Completed, Lease
from leasekeeper.client._sync import HeldLease, LeaseClient

__all__ = [
    "CLIENT_COMMANDS",
    "EXIT_COMPLETED",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_HELD",
    "EXIT_INVALID",
    "EXIT_LOST",
    "EXIT_UNAVAILABLE",
    "CliEnvironment",
    "exit_code",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_HELD = 10
EXIT_LOST = 11
EXIT_CONFLICT = 12
EXIT_INVALID = 13
EXIT_UNAVAILABLE = 14
EXIT_COMPLETED = 15
#: ``run`` could not start the command (the shell's code for "not found").
EXIT_NOT_STARTED = 127

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("leasekeeper.client")


def exit_code(error: LeaseError) -> int:
    """The exit code for ``error`` (see the module's table)."""
    if isinstance(error, LeaseHeld):
        return EXIT_HELD
    if isinstance(error, LeaseLost):
        return EXIT_LOST
    if isinstance(error, FingerprintConflict):
        return EXIT_CONFLICT
    if isinstance(error, RateLimited | ServiceUnavailable | RequestTimeout):
        return EXIT_UNAVAILABLE  # 408: the request was slow to arrive; sent again, it may not be
    if isinstance(error, NotFound | MethodNotAllowed):
        return EXIT_ERROR  # no such route: a wrong --url path, not a bad request of ours
    if isinstance(error, RequestError):
        return EXIT_INVALID
    return EXIT_ERROR


def _default_client(url: str, timeout: float) -> LeaseClient:
    return LeaseClient(url, timeout=timeout)


def _stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()  # None: started with fd 2 closed


@dataclass(frozen=True)
class CliEnvironment:
    """What the client commands take from outside; tests pass their own as ``obj``."""

    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    make_client: Callable[[str, float], LeaseClient] = _default_client
    stderr_is_terminal: Callable[[], bool] = _stderr_is_terminal


class _StderrHandler(logging.Handler):
    """Client warnings as ``leasekeeper: ...`` on the current stderr (click's, in tests)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"leasekeeper: {record.getMessage()}", err=True)


def _log_warnings() -> None:
    """Send the client's WARNINGs to stderr, once per process."""
    logger = logging.getLogger("leasekeeper.client")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler(logging.WARNING)
        logger.addHandler(handler)


def _env() -> CliEnvironment:
    found = click.get_current_context().find_object(CliEnvironment)
    return found if found is not None else CliEnvironment()


class _OutputLost(Exception):
    """The answer could not be written (a full disk, a closed pipe): the caller never saw it."""


def _print_json(body: Mapping[str, Any], *, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    # Started with the descriptor closed, Python has None for the stream, and click.echo
    # would write nothing and say nothing: the answer (an owner token) would be lost.
    if stream is None:
        raise _OutputLost(f"cannot write the {'error' if err else 'output'}: it is closed")
    # The client's own encoding (Python's json): a result may hold integers past 64 bits.
    # Written as UTF-8 bytes whatever the locale: JSON is UTF-8, and a Latin-1 stdout
    # could not encode a result's "日本" at all. A stream with no bytes beneath it (a
    # StringIO put in its place) takes the text.
    data = encode(dict(body))
    try:
        click.echo(data if hasattr(stream, "buffer") else data.decode("utf-8"), err=err)
    except OSError as error:  # BrokenPipeError included
        raise _OutputLost(f"cannot write the {'error' if err else 'output'}: {error}") from None


def _report(body: Mapping[str, Any]) -> None:
    """Write ``body`` to stderr if it can be: the exit code says the same where it cannot."""
    with contextlib.suppress(_OutputLost):
        _print_json(body, err=True)


def _fail(error: LeaseError, *, err: bool = False) -> NoReturn:
    try:
        _print_json(error.body(), err=err)
    except _OutputLost as lost:  # the exit code still tells what happened
        _say_output_lost(lost)
    sys.exit(exit_code(error))


def _say_output_lost(lost: _OutputLost) -> None:
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


# -- options ------------------------------------------------------------------------------------


class _Seconds(click.FloatRange):
    """A number of seconds at least ``min``: ``click.FloatRange``, which lets NaN through
    (every comparison with it is false) to fail later with a traceback."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail("NaN is not a number of seconds.", param, ctx)
        return seconds


def _connection_options(function: F) -> F:
    function = click.option(
        "--timeout",
        type=_Seconds(min=0.1, max=86_400),
        default=DEFAULT_TIMEOUT,
        show_default=True,
        help="Seconds for one HTTP request.",
    )(function)
    return click.option(
        "--url",
        default=None,
        metavar="URL",
        help=f"Service URL [LEASEKEEPER_URL, {DEFAULT_URL}].",
    )(function)


def _secret_options(name: str, *, plain: bool, default_env: str | None, what: str) -> Any:
    """``--NAME-env`` and ``--NAME-file`` (and ``--NAME`` itself when not a secret)."""

    def decorate(function: F) -> F:
        function = click.option(
            f"--{name}-file",
            type=click.Path(dir_okay=False, allow_dash=True),
            default=None,
            help=f"Read {what} from this file (- for stdin).",
        )(function)
        env_help = f"Read {what} from this environment variable" + (
            f" [default: {default_env}]." if default_env else "."
        )
        function = click.option(f"--{name}-env", metavar="NAME", default=None, help=env_help)(
            function
        )
        if plain:
            function = click.option(
                f"--{name}", default=None, help=f"{what[0].upper()}{what[1:]}."
            )(function)
        return function

    return decorate


def _namespace_options(function: F) -> F:
    decorate = _secret_options(
        "namespace", plain=False, default_env="LEASEKEEPER_NAMESPACE", what="the namespace"
    )
    return decorate(function)  # type: ignore[no-any-return]


def _key_options(function: F) -> F:
    function = _secret_options("key", plain=True, default_env=None, what="the key")(function)
    return _namespace_options(function)


def _fingerprint_options(function: F) -> F:
    decorate = _secret_options("fingerprint", plain=True, default_env=None, what="the fingerprint")
    return decorate(function)  # type: ignore[no-any-return]


def _owner_token_options(function: F) -> F:
    decorate = _secret_options(
        "owner-token",
        plain=False,
        default_env="LEASEKEEPER_OWNER_TOKEN",
        what="the owner token",
    )
    return decorate(function)  # type: ignore[no-any-return]


def _read_file(path: str, option: str, *, exact: bool = False) -> str:
    """The file's text (``-``: stdin's), without its surrounding whitespace; ``exact``
    (for keys and fingerprints, which may begin or end with spaces) drops only one
    line ending at the end, so that the value is the one ``--key`` would give."""
    if path == "-":
        if sys.stdin is None:  # started with fd 0 closed
            raise click.UsageError(f"{option}: cannot read the file (stdin is closed)")
        # Read once, it is empty the second time: not "no value in the file".
        meta = click.get_current_context().meta
        if meta.setdefault("leasekeeper.stdin", option) != option:
            raise click.UsageError(
                f"{option}: stdin (-) is already read for {meta['leasekeeper.stdin']}"
            )
    try:
        text = _read_stdin() if path == "-" else Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(
            f"{option}: cannot read the file ({exc.__class__.__name__})"
        ) from None
    if exact:
        return text.removesuffix("\n").removesuffix("\r")
    return text.strip()


def _read_stdin() -> str:
    """Stdin's text, as UTF-8 like a file's, whatever the locale says: JSON is UTF-8, and a
    key read in the locale's encoding (Latin-1, say) would be another key than the same
    bytes in a file, and a result would be stored garbled ("rÃ©sumÃ©"). A byte-order mark
    at the start is dropped, from a file too (Notepad writes one): it would make another
    key, as the service ignores one before a body."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream put in its place
        return sys.stdin.read().removeprefix("\ufeff")
    data: bytes = raw.read()
    return data.decode("utf-8-sig")


def _secret(
    name: str,
    options: Mapping[str, Any],
    environ: Mapping[str, str],
    *,
    json_field: str | None = None,
    default_env: str | None = None,
    required: bool,
) -> str | None:
    """One value from ``--NAME``, ``--NAME-env`` or ``--NAME-file`` (at most one given)."""
    plain = options.get(name.replace("-", "_"))
    env_name = options.get(f"{name.replace('-', '_')}_env")
    path = options.get(f"{name.replace('-', '_')}_file")
    given = [v for v in (plain, env_name, path) if v is not None]
    if len(given) > 1:
        ways = [f"--{name}"] if name.replace("-", "_") in options else []
        ways += [f"--{name}-env", f"--{name}-file"]
        raise click.UsageError(f"give the {name} one way only ({', '.join(ways)})")
    if plain is not None:
        return str(plain)
    if env_name is not None:
        value = environ.get(env_name, "")
        if not value:
            # The name is not repeated: given the value by mistake (--owner-token-env
            # "$TOKEN"), it is the secret itself.
            raise click.UsageError(
                f"--{name}-env: the environment variable it names is unset or empty"
            )
        return value
    if path is not None:
        value = _read_file(path, f"--{name}-file", exact=json_field is None)
        if json_field is not None and value.startswith("{"):
            try:
                found = decode(value).get(json_field) or ""
            except (ValueError, AttributeError):
                raise click.UsageError(f"--{name}-file: the file is not valid JSON") from None
            if not isinstance(found, str):
                raise click.UsageError(f"--{name}-file: its {json_field} is not a string")
            value = found
        if not value:
            raise click.UsageError(f"--{name}-file: no {name} in the file")
        return value
    if default_env is not None and environ.get(default_env):
        return environ[default_env]
    if required:
        ways = ([f"--{name}"] if name.replace("-", "_") in options else []) + [
            f"--{name}-env NAME",
            f"--{name}-file PATH",
        ]
        where = f", or set {default_env}" if default_env else ""
        raise click.UsageError(f"the {name} is required: give {' or '.join(ways)}{where}")
    return None


@dataclass(frozen=True)
class _Target:
    """The namespace, key and (optionally) fingerprint of a command, and its client.

    Its repr shows none of them, nor the environment (which may hold an owner token)."""

    client: LeaseClient
    namespace: str | None = field(repr=False)
    key: str = field(repr=False)
    fingerprint: str | None = field(repr=False)
    environ: Mapping[str, str] = field(repr=False)


def _target(options: Mapping[str, Any], *, with_fingerprint: bool = False) -> _Target:
    _log_warnings()
    env = _env()
    environ = env.environ
    namespace = _secret(
        "namespace",
        options,
        environ,
        json_field="namespace",
        default_env="LEASEKEEPER_NAMESPACE",
        required=False,
    )
    key = _secret("key", options, environ, required=True)
    fingerprint = (
        _secret("fingerprint", options, environ, required=False) if with_fingerprint else None
    )
    return _Target(_client(env, options), namespace, str(key), fingerprint, environ)


def _client(env: CliEnvironment, options: Mapping[str, Any]) -> LeaseClient:
    """The client for ``--url`` (or ``LEASEKEEPER_URL``); a bad URL is a usage error."""
    url = options.get("url") or env.environ.get("LEASEKEEPER_URL") or DEFAULT_URL
    try:
        return env.make_client(url, float(options["timeout"]))
    except ValueError as exc:  # not an http(s) URL with a host (the URL is not repeated)
        raise click.UsageError(f"--url or LEASEKEEPER_URL: {exc}") from None


def _owner_token(options: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    token = _secret(
        "owner-token",
        options,
        environ,
        json_field="owner_token",
        default_env="LEASEKEEPER_OWNER_TOKEN",
        required=True,
    )
    return str(token)


class _Progress:
    """Progress lines on stderr, only when it is a terminal (or ``--progress``)."""

    def __init__(self, enabled: bool | None, wait: float) -> None:
        self.enabled = _env().stderr_is_terminal() if enabled is None else enabled
        self.wait = wait
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        if self.enabled:
            click.echo(f"leasekeeper: {message}", err=True)

    def waiting(self, error: LeaseError, delay: float) -> None:
        waited = time.monotonic() - self.started
        if isinstance(error, LeaseHeld):
            why = f"the lease is held by another owner (fencing token {error.fencing_token})"
        else:
            why = f"the service answered {error.status}"
        limit = "no limit" if self.wait == float("inf") else f"{self.wait:g} s"
        self.say(f"{why}; trying again in {delay:.1f} s (waited {waited:.0f} s of {limit})")


def _progress_option(function: F) -> F:
    return click.option(
        "--progress/--no-progress",
        default=None,
        help="Progress on stderr [default: when stderr is a terminal].",
    )(function)


def _ttl_option(function: F) -> F:
    """``--ttl`` for acquire and renew: absent, the service's default applies."""
    return click.option(
        "--ttl",
        type=click.IntRange(1, MAX_TTL_SECONDS),
        default=None,
        help=f"Lease seconds [{DEFAULT_TTL_SECONDS}].",
    )(function)


# -- commands -----------------------------------------------------------------------------------


@click.command("namespace")
@_connection_options
def namespace_command(**options: Any) -> None:
    """Mint a namespace and print it as JSON: a secret; store it with care (umask 077)."""
    with _client(_env(), options) as client:
        try:
            namespace = client.create_namespace()
        except LeaseError as error:
            _fail(error)
    _print_json({"ok": True, "namespace": namespace, "entropy_bits": 256})  # the service's body


@click.command("acquire")
@_connection_options
@_key_options
@_fingerprint_options
@_ttl_option
@click.option(
    "--wait",
    type=_Seconds(min=0),
    default=0.0,
    help="Seconds to wait while the key is held (inf: for ever) [0].",
)
@_progress_option
def acquire_command(**options: Any) -> None:
    """Acquire a lease; prints the owner token (exit 0), or the stored result (exit 15)."""
    target = _target(options, with_fingerprint=True)
    progress = _Progress(options["progress"], options["wait"])
    with target.client as client:
        try:
            outcome = client.acquire(
                target.namespace,
                target.key,
                ttl=options["ttl"],
                fingerprint=target.fingerprint,
                wait=options["wait"],
                on_wait=progress.waiting,
            )
        except LeaseError as error:
            _fail(error)
        try:
            _print_json(outcome.body)
        except _OutputLost:
            if isinstance(outcome, Lease):  # nobody has its owner token: let the key go now
                with contextlib.suppress(LeaseError):
                    client.release(target.namespace, target.key, outcome.owner_token)
            raise
    if isinstance(outcome, Completed):
        sys.exit(EXIT_COMPLETED)


@click.command("renew")
@_connection_options
@_key_options
@_owner_token_options
@_ttl_option
def renew_command(**options: Any) -> None:
    """Move the lease's expiry (owner token from LEASEKEEPER_OWNER_TOKEN or a file)."""
    target = _target(options)
    token = _owner_token(options, target.environ)
    with target.client as client:
        try:
            lease = client.renew(target.namespace, target.key, token, ttl=options["ttl"])
        except LeaseError as error:
            _fail(error)
    _print_json(lease.body)


@click.command("release")
@_connection_options
@_key_options
@_owner_token_options
def release_command(**options: Any) -> None:
    """End ownership now; the key can be acquired at once."""
    target = _target(options)
    token = _owner_token(options, target.environ)
    with target.client as client:
        try:
            released = client.release(target.namespace, target.key, token)
        except LeaseError as error:
            _fail(error)
    _print_json(released.body)


@click.command("complete")
@_connection_options
@_key_options
@_owner_token_options
@click.option("--result", "result_json", default=None, help="The result as JSON text.")
@click.option(
    "--result-file",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Read the JSON result from this file (- for stdin).",
)
def complete_command(**options: Any) -> None:
    """Store a JSON result and end ownership for good."""
    text, path = options["result_json"], options["result_file"]
    if (text is None) == (path is None):
        raise click.UsageError("give the result with --result JSON or --result-file PATH")
    if path is not None:
        text = _read_file(path, "--result-file")
    try:
        result = decode(text)
    except ValueError as exc:
        raise click.UsageError(f"the result is not valid JSON: {exc}") from None
    target = _target(options)
    token = _owner_token(options, target.environ)
    with target.client as client:
        try:
            done = client.complete(target.namespace, target.key, token, result)
        except LeaseError as error:
            _fail(error)
    _print_json(done.body)


# -- run ----------------------------------------------------------------------------------------


def _shell_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    """Whether any process is left in the command's process group.

    Once the command itself has been waited for, the group's zombies that are ``run``'s
    own children (``run`` as PID 1 in a container, or a subreaper, inherits the orphans)
    are reaped first: a zombie has ended, but would still count for ``killpg``."""
    if process.returncode is not None:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-process.pid, os.WNOHANG)[0]:
                pass
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # one is there, and no longer ours to signal
        return True
    return True


#: Signals passed on to the command's group that end its status's claim to be recorded
#: (an interruption); and signals passed on that do not (USR1 and USR2 ask a program
#: to do something, such as reopen its logs, not to stop).
_INTERRUPTIONS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def _forward_signals(
    started: list[subprocess.Popen[bytes]],
    received: list[int],
    unsent: list[int],
    still_held: Callable[[], bool],
    terminated: list[float],
) -> Iterator[None]:
    """Pass SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 on to the command's
    process group while it runs, and stop the command with ``run`` (SIGTSTP, Ctrl-Z).

    The handlers are in place before the command starts (``started`` is empty until
    then): an interruption that arrives meanwhile is kept in ``received`` and
    ``unsent``, and the caller does not start the command, or passes it on once it
    has; a SIGUSR1 or SIGUSR2 then is dropped. A signal that ``run``
    was started ignoring (``nohup``) stays ignored. The command has a process group
    of its own, so a Ctrl-Z would stop ``run`` (and its renewals) but not the
    command, which went on working past the lease. Now the command is stopped
    first; when ``run`` is continued, the command continues only if
    ``still_held()``, and otherwise gets SIGTERM before it runs again (recorded in
    ``terminated``, so that ``_stop`` does not send a second one).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two of its steps, so "started" is either
        # empty (kept in "unsent": the caller passes it on once the command exists) or
        # not (passed on here): never both, never neither.
        if signum in _INTERRUPTIONS:
            received.append(signum)
        if started:
            _signal_group(started[0], signum)
        elif signum in _INTERRUPTIONS:
            unsent.append(signum)
        # else a request (USR1, USR2) to a command not yet there: it means nothing to it,
        # and sent just after it starts, before it could install a handler, would kill it.

    def pause(signum: int, frame: FrameType | None) -> None:
        if started:
            _signal_group(started[0], signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here, as asked; returns on SIGCONT
        signal.signal(signal.SIGTSTP, pause)
        if started:
            if not still_held():  # expired meanwhile: the loss is handled by the main loop
                _terminate(started[0], terminated)
            _signal_group(started[0], signal.SIGCONT)

    with _handling(forward, (*_INTERRUPTIONS, *_PASSED_ON)):
        before = signal.signal(signal.SIGTSTP, pause)  # ignored or not, as before
        try:
            yield
        finally:
            signal.signal(signal.SIGTSTP, before)


class _Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM, SIGHUP or SIGQUIT while ``run`` stores the command's status (a
    KeyboardInterrupt, so that the lease takes the ``complete`` under way as unsure)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _handling(
    handler: Callable[[int, FrameType | None], None],
    signals: tuple[int, ...] = _INTERRUPTIONS,
) -> Iterator[None]:
    """``handler`` for ``signals`` (SIGINT, SIGTERM, SIGHUP and SIGQUIT by default; not
    those ``run`` was started ignoring), then the handlers before it again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, handler)
        for signum in signals
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def _noting(noted: list[int]) -> contextlib.AbstractContextManager[None]:
    """From the lease acquired to the lease let go, an interruption that no step of
    ``run`` handles itself is kept in ``noted``: the default action would end ``run``
    at once, with the key held to its TTL and nothing said."""
    return _handling(lambda signum, frame: noted.append(signum))


def _interruptible(noted: list[int]) -> contextlib.AbstractContextManager[None]:
    """While storing the status: an interruption stops the storing (which may be retried
    for as long as the lease is held) with ``_Interrupted``, once; any later one is only
    kept in ``noted`` (it may come while the handlers are being put back)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        noted.append(signum)
        if len(noted) == 1:
            raise _Interrupted(signum)

    return _handling(interrupt)


def _terminate(process: subprocess.Popen[bytes], terminated: list[float]) -> None:
    """SIGTERM the command's whole group once: ``terminated`` keeps when it was sent.

    A second SIGTERM would reach a command still handling the first, and many programs
    take a second one as "stop now, skip the clean-up"."""
    if not terminated:
        terminated.append(time.monotonic())
        _signal_group(process, signal.SIGTERM)


def _stop(process: subprocess.Popen[bytes], grace: float, terminated: list[float]) -> str:
    """SIGTERM the command's whole group (unless it already got it), then SIGKILL
    ``grace`` seconds after that SIGTERM to what is left of it (the leader, or
    processes it started); how it ended."""
    _terminate(process, terminated)
    deadline = terminated[0] + grace
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    else:
        while _group_alive(process) and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # not our children: nothing to wait on but this
    if process.poll() is None or _group_alive(process):
        _signal_group(process, signal.SIGKILL)
        process.wait()
        return "killed with SIGKILL after the grace period"
    return "stopped with SIGTERM"


def _stored_status(result: Any) -> int:
    if isinstance(result, dict):
        code = result.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255:
            return code
    return EXIT_OK


@click.command(
    "run",
    context_settings={"allow_interspersed_args": False},
)
@_connection_options
@_key_options
@_fingerprint_options
@click.option(
    "--ttl",
    type=click.IntRange(1, MAX_TTL_SECONDS),
    default=30,
    show_default=True,
    help="Lease seconds.",
)
@click.option(
    "--wait",
    type=_Seconds(min=0),
    default=0.0,
    help="Seconds to wait while the key is held (inf: for ever) [0].",
)
@click.option(
    "--complete",
    "record",
    is_flag=True,
    help="Record the exit status, so later runs with this key and fingerprint are skipped.",
)
@click.option(
    "--grace",
    type=_Seconds(min=0, max=86_400),
    default=10.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when the lease is lost.",
)
@_progress_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_command(command: tuple[str, ...], **options: Any) -> None:
    """Run COMMAND while holding the lease on the key, renewing it.

    The command gets LEASEKEEPER_FENCING_TOKEN in its environment and runs in its
    own process group. If the lease is lost, the group gets SIGTERM, then SIGKILL
    after --grace seconds, and run exits 11; what the command leaves running in its
    group when it exits is stopped the same way. With --complete the exit status is
    stored as {"exit_code": N}; a later run with the same key and fingerprint does
    not run the command, prints the stored result on stdout and exits with that
    status. SIGINT, SIGTERM, SIGHUP and SIGQUIT are passed on to the command, and
    then its status is not recorded; SIGUSR1 and SIGUSR2 are passed on. Ctrl-Z
    stops the command with run.

    \b
    leasekeeper run --namespace-file ns.json --key nightly-report --wait 600 \\
        --complete -- ./report.sh
    """
    target = _target(options, with_fingerprint=True)
    progress = _Progress(options["progress"], options["wait"])
    wake = threading.Event()
    with target.client as client:
        held = client.lease(
            target.namespace,
            target.key,
            ttl=options["ttl"],
            fingerprint=target.fingerprint,
            wait=options["wait"],
            on_lost=lambda error: wake.set(),
            on_wait=progress.waiting,
        )
        try:
            held.__enter__()
        except LeaseError as error:
            _fail(error, err=True)
        noted: list[int] = []
        with _noting(noted):
            try:
                code = _run_held(
                    client, held, command, options, target.environ, wake, progress, noted
                )
            finally:
                held.__exit__(None, None, None)
    sys.exit(code)


def _run_held(
    client: LeaseClient,
    held: HeldLease,
    command: tuple[str, ...],
    options: Mapping[str, Any],
    environ: Mapping[str, str],
    wake: threading.Event,
    progress: _Progress,
    noted: list[int],
) -> int:
    """Run the command under ``held``; the exit code for leasekeeper. ``noted`` holds
    the interruptions that came while no step handled them itself (``_noting``)."""
    if held.completion is not None:
        stored = _stored_status(held.result)
        progress.say(f"already completed (exit code {stored}); not running the command")
        _print_json({**held.completion.body, "skipped": True})
        return stored
    fence = held.fencing_token
    child_env = {**environ, "LEASEKEEPER_FENCING_TOKEN": str(fence)}
    received: list[int] = []
    unsent: list[int] = []
    started: list[subprocess.Popen[bytes]] = []
    terminated: list[float] = []  # when the command's group got its SIGTERM

    def still_held() -> bool:
        try:
            held.check()  # sets ``lost`` (and so ``wake``) when the lease expired
        except LeaseLost:
            return False
        return True

    with _forward_signals(started, received, unsent, still_held, terminated):
        progress.say(f"lease acquired (fencing token {fence}); running the command")
        received[:0] = noted  # those that came between the acquire and the handlers
        if received:  # interrupted before the command started: it is not started
            return 128 + received[0]
        try:
            process = subprocess.Popen(command, env=child_env, process_group=0)  # noqa: S603
        except OSError as exc:
            why = f"cannot run the command: {exc.strerror}"
            _report({"ok": False, "status": "error", "error": why})
            return EXIT_NOT_STARTED
        started.append(process)  # from here the handler passes signals on itself
        while unsent:  # those that came while it was starting
            _signal_group(process, unsent.pop(0))

        def watch() -> None:
            process.wait()
            wake.set()

        threading.Thread(target=watch, name="leasekeeper-run-watch", daemon=True).start()
        wake.wait()
        if held.lost.is_set() and process.poll() is None:
            how = _stop(process, options["grace"], terminated)
            lost = held.lost_error.error if held.lost_error else "the lease was lost"
            _report({"ok": False, "status": "lost", "error": lost, "command": how})
            return EXIT_LOST
        process.wait()
        if _group_alive(process):  # the lease covers the whole group: none of it outlives it
            log.warning(
                "the command exited and left processes in its group; they get SIGTERM "
                "(SIGKILL after %s s) before the lease ends",
                options["grace"],
            )
            _stop(process, options["grace"], terminated)
    status = _shell_status(process.returncode)
    if held.lost.is_set():
        lost = held.lost_error.error if held.lost_error else "the lease was lost"
        _report({"ok": False, "status": "lost", "error": lost, "exit_code": status})
        return EXIT_LOST
    if options["record"] and (received or noted):  # noted: since the command ended
        name = signal.Signals((received or noted)[0]).name
        why = f"run was sent {name}: the command's status is not recorded"
        _report({"ok": False, "status": "interrupted", "error": why, "exit_code": status})
    elif options["record"]:
        try:
            with _interruptible(noted):
                client._complete_once(held, {"exit_code": status})  # retried while held
        except _Interrupted as stop:  # the lease is let go on the way out
            name = signal.Signals(stop.signum).name
            why = f"{name} while the status was being stored: it may not have been"
            _report({"ok": False, "status": "interrupted", "error": why, "exit_code": status})
            return 128 + stop.signum
        except LeaseError as error:  # the status is said, since it could not be stored
            _report({**error.body(), "exit_code": status})
            return exit_code(error)
        progress.say(f"recorded exit code {status}")
    return status


def _exit_130_on_interrupt(callback: Callable[..., Any]) -> Callable[..., Any]:
    """A Ctrl-C that reaches Python (while waiting, say) exits 130, as a shell reports
    SIGINT, rather than click's "Aborted!" with 1, which the table keeps for errors.
    An answer that could not be written exits 1 with one line on stderr, not a traceback."""

    @functools.wraps(callback)
    def interruptible(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt as stop:  # _Interrupted carries its own signal
            sys.exit(128 + getattr(stop, "signum", signal.SIGINT))
        except _OutputLost as lost:  # the caller did not get the answer it asked for
            _say_output_lost(lost)
            sys.exit(1)

    return interruptible


#: The commands ``leasekeeper.cli`` adds to ``main``.
CLIENT_COMMANDS = [
    namespace_command,
    acquire_command,
    renew_command,
    release_command,
    complete_command,
    run_command,
]
for _command in CLIENT_COMMANDS:
    if _command.callback is not None:
        _command.callback = _exit_130_on_interrupt(_command.callback)
