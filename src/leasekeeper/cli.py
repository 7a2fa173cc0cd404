"""The ``leasekeeper`` command.

The client's commands (``namespace``, ``acquire``, ``renew``, ``release``, ``complete``,
``run``) come with every install. The server's (``serve``, ``mcp``, ``cleanup``,
``fence``) load when one is run or listed, and need ``leasekeeper[server]``: without
it each is still listed, and says in one line how to install it.
"""

from __future__ import annotations

import click

from leasekeeper._extras import SERVER_INSTALL, ServerMissing, import_server
from leasekeeper.client.cli import CLIENT_COMMANDS

__all__ = ["main"]

#: The commands of ``leasekeeper._server_cli`` (``SERVER_COMMANDS``), named here so that
#: the client's commands, and a listing without the server, do not import it.
_SERVER_COMMANDS = ("cleanup", "fence", "mcp", "serve")


class _Commands(click.Group):
    """The client's commands, and the server's, loaded on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_SERVER_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _SERVER_COMMANDS:
            return super().get_command(ctx, cmd_name)
        try:
            import_server("leasekeeper._server_cli", f"{ctx.command_path} {cmd_name}")
        except ServerMissing as missing:
            return _not_installed(cmd_name, str(missing))
        from leasekeeper._server_cli import SERVER_COMMANDS

        return SERVER_COMMANDS[cmd_name]


def _not_installed(name: str, line: str) -> click.Command:
    """Stands for a server command that cannot load: whatever its arguments (``--help``
    included), it prints ``line`` to stderr and exits 2, the status of a usage error."""

    def refuse() -> None:
        click.echo(line, err=True)
        raise click.exceptions.Exit(2)

    return click.Command(
        name,
        callback=refuse,
        short_help=f"Needs the server: {SERVER_INSTALL}",
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


@click.group(cls=_Commands)
@click.version_option(package_name="leasekeeper")
def main() -> None:
    """leasekeeper: leases, fencing tokens and idempotent results."""


for _command in CLIENT_COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover - python -m leasekeeper.cli
    main()
