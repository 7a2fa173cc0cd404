"""The client commands over ``LeaseClient``: namespace, acquire, renew, release, complete.

Each parses its options (``_options``), makes one call, prints the service's JSON body
on stdout and exits with the code of its outcome (``_output``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import click

from leasekeeper._errors import LeaseError
from leasekeeper.client._http import decode
from leasekeeper.client._results import Completed, Lease
from leasekeeper.client.cli._options import (
    Progress,
    Seconds,
    connection_options,
    environment,
    fingerprint_options,
    key_options,
    lease_client,
    owner_token,
    owner_token_options,
    progress_option,
    read_file,
    read_target,
    ttl_option,
)
from leasekeeper.client.cli._output import (
    EXIT_COMPLETED,
    OutputLost,
    client_command,
    fail,
    print_json,
)

__all__ = [
    "acquire_command",
    "complete_command",
    "namespace_command",
    "release_command",
    "renew_command",
]


@client_command("namespace")
@connection_options
def namespace_command(**options: Any) -> None:
    """Mint a namespace and print it as JSON: a secret; store it with care (umask 077)."""
    with lease_client(environment(), options) as client:
        try:
            namespace = client.create_namespace()
        except LeaseError as error:
            fail(error)
    print_json({"ok": True, "namespace": namespace, "entropy_bits": 256})  # the service's body


@client_command("acquire")
@connection_options
@key_options
@fingerprint_options
@ttl_option
@click.option(
    "--wait",
    type=Seconds(min=0),
    default=0.0,
    help="Seconds to wait while the key is held (inf: for ever) [0].",
)
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
@owner_token_options
@ttl_option
def renew_command(**options: Any) -> None:
    """Move the lease's expiry (owner token from LEASEKEEPER_OWNER_TOKEN or a file)."""
    target = read_target(options)
    token = owner_token(options, target.environ)
    with target.client as client:
        try:
            lease = client.renew(target.namespace, target.key, token, ttl=options["ttl"])
        except LeaseError as error:
            fail(error)
    print_json(lease.body)


@client_command("release")
@connection_options
@key_options
@owner_token_options
def release_command(**options: Any) -> None:
    """End ownership now; the key can be acquired at once."""
    target = read_target(options)
    token = owner_token(options, target.environ)
    with target.client as client:
        try:
            released = client.release(target.namespace, target.key, token)
        except LeaseError as error:
            fail(error)
    print_json(released.body)


@client_command("complete")
@connection_options
@key_options
@owner_token_options
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
        text = read_file(path, "--result-file")
    try:
        result = decode(text)
    except ValueError as exc:
        raise click.UsageError(f"the result is not valid JSON: {exc}") from None
    target = read_target(options)
    token = owner_token(options, target.environ)
    with target.client as client:
        try:
            done = client.complete(target.namespace, target.key, token, result)
        except LeaseError as error:
            fail(error)
    print_json(done.body)
