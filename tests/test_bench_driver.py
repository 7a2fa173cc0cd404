"""The bench driver puts every workload run between two reference runs and records
their mean rate with it (``Bench._between_references``), and the report's ratio
uses that pair (``bench._report.ratio``). No wrk runs here: ``_wrk`` is replaced."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench import _driver
from bench._driver import Bench, Plan
from bench._report import ratio, references
from bench._wrk import Run

from tests._server import running_server


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
        self.quantiles: list[bool] = []  # whether each run was asked for its quantiles

    def _wrk(self, process: Any, target: str, script: str, connections: int,
             seconds: int, args: list[str], *rest: Any) -> Run:  # fmt: skip
        self.order.append((script, connections, seconds))
        self.quantiles.append(bool(rest[1:2] and rest[1]))
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


class FreshStores:
    """A store target that only counts the stores it made and discarded."""

    name = "sqlite"

    def __init__(self) -> None:
        self.made: list[str] = []
        self.discarded: list[str] = []

    def fresh(self) -> str:
        self.made.append(f"sqlite:///store-{len(self.made)}.db")
        return self.made[-1]

    def discard(self, url: str) -> None:
        self.discarded.append(url)


def test_acquire_runs_four_more_rounds_each_on_a_fresh_store_between_references(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_driver, "_mint", lambda server: "ns_" + "A" * 43)
    started: list[str] = []

    @contextlib.contextmanager
    def server(self: Bench, url: str, env: Any = None) -> Iterator[str]:
        started.append(url)
        yield url

    monkeypatch.setattr(Bench, "_server", server)
    holders: list[str] = []
    monkeypatch.setattr(Bench, "_holders", lambda self, server: holders.append(server))
    # Per round: warm-up, reference, acquire, reference.
    rates = [0, 10_000, 4_400, 12_000] + [0, 20_000, 10_000, 20_000] * 3
    bench = ScriptedBench(rates, ["acquire", "heartbeat"])
    assert bench.plan.rounds == 5
    stores = FreshStores()
    runs = bench._more_rounds(stores)  # type: ignore[arg-type]

    assert started == stores.made == stores.discarded == holders
    assert len(stores.made) == 4
    assert [(r.workload, r.extra.get("round")) for r in runs] == [
        pair
        for number in (2, 3, 4, 5)
        for pair in (("reference", None), ("acquire", number), ("reference", None))
    ]
    assert runs[1].extra["reference_ops_per_s"] == 11_000
    assert runs[1].ops_per_s == 4_400
    assert ratio(runs[1].as_dict(), {}) == 0.4
    # Every round runs as long as the first, and keeps its quantiles for the p99.
    plan = bench.plan
    assert bench.order[:4] == [
        ("acquire", 64, plan.warmup),
        ("reference", 64, plan.seconds_reference),
        ("acquire", 64, plan.seconds),
        ("reference", 64, plan.seconds_reference),
    ]
    assert bench.quantiles == [False, False, True, False] * 4


def test_a_quick_run_makes_a_single_round() -> None:
    assert Plan.make(quick=True, records=None).rounds == 1


def test_holders_are_acquired_with_their_own_tokens(tmp_path: Path) -> None:
    """``_acquire_many`` takes every key once, each with the token that renews it; a key
    that someone else holds stops it with the server's answer."""
    with running_server("memory://", tmp_path / "server.log") as server:
        namespace = httpx.post(f"{server.api}/lease/namespace").json()["namespace"]
        holders = _driver._acquire_many(server.url, namespace, 50, workers=4)
        assert sorted(key for key, _ in holders) == sorted(f"holder-{n}" for n in range(50))
        for key, token in holders[::7]:
            body = {"namespace": namespace, "key": key, "owner_token": token}
            renewed = httpx.post(f"{server.api}/lease/renew", json=body)
            assert (renewed.status_code, renewed.json()["status"]) == (200, "held")
        with pytest.raises(RuntimeError, match="acquiring a holder: 409"):
            _driver._acquire_many(server.url, namespace, 1)


@pytest.mark.parametrize("records", ["0", "-5", "many"])
def test_a_number_of_records_below_one_is_refused(
    records: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--records 0`` read as 'not given': the growth runs filled a million records and
    were labelled with them; a negative number filled none and was labelled with it."""
    with pytest.raises(SystemExit):
        _driver.parse_args(["--records", records])
    assert "--records" in capsys.readouterr().err


def test_the_number_of_records_given_is_the_plans() -> None:
    assert Plan.make(quick=True, records=5).records == 5
    assert Plan.make(quick=False, records=None).records == 1_000_000


def test_an_etcd_that_does_not_start_is_a_note_not_the_end_of_the_run(tmp_path: Path) -> None:
    """The peer comes last, after some 15 minutes of runs that are only written out at
    the end: an etcd that does not start (a data directory it refuses, a port taken)
    is noted in its section, with what it logged, and the results are kept."""
    etcd = tmp_path / "fake-etcd"
    etcd.write_text("#!/bin/sh\necho 'etcdmain: listen tcp: address already in use' >&2\nexit 1\n")
    etcd.chmod(0o755)
    plan = Plan.make(quick=True, records=None)
    bench = Bench("wrk", plan, tmp_path, None, ["acquire"], single=True)  # type: ignore[arg-type]
    section = _driver.Section("etcd")
    bench.etcd(str(etcd), section)
    assert section.runs == []
    (note,) = section.notes
    assert note.startswith("etcd did not start: etcd exited with 1 before it was ready")
    assert "address already in use" in note
