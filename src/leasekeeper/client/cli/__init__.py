"""The client commands of ``leasekeeper``: namespace, acquire, renew, release, complete, run.

A thin layer over ``LeaseClient``: ``_options`` reads what a command is given (never a
secret on the command line), ``_output`` prints the service's JSON and picks the exit
code, ``_commands`` holds the five one-call commands and ``_run`` the ``run`` command and
its process group. ``leasekeeper.cli`` adds ``CLIENT_COMMANDS`` to its ``main`` group.
"""

from leasekeeper.client.cli._commands import (
    acquire_command,
    complete_command,
    namespace_command,
    release_command,
    renew_command,
)
from leasekeeper.client.cli._run import run_command

__all__ = ["CLIENT_COMMANDS"]

#: The commands ``leasekeeper.cli`` adds to ``main``.
CLIENT_COMMANDS = [
    namespace_command,
    acquire_command,
    renew_command,
    release_command,
    complete_command,
    run_command,
]
