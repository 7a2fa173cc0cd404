"""The MCP adapter: five lease tools over one ``LeaseService``.

Each tool is one service operation: its arguments are the HTTP body's fields, validated
as HTTP's are, and its result is the HTTP body (structured, and as JSON text); a
``LeaseError`` is a tool error result with the error's body (``call_lease_tool``).
Over ``/mcp`` calls spend the HTTP routes' ``Limits``; over stdio nothing is limited.

Built on the SDK's low-level ``Server``: ``MCPServer`` validates arguments in pydantic's
lax mode (``"60"`` and ``true`` would pass as integers). Transports: ``_http`` (``/mcp``)
and ``_stdio`` (``leasekeeper mcp``). Nothing here logs tool arguments or results: they
hold secrets.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping
from typing import Any, Final

import orjson
from mcp import types
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError
from starlette.requests import HTTPConnection

from leasekeeper._core.secrets import ENCODED_CHARS, NAMESPACE_PREFIX, OWNER_PREFIX
from leasekeeper._core.validation import (
    DEFAULT_TTL_SECONDS,
    MAX_FINGERPRINT_CHARS,
    MAX_KEY_CHARS,
    MAX_RESULT_BYTES,
    MAX_TTL_SECONDS,
    MAX_WAIT_SECONDS,
    MIN_BARE_KEY_BITS,
    MIN_BARE_KEY_CHARS,
    SECRET_WORDS,
    check_tree,
)
from leasekeeper._errors import (
    InternalError,
    LeaseError,
)
from leasekeeper._limits import Limits
from leasekeeper._schemas import tool_input_schema
from leasekeeper._service import OPERATIONS, LeaseService

__all__ = [
    "INSTRUCTIONS",
    "MCP_PATH",
    "TOOL_OPERATIONS",
    "call_lease_tool",
    "create_mcp_server",
    "instructions",
    "lease_tools",
    "quiet_sdk_logs",
]

log = logging.getLogger("leasekeeper.mcp")

MCP_PATH: Final = "/mcp"

#: Tool name -> ``LeaseService.handle`` operation.
TOOL_OPERATIONS: Final[Mapping[str, str]] = {
    "create_lease_namespace": "namespace",
    "acquire_lease": "acquire",
    "renew_lease": "renew",
    "release_lease": "release",
    "complete_lease": "complete",
}

# -- input schemas ---------------------------------------------------------------------------
# A tool's arguments are its operation's request fields, with their types and bounds
# (``tool_input_schema``); what is written here is what each field means to an agent.
# The service still checks every argument (a client need not honour a schema).

_ARGUMENTS: Final = {
    "namespace": (
        f"The namespace returned by create_lease_namespace ({NAMESPACE_PREFIX} followed by "
        f"{ENCODED_CHARS} characters). A secret: keep it in your own state and never show it "
        "to users or write it to logs. Optional: without a namespace the key itself must be a "
        "random value (see key)."
    ),
    "key": (
        f"Names one job, for example 'invoice:2026-09-05'. With a namespace: 1 to "
        f"{MAX_KEY_CHARS} characters, no control characters. Without a namespace: "
        f"{MIN_BARE_KEY_CHARS} to {MAX_KEY_CHARS} printable ASCII characters, no whitespace, "
        f"visibly random (at least {MIN_BARE_KEY_BITS:.0f} bits of entropy, such as a UUID4). "
        "Use the same key every time you mean the same job. Treat it as a secret."
    ),
    "ttl_seconds": (
        f"Seconds until the lease expires unless renewed: an integer from 1 to "
        f"{MAX_TTL_SECONDS}, default {DEFAULT_TTL_SECONDS}. Pick a little more than one step "
        "of your work and renew as you go."
    ),
    "fingerprint": (
        f"Identifies the job's input, for example a hash of the request (1 to "
        f"{MAX_FINGERPRINT_CHARS} characters). The first acquire binds the key to this "
        "fingerprint, or to having none, for the key's 24-hour lifecycle; an acquire with a "
        "different one gets status conflict. Send the same fingerprint every time for the same "
        "job. Treat it as a secret."
    ),
    "wait_seconds": (
        f"Seconds to wait, 0 to {MAX_WAIT_SECONDS} (default 0), when another worker holds the "
        "lease: the call returns as soon as the lease is handed to you (held), the job is "
        "completed (completed, with its result) or the time runs out (held). Use it when you "
        "have nothing else to do until the job is free or done, instead of calling again."
    ),
    "owner_token": (
        f"The owner_token that acquire_lease returned to you ({OWNER_PREFIX} followed by "
        f"{ENCODED_CHARS} characters). A secret: it proves you own the lease."
    ),
    "result": (
        f"The job's result: any JSON value, at most {MAX_RESULT_BYTES:,} bytes as compact JSON "
        "(and the whole call under 64 KiB, or it is refused before the tool runs). Fields "
        f"whose name contains a secret's word ({', '.join(SECRET_WORDS)}; case, '-', '_', '.' "
        'and spaces ignored, so tokens_used and API-Key too) are stored as "[redacted]"; '
        "keep secrets and personal data out of other fields too."
    ),
}


def _schema(tool: str) -> dict[str, Any]:
    """The input schema of ``tool``: the fields of its operation's request."""
    model, _ = OPERATIONS[TOOL_OPERATIONS[tool]]
    return tool_input_schema(model, _ARGUMENTS)


