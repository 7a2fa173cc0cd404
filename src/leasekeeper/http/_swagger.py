"""``/docs``: the interactive API page (Swagger UI) and the files it loads, all served
by leasekeeper itself (no network, no other origin).

The files are ``swagger-ui-dist``'s as the ``flask-swagger-ui`` distribution ships them
(found, never imported); each is read once, and only the names in ``_ASSETS`` are served.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

__all__ = ["ASSET_PATHS", "docs_routes"]

_PREFIX = "/docs/"
#: The package's files the page loads, and their media types: with ``nosniff``, a
#: browser runs a script or applies a style sheet only under its own type.
_JS = "text/javascript"
_ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": _JS,
    "favicon-32x32.png": "image/png",
}
#: Swagger UI's start, a file of its own so that the page runs no inline script and
#: its Content-Security-Policy can allow scripts from its own origin only.
_INIT = "init.js"
_INIT_JS = b'SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});\n'
#: The paths served beside ``/docs`` (their metrics and log route name is "docs_asset").
ASSET_PATHS = tuple(_PREFIX + name for name in (*_ASSETS, _INIT))

_PAGE = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>leasekeeper API</title>
<link rel="icon" type="image/png" href="{_PREFIX}favicon-32x32.png">
<link rel="stylesheet" href="{_PREFIX}swagger-ui.css">
</head><body><div id="ui"></div>
<script src="{_PREFIX}swagger-ui-bundle.js"></script>
<script src="{_PREFIX}{_INIT}"></script>
<noscript>The machine-readable API description is at <a href="/openapi.json">/openapi.json</a>.
</noscript></body></html>
"""
#: What the page may load: its own origin's scripts, style sheets and fetches (the
#: description, and "Try it out"), and images from there or inline in the style sheet.
_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: A trailing ``sourceMappingURL`` comment, cut: the package ships no map.
_SOURCE_MAP = re.compile(rb"\s*/[*/]# sourceMappingURL=[^\n]*\s*\Z")
#: Bytes an asset is sent in: the connection guard's send timeout applies to each piece,
#: not to Swagger UI's megabytes whole.
_PIECE = 65_536


class _InPieces(Response):
    """A response whose body is sent ``_PIECE`` bytes at a time, with its length."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        body = self.body
        for start in range(0, max(len(body), 1), _PIECE):
            end = start + _PIECE
            more = end < len(body)
            await send({"type": "http.response.body", "body": body[start:end], "more_body": more})


def _dist() -> Path:
    """The directory of Swagger UI's files in the installed ``flask-swagger-ui``, found
    without importing it."""
    spec = importlib.util.find_spec("flask_swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("flask-swagger-ui is not installed: /docs has no Swagger UI to serve")
    return Path(next(iter(spec.submodule_search_locations))) / "dist"


@functools.cache
def _asset(name: str) -> bytes:
    """One of ``_ASSETS``, read once per process."""
    data = (_dist() / name).read_bytes()
    return _SOURCE_MAP.sub(b"\n", data) if name.endswith((".css", ".js")) else data


def docs_routes() -> list[Route]:
    """``GET /docs`` and one route for each file it loads (``ASSET_PATHS``)."""

    async def page(request: Request) -> Response:
        return HTMLResponse(_PAGE, headers={"Content-Security-Policy": _POLICY})

    async def init(request: Request) -> Response:
        return Response(_INIT_JS, media_type=_JS)

    def asset(name: str) -> Route:
        async def serve(request: Request) -> Response:
            return _InPieces(_asset(name), media_type=_ASSETS[name])

        return Route(_PREFIX + name, serve, methods=["GET"])

    return [
        Route("/docs", page, methods=["GET"]),
        *(asset(name) for name in _ASSETS),
        Route(_PREFIX + _INIT, init, methods=["GET"]),
    ]
