"""``python -m bench.middleware``: its figures, its arguments, and one short run; and
``make bench``'s last stage, which runs it (no processes: the stages are replaced)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench import _driver, latency, middleware
from bench._report import middleware_lines, render
from bench.middleware import LEASE, MEASURES, parse_args, report, summary


def test_the_summary_is_in_milliseconds_at_the_median_p90_and_p99() -> None:
    samples = [i / 1000 for i in range(1, 101)]  # 1 to 100 ms
    figures = summary(samples)
    assert figures["median"] == pytest.approx(50.5)
    assert figures["p90"] == pytest.approx(90.0)
    assert figures["p99"] == pytest.approx(99.0)
    assert summary([0.002])["p99"] == pytest.approx(2.0)


def test_the_report_says_what_the_middleware_adds_at_the_median() -> None:
    figures = {name: {"median": 1.0, "p90": 2.0, "p99": 3.0} for name in MEASURES}
    figures["first"] = {"median": 4.5, "p90": 6.0, "p99": 9.0}
    lease = {LEASE: {"median": 3.0, "p90": 4.0, "p99": 5.0}}
    text = report({"asgi": figures, "wsgi": figures, LEASE: lease})
    assert "asgi  added: first +3.50 ms, replay +0.00 ms (medians)" in text
    assert text.splitlines()[-1].split() == ["-", "lease", "3.00", "4.00", "5.00"]
    assert len(text.splitlines()) == 1 + 2 * (len(MEASURES) + 1) + 1


def test_the_arguments_are_checked() -> None:
    assert parse_args(["--kinds", "wsgi"]).kinds == ["wsgi"]
    with pytest.raises(SystemExit):
        parse_args(["--kinds", "cgi"])
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


@pytest.mark.slow
def test_a_short_run_measures_both_kinds(tmp_path: Path) -> None:
    """Three rounds against real processes: the bench runs, and its JSON holds every figure."""
    out = tmp_path / "mw.json"
    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, "-m", "bench.middleware", "--rounds", "3", "--json", str(out)],
        check=True,
        cwd=root,
        capture_output=True,
        timeout=240,
    )
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"asgi", "wsgi", LEASE}
    assert set(results.pop(LEASE)) == {LEASE}
    for figures in results.values():
        assert set(figures) == set(MEASURES)
        assert all(f["median"] > 0 for f in figures.values())


# -- the last stage of make bench -------------------------------------------------------------

FIGURES = {
    kind: {name: {"median": 1.0, "p90": 2.0, "p99": 3.0} for name in MEASURES}
    for kind in ("asgi", "wsgi")
} | {LEASE: {LEASE: {"median": 3.0, "p90": 4.0, "p99": 5.0}}}


class FakeProcess:
    def stop(self) -> None:
        pass


def fake_bench(monkeypatch: pytest.MonkeyPatch, order: list[str]) -> None:
    """``_bench`` with every stage replaced: each records its name in ``order``."""
    machine = {
        "nproc": 2, "cpu": "cpu", "kernel": "6", "python": "3.11", "commit": "abc",
        "loadavg_before": (1.0, 1.0, 1.0), "fsync_ms": {"p50": 1.0, "p99": 2.0},
    }  # fmt: skip
    monkeypatch.setattr(_driver, "_machine", lambda workdir: dict(machine))
    monkeypatch.setattr(_driver, "start_reference", lambda workdir: FakeProcess())
    monkeypatch.setattr(
        _driver.Bench, "store", lambda self, target, section, growth: order.append(target.name)
    )
    monkeypatch.setattr(_driver.Bench, "etcd", lambda self, etcd, section: order.append("etcd"))

    def run(workdir: Path, rounds: int) -> dict[str, Any]:
        assert workdir.is_dir()
        order.append(f"middleware {rounds}")
        return {"rounds": rounds, "results": FIGURES}

    monkeypatch.setattr(middleware, "run", run)

    def one_client(workdir: Path, pairs: int, seconds: int, wrk: str | None) -> dict[str, Any]:
        order.append(f"latency {pairs}")
        return {"pairs": pairs, "results": {}, "notes": []}

    monkeypatch.setattr(latency, "run", one_client)

    def no_plot(results: dict[str, Any], path: Path) -> Path:
        raise ImportError

    monkeypatch.setattr(_driver._plot, "plot", no_plot)


def test_make_bench_measures_the_middleware_last_and_reports_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    order: list[str] = []
    fake_bench(monkeypatch, order)
    out = tmp_path / "results.json"
    args = _driver.parse_args(["--stores", "sqlite,memory", "--out", str(out)])
    plan = _driver.Plan.make(quick=False, records=None)
    assert _driver._bench(args, plan, ["sqlite", "memory"], ["acquire"], "wrk", "etcd") == 0
    assert order == [
        "sqlite", "memory", "etcd", f"latency {plan.latency_pairs}",
        f"middleware {plan.middleware_rounds}",
    ]  # fmt: skip
    stage = json.loads(out.read_text())["middleware"]
    assert stage == {"rounds": plan.middleware_rounds, "results": FIGURES, "notes": []}
    printed = capsys.readouterr().out
    report_at = printed.index("Idempotency-Key middleware, 500 rounds")
    assert printed.index("asgi  added: first +0.00 ms", report_at) < printed.index("targets:")


def test_no_middleware_skips_the_stage_and_its_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    order: list[str] = []
    fake_bench(monkeypatch, order)
    out = tmp_path / "results.json"
    args = _driver.parse_args(["--no-middleware", "--no-latency", "--no-etcd", "--out", str(out)])
    plan = _driver.Plan.make(quick=True, records=None)
    assert _driver._bench(args, plan, ["sqlite"], ["acquire"], "wrk", None) == 0
    assert order == ["sqlite"]
    results = json.loads(out.read_text())
    assert "middleware" not in results
    assert "Idempotency-Key middleware" not in render(results)


def test_a_middleware_stage_that_fails_is_a_note_not_the_end_of_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It comes after every store's runs: an app that does not start loses none of them."""

    def failing(workdir: Path, rounds: int) -> dict[str, Any]:
        raise RuntimeError("wsgi exited with 1 before it was ready")

    monkeypatch.setattr(middleware, "run", failing)
    stage = middleware.stage(tmp_path / "middleware", 30)
    assert stage["results"] == {} and stage["rounds"] == 30
    (note,) = stage["notes"]
    assert "wsgi exited with 1 before it was ready" in note
    lines = middleware_lines(stage)
    assert lines[-1] == f"  note: {note}"
    assert not any("median" in line for line in lines)


def test_the_report_shows_the_stages_table_under_its_heading() -> None:
    lines = middleware_lines({"rounds": 500, "results": FIGURES, "notes": []})
    assert lines[1].startswith("Idempotency-Key middleware, 500 rounds:")
    assert lines[3:] == ["  " + row for row in report(FIGURES).splitlines()]
    assert middleware_lines(None) == []