def _hints(
    title: str, *, read_only: bool = False, destructive: bool = False, idempotent: bool
) -> types.ToolAnnotations:
    """A tool's annotations; no tool reaches outside leasekeeper."""
    return types.ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


_ERRORS_ANY_TOOL = (
    'Other errors: "invalid" (an argument breaks a rule; the error names it; fix it, do not '
    'retry unchanged), "rate_limited" (too many requests from your address or for this '
    'namespace; wait retry_after_seconds), "unavailable" (the store is unreachable; retry '
    'after retry_after_seconds), "internal" (retry later).'
)

_TOOLS: Final = (
    types.Tool(
        name="create_lease_namespace",
        title="Create a lease namespace",
        description=(
            "Mint a private namespace: a 256-bit secret (ns_...) that lets you use readable keys "
            "such as 'invoice:2026-09-05' with the other lease tools. Call it once per project "
            "or family of jobs and store the namespace in your own durable state: the service "
            "keeps no copy and cannot list or recover it, and anyone who has it can test your "
            "leases and read their results, so never show it to users or write it to logs. Do "
            "not mint a new namespace per lease: the same key in another namespace is another "
            "job, so duplicates would go unnoticed. Takes no arguments; returns "
            "{ok, namespace, entropy_bits}.\n"
            'Tool error "rate_limited": too many namespaces were minted (or requests sent) '
            "from your address; use the namespace you already have, or wait "
            "retry_after_seconds."
        ),
        input_schema=_schema("create_lease_namespace"),
        # Minting stores nothing (the namespace is its own proof); each call makes a new one.
        annotations=_hints("Create a lease namespace", read_only=True, idempotent=False),
    ),
    types.Tool(
        name="acquire_lease",
        title="Acquire a lease",
        description=(
            "Ask for the exclusive right to do one job (named by key), or learn that it is "
            "already done. Call it before starting work that must not run twice, for example "
            "a payment, an email or a deployment. Read `status` in the result:\n"
            '- "held" (ok true): you own the lease for ttl_seconds. Keep owner_token secret; '
            "renew_lease, release_lease and complete_lease need it. Do the work, renew before "
            "lease_expires_at, then call complete_lease. If the systems you write to accept "
            "it, send fencing_token with your writes (a higher token always wins).\n"
            '- "completed" (ok true): the job was done before; `result` is its stored result. '
            "Reuse it and do not do the work again. No owner token is issued.\n"
            'Tool errors (ok false):\n- "held": another worker owns the lease right now. Do '
            "not do the work. If you have nothing else to do until it is free or done, call "
            f"acquire_lease again with wait_seconds (up to {MAX_WAIT_SECONDS}): the call waits "
            "and returns as soon as the lease is yours or the job is completed. Otherwise do "
            "something else and call again after retry_after_seconds.\n"
            '- "conflict": this key was already used with a different fingerprint (different '
            "input) within its 24-hour lifecycle. Use a new key for different input; never "
            "reuse a key for other work.\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema("acquire_lease"),
        # It takes nothing from a live owner; a repeat after expiry makes a new owner.
        annotations=_hints("Acquire a lease", idempotent=False),
    ),
    types.Tool(
        name="renew_lease",
        title="Renew a lease",
        description=(
            "Keep your lease while you are still working: it will now expire ttl_seconds "
            "from now, but never after absolute_expires_at, the end of the key's 24-hour "
            "lifecycle (the returned ttl_seconds is what you actually got). Renew well before "
            "lease_expires_at, for example when half the ttl has passed. fencing_token stays "
            "the same.\n"
            'Tool error "lost": you no longer own the lease (it expired, was released or '
            "completed, or the token is wrong), and someone else may own it now. Stop the work "
            "at once, do not write its output, and call acquire_lease again if the job still "
            "needs doing.\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema("renew_lease"),
        # Repeating it leaves the same state: held until about now + ttl.
        annotations=_hints("Renew a lease", idempotent=True),
    ),
    types.Tool(
        name="release_lease",
        title="Release a lease",
        description=(
            "Give your lease up without storing a result, so that another worker (or you, "
            "later) can acquire the key at once. Use it when you stop or fail before the job "
            "is done. The key keeps its fingerprint binding; your owner_token is useless "
            'afterwards. Returns {ok, status: "released", fencing_token}.\n'
            'Tool error "lost": you were not the owner any more; there is nothing to release. '
            "Do not write the job's output.\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema("release_lease"),
        # It ends the caller's ownership; a repeat is refused as lost and changes nothing.
        annotations=_hints("Release a lease", destructive=True, idempotent=True),
    ),
    types.Tool(
        name="complete_lease",
        title="Complete a lease",
        description=(
            "Finish the job: store its result and end your ownership for good. Until the "
            "key's lifecycle ends (24 hours after its first acquire), acquire_lease with the "
            'same namespace, key and fingerprint returns status "completed" with this result '
            "instead of a lease, so nobody does the work again. The result is returned as "
            "stored, with secret-named fields redacted.\n"
            'Tool error "lost": you no longer own the lease; someone else may have done the '
            "job or be doing it. If an earlier complete_lease call of yours may have succeeded "
            '(a timeout, say), call acquire_lease: status "completed" means it did.\n'
            'Tool error "too_large": the result is over the limit; shrink it and call again '
            "(your lease is unchanged).\n" + _ERRORS_ANY_TOOL
        ),
        input_schema=_schema("complete_lease"),
        # It ends ownership for the lifecycle and fixes the result; a repeat changes nothing.
        annotations=_hints("Complete a lease", destructive=True, idempotent=True),
    ),
)


INSTRUCTIONS: Final = (
    "leasekeeper makes sure a job is done once: one worker at a time holds a lease on the "
    "job's key, and the finished job's result is kept until 24 hours after the key's first "
    "acquire, so that later callers reuse it instead of doing the work again. Typical flow: "
    "create_lease_namespace once and keep the namespace in your own state; acquire_lease with "
    "a key naming the job and a fingerprint of its input; on a result with ok true, status "
    "held and an owner_token, the lease is yours: do the work, renew_lease before the lease "
    "expires, then complete_lease with the result (or release_lease if you give up); on "
    "status completed, reuse the result. Refusals are tool errors (ok false) whose `status` "
    "says what to do next: a tool error with status held means another worker owns the "
    "lease, so do not do the work. The "
    "namespace, key, fingerprint and owner_token are secrets: never show them to users or "
    "write them to logs."
)


def lease_tools(lifecycle_seconds: int = 86_400) -> list[types.Tool]:
    """The five tool definitions, as ``tools/list`` returns them, their texts quoting
    the lifecycle (``LEASEKEEPER_LIFECYCLE_SECONDS``: 24 hours by default)."""
    if lifecycle_seconds == 86_400:
        return list(_TOOLS)
    return [
        types.Tool.model_validate_json(_with_lifecycle(tool.model_dump_json(), lifecycle_seconds))
        for tool in _TOOLS
    ]


def instructions(lifecycle_seconds: int = 86_400) -> str:
    """``INSTRUCTIONS``, quoting the lifecycle as ``lease_tools`` does."""
    return _with_lifecycle(INSTRUCTIONS, lifecycle_seconds)


def _with_lifecycle(text: str, seconds: int) -> str:
    """``text`` with the default lifecycle's words ("24 hours", "24-hour") made those of
    ``seconds``: the texts are written for the default."""
    for size, unit in ((86_400, "day"), (3_600, "hour"), (60, "minute"), (1, "second")):
        # Hours up to two days (48 hours reads better than 2 days less a bit).
        if seconds % size == 0 and (unit != "day" or seconds >= 2 * 86_400):
            count = seconds // size
            break
    noun = f"{count} {unit}" + ("" if count == 1 else "s")
    return text.replace("24 hours", noun).replace("24-hour", f"{count}-{unit}")


# -- calling a tool --------------------------------------------------------------------------


async def call_lease_tool(
    service: LeaseService,
    name: str,
    arguments: Mapping[str, Any] | None,
    *,
    limits: Limits | None = None,
    scope: Mapping[str, Any] | None = None,
) -> types.CallToolResult:
    """Run tool ``name`` on ``service``; every outcome but an unknown tool is a result
    (a ``LeaseError``: an error result with HTTP's body). With ``limits``, the call
    spends what the same HTTP request would, for the ASGI ``scope``'s client address.
    """
    operation = TOOL_OPERATIONS.get(name)
    if operation is None:
        # Protocol error, as the MCP spec asks for unknown tools; a tool name is no secret.
        raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {name}")
    data = dict(arguments or {})
    try:
        # In HTTP's order: address limit, the body checks HTTP's parser makes, then the
        # mint and namespace limits.
        if limits is not None:
            limits.enforce_address(scope or {})
        check_tree(data)
        if limits is not None:
            limits.enforce(scope or {}, operation, data, address=False)
        reply = await service.handle(operation, data)
        return _result(reply.plain(), reply.json_bytes(), is_error=False)
    except LeaseError as error:
        body = error.body()
        return _result(body, orjson.dumps(body), is_error=True)
    except Exception:
        # As HTTP's: the traceback is logged, never the arguments.
        log.exception("unexpected error in MCP tool %s", name)
        body = InternalError().body()
        return _result(body, orjson.dumps(body), is_error=True)


def _result(body: dict[str, Any], text: bytes, *, is_error: bool) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=text.decode())],
        structured_content=body,
        is_error=is_error,
    )


