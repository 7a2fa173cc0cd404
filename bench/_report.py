"""The terminal table and the targets, computed from the results (the JSON file's content)."""

from __future__ import annotations

import statistics
from typing import Any

from bench import latency, middleware
from bench._wrk import Run

Runs = list[dict[str, Any]]

_HEADER = (
    f"{'target':<30}{'workload':<13}{'conns':>5}{'ops/s':>9}{'ratio':>7}{'p50 ms':>8}"
    f"{'p99 ms':>8}{'CPU µs/op':>10}{'RSS MB':>8}  statuses"
)


def line(run: Run) -> str:
    """One run as it finishes (no ratio yet)."""
    return _row(run.as_dict(), None)


def _row(run: dict[str, Any], ratio: float | None) -> str:
    statuses = " ".join(f"{k}:{v}" for k, v in sorted(run["statuses"].items()))
    # What the operations make up: flows (idempotency), cycles, etcd's acquires.
    named = " ".join(f"{k}:{v}" for k, v in sorted(run.get("counters", {}).items()))
    if named:
        statuses += f"  {named}"
    if run["errors"]:
        statuses += f"  ERRORS {run['errors']}"
    ratio_text = "" if ratio is None else f"{ratio:.2f}"
    return (
        f"{run['target']:<30}{run['workload']:<13}{run['connections']:>5}"
        f"{run['ops_per_s']:>9,.0f}{ratio_text:>7}{run['p50_ms']:>8.2f}{run['p99_ms']:>8.2f}"
        f"{run['server_cpu_us_per_op']:>10.0f}{run['rss_mb']:>8.0f}  {statuses}"
    )


def _mean_rate(runs: Runs) -> float:
    return sum(r["ops_per_s"] for r in runs) / len(runs) if runs else 0.0


def references(results: dict[str, Any]) -> dict[tuple[str, int], float]:
    """(target label, connections) -> the reference rate measured around that target's runs."""
    found: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for section in results["sections"]:
        for run in section["runs"]:
            if run["workload"] == "reference":
                label = run["target"].partition("@")[2]
                found.setdefault((label, run["connections"]), []).append(run)
    return {key: _mean_rate(runs) for key, runs in found.items()}


def ratio(run: dict[str, Any], refs: dict[tuple[str, int], float]) -> float | None:
    """The run's rate over the empty endpoint's rate measured near it: the two reference
    runs around it when the driver recorded them, else (cleanup windows, reference runs,
    and results from before runs had their own pair) the mean of the references of the
    run's store at as many connections, ``refs``."""
    around = run.get("extra", {}).get("reference_ops_per_s")
    if around:
        return float(run["ops_per_s"] / around)
    label = run["target"].partition("@")[2] or run["target"]
    label = label.partition(":")[0]  # cleanup windows compare with the store's empty runs
    reference = refs.get((label, run["connections"]))
    return run["ops_per_s"] / reference if reference else None


