"""The reference: an empty Starlette JSON endpoint on the server stack of ``leasekeeper serve``.

Every ratio in the benchmark is a lease operation's rate divided by this endpoint's
rate, measured in the same run on the same machine: it cancels out how fast the
machine is (and, roughly, how busy it is), and leaves what the lease service costs
on top of Starlette on uvicorn. ``python -m bench._reference --port N`` serves
``POST /ref`` -> ``{"ok":true}`` with the very uvicorn options ``serve`` uses, and its
garbage collector tuned as ``serve`` tunes it (``bench._instructions`` does the same).
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from leasekeeper._server_cli import _tune_gc, uvicorn_options
from leasekeeper._settings import Settings


async def ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


app = Starlette(routes=[Route("/ref", ok, methods=["POST", "GET"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    _tune_gc()
    uvicorn.run(app, host=args.host, port=args.port, **uvicorn_options(Settings()))


if __name__ == "__main__":
    main()
