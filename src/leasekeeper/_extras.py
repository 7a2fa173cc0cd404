"""The server is an extra: ``pip install leasekeeper`` installs the client alone.

The client (``leasekeeper.client``, ``leasekeeper.web``, the client's commands) needs
httpx, httpcore, click and sniffio; the server's modules import packages (Starlette,
uvicorn, pydantic, msgspec, orjson, the MCP SDK, prometheus-client) that only
``leasekeeper[server]`` installs. Whatever loads the server goes through
``import_server``, so that a missing package is told as the command that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["SERVER_INSTALL", "ServerMissing", "import_server"]

SERVER_INSTALL = "pip install 'leasekeeper[server]'"


class ServerMissing(ImportError):
    """A module of the server cannot be imported: a package it needs is not installed."""


def import_server(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, a module of the server's. When a package it
    needs is missing, ``ServerMissing`` whose message (one line) says that ``what`` needs
    the server and names ``SERVER_INSTALL``. A missing module of leasekeeper's own is no
    missing extra: that error is raised as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.partition(".")[0] == "leasekeeper":
            raise
        raise ServerMissing(
            f"{what} needs the server, which is not installed "
            f"(no module named {exc.name!r}): {SERVER_INSTALL}",
            name=exc.name,
        ) from exc
