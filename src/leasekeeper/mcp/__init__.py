"""The MCP adapter: the five lease tools for AI agents, over streamable HTTP and stdio.

``create_mcp_server(service)`` builds the server (on the ``mcp`` SDK);
``streamable_http_mount`` gives what ``create_app`` mounts at ``/mcp``; ``serve_stdio``
serves stdin/stdout (``leasekeeper mcp``).
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
