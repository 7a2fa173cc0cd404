"""The client commands of ``leasekeeper``: namespace, acquire, renew, release, complete, run.

A thin layer over ``LeaseClient``: ``_commands`` holds the options and the five one-call
commands, ``_output`` what they print and their exit codes, ``_run`` the ``run`` command
and its process group. ``leasekeeper.cli`` adds ``CLIENT_COMMANDS`` to its ``main``.
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
