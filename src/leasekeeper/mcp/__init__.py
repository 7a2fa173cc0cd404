"""The MCP adapter: the five lease tools for AI agents, over streamable HTTP and stdio.

Built on the official ``mcp`` SDK (2.x), a dependency of leasekeeper.
``create_mcp_server(service)`` builds the server; ``streamable_http_mount``
gives the routes and lifespan hooks that ``leasekeeper.http.create_app`` mounts
at ``/mcp``; ``serve_stdio`` serves it over stdin/stdout (``leasekeeper mcp``).
"""

from leasekeeper.mcp._http import StreamableHttpMount, streamable_http_mount
from leasekeeper.mcp._server import (
    INSTRUCTIONS,
    MCP_PATH,
    TOOL_OPERATIONS,
    call_lease_tool,
    create_mcp_server,
    lease_tools,
    quiet_sdk_logs,
)
from leasekeeper.mcp._stdio import serve_stdio

__all__ = [
    "INSTRUCTIONS",
    "MCP_PATH",
    "TOOL_OPERATIONS",
    "StreamableHttpMount",
    "call_lease_tool",
    "create_mcp_server",
    "lease_tools",
    "quiet_sdk_logs",
    "serve_stdio",
    "streamable_http_mount",
]