def percentile(runs: Runs, p: float) -> float:
    """The ``p``-th percentile latency in ms of all the runs' requests together, as wrk
    would have given it for one run of them all.

    Each run kept its quantiles (``Run.quantiles``: wrk's latency at the percentiles
    0.5 to 99 in steps of 0.5, 99.01 to 99.99 in steps of 0.01, and its maximum at
    100). wrk's ``q`` at percentile ``k`` of ``n`` samples is the latency of a
    sample of rank at least ``k * n / 100``, so a run has at least
    ``floor(k * n / 100)`` samples at or below any latency from ``q`` up. The answer
    is the lowest latency that any run reported at which these counts reach wrk's rank
    for ``p`` of all samples: never below the true value, and above it by at most
    one grid step (half a percent of the samples, or a hundredth in the tail) and one
    sample of each run.

    ``n`` is the run's ``latency_samples``, not its requests: wrk's histogram holds a
    sample for every request and more for the requests a stalled connection did not
    send (its correction for coordinated omission), and its quantiles are over them
    all. Results from before the samples were kept fall back to the requests.
    """
    if not runs or not all(run.get("quantiles") for run in runs):
        raise ValueError("every run needs its quantiles")
    sizes = [run.get("latency_samples") or run["requests"] for run in runs]
    total = sum(sizes)
    # Percentiles in hundredths, so that the ranks are exact integers.
    need = min(total, round(p * 100) * total // 10_000 + 1)
    grids = [
        (n, [(round(k * 100), us) for k, us in run["quantiles"]])
        for n, run in zip(sizes, runs, strict=True)
    ]

    def at_or_below(v: float) -> int:  # a lower bound of the samples at or below v
        found = 0
        for n, grid in grids:
            reached = max((k for k, us in grid if us <= v), default=0)
            if reached == 10_000:
                found += n
            else:
                found += reached * n // 10_000
        return found

    candidates = sorted({us for _, grid in grids for _, us in grid})
    low, high = 0, len(candidates) - 1  # at_or_below() rises with v: the first to reach
    while low < high:
        middle = (low + high) // 2
        if at_or_below(candidates[middle]) >= need:
            high = middle
        else:
            low = middle + 1
    return float(candidates[low]) / 1000


def _failed(*runs: dict[str, Any]) -> int:
    """The failed requests (``Run.errors``) of the runs a target is computed from."""
    return sum(run.get("errors", 0) for run in runs)


def _failures(failed: int) -> str:
    return f"; {failed:,} requests failed" if failed else ""


def _find(runs: Runs, target: str, workload: str, connections: int) -> dict[str, Any] | None:
    for run in runs:
        if (run["target"], run["workload"], run["connections"]) == (target, workload, connections):
            return run
    return None


def headline(
    runs: Runs, store: str, refs: dict[tuple[str, int], float]
) -> tuple[float, float, str, int] | None:
    """``store``'s acquire at 64 connections over all its rounds (``Plan.rounds``): the
    median of their ratios, the p99 of all their requests together, how they were
    taken (empty for a single run), and their errors; None without a run."""
    key = (store, "acquire", 64)
    rounds = [r for r in runs if (r["target"], r["workload"], r["connections"]) == key]
    if not rounds:
        return None
    ratios = [ratio(r, refs) or 0.0 for r in rounds]
    errors = sum(r["errors"] for r in rounds)
    if len(rounds) == 1:
        return ratios[0], rounds[0]["p99_ms"], "", errors
    if all(r.get("quantiles") for r in rounds):
        p99, of = percentile(rounds, 99), "all their requests"
    else:  # results from before quantiles were kept: the median round's stands in
        p99, of = statistics.median(r["p99_ms"] for r in rounds), "the median round"
    how = f" (median of {len(rounds)} rounds, {min(ratios):.2f}-{max(ratios):.2f}; p99 of {of})"
    return statistics.median(ratios), p99, how, errors


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it is met. A target
    whose runs had failed requests (``Run.errors``: statuses the workload never expects,
    socket errors, timeouts) is not met, whatever its figures: failures can be quick ones,
    which keep a rate and a p99 low."""
    refs = references(results)
    runs = [run for section in results["sections"] for run in section["runs"]]
    out: list[dict[str, Any]] = []

    def add(name: str, measured: str, goal: str, met: bool) -> None:
        out.append({"target": name, "measured": measured, "goal": goal, "met": met})

    # For context: the same server on the memory store, which writes nothing down.
    memory = headline(runs, "memory", refs)
    for store, floor, ceiling in (("sqlite", 0.50, 25.0), ("postgresql", 0.25, 50.0)):
        found = headline(runs, store, refs)
        if found is None:
            continue
        r, p99, how, errors = found
        measured = f"ratio {r:.2f}, p99 {p99:.1f} ms{how}"
        if memory is not None:
            measured += f"; the memory store, which writes nothing: {memory[0]:.2f}"
        measured += _failures(errors)
        add(
            f"{store} acquire, 64 connections",
            measured,
            f"ratio >= {floor:.2f}, p99 <= {ceiling:.0f} ms",
            r >= floor and p99 <= ceiling and not errors,
        )
    one = _find(runs, "sqlite", "acquire", 1)
    if one is not None:
        fsync = results["machine"]["fsync_ms"]["p50"]
        failed = _failed(one)
        add(
            "sqlite acquire, 1 connection",
            f"p50 {one['p50_ms']:.2f} ms (this disk's fsync p50: {fsync:.2f} ms)"
            + _failures(failed),
            f"p50 <= {latency.WRK_P50_MS:.2f} ms",
            one["p50_ms"] <= latency.WRK_P50_MS and not failed,
        )
    for growth in {r["target"] for r in runs if "+" in r["target"] and "@" not in r["target"]}:
        store = growth.partition("+")[0]
        for run in runs:
            if run["target"] != growth:
                continue
            empty = _find(runs, store, run["workload"], run["connections"])
            if empty is None:
                continue
            g = _growth(run, empty, refs)
            failed = _failed(run, empty)
            add(
                f"{growth} records, {run['workload']}",
                f"{g:.2f} of the empty store (reference-normalised){_failures(failed)}",
                ">= 0.80",
                g >= 0.80 and not failed,
            )
    for store in ("sqlite", "postgresql"):
        windows = [r for r in runs if r["target"] == f"{store}:cleanup"]
        normal = headline(runs, store, refs)
        if windows and normal:
            first = _find(runs, store, "acquire", 64)
            normal_p99, rounds = normal[1], normal[2]
            worst = max(r["p99_ms"] for r in windows)
            median = statistics.median(r["p99_ms"] for r in windows)
            longest = max(r["max_ms"] for r in windows)
            # For context only: the same store, as large, with no cleanup running.
            grown = next(
                (
                    r
                    for r in runs
                    if r["target"].startswith(f"{store}+") and r["workload"] == "acquire"
                ),
                None,
            )
            context = f"; {grown['target']}, no cleanup: {grown['p99_ms']:.1f} ms" if grown else ""
            # The normal p99 is the acquire target's: of every round's requests together.
            of_rounds = (
                f" (all acquire rounds; the first alone: {first['p99_ms']:.1f} ms)"
                if rounds and first
                else ""
            )
            windowed = (
                f"windows of {windows[0]['seconds']:.0f} s: median p99 {median:.1f}, "
                f"worst {worst:.1f}; longest request {longest:.0f} ms"
            )
            if all(r.get("quantiles") for r in windows):
                # The measure: the p99 of every acquire made during the cleanup.
                during = percentile(windows, 99)
                measured = f"{during:.1f} ms over the whole cleanup"
            else:  # results from before quantiles were kept: the worst window stands in
                during = worst
                measured = f"{worst:.1f} ms worst window"
            # The windows, and the acquire rounds their normal p99 comes from.
            failed = _failed(*windows) + normal[3]
            add(
                f"{store} p99 during cleanup",
                f"{measured} vs {normal_p99:.1f} ms normal{of_rounds} "
                f"({during / normal_p99:.2f}x; {windowed}){context}{_failures(failed)}",
                "<= 2x",
                during <= 2 * normal_p99 and not failed,
            )
    if results.get("latency"):
        for name, measured, goal, met in latency.targets(results["latency"]):
            add(name, measured, goal, met)
    etcd = _find(runs, "etcd", "etcd_acquire", 64)
    if etcd is not None:
        for store in ("sqlite", "postgresql"):
            ours = _find(runs, store, "acquire", 64)
            if ours is not None:
                failed = _failed(ours, etcd)
                add(
                    f"{store} acquire vs etcd, 64 connections",
                    f"{ours['ops_per_s']:,.0f}/s vs {etcd['ops_per_s']:,.0f}/s "
                    f"({ours['ops_per_s'] / max(etcd['ops_per_s'], 1e-9):.2f}x)"
                    + _failures(failed),
                    "ahead of etcd",
                    ours["ops_per_s"] > etcd["ops_per_s"] and not failed,
                )
    return out


def _growth(
    run: dict[str, Any], empty: dict[str, Any], refs: dict[tuple[str, int], float]
) -> float:
    grown, base = ratio(run, refs), ratio(empty, refs)
    if grown is None or not base:
        return run["ops_per_s"] / empty["ops_per_s"] if empty["ops_per_s"] else 0.0
    return grown / base


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    refs = references(results)
    lines = [
        f"machine: {m['nproc']} CPUs, {m['cpu']}, Linux {m['kernel']}, Python {m['python']}, "
        f"commit {m['commit']}",
        f"fsync of 4 KiB: p50 {m['fsync_ms']['p50']:.2f}, p99 {m['fsync_ms']['p99']:.2f} ms; "
        f"load average before {_load(m['loadavg_before'])}, after "
        f"{_load(m.get('loadavg_after', ()))} (other work on the machine shows here)",
        "ops = requests answered as the workload expects (an idempotency flow is three: "
        "acquire, complete, replay; a cycle two), but for etcd: acquires (grant + txn)",
        "ratio = ops/s over the empty Starlette endpoint measured around the same runs; "
        "CPU = the server process's CPU time per op (not PostgreSQL's own)",
        "",
        _HEADER,
    ]
    for section in results["sections"]:
        for run in section["runs"]:
            lines.append(_row(run, ratio(run, refs)))
        lines += [f"  note: {note}" for note in section["notes"]]
    runs = [run for section in results["sections"] for run in section["runs"]]
    etcd = [r for r in runs if r["target"] == "etcd"]
    if etcd:
        lines.append("")
        lines.append(
            "etcd: ops = acquires (grant + txn, two requests each); latency is per request"
        )
        for run in etcd:
            lines.append(
                f"  {run['connections']:>2} conns: {run['ops_per_s']:,.0f} acquires/s "
                f"({run['requests_per_s']:,.0f} requests/s), p50 {run['p50_ms']:.2f} ms, "
                f"p99 {run['p99_ms']:.2f} ms per request, server CPU "
                f"{run['server_cpu_us_per_op']:.0f} µs/acquire "
                f"({run['server_cpu_cores']:.2f} cores), RSS {run['rss_mb']:.0f} MB"
            )
    cleanup = [r for r in runs if r["target"].endswith(":cleanup")]
    if cleanup:
        lines.append("")
        lines.append(
            "cleanup windows (acquire, 64 conns): seconds since start, expired records left, "
            "ops/s, p99"
        )
        for run in cleanup:
            extra = run["extra"]
            lines.append(
                f"  {run['target']:<20} {extra.get('elapsed_s', 0):>6.1f} s "
                f"{extra.get('expired_left', 0):>12,} {run['ops_per_s']:>9,.0f}/s "
                f"p99 {run['p99_ms']:.2f} ms  RSS {run['rss_mb']:.0f} MB"
            )
    lines += latency_lines(results.get("latency"))
    lines += middleware_lines(results.get("middleware"))
    lines.append("")
    lines.append("targets:")
    for t in results.get("targets", []):
        mark = "met    " if t["met"] else "NOT MET"
        lines.append(f"  {mark} {t['target']}: {t['measured']} (goal {t['goal']})")
    return "\n".join(lines)


def latency_lines(stage: dict[str, Any] | None) -> list[str]:
    """The one-client stage's table (``bench.latency.report``) and its notes; nothing when
    the run skipped it (``--no-latency``, or results from before the stage)."""
    if stage is None:
        return []
    lines = [
        "",
        f"one client, {stage['pairs']} calls of each in turns, one keep-alive connection each; "
        "x redis = p50 over redis-py Lock's acquire + release (appendfsync always)",
    ]
    if stage["results"]:
        lines += ["  " + row for row in latency.report(stage).splitlines()]
    lines += [f"  note: {note}" for note in stage.get("notes", [])]
    return lines


def middleware_lines(stage: dict[str, Any] | None) -> list[str]:
    """The middleware stage's table (``bench.middleware.report``) and its notes; nothing
    when the run skipped it (``--no-middleware``, or results from before the stage)."""
    if stage is None:
        return []
    lines = [
        "",
        f"Idempotency-Key middleware, {stage['rounds']} rounds: one request at a time over one "
        "keep-alive connection per app",
        "  unguarded = a path it does not guard; first = a new key (acquire + complete); "
        "replay = a completed key (acquire); lease = acquire + complete from LeaseClient",
    ]
    if stage["results"]:
        lines += ["  " + row for row in middleware.report(stage["results"]).splitlines()]
    lines += [f"  note: {note}" for note in stage.get("notes", [])]
    return lines


def _load(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "?"
