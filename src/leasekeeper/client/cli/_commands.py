"""The one-call client commands (namespace, acquire, renew, release, complete) and the
options every client command takes.

Each command parses its options, makes one call, prints the service's JSON body and
exits with the code of its outcome (``_output``). Secrets never go on the command line,
where ``ps`` would show them: they come from environment variables or files (``-``:
stdin), as docs/cli.md says.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click

from leasekeeper._core.validation import DEFAULT_TTL_SECONDS, MAX_TTL_SECONDS
from leasekeeper._errors import LeaseError, LeaseHeld
from leasekeeper.client._http import DEFAULT_TIMEOUT, DEFAULT_URL, decode
from leasekeeper.client._results import Completed, Lease, Released
from leasekeeper.client._sync import LeaseClient
from leasekeeper.client.cli._output import (
    EXIT_COMPLETED,
    OutputLost,
    client_command,
    fail,
    log_warnings,
    print_json,
)

__all__ = [
    "CliEnvironment",
    "Progress",
    "Seconds",
    "Target",
    "acquire_command",
    "complete_command",
    "connection_options",
    "fingerprint_options",
    "key_options",
    "namespace_command",
    "progress_option",
    "read_target",
    "release_command",
    "renew_command",
    "wait_option",
]

F = TypeVar("F", bound=Callable[..., Any])
#: A decorator that adds options to a command.
Options = Callable[[Callable[..., Any]], Callable[..., Any]]


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


def _env() -> CliEnvironment:
    """The running command's ``CliEnvironment``: the context's object, else the real one."""
    found = click.get_current_context().find_object(CliEnvironment)
    return found if found is not None else CliEnvironment()


class Seconds(click.FloatRange):
    """A number of seconds at least ``min``: ``click.FloatRange``, which lets NaN through
    (every comparison with it is false) to fail later with a traceback."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail("NaN is not a number of seconds.", param, ctx)
        return seconds


