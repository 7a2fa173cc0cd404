"""``python -m bench.middleware``: its figures, its arguments, and one short run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
