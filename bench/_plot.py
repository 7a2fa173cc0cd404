"""A picture of one run: ratios against their targets, and the p99 during a cleanup.

``make bench`` writes it beside the JSON file (same name, ``.png``) when matplotlib
is installed (``make bench`` installs the ``bench`` extra). To draw it again from
a results file: ``python -m bench._plot bench/results/bench-….json``.

Two panels: the ratio to the empty endpoint of every workload at 64 connections,
per store, empty and grown (acquire's the median of its rounds, as its target takes
it), with each store's target ratio; and the p99 of each
4-second window of acquires during the cleanup, with the p99 of all of them together
(the target's measure) and twice each store's normal p99.
``series`` picks the numbers out of the results; ``plot`` only draws them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench import _report

#: The issue's ratio targets (64 connections), for the lines on the first panel.
RATIO_TARGETS = {"sqlite": 0.50, "postgresql": 0.25}
#: The second panel's lines for each store: (key in ``series``' cleanup, style, label).
_CLEANUP_LINES = (
    ("overall", ":", "p99 of the whole cleanup"),
    ("limit", "--", "twice the normal p99"),
)


def series(results: dict[str, Any]) -> dict[str, Any]:
    """The plotted numbers: ``ratios`` {store label: {workload: ratio}} at 64
    connections (a grown store's label is ``store+records``; acquire's is the median of
    its rounds, as its target takes it: ``_report.headline``); ``cleanup`` {store:
    {"elapsed": [s], "p99": [ms], "overall": the p99 of all the windows' requests
    (None in results from before windows kept their quantiles), "limit": twice the
    store's normal p99}}."""
    refs = _report.references(results)
    runs = [run for section in results["sections"] for run in section["runs"]]
    found: dict[str, dict[str, list[float]]] = {}
    cleanup: dict[str, dict[str, Any]] = {}
    for run in runs:
        target, workload = run["target"], run["workload"]
        if run["connections"] != 64 or "@" in target or workload == "reference":
            continue
        if target.endswith(":cleanup"):
            store = target.partition(":")[0]
            window = cleanup.setdefault(
                store, {"elapsed": [], "p99": [], "overall": None, "limit": None, "runs": []}
            )
            window["elapsed"].append(run.get("extra", {}).get("elapsed_s", 0.0))
            window["p99"].append(run["p99_ms"])
            window["runs"].append(run)
            continue
        value = _report.ratio(run, refs)
        if value is not None:  # etcd has no reference of its own, so no ratio
            found.setdefault(target, {}).setdefault(workload, []).append(value)
    ratios = {
        target: {workload: statistics.median(values) for workload, values in by_workload.items()}
        for target, by_workload in found.items()
    }
    for store, window in cleanup.items():
        during = window.pop("runs")
        if all(run.get("quantiles") for run in during):
            window["overall"] = _report.percentile(during, 99)
        normal = _report.headline(runs, store, refs)
        window["limit"] = 2 * normal[1] if normal else None  # the acquire rounds' p99
    return {"ratios": ratios, "cleanup": cleanup}


def plot(results: dict[str, Any], path: Path) -> Path:
    """Draw ``results`` into the PNG file ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    data = series(results)
    fig, (bars, windows) = plt.subplots(1, 2, figsize=(13, 4.8))
    ratios: dict[str, dict[str, float]] = data["ratios"]
    workloads = sorted({w for by_workload in ratios.values() for w in by_workload})
    width = 0.8 / max(len(ratios), 1)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, by_workload) in enumerate(sorted(ratios.items())):
        xs = [j + i * width for j, w in enumerate(workloads) if w in by_workload]
        ys = [by_workload[w] for w in workloads if w in by_workload]
        bars.bar(xs, ys, width, label=label, color=colours[i % len(colours)])
    for store, goal in RATIO_TARGETS.items():
        if store in ratios:
            style = ":" if store == "postgresql" else "--"
            bars.axhline(goal, linestyle=style, color="grey", label=f"{store} target {goal:.2f}")
    bars.set_xticks([j + width * (len(ratios) - 1) / 2 for j in range(len(workloads))])
    bars.set_xticklabels(workloads)
    bars.set_ylabel("ops/s ÷ empty endpoint's requests/s")
    bars.set_title("Ratio to the empty endpoint, 64 connections")
    highest = max((v for by_workload in ratios.values() for v in by_workload.values()), default=0)
    bars.set_ylim(0, max(highest, *RATIO_TARGETS.values()) * 1.45)  # room for the legend
    bars.legend(fontsize=8, loc="upper right", ncols=2)
    for i, (store, window) in enumerate(sorted(data["cleanup"].items())):
        colour = colours[i % len(colours)]
        windows.plot(
            window["elapsed"], window["p99"], marker="o", label=f"{store} p99", color=colour
        )
        for key, style, what in _CLEANUP_LINES:
            if window[key] is not None:
                windows.axhline(
                    window[key], linestyle=style, color=colour, label=f"{store}: {what}"
                )
    windows.set_xlabel("seconds since the cleanup started")
    windows.set_ylabel("p99 of acquires in the window, ms")
    seconds = results.get("plan", {}).get("cleanup_window", 4)
    windows.set_title(f"During a cleanup of expired records ({seconds}-second windows)")
    windows.set_ylim(bottom=0)
    if data["cleanup"]:
        windows.legend(fontsize=8)
    else:
        windows.text(0.5, 0.5, "no cleanup in this run", ha="center", transform=windows.transAxes)
    machine = results.get("machine", {})
    fig.suptitle(
        f"leasekeeper bench, commit {machine.get('commit', '?')}, {results.get('started', '')}, "
        f"{machine.get('nproc', '?')} CPUs {machine.get('cpu', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="Draw a bench results file as a PNG beside it.")
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    out = plot(json.loads(args.results.read_text()), args.results.with_suffix(".png"))
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
