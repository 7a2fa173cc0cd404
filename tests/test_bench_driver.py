"""The bench driver puts every workload run between two reference runs and records
their mean rate with it (``Bench._between_references``), and the report's ratio
uses that pair (``bench._report.ratio``). No wrk runs here: ``_wrk`` is replaced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench import _driver
from bench._driver import Bench, Plan
from bench._report import ratio, references
from bench._wrk import Run


def fake_run(target: str, workload: str, connections: int, rate: float) -> Run:
    return Run(
        target=target, workload=workload, connections=connections, seconds=1.0,
        requests=int(rate), ops=int(rate), ops_per_s=rate, requests_per_s=rate,
        p50_ms=1.0, p90_ms=1.0, p99_ms=1.0, max_ms=1.0, server_cpu_us_per_op=1.0,
        server_cpu_cores=1.0, client_cpu_us_per_op=1.0, rss_mb=1.0, peak_rss_mb=1.0,
        statuses={}, counters={}, errors=0,
    )  # fmt: skip


class ScriptedBench(Bench):
    """Answers each run from a script of rates instead of running wrk; logs the order."""

    def __init__(self, rates: list[float], workloads: list[str]) -> None:
        plan = Plan.make(quick=False, records=None)
        super().__init__("wrk", plan, Path("."), None, workloads, single=True)  # type: ignore[arg-type]
        self.rates = iter(rates)
        self.order: list[tuple[str, int, int]] = []

    def _wrk(self, process: Any, target: str, script: str, connections: int,
             seconds: int, args: list[str], *rest: Any) -> Run:  # fmt: skip
        self.order.append((script, connections, seconds))
        return fake_run(target, script, connections, next(self.rates))


def test_each_workload_run_sits_between_two_references_and_keeps_their_mean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_driver, "_mint", lambda server: "ns_" + "A" * 43)
    # The machine slows down as it goes: the reference falls from 20k to 10k requests/s.
    bench = ScriptedBench([20_000, 7_200, 16_000, 5_200, 10_000], ["acquire", "cycle"])
    runs = bench._between_references(None, "sqlite", 64, None)  # type: ignore[arg-type]
    assert [(r.workload, r.target) for r in runs] == [
        ("reference", "reference@sqlite"),
        ("acquire", "sqlite"),
        ("reference", "reference@sqlite"),
        ("cycle", "sqlite"),
        ("reference", "reference@sqlite"),
    ]
    plan = bench.plan
    assert [seconds for _, _, seconds in bench.order] == [
        plan.seconds_reference, plan.seconds, plan.seconds_reference, plan.seconds,
        plan.seconds_reference,
    ]  # fmt: skip
    acquire, cycle = runs[1].as_dict(), runs[3].as_dict()
    assert acquire["extra"]["reference_ops_per_s"] == 18_000
    assert cycle["extra"]["reference_ops_per_s"] == 13_000
    results = {"sections": [{"runs": [r.as_dict() for r in runs]}]}
    refs = references(results)
    assert refs[("sqlite", 64)] == 46_000 / 3  # the store's mean, the fallback
    assert ratio(acquire, refs) == 0.4
    assert ratio(cycle, refs) == 0.4  # against the mean of all three it would be 0.34


def test_runs_without_their_own_references_use_the_stores_mean() -> None:
    """Cleanup windows, and results files from before the pairs were recorded."""
    window = fake_run("sqlite:cleanup", "acquire", 64, 5_000).as_dict()
    assert ratio(window, {("sqlite", 64): 20_000}) == 0.25
    assert ratio(window, {}) is None
