"""What the bench's plot shows is picked from the results correctly (``bench._plot.series``);
drawing it needs matplotlib, which only ``make bench`` installs."""

from __future__ import annotations

from typing import Any

from bench._plot import series


def run(target: str, workload: str, ops: float, p99: float = 5.0, **extra: Any) -> dict[str, Any]:
    return {
        "target": target,
        "workload": workload,
        "connections": extra.pop("connections", 64),
        "ops_per_s": ops,
        "p99_ms": p99,
        "errors": 0,
        "extra": extra,
    }


def test_ratios_per_store_and_cleanup_windows_against_twice_the_normal_p99() -> None:
    results = {
        "sections": [
            {
                "runs": [
                    run("reference@sqlite", "reference", 30_000),
                    run("sqlite", "acquire", 15_000, p99=8.0),
                    run("sqlite", "cycle", 12_000),
                    run("reference@sqlite", "reference", 10_000, connections=1),
                    run("sqlite", "acquire", 3_000, connections=1),
                    run("reference@sqlite+1000000", "reference", 20_000),
                    run("sqlite+1000000", "acquire", 8_000),
                    run("sqlite:cleanup", "acquire", 9_000, p99=12.0, elapsed_s=4.0),
                    run("sqlite:cleanup", "acquire", 9_500, p99=17.0, elapsed_s=8.0),
                ]
            },
            {"runs": [run("etcd", "etcd_acquire", 4_000)]},
        ]
    }
    picked = series(results)
    assert picked["ratios"] == {
        "sqlite": {"acquire": 0.5, "cycle": 0.4},
        "sqlite+1000000": {"acquire": 0.4},
    }
    assert picked["cleanup"] == {
        "sqlite": {"elapsed": [4.0, 8.0], "p99": [12.0, 17.0], "overall": None, "limit": 16.0}
    }


def test_the_acquire_bar_is_the_median_of_the_rounds_the_target_takes() -> None:
    """Acquire runs five rounds on each store; the target takes their median ratio, and
    the bar drawn against the target's line shows the same, not whichever round ran last."""
    runs = [run("reference@sqlite", "reference", 20_000)]
    for rate, reference in ((9_000, 20_000), (10_000, 20_000), (6_000, 20_000)):
        runs.append(run("sqlite", "acquire", rate, reference_ops_per_s=reference))
    runs.append(run("sqlite", "cycle", 8_000, reference_ops_per_s=20_000))
    picked = series({"sections": [{"runs": runs}]})
    assert picked["ratios"] == {"sqlite": {"acquire": 0.45, "cycle": 0.4}}
