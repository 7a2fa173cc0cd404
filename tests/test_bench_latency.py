"""``python -m bench.latency``: its figures, its targets, its table in ``make bench``'s
report, and one short run against real processes (a Redis of its own included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench import latency
from bench._report import latency_lines, render, targets
from bench.latency import MEASURES, REDIS, parse_args, report, summary


def figures(pair: float = 1.0, async_pair: float = 1.1) -> dict[str, Any]:
    results = {name: {"p50": 2.0, "p99": 4.0, "n": 10} for name in MEASURES}
    results[REDIS] = {"p50": 0.8, "p99": 2.0, "n": 10}
    results["sync pair"] = {"p50": pair, "p99": 3.0, "n": 10}
    results["async pair"] = {"p50": async_pair, "p99": 3.0, "n": 10}
    return {
        "pairs": 10,
        "results": results,
        "wrk": {"p50_ms": 0.35, "p99_ms": 1.0, "ops_per_s": 2_800, "errors": 0, "requests": 9},
        "notes": [],
    }


def test_the_summary_is_p50_and_p99_in_milliseconds() -> None:
    found = summary([i / 1000 for i in range(1, 101)])
    assert found["p50"] == pytest.approx(51.0) and found["p99"] == pytest.approx(99.0)
    assert found["n"] == 100


def test_the_table_gives_each_p50_over_redis_pair() -> None:
    rows = report(figures()).splitlines()
    assert rows[1].split() == ["redis", "lock", "0.80", "2.00", "1.00"]
    assert rows[2].split() == ["sync", "pair", "1.00", "3.00", "1.25"]
    assert rows[-2].split()[0] == "fdatasync" and "p50 0.35 ms" in rows[-1]
    assert len(rows) == 1 + len(MEASURES) + 1


def test_the_targets_are_the_issues_ratios_and_the_wrk_p50() -> None:
    met = {name: ok for name, _, _, ok in latency.targets(figures())}
    assert len(met) == 3 and all(met.values())
    slow = figures(pair=1.3, async_pair=1.6) | {
        "wrk": {"p50_ms": 0.41, "p99_ms": 1, "ops_per_s": 1, "errors": 0, "requests": 1}
    }
    assert not any(ok for _, _, _, ok in latency.targets(slow))
    failed = figures() | {
        "wrk": {"p50_ms": 0.3, "p99_ms": 1, "ops_per_s": 1, "errors": 2, "requests": 1}
    }
    (wrk,) = [t for t in latency.targets(failed) if "wrk" in t[0]]
    assert not wrk[3] and wrk[1].endswith("2 requests failed")


def test_the_pair_target_shows_the_floor_under_the_sdk() -> None:
    """The same pair over the standard library's ``http.client``, no SDK: what no client
    of this server can beat, shown beside the SDK's ratio (2.0 / 0.8 in ``figures``)."""
    (pair, *_) = latency.targets(figures())
    assert pair[1] == "p50 1.00 vs 0.80 ms (1.25x; over http.client, no SDK: 2.50x)"
    stage = figures()
    del stage["results"][latency.FLOOR]
    assert latency.targets(stage)[0][1] == "p50 1.00 vs 0.80 ms (1.25x)"


def test_without_redis_there_is_no_ratio_and_no_redis_target() -> None:
    stage = figures()
    del stage["results"][REDIS]
    assert report(stage).splitlines()[1].split()[-1] == "-"
    assert next(t[0] for t in latency.targets(stage)).startswith("async client")


def test_make_bench_reports_the_stage_and_its_targets() -> None:
    results = {
        "machine": {
            "nproc": 2, "cpu": "cpu", "kernel": "6", "python": "3.11", "commit": "abc",
            "loadavg_before": (1.0, 1.0, 1.0), "fsync_ms": {"p50": 1.0, "p99": 2.0},
        },
        "sections": [],
        "latency": figures(),
    }  # fmt: skip
    results["targets"] = targets(results)
    assert len(results["targets"]) == 3 and all(t["met"] for t in results["targets"])
    text = render(results)
    assert "one client, 10 calls of each" in text
    assert text.index("sync pair") < text.index("targets:")
    assert latency_lines(None) == []


def test_a_stage_that_fails_is_a_note(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing(*args: Any) -> dict[str, Any]:
        raise RuntimeError("leasekeeper exited with 1 before it was ready")

    monkeypatch.setattr(latency, "run", failing)
    stage = latency.stage(tmp_path / "latency", 10, 1, None)
    assert stage["results"] == {}
    (note,) = stage["notes"]
    assert latency_lines(stage)[-1] == f"  note: {note}"


def test_the_arguments_are_checked() -> None:
    assert (parse_args(["--quick"]).pairs, parse_args([]).pairs) == (500, 2000)
    with pytest.raises(SystemExit):
        parse_args(["--pairs", "-1"])


@pytest.mark.slow
def test_a_short_run_measures_every_row(tmp_path: Path) -> None:
    """A short run of the stage, Redis's row included (redis-server is on every machine
    this runs on, CI's too; redis-py is in the dev extra)."""
    out = tmp_path / "latency.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.latency",
            "--pairs",
            "5",
            "--seconds",
            "1",
            "--json",
            str(out),
        ],
        check=True,
        cwd=root,
        capture_output=True,
        timeout=240,
    )
    stage = json.loads(out.read_text())
    assert set(stage["results"]) == set(MEASURES)
    assert all(s["n"] == 5 and s["p50"] > 0 for s in stage["results"].values())