def connection_options(function: F) -> F:
    function = click.option(
        "--timeout",
        type=Seconds(min=0.1, max=86_400),
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


def _secret_options(name: str, *, plain: bool, default_env: str | None, what: str) -> Options:
    """``--NAME-env`` and ``--NAME-file`` (and ``--NAME`` itself when not a secret)."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
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


_namespace_options = _secret_options(
    "namespace", plain=False, default_env="LEASEKEEPER_NAMESPACE", what="the namespace"
)
_key_only_options = _secret_options("key", plain=True, default_env=None, what="the key")
fingerprint_options = _secret_options(
    "fingerprint", plain=True, default_env=None, what="the fingerprint"
)
_owner_token_options = _secret_options(
    "owner-token", plain=False, default_env="LEASEKEEPER_OWNER_TOKEN", what="the owner token"
)


def key_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The key's options and the namespace's."""
    return _namespace_options(_key_only_options(function))


def _read_file(path: str, option: str, *, exact: bool = False) -> str:
    """The file's text (``-``: stdin's) without its surrounding whitespace; ``exact`` (keys
    and fingerprints) drops only a final line ending, giving the value ``--key`` would."""
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
    """Stdin's text, as UTF-8 like a file's, whatever the locale says: read in Latin-1, say,
    a key would be another than the same bytes in a file, a result stored garbled. A
    leading byte-order mark is dropped, as from a file (Notepad writes one)."""
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
    attr = name.replace("-", "_")
    plain, env_name, path = (options.get(attr + end) for end in ("", "_env", "_file"))
    plain_way = [f"--{name}"] if attr in options else []  # none for a secret
    if sum(value is not None for value in (plain, env_name, path)) > 1:
        ways = ", ".join([*plain_way, f"--{name}-env", f"--{name}-file"])
        raise click.UsageError(f"give the {name} one way only ({ways})")
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
        ways = " or ".join([*plain_way, f"--{name}-env NAME", f"--{name}-file PATH"])
        where = f", or set {default_env}" if default_env else ""
        raise click.UsageError(f"the {name} is required: give {ways}{where}")
    return None


@dataclass(frozen=True)
class Target:
    """The namespace, key and (optionally) fingerprint of a command, and its client; its
    repr shows none of them, nor the environment (which may hold an owner token)."""

    client: LeaseClient
    namespace: str | None = field(repr=False)
    key: str = field(repr=False)
    fingerprint: str | None = field(repr=False)
    environ: Mapping[str, str] = field(repr=False)


def read_target(options: Mapping[str, Any], *, with_fingerprint: bool = False) -> Target:
    """The command's ``Target`` from its options (a usage error for a secret given badly);
    from here on the client's WARNINGs go to stderr."""
    log_warnings()
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
    return Target(_client(env, options), namespace, str(key), fingerprint, environ)


def _client(env: CliEnvironment, options: Mapping[str, Any]) -> LeaseClient:
    """The client for ``--url`` (or ``LEASEKEEPER_URL``); a bad URL is a usage error."""
    url = options.get("url") or env.environ.get("LEASEKEEPER_URL") or DEFAULT_URL
    try:
        return env.make_client(url, float(options["timeout"]))
    except ValueError as exc:  # not an http(s) URL with a host (the URL is not repeated)
        raise click.UsageError(f"--url or LEASEKEEPER_URL: {exc}") from None


def _owner_token(options: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """The owner token from ``--owner-token-env``, ``--owner-token-file`` or
    ``LEASEKEEPER_OWNER_TOKEN``; a usage error when there is none."""
    token = _secret(
        "owner-token",
        options,
        environ,
        json_field="owner_token",
        default_env="LEASEKEEPER_OWNER_TOKEN",
        required=True,
    )
    return str(token)


class Progress:
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
        # delay 0: a wait on the service ended held, and it is asked to wait on.
        again = f"trying again in {delay:.1f} s" if delay else "waiting on"
        self.say(f"{why}; {again} (waited {waited:.0f} s of {limit})")


progress_option = click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress on stderr [default: when stderr is a terminal].",
)
#: ``--ttl`` for acquire and renew: absent, the service's default applies.
_ttl_option = click.option(
    "--ttl",
    type=click.IntRange(1, MAX_TTL_SECONDS),
    default=None,
    help=f"Lease seconds [{DEFAULT_TTL_SECONDS}].",
)
wait_option = click.option(
    "--wait",
    type=Seconds(min=0),
    default=0.0,
    help="Seconds to wait while the key is held (inf: for ever) [0].",
)


@client_command("namespace")
@connection_options
def namespace_command(**options: Any) -> None:
    """Mint a namespace and print it as JSON: a secret; store it with care (umask 077)."""
    with _client(_env(), options) as client:
        try:
            namespace = client.create_namespace()
        except LeaseError as error:
            fail(error)
    print_json({"ok": True, "namespace": namespace, "entropy_bits": 256})  # the service's body


@client_command("acquire")
@connection_options
@key_options
@fingerprint_options
@_ttl_option
@wait_option
@progress_option
def acquire_command(**options: Any) -> None:
    """Acquire a lease; prints the owner token (exit 0), or the stored result (exit 15)."""
    target = read_target(options, with_fingerprint=True)
    progress = Progress(options["progress"], options["wait"])
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
            fail(error)
        try:
            print_json(outcome.body)
        except OutputLost:
            if isinstance(outcome, Lease):  # nobody has its owner token: let the key go now
                with contextlib.suppress(LeaseError):
                    client.release(target.namespace, target.key, outcome.owner_token)
            raise
    if isinstance(outcome, Completed):
        sys.exit(EXIT_COMPLETED)


@client_command("renew")
@connection_options
@key_options
@_owner_token_options
@_ttl_option
def renew_command(**options: Any) -> None:
    """Move the lease's expiry (owner token from LEASEKEEPER_OWNER_TOKEN or a file)."""
    _as_owner(
        options, lambda client, ns, key, token: client.renew(ns, key, token, ttl=options["ttl"])
    )


@client_command("release")
@connection_options
@key_options
@_owner_token_options
def release_command(**options: Any) -> None:
    """End ownership now; the key can be acquired at once."""
    _as_owner(options, lambda client, ns, key, token: client.release(ns, key, token))


@client_command("complete")
@connection_options
@key_options
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
    _as_owner(options, lambda client, ns, key, token: client.complete(ns, key, token, result))


def _as_owner(
    options: Mapping[str, Any], call: Callable[..., Lease | Released | Completed]
) -> None:
    """``call(client, namespace, key, owner_token)`` for the command's target; print its
    body, or the error's and exit with its code."""
    target = read_target(options)
    token = _owner_token(options, target.environ)
    with target.client as client:
        try:
            answer = call(client, target.namespace, target.key, token)
        except LeaseError as error:
            fail(error)
    print_json(answer.body)
