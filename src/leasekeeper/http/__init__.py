"""The HTTP adapter: ``create_app(service, settings)`` returns the ASGI application."""

from leasekeeper.http._app import BASE_PATH, create_app
from leasekeeper.http._errors import STATUS_CODES, error_response, status_code
from leasekeeper.http._lease_app import LeaseApp

__all__ = [
    "BASE_PATH",
    "STATUS_CODES",
    "LeaseApp",
    "create_app",
    "error_response",
    "status_code",
]
