"""The instruction counter (``bench._instructions``) drives each target and reads valgrind.

Its in-process driver runs here for real; valgrind is stood in for by a script that
runs the same inner process and reports a count that grows by 10 per request, so the
plumbing (statuses checked, two runs, the difference per request) is checked without
valgrind's minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench import _instructions

from leasekeeper import _server_cli


@pytest.mark.parametrize(
    ("target", "status"), [("reference", 200), ("memory", 201), ("sqlite", 201), ("bare", 201)]
)
def test_the_driver_sends_every_request_and_each_succeeds(
    target: str, status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128 requests after the warm-up, every one answered 200 (reference) or 201 (acquire)."""
    monkeypatch.setattr(_server_cli, "_tune_gc", lambda: None)  # gc.freeze() would outlive the test
    statuses = _instructions._run(_instructions.drive(target, 128, tmp_path))
    assert statuses == {status: 128}


def test_the_count_is_read_from_callgrinds_summary() -> None:
    stderr = "==41== Events    : Ir\n==41== Collected : 3629191661\n==41==\n==41== I   refs:"
    assert _instructions.collected(stderr) == 3_629_191_661
    with pytest.raises(RuntimeError, match="no instruction count"):
        _instructions.collected("valgrind: command not found")


FAKE_VALGRIND = """#!{python}
import subprocess, sys
argv = sys.argv[1:]
inner = argv[argv.index("-m") - 1 :]
requests = int(argv[argv.index("--requests") + 1])
done = subprocess.run(inner, capture_output=True, text=True)
sys.stdout.write(done.stdout)
sys.stderr.write(done.stderr + "==7== Collected : %d\\n" % (1_000_000 + 10 * requests))
sys.exit(done.returncode)
"""


def test_a_run_counts_each_target_twice_and_reports_the_difference_per_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """N and 3N requests; (count(3N) - count(N)) / 2N per request, and the ratio table."""
    fake = tmp_path / "valgrind"
    fake.write_text(FAKE_VALGRIND.format(python=sys.executable))
    fake.chmod(0o755)
    argv = ["--valgrind", str(fake), "--requests", "64", "--results", str(tmp_path / "out")]
    assert _instructions.main([*argv, "--targets", "reference,memory"]) == 0
    out = capsys.readouterr().out
    assert "reference (the empty endpoint)" in out and "acquire, memory store" in out
    assert out.count("                    10 ") == 2 and "1.00" in out
    saved = next((tmp_path / "out").glob("instructions-*.json")).read_text()
    assert '"reference": 10.0' in saved and '"memory": 10.0' in saved


def test_without_valgrind_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert _instructions.main(["--valgrind", "no-such-valgrind"]) == 2
    assert "valgrind is not installed" in capsys.readouterr().err