def create_mcp_server(service: LeaseService, *, limits: Limits | None = None) -> Server[Any]:
    """An MCP server with the five lease tools over ``service``, which its owner opens
    and closes. ``limits`` as for ``call_lease_tool``."""

    tools = lease_tools(service.lifecycle_seconds)
    schemas = {tool.name: tool.input_schema for tool in tools}

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        # The SDK's streamable HTTP transports hand over the POST's Starlette request.
        request = ctx.request
        scope = request.scope if isinstance(request, HTTPConnection) else None
        return await call_lease_tool(
            service, params.name, params.arguments, limits=limits, scope=scope
        )

    def input_schema(name: str) -> Mapping[str, Any] | None:
        return schemas.get(name)

    return Server(
        "leasekeeper",
        version=_version(),
        title="leasekeeper",
        description="Leases, fencing tokens and idempotent results for agents and workers.",
        instructions=instructions(service.lifecycle_seconds),
        # Lets the 2026-07-28 HTTP path find a tool's schema without a tools/list round.
        get_tool_input_schema=input_schema,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def _version() -> str:
    try:
        return importlib.metadata.version("leasekeeper")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0"


def quiet_sdk_logs() -> None:
    """Keep the MCP SDK's loggers at WARNING or above: at DEBUG it logs whole frames,
    secrets included."""
    sdk = logging.getLogger("mcp")
    sdk.setLevel(max(logging.WARNING, logging.getLogger().getEffectiveLevel()))
