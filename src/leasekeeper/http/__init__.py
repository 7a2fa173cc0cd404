"""The HTTP adapter: ``create_app(service, settings)`` returns the ASGI application;
``guard_protocol`` and the functions beside it fit uvicorn to it (``leasekeeper serve``)."""

from leasekeeper.http._app import BASE_PATH, create_app
from leasekeeper.http._errors import STATUS_CODES, error_response, status_code
from leasekeeper.http._lease_app import LeaseApp
from leasekeeper.http._protocol import guard_protocol, serve_connection_limit_with, uvicorn_protocol

__all__ = [
    "BASE_PATH",
    "STATUS_CODES",
    "LeaseApp",
    "create_app",
    "error_response",
    "guard_protocol",
    "serve_connection_limit_with",
    "status_code",
    "uvicorn_protocol",
]
