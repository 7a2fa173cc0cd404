"""One wrk run against one process, with that process's CPU time and memory around it."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._procs import Process

LUA = Path(__file__).resolve().parent / "lua"

#: The HTTP statuses each script expects; anything else is counted as an error.
EXPECTED: dict[str, frozenset[int]] = {
    "reference": frozenset({200}),
    "acquire": frozenset({201}),
    "idempotency": frozenset({200, 201}),
    "cycle": frozenset({200, 201, 409}),
    "contention": frozenset({200, 201, 409}),
    "heartbeat": frozenset({200}),
    "etcd_acquire": frozenset({200}),
}


@dataclass
class Run:
    """What one wrk run measured. Times in milliseconds, CPU in microseconds per operation."""

    target: str
    workload: str
    connections: int
    seconds: float
    requests: int
    ops: int
    ops_per_s: float
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_us_per_op: float
    server_cpu_cores: float
    client_cpu_us_per_op: float
    rss_mb: float
    peak_rss_mb: float
    statuses: dict[str, int]
    counters: dict[str, int]
    errors: int
    extra: dict[str, Any] = field(default_factory=dict)
    #: [percentile, latency µs] pairs (``lua/common.lua``), kept only when asked for
    #: (``run_wrk(quantiles=True)``): runs are merged with ``_report.percentile``.
    quantiles: list[list[float]] = field(default_factory=list)
    #: The samples in wrk's latency histogram, which its quantiles are over: more than
    #: ``requests`` when wrk filled in for stalled connections (``lua/common.lua``).
    latency_samples: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_wrk(
    wrk: str,
    process: Process,
    path: str,
    script: str,
    *,
    target: str,
    connections: int,
    seconds: int,
    args: Sequence[str],
    ops_counter: str | None = None,
    quantiles: bool = False,
    overrun: float = 60,
) -> Run:
    """Run ``bench/lua/<script>.lua`` against ``process.url + path``.

    wrk gets one thread per connection (see ``lua/common.lua``). ``ops_counter``
    names the Lua counter that counts operations when an operation is not one
    request (etcd's acquire is two); by default every request answered with a status
    the script expects (``EXPECTED``) is one operation. The others, and socket errors
    and timeouts, are ``errors``: never throughput.
    ``quantiles`` keeps the run's latency quantiles in the result.

    A wrk still running ``overrun`` seconds past its time is killed and run once more:
    now and then one hangs on this 2-core VM (a reference run, once in a whole bench),
    and a single hung process must not throw away the quarter of an hour before it.
    Hung twice, the run fails.
    """
    argv = [
        wrk,
        f"-t{connections}",
        f"-c{connections}",
        f"-d{seconds}s",
        "--timeout=10s",
        "-s",
        str(LUA / f"{script}.lua"),
        process.url + path,
        "--",
        *args,
    ]
    process.check_running("before a run")
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_before = process.cpu_seconds()
    for attempt in (1, 2):
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, check=False, timeout=seconds + overrun
            )
            break
        except subprocess.TimeoutExpired:
            hung = f"wrk ran over its {seconds} s by {overrun:g} s"
            if attempt == 2:
                raise RuntimeError(f"{hung} twice: {' '.join(argv)}") from None
            print(f"   {hung} and was killed; running it again", file=sys.stderr, flush=True)
            process.check_running(f"while wrk hung on {script} at {connections} connections")
            children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_before = process.cpu_seconds()
    # A server that died during the run would leave a run of connection errors, and the
    # next step a bare "connection refused".
    process.check_running(f"during a run of {script} at {connections} connections")
    cpu_after = process.cpu_seconds()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss, peak = process.memory_mb()
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout}")
    data = json.loads(lines[-1].removeprefix("BENCH_JSON "))
    counters: dict[str, int] = data["counters"]
    statuses = {k: v for k, v in counters.items() if k.isdigit()}
    named = {k: v for k, v in counters.items() if not k.isdigit()}
    expected = EXPECTED[script]
    unexpected = sum(v for k, v in statuses.items() if int(k) not in expected)
    socket_errors = sum(v for k, v in data["errors"].items() if k != "status")
    elapsed = data["duration_us"] / 1e6
    requests = int(data["requests"])
    ops = named.get(ops_counter, 0) if ops_counter else requests - unexpected
    client_cpu = (children_after.ru_utime + children_after.ru_stime) - (
        children_before.ru_utime + children_before.ru_stime
    )
    per_op = 1e6 / ops if ops else 0.0
    latency = data["latency_us"]
    return Run(
        target=target,
        workload=script,
        connections=connections,
        seconds=round(elapsed, 3),
        requests=requests,
        ops=ops,
        ops_per_s=ops / elapsed,
        requests_per_s=requests / elapsed,
        p50_ms=latency["p50"] / 1000,
        p90_ms=latency["p90"] / 1000,
        p99_ms=latency["p99"] / 1000,
        max_ms=latency["max"] / 1000,
        server_cpu_us_per_op=(cpu_after - cpu_before) * per_op,
        server_cpu_cores=(cpu_after - cpu_before) / elapsed,
        client_cpu_us_per_op=client_cpu * per_op,
        rss_mb=rss,
        peak_rss_mb=peak,
        statuses=statuses,
        counters=named,
        errors=unexpected + socket_errors,
        quantiles=data["quantiles"] if quantiles else [],
        latency_samples=int(data["samples"]),
    )
