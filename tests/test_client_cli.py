"""The client commands, in-process: JSON out, exit codes, secrets from env/files, run."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import httpx
import orjson
import pytest
from click.testing import CliRunner, Result

from leasekeeper import FakeClock, LeaseClient
from leasekeeper._errors import (
    InvalidRequest,
    LeaseError,
    LeaseLost,
    MethodNotAllowed,
    NotFound,
    OutcomeUnknown,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
)
from leasekeeper.cli import main
from leasekeeper.client.cli import _run as _run_module
from leasekeeper.client.cli._commands import CliEnvironment, Progress
from leasekeeper.client.cli._output import (
    EXIT_COMPLETED,
    EXIT_CONFLICT,
    EXIT_ERROR,
    EXIT_HELD,
    EXIT_INVALID,
    EXIT_LOST,
    EXIT_UNAVAILABLE,
    EXIT_UNKNOWN,
    exit_code,
    print_json,
)
from tests.client_fakes import (
    BASE_URL,
    FakeTime,
    ManualThread,
    answer_lost_after_complete,
    bridge,
)


class Cli:
    """``leasekeeper`` in-process against the test app, with its own environment."""

    def __init__(self, api: Any, tmp_path: Path) -> None:
        self.api = api
        self.tmp_path = tmp_path
        self.environ: dict[str, str] = {"PATH": os.environ.get("PATH", "")}
        self.terminal = False

    def client(self, url: str = BASE_URL, timeout: float = 10.0) -> LeaseClient:
        return LeaseClient(BASE_URL, transport=bridge(self.api), timeout=timeout)

    def __call__(
        self, *args: str, input: str | bytes | None = None, charset: str = "utf-8"
    ) -> Result:
        """``charset``: the encoding of the streams, as a locale would set it."""
        env = CliEnvironment(
            environ=self.environ, make_client=self.client, stderr_is_terminal=lambda: self.terminal
        )
        return CliRunner(charset=charset).invoke(main, list(args), obj=env, input=input)

    def json(self, result: Result) -> Any:
        return orjson.loads(result.stdout)


@pytest.fixture
def cli(api: Any, tmp_path: Path) -> Cli:
    cli = Cli(api, tmp_path)
    result = cli("namespace")
    assert result.exit_code == 0, result.output
    cli.environ["LEASEKEEPER_NAMESPACE"] = cli.json(result)["namespace"]
    return cli


def test_namespace_prints_a_fresh_secret(cli: Cli) -> None:
    """leasekeeper namespace prints {"ok": true, "namespace": "ns_..."}."""
    body = cli.json(cli("namespace"))
    assert body["ok"] is True
    assert body["namespace"].startswith("ns_")
    assert body["entropy_bits"] == 256  # the service's body, as the README says


@pytest.mark.parametrize(
    "args",
    [
        ["acquire", "--key", "k", "--wait", "nan"],
        ["acquire", "--key", "k", "--timeout", "NaN"],
        ["run", "--key", "k", "--grace", "nan", "--", "true"],
    ],
)
def test_nan_seconds_are_a_usage_error(cli: Cli, args: list[str]) -> None:
    """NaN, which passes every range check, is refused as bad usage (2), not a traceback."""
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert "NaN is not a number of seconds" in result.output


def test_acquire_renew_complete_with_exit_codes(cli: Cli, tmp_path: Path) -> None:
    """The owner token goes through a file of acquire's JSON; each outcome has its code."""
    acquired = cli("acquire", "--key", "invoice:1", "--ttl", "30", "--fingerprint", "f")
    assert acquired.exit_code == 0
    lease_file = tmp_path / "lease.json"
    lease_file.write_text(acquired.stdout)
    assert cli.json(acquired)["owner_token"].startswith("own_")

    held = cli("acquire", "--key", "invoice:1", "--fingerprint", "f")
    assert held.exit_code == EXIT_HELD
    assert cli.json(held)["status"] == "held"
    conflict = cli("acquire", "--key", "invoice:1", "--fingerprint", "g")
    assert conflict.exit_code == EXIT_CONFLICT

    token_args = ("--key", "invoice:1", "--owner-token-file", str(lease_file))
    renewed = cli("renew", *token_args, "--ttl", "60")
    assert renewed.exit_code == 0
    assert cli.json(renewed)["ttl_seconds"] == 60
    done = cli("complete", *token_args, "--result", '{"receipt": 4817}')
    assert done.exit_code == 0
    assert cli.json(done)["result"] == {"receipt": 4817}
    lost = cli("release", *token_args)
    assert lost.exit_code == EXIT_LOST
    assert cli.json(lost)["status"] == "lost"
    reused = cli("acquire", "--key", "invoice:1", "--fingerprint", "f")
    assert reused.exit_code == EXIT_COMPLETED
    assert cli.json(reused)["result"] == {"receipt": 4817}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("NaN", "NaN is not JSON"),
        ('{"a": 1, "a": 2}', "an object repeats a name"),
        ('{"a": ', "Expecting value"),
        ('{"a": 1e400}', "too large for a double"),
        ("-1e999", "too large for a double"),
        ('"\\ud800"', "lone surrogate"),
        ("[" * 70 + "]" * 70, "deeper than 64"),
    ],
)
def test_complete_refuses_a_result_the_service_would_not_take(
    cli: Cli, text: str, why: str
) -> None:
    """A result that is not strict JSON is bad usage (2) and leaves the lease held."""
    token = cli.json(cli("acquire", "--key", "k"))["owner_token"]
    cli.environ["LEASEKEEPER_OWNER_TOKEN"] = token
    refused = cli("complete", "--key", "k", "--result", text)
    assert refused.exit_code == 2 and why in refused.output, refused.output
    assert cli("renew", "--key", "k").exit_code == 0  # still held by the same owner


def test_complete_and_replay_keep_integers_past_64_bits(cli: Cli) -> None:
    """--result with 10**30 + 1 is stored, printed and replayed exactly (orjson would have
    read and stored it as 1e+30)."""
    token = cli.json(cli("acquire", "--key", "big"))["owner_token"]
    cli.environ["LEASEKEEPER_OWNER_TOKEN"] = token
    done = cli("complete", "--key", "big", "--result", '{"n": 1000000000000000000000000000001}')
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["result"] == {"n": 10**30 + 1}
    replay = cli("acquire", "--key", "big")
    assert replay.exit_code == EXIT_COMPLETED
    assert '"result":{"n":1000000000000000000000000000001}' in replay.stdout


def test_release_with_the_token_from_the_environment(cli: Cli) -> None:
    """LEASEKEEPER_OWNER_TOKEN (or --owner-token-env NAME) carries the token."""
    token = cli.json(cli("acquire", "--key", "k"))["owner_token"]
    cli.environ["MY_TOKEN"] = token
    released = cli("release", "--key", "k", "--owner-token-env", "MY_TOKEN")
    assert released.exit_code == 0
    assert cli.json(released)["status"] == "released"
    token = cli.json(cli("acquire", "--key", "k"))["owner_token"]
    cli.environ["LEASEKEEPER_OWNER_TOKEN"] = token
    assert cli("release", "--key", "k").exit_code == 0


def test_invalid_and_unreachable_have_their_codes(cli: Cli) -> None:
    """A refused request exits 13, an unreachable service 14."""
    invalid = cli("complete", "--key", "k", "--owner-token-env", "LEASEKEEPER_NAMESPACE",
                  "--result", "1")  # fmt: skip
    assert invalid.exit_code == EXIT_INVALID
    assert cli.json(invalid)["status"] == "invalid"

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    cli.client = lambda url=BASE_URL, timeout=10.0: LeaseClient(  # type: ignore[method-assign]
        BASE_URL, transport=httpx.MockTransport(refuse)
    )
    down = cli("acquire", "--key", "k")
    assert down.exit_code == EXIT_UNAVAILABLE
    assert cli.json(down)["status"] == "unreachable"


def test_an_acquire_whose_outcome_is_unknown_exits_16_and_run_does_not_start(
    cli: Cli, tmp_path: Path
) -> None:
    """A 503 with "outcome": "unknown" (the store lost its commit's answer) is neither
    "held" (10) nor "retry later" (14): acquire and run exit 16 with the service's body,
    and run does not start its command, which may hold the key under a lost token."""
    unknown = {
        "ok": False,
        "status": "unavailable",
        "error": "its outcome is unknown",
        "retry_after_seconds": 1,
        "outcome": "unknown",
    }

    def lost_commit(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/lease"):
            return httpx.Response(503, json=unknown)
        return None

    cli.client = lambda url=BASE_URL, timeout=10.0: LeaseClient(  # type: ignore[method-assign]
        BASE_URL, transport=bridge(cli.api, lost_commit), timeout=timeout
    )
    acquired = cli("acquire", "--key", "u")
    assert acquired.exit_code == EXIT_UNKNOWN == 16
    assert cli.json(acquired) == unknown
    marker = tmp_path / "ran"
    ran = cli("run", "--key", "u", "--", "touch", str(marker))
    assert ran.exit_code == EXIT_UNKNOWN
    assert orjson.loads(ran.stderr.strip().splitlines()[-1]) == unknown
    assert not marker.exists()


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RequestTimeout(), EXIT_UNAVAILABLE),  # slow to arrive: sent again, it may not be
        (RateLimited(), EXIT_UNAVAILABLE),
        (ServiceUnavailable(), EXIT_UNAVAILABLE),
        (OutcomeUnknown(), EXIT_UNKNOWN),  # not "retry later": it may have taken effect
        (InvalidRequest(), EXIT_INVALID),
        (PayloadTooLarge(), EXIT_INVALID),
        (NotFound(), EXIT_ERROR),  # a wrong URL path: an unexpected response, not bad input
        (MethodNotAllowed(), EXIT_ERROR),
    ],
)
def test_retryable_refusals_exit_14_and_bad_requests_13(error: LeaseError, code: int) -> None:
    """What a retry may cure exits 14 (retry later); what it cannot, 13; a route that
    is not there (a wrong --url path) is an unexpected response, 1."""
    assert exit_code(error) == code


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["acquire"], "the key is required"),
        (
            ["acquire", "--key", "k", "--key-env", "K"],
            "one way only (--key, --key-env, --key-file)",
        ),
        (
            ["acquire", "--key", "k", "--namespace-env", "N", "--namespace-file", "ns"],
            "one way only (--namespace-env, --namespace-file)",  # there is no --namespace
        ),
        (["acquire", "--key-env", "UNSET"], "--key-env: the environment variable it names"),
        (["acquire", "--key", "k", "--namespace-file", "/nonexistent/ns"], "cannot read"),
        (["renew", "--key", "k"], "owner-token is required"),
        (["complete", "--key", "k", "--result", "{nope"], "not valid JSON"),
        (["complete", "--key", "k"], "--result JSON or --result-file"),
        (["complete", "--key", "k", "--result", "1", "--result-file", "-"], "--result JSON or"),
    ],
)
def test_usage_errors_exit_2_without_echoing_secrets(
    cli: Cli, args: list[str], message: str
) -> None:
    """Missing or doubled secrets and bad JSON are usage errors (exit 2)."""
    result = cli(*args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert cli.environ["LEASEKEEPER_NAMESPACE"] not in result.output


def test_a_secret_given_to_an_env_option_by_mistake_is_not_repeated(cli: Cli) -> None:
    """``--owner-token-env "$TOKEN"`` (the value where its variable's name belongs) names a
    variable that is not set: the usage error says so without repeating the name, which
    is then the secret itself, on stderr (a cron mail, a journal)."""
    namespace = cli.environ["LEASEKEEPER_NAMESPACE"]
    token = "own_" + "Q" * 42 + "A"
    for args in (
        ["acquire", "--key", "k", "--namespace-env", namespace],
        ["renew", "--key", "k", "--owner-token-env", token],
        ["acquire", "--key-env", "c0ffee" + "d" * 58],  # a bare key
        ["acquire", "--key", "k", "--fingerprint-env", "SECRETFP"],
    ):
        result = cli(*args)
        assert result.exit_code == 2
        assert "the environment variable it names is unset or empty" in result.stderr
        assert args[-1] not in result.output


def test_secrets_from_files_and_stdin(cli: Cli, tmp_path: Path) -> None:
    """A namespace file holds the bare secret or namespace's JSON; - reads stdin."""
    namespace = cli.environ.pop("LEASEKEEPER_NAMESPACE")
    (tmp_path / "ns.txt").write_text(namespace + "\n")
    (tmp_path / "ns.json").write_text(orjson.dumps({"ok": True, "namespace": namespace}).decode())
    first = cli("acquire", "--namespace-file", str(tmp_path / "ns.txt"), "--key", "readable")
    assert first.exit_code == 0
    second = cli("acquire", "--namespace-file", str(tmp_path / "ns.json"), "--key", "readable")
    assert second.exit_code == EXIT_HELD  # the same namespace
    third = cli("acquire", "--namespace-file", "-", "--key", "readable", input=namespace)
    assert third.exit_code == EXIT_HELD
    # Without a namespace, a readable key is invalid: the service says how to make one.
    assert cli("acquire", "--key", "readable").exit_code == EXIT_INVALID


def test_stdin_is_read_as_utf8_whatever_the_locale(cli: Cli) -> None:
    """What ``-`` reads is UTF-8, as a file is, even where the locale's encoding is
    another (here Latin-1): a result is stored as sent, not garbled ("rÃ©sumÃ©"), and a
    key is the key that ``--key`` names. Bytes that are not UTF-8 are a usage error."""
    key = cli("acquire", "--key-file", "-", input="clé".encode(), charset="latin-1")
    assert key.exit_code == 0, key.output
    assert cli("acquire", "--key", "clé").exit_code == EXIT_HELD  # the same key
    cli.environ["LEASEKEEPER_OWNER_TOKEN"] = cli.json(key)["owner_token"]
    result = '{"msg": "résumé"}'.encode()
    done = cli("complete", "--key", "clé", "--result-file", "-", input=result, charset="latin-1")
    assert done.exit_code == 0, done.output
    assert cli.json(cli("acquire", "--key", "clé"))["result"] == {"msg": "résumé"}
    latin = cli("acquire", "--key-file", "-", input="clé".encode("latin-1"), charset="latin-1")
    assert latin.exit_code == 2
    assert "--key-file: cannot read the file (UnicodeDecodeError)" in latin.stderr


def test_a_byte_order_mark_before_a_file_or_stdin_is_dropped(cli: Cli, tmp_path: Path) -> None:
    """Notepad starts a UTF-8 file with a byte-order mark: dropped, as the service drops
    one before a body, so that the key is the one ``--key`` names and the JSON parses."""
    bom = "\ufeff".encode()
    (tmp_path / "key.txt").write_bytes(bom + "clé\r\n".encode())
    first = cli("acquire", "--key-file", str(tmp_path / "key.txt"))
    assert first.exit_code == 0, first.output
    assert cli("acquire", "--key", "clé").exit_code == EXIT_HELD
    assert cli("acquire", "--key-file", "-", input=bom + "clé".encode()).exit_code == EXIT_HELD
    cli.environ["LEASEKEEPER_OWNER_TOKEN"] = cli.json(first)["owner_token"]
    (tmp_path / "result.json").write_bytes(bom + b'{"a": 1}')
    done = cli("complete", "--key", "clé", "--result-file", str(tmp_path / "result.json"))
    assert done.exit_code == 0, done.output
    assert cli.json(done)["result"] == {"a": 1}


def test_output_is_utf8_whatever_the_locale(cli: Cli) -> None:
    """The JSON on stdout is UTF-8 even where the locale's encoding is another: a Latin-1
    stdout cannot encode "日本", and printing a stored result that holds it raised
    UnicodeEncodeError (exit 1, a traceback) instead."""
    acquired = cli.json(cli("acquire", "--key", "k"))
    cli.environ["LEASEKEEPER_OWNER_TOKEN"] = acquired["owner_token"]
    assert cli("complete", "--key", "k", "--result", '{"m": "日本é"}').exit_code == 0
    replay = cli("acquire", "--key", "k", charset="latin-1")
    assert replay.exit_code == EXIT_COMPLETED, replay.output
    assert orjson.loads(replay.stdout_bytes)["result"] == {"m": "日本é"}


def test_output_goes_to_a_stdout_that_takes_only_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program that runs the CLI with a StringIO for stdout (``redirect_stdout``) gets
    the JSON as text: there are no bytes beneath to write UTF-8 to."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    print_json({"ok": True, "result": {"m": "日本é"}})
    assert orjson.loads(out.getvalue())["result"] == {"m": "日本é"}


def test_stdin_read_for_two_options_and_a_namespace_that_is_not_text(
    cli: Cli, tmp_path: Path
) -> None:
    """``-`` for two options: the second would read nothing and be told its file holds no
    value; said as it is instead. A namespace file whose ``namespace`` is not a string
    is a usage error, not a request the service refuses."""
    both = cli("complete", "--key", "k", "--owner-token-file", "-", "--result-file", "-",
               input='{"a": 1}')  # fmt: skip
    assert both.exit_code == 2
    assert "--owner-token-file: stdin (-) is already read for --result-file" in both.stderr
    (tmp_path / "ns.json").write_text('{"namespace": 5}')
    number = cli("acquire", "--key", "k", "--namespace-file", str(tmp_path / "ns.json"))
    assert number.exit_code == 2
    assert "--namespace-file: its namespace is not a string" in number.stderr


def test_a_key_or_fingerprint_file_gives_the_value_the_flag_would(cli: Cli, tmp_path: Path) -> None:
    """Keys and fingerprints may begin or end with spaces: their files lose only the line
    ending at the end, so that --key-file names the key --key names (else a run keyed
    one way and then the other would do the work twice)."""
    key, fingerprint = " nightly:15492 ", " v1\t"
    (tmp_path / "key").write_text(key)
    (tmp_path / "key-crlf").write_bytes((key + "\r\n").encode())
    (tmp_path / "fp").write_text(fingerprint + "\n")
    first = cli("acquire", "--key", key, "--fingerprint", fingerprint, "--ttl", "60")
    assert first.exit_code == 0, first.output
    for key_file in ("key", "key-crlf"):
        again = cli("acquire", "--key-file", str(tmp_path / key_file),
                    "--fingerprint-file", str(tmp_path / "fp"))  # fmt: skip
        assert again.exit_code == EXIT_HELD, again.output  # the same key and fingerprint
    other = cli("acquire", "--key", key.strip(), "--fingerprint", fingerprint)
    assert other.exit_code == 0, other.output  # without the spaces: another key


def test_acquire_wait_reports_progress_on_a_terminal(cli: Cli) -> None:
    """Waiting is told on stderr when it is a terminal, and not otherwise."""
    cli("acquire", "--key", "busy", "--ttl", "60")
    quiet = cli("acquire", "--key", "busy", "--wait", "0.3")
    assert quiet.exit_code == EXIT_HELD
    assert quiet.stderr == ""
    cli.terminal = True
    loud = cli("acquire", "--key", "busy", "--wait", "0.3")
    assert loud.exit_code == EXIT_HELD
    assert "held by another owner" in loud.stderr
    assert "trying again in" in loud.stderr


# -- run --------------------------------------------------------------------------------------


def test_progress_flags_override_whether_stderr_is_a_terminal(cli: Cli) -> None:
    """--progress tells on stderr in a pipe too; --no-progress keeps a terminal quiet."""
    loud = cli("run", "--key", "p1", "--progress", "--", "true")
    assert loud.exit_code == 0, loud.output
    assert "leasekeeper: lease acquired (fencing token" in loud.stderr
    cli.terminal = True
    quiet = cli("run", "--key", "p2", "--no-progress", "--", "true")
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""


def test_run_gives_the_fence_and_passes_the_exit_status(cli: Cli, tmp_path: Path) -> None:
    """The command sees LEASEKEEPER_FENCING_TOKEN; run exits with its status; lease released."""
    out = tmp_path / "fence"
    result = cli("run", "--key", "job", "--", "sh", "-c",
                 f'echo "$LEASEKEEPER_FENCING_TOKEN" > {out}; exit 3')  # fmt: skip
    assert result.exit_code == 3
    assert int(out.read_text()) > 0
    assert result.stdout == ""
    assert cli("acquire", "--key", "job").exit_code == 0  # released


def test_run_holds_the_key_for_30_seconds_by_default(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run`` without --ttl leases for 30 s (README: ``[--ttl 30]``)."""
    ttls: list[int] = []
    real_lease = LeaseClient.lease

    def lease(self: LeaseClient, *args: Any, **kwargs: Any) -> Any:
        ttls.append(kwargs["ttl"])
        return real_lease(self, *args, **kwargs)

    monkeypatch.setattr(LeaseClient, "lease", lease)
    assert cli("run", "--key", "t", "--", "true").exit_code == 0
    assert cli("run", "--key", "t", "--ttl", "7", "--", "true").exit_code == 0
    assert ttls == [30, 7]


def test_run_complete_records_and_later_runs_skip(cli: Cli, tmp_path: Path) -> None:
    """With --complete --record-failures a failed status is stored; the next run skips and
    reports it."""
    log = tmp_path / "ran"
    job = ["sh", "-c", f"echo ran >> {log}; exit 4"]
    flags = ["--key", "nightly", "--fingerprint", "v1", "--complete", "--record-failures"]
    first = cli("run", *flags, "--", *job)
    assert first.exit_code == 4
    cli.terminal = True
    second = cli("run", *flags, "--", *job)
    assert second.exit_code == 4
    report = cli.json(second)
    assert report["skipped"] is True
    assert report["result"] == {"exit_code": 4}
    assert "already completed" in second.stderr
    assert log.read_text() == "ran\n"


def test_run_complete_records_a_success_and_releases_after_a_failure(
    cli: Cli, tmp_path: Path
) -> None:
    """--complete alone records exit 0 only: a failure is not stored and the key is
    released, so the next run runs the command again; once it succeeds, runs skip it."""
    log = tmp_path / "ran"
    cli.terminal = True
    failed = cli(
        "run", "--key", "flaky", "--complete", "--", "sh", "-c", f"echo 1 >> {log}; exit 3"
    )
    assert failed.exit_code == 3, failed.output
    assert "exit code 3 is not recorded (no --record-failures); key released" in failed.stderr
    assert failed.stdout == ""
    done = cli("run", "--key", "flaky", "--complete", "--", "sh", "-c", f"echo 2 >> {log}")
    assert done.exit_code == 0, done.output
    assert "recorded exit code 0" in done.stderr
    again = cli("run", "--key", "flaky", "--complete", "--", "sh", "-c", f"echo 3 >> {log}")
    assert again.exit_code == 0
    assert cli.json(again)["result"] == {"exit_code": 0}
    assert log.read_text() == "1\n2\n"


@pytest.mark.parametrize("flag", ["--record-failures", "--store-output"])
def test_run_options_that_store_need_complete(cli: Cli, flag: str) -> None:
    """--record-failures and --store-output without --complete are a usage error."""
    result = cli("run", "--key", "k", flag, "--", "true")
    assert result.exit_code == 2
    assert f"{flag} needs --complete" in result.stderr


@pytest.mark.parametrize(
    ("printed", "stored"),
    [
        ('{"rows": 3, "file": "r.csv"}\n', {"rows": 3, "file": "r.csv"}),
        ("report sent to 2 people\nété\n", "report sent to 2 people\nété\n"),
        ('"quoted"\n', '"quoted"\n'),
        ("", ""),
    ],
    ids=["json", "text", "json-string", "nothing"],
)
def test_run_store_output_stores_stdout_and_later_runs_print_it(
    cli: Cli, printed: str, stored: Any, tmp_path: Path
) -> None:
    """--store-output passes the command's stdout through and stores it in the result
    (JSON when it parses, else text, a JSON string too); a later run prints it on
    stdout, its own report on stderr, and exits 0."""
    out = tmp_path / "out"
    out.write_text(printed, encoding="utf-8")
    job = ["run", "--key", "report", "--complete", "--store-output", "--", "cat", str(out)]
    first = cli(*job)
    assert first.exit_code == 0, first.output
    assert first.stdout == printed  # seen as it ran
    replay = cli("acquire", "--key", "report")
    assert replay.exit_code == EXIT_COMPLETED
    assert cli.json(replay)["result"] == {"exit_code": 0, "output": stored}
    again = cli("run", "--key", "report", "--complete", "--", "false")
    assert again.exit_code == 0, again.output
    expected = printed if isinstance(stored, str) else json.dumps(stored, separators=(",", ":"))
    assert again.stdout.rstrip("\n") == expected.rstrip("\n")
    report = json.loads(again.stderr)
    assert report["skipped"] is True and report["result"]["output"] == stored


def test_run_store_output_over_the_limit_keeps_the_exit_code(cli: Cli, tmp_path: Path) -> None:
    """Output that would make the result larger than 32,768 bytes is not stored: the exit
    code is, marked "output_too_large" with the output's size, and a WARNING says so; the
    output still reaches stdout, and a later run prints the stored result as JSON."""
    out = tmp_path / "out"
    out.write_bytes(b"x" * 40_000)
    first = cli("run", "--key", "big", "--complete", "--store-output", "--", "cat", str(out))
    assert first.exit_code == 0, first.output
    assert first.stdout == "x" * 40_000
    assert "over the result's 32768-byte limit: only its exit code is stored" in first.stderr
    again = cli("run", "--key", "big", "--complete", "--", "true")
    assert again.exit_code == 0
    assert cli.json(again)["result"] == {
        "exit_code": 0,
        "output_too_large": True,
        "output_bytes": 40_000,
    }


def test_run_store_output_with_record_failures_stores_the_failure_and_its_output(
    cli: Cli,
) -> None:
    """--record-failures with --store-output: a failure is stored with what it printed,
    and a later run prints that output and exits with the stored status."""
    job = ["sh", "-c", "echo 'disk full'; exit 5"]
    flags = ["--key", "f", "--complete", "--record-failures", "--store-output"]
    assert cli("run", *flags, "--", *job).exit_code == 5
    again = cli("run", *flags, "--", "true")
    assert again.exit_code == 5
    assert again.stdout == "disk full\n"


def test_run_replays_a_stored_status_of_255(cli: Cli) -> None:
    """255, the highest status a command can exit with, is stored and replayed as it is."""
    first = cli(
        "run", "--key", "top", "--complete", "--record-failures", "--", "sh", "-c", "exit 255"
    )
    assert first.exit_code == 255, first.output
    again = cli("run", "--key", "top", "--complete", "--", "sh", "-c", "exit 0")
    assert again.exit_code == 255, again.output
    assert cli.json(again)["result"] == {"exit_code": 255}


def test_run_without_the_command_starting(cli: Cli) -> None:
    """A command that cannot start exits 127, names the command, and releases the lease."""
    result = cli("run", "--key", "x", "--", "/nonexistent/command", "arg")
    assert result.exit_code == 127
    assert json.loads(result.stderr)["error"] == (
        'cannot run "/nonexistent/command": No such file or directory'
    )
    assert cli("acquire", "--key", "x").exit_code == 0


def take_lease_away(cli: Cli, clock: FakeClock, key: str, ready: Path, done: list[Any]) -> None:
    """Once the command runs, expire the lease on the service and let another take it."""
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    clock.advance(10)  # past the ttl of 3 s: expired on the service
    done.append(cli.client().acquire(cli.environ["LEASEKEEPER_NAMESPACE"], key))


@pytest.mark.parametrize(
    ("script", "how"),
    [
        ("touch {ready}; exec sleep 30", "stopped with SIGTERM"),
        ("trap '' TERM; touch {ready}; sleep 30", "killed with SIGKILL after the grace period"),
        # The leader ends on SIGTERM; what it started and ignores SIGTERM is killed too.
        (
            "(trap '' TERM; exec sleep 30) & echo $! > {ready}.pid; touch {ready}; wait",
            "killed with SIGKILL after the grace period",
        ),
    ],
    ids=["sigterm", "sigkill", "group"],
)
def test_run_stops_the_command_when_the_lease_is_lost(
    cli: Cli, clock: FakeClock, tmp_path: Path, script: str, how: str
) -> None:
    """When the service takes the lease away, the command is stopped and run exits 11."""
    ready = tmp_path / "ready"
    taken: list[Any] = []
    thief = threading.Thread(target=take_lease_away, args=(cli, clock, "cron", ready, taken))
    thief.start()
    started = time.monotonic()
    result = cli("run", "--key", "cron", "--ttl", "3", "--grace", "0.3", "--complete", "--",
                 "sh", "-c", script.format(ready=ready))  # fmt: skip
    thief.join()
    assert result.exit_code == EXIT_LOST, result.output
    assert time.monotonic() - started < 10
    report = orjson.loads(result.stderr.strip().splitlines()[-1])
    assert report["status"] == "lost"
    assert report["command"] == how
    assert "leasekeeper: lease lost" in result.stderr  # the client's WARNING, said plainly
    assert cli.environ["LEASEKEEPER_NAMESPACE"] not in result.output
    # Nothing was recorded, and the new owner still holds the key.
    assert cli("acquire", "--key", "cron").exit_code == EXIT_HELD
    pid_file = tmp_path / "ready.pid"
    if pid_file.exists():
        assert not _alive(int(pid_file.read_text()))


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _after_ready(ready: Path, signum: int) -> threading.Thread:
    """A thread that sends ``signum`` to this process (run's) once ``ready`` exists."""

    def send() -> None:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_run_stops_what_the_command_leaves_in_its_group(cli: Cli, tmp_path: Path) -> None:
    """The lease covers the command's whole group: what the command started and left
    running gets SIGTERM when it exits, before the status is recorded and the lease
    let go, so no work of it outlives the lease."""
    pid_file = tmp_path / "pid"
    result = cli("run", "--key", "bg", "--grace", "0.5", "--complete", "--",
                 "sh", "-c", f"sleep 30 & echo $! > {pid_file}; exit 0")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "left processes in its group" in result.stderr
    assert not _alive(int(pid_file.read_text()))
    assert cli("acquire", "--key", "bg").exit_code == EXIT_COMPLETED


def test_run_gives_leftovers_10_seconds_grace_by_default(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --grace, SIGKILL follows the SIGTERM by 10 s (README: ``[--grace 10]``), as
    the warning about what the command left in its group says. (The stop itself is given
    no grace here, so that the test need not wait for the orphan's zombie to be reaped.)"""
    graces: list[float] = []
    real_stop = _run_module._stop

    def stop(process: Any, grace: float, terminated: list[float]) -> str:
        graces.append(grace)
        return real_stop(process, 0.0, terminated)

    monkeypatch.setattr(_run_module, "_stop", stop)
    pid_file = tmp_path / "pid"
    result = cli("run", "--key", "bg10", "--",
                 "sh", "-c", f"sleep 30 & echo $! > {pid_file}; exit 0")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "they get SIGTERM (SIGKILL after 10.0 s)" in result.stderr
    assert graces == [10.0]
    assert not _alive(int(pid_file.read_text()))


def test_a_lease_lost_as_the_command_ends_exits_11_with_its_status(
    cli: Cli, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease found lost once the command has ended (its local expiry passed while it
    exited): run exits 11, not with the command's status, and says that status on stderr."""
    fake = FakeTime(clock)  # the client's time is the service's: the lease expires on both
    cli.client = lambda url=BASE_URL, timeout=10.0: LeaseClient(  # type: ignore[method-assign]
        BASE_URL, transport=bridge(cli.api), timeout=timeout, monotonic=fake.monotonic,
        event_factory=fake.event, thread_factory=ManualThread,
    )  # fmt: skip
    held: list[Any] = []
    real_lease, real_status = LeaseClient.lease, _run_module._shell_status

    def lease(self: LeaseClient, *args: Any, **kwargs: Any) -> Any:
        held.append(real_lease(self, *args, **kwargs))
        return held[-1]

    def status_after_the_expiry(returncode: int) -> int:
        clock.advance(31)  # past the 30 s lease, which no renewal moved
        with pytest.raises(LeaseLost):
            held[0].check()  # as the renewals would find it
        return real_status(returncode)

    monkeypatch.setattr(LeaseClient, "lease", lease)
    monkeypatch.setattr(_run_module, "_shell_status", status_after_the_expiry)
    result = cli("run", "--key", "late", "--", "sh", "-c", "exit 4")
    monkeypatch.undo()
    assert result.exit_code == EXIT_LOST, result.output
    report = json.loads(result.stderr.splitlines()[-1])
    assert report["status"] == "lost" and report["exit_code"] == 4


def test_a_signal_while_the_command_starts_is_passed_on(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to run while the command is being started reaches the command once it
    exists (run's handlers are in place before): no command runs on without run."""
    real_popen = subprocess.Popen

    def popen_during_a_signal(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # handled (recorded) before the child exists
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(_run_module.subprocess, "Popen", popen_during_a_signal)
    started = time.monotonic()
    result = cli("run", "--key", "st", "--complete", "--", "sleep", "30")
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert time.monotonic() - started < 10
    assert cli("acquire", "--key", "st").exit_code == 0  # not recorded, released


def test_a_signal_before_the_command_starts_keeps_it_from_starting(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interruption after the lease was acquired but before the command started:
    the command is not started, run exits 128 + N and lets the lease go."""
    ran = tmp_path / "ran"

    def say(self: Any, message: str) -> None:
        if message.startswith("lease acquired"):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Progress, "say", say)
    result = cli("run", "--key", "pre", "--complete", "--", "touch", str(ran))
    assert result.exit_code == 128 + signal.SIGINT, result.output
    assert not ran.exists()
    assert cli("acquire", "--key", "pre").exit_code == 0


def test_a_signal_just_after_the_acquire_keeps_the_command_from_starting(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interruption after the lease was acquired, before run's own handlers are in
    place (noted meanwhile), still keeps the command from starting: exit 128 + N, and
    the lease is let go."""
    ran = tmp_path / "ran"
    real_forward = _run_module._forward_signals

    def forward_after_a_signal(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # handled (noted) before the handlers change
        return real_forward(*args)

    monkeypatch.setattr(_run_module, "_forward_signals", forward_after_a_signal)
    result = cli("run", "--key", "early", "--complete", "--", "touch", str(ran))
    assert result.exit_code == 128 + signal.SIGINT, result.output
    assert not ran.exists()
    assert cli("acquire", "--key", "early").exit_code == 0  # released, nothing recorded


def test_a_request_signal_before_the_command_starts_is_dropped(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGUSR1 before the command exists asks nothing of it; passed on the moment it
    starts, before it could set a handler, it would kill it and that death be recorded.
    Dropped: the command runs, and its own status is recorded."""

    def say(self: Any, message: str) -> None:
        if message.startswith("lease acquired"):
            os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(Progress, "say", say)
    job = ["sh", "-c", "sleep 0.2; exit 3"]
    result = cli("run", "--key", "usr", "--complete", "--record-failures", "--", *job)
    assert result.exit_code == 3, result.output
    recorded = cli("acquire", "--key", "usr")
    assert recorded.exit_code == EXIT_COMPLETED
    assert cli.json(recorded)["result"] == {"exit_code": 3}


def test_sigquit_is_passed_on_and_usr1_does_not_cancel_recording(cli: Cli, tmp_path: Path) -> None:
    """SIGQUIT (Ctrl-\\) interrupts the command like SIGTERM (not recorded); SIGUSR1 is
    passed on as a request to the command, whose status is then recorded."""
    ready = tmp_path / "ready"
    sender = _after_ready(ready, signal.SIGQUIT)
    result = cli("run", "--key", "q", "--complete", "--",
                 "sh", "-c", f"touch {ready}; exec sleep 30")  # fmt: skip
    sender.join()
    assert result.exit_code == 128 + signal.SIGQUIT, result.output
    report = json.loads(result.stderr.splitlines()[-1])  # said, not silent
    assert report["status"] == "interrupted" and report["exit_code"] == 128 + signal.SIGQUIT
    assert "run was sent SIGQUIT: the command's status is not recorded" in report["error"]
    assert cli("acquire", "--key", "q").exit_code == 0  # not recorded

    ready.unlink()
    got = tmp_path / "got"
    sender = _after_ready(ready, signal.SIGUSR1)
    script = (f"trap 'echo usr1 > {got}' USR1; touch {ready}; "
              f"while [ ! -s {got} ]; do sleep 0.05; done; exit 5")  # fmt: skip
    result = cli("run", "--key", "u", "--complete", "--record-failures", "--", "sh", "-c", script)
    sender.join()
    assert result.exit_code == 5, result.output
    recorded = cli("acquire", "--key", "u")
    assert recorded.exit_code == EXIT_COMPLETED
    assert cli.json(recorded)["result"] == {"exit_code": 5}


def _run_with_sigterm_in(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, *args: str
) -> tuple[Result, list[int]]:
    """``cli(*args)`` with a SIGTERM sent to this process as ``owner.name`` is called
    (which then runs), under a handler of the test's own that only notes it (without
    run's handler, SIGTERM would end the test run): the result, and what that handler
    saw, none of it when run's own handler was in place."""
    real = getattr(owner, name)

    def with_a_signal(*called: Any, **keywords: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # handled between two bytecodes
        return real(*called, **keywords)

    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    monkeypatch.setattr(owner, name, with_a_signal)
    try:
        result = cli(*args)
    finally:
        signal.signal(signal.SIGTERM, before)
    monkeypatch.undo()
    return result, seen


def test_a_signal_while_the_status_is_stored_is_said_and_the_lease_let_go(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while run stores the status (retried for as long as the lease is held,
    seconds when the service is down) stops the storing: run says so with the status on
    stderr, releases the lease and exits 128 + N, where the default action would end it
    silently with the key held to its TTL."""
    result, seen = _run_with_sigterm_in(  # as complete is called, before it sends
        cli, monkeypatch, LeaseClient, "complete",
        "run", "--key", "storing", "--ttl", "600", "--complete", "--", "true",
    )  # fmt: skip
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    report = json.loads(result.stderr.splitlines()[-1])
    assert report["status"] == "interrupted" and report["exit_code"] == 0
    assert "SIGTERM while the status was being stored" in report["error"]
    assert seen == []
    assert cli("acquire", "--key", "storing").exit_code == 0  # released, and not stored


def test_a_second_signal_while_the_handlers_are_put_back(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM then SIGHUP at once (systemd with SendSIGHUP): the first stops the storing;
    the second, handled just as run puts its handlers back, is only noted, so that every
    handler is put back, the release is not cut short, and run exits 128 + the first.
    Both go to the main thread (sent to the process, the kernel may give a signal to any
    thread, which changes when it is handled)."""
    real_complete, real_signal = LeaseClient.complete, signal.signal
    main_thread = threading.main_thread().ident or 0
    sent: list[int] = []

    def complete_during_a_signal(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(signal.SIGTERM)
        signal.pthread_kill(main_thread, signal.SIGTERM)  # raises at the next check
        return real_complete(self, *args, **kwargs)

    def put_back_during_a_signal(signum: int, handler: Any) -> Any:
        if sent == [signal.SIGTERM]:  # the first handler put back after the interruption
            sent.append(signal.SIGHUP)
            signal.pthread_kill(main_thread, signal.SIGHUP)  # handled before the next line
        return real_signal(signum, handler)

    seen: list[int] = []

    def note(signum: int, frame: Any) -> None:
        seen.append(signum)

    both = (signal.SIGTERM, signal.SIGHUP)
    before = {signum: real_signal(signum, note) for signum in both}
    monkeypatch.setattr(LeaseClient, "complete", complete_during_a_signal)
    monkeypatch.setattr(signal, "signal", put_back_during_a_signal)
    try:
        result = cli("run", "--key", "two", "--ttl", "600", "--complete", "--", "true")
        after = {signum: signal.getsignal(signum) for signum in both}
    finally:
        monkeypatch.undo()
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert sent == [signal.SIGTERM, signal.SIGHUP]
    assert after == dict.fromkeys(both, note)
    assert seen == []
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    report = json.loads(result.stderr.splitlines()[-1])
    assert report["status"] == "interrupted"
    assert cli("acquire", "--key", "two").exit_code == 0  # released, and not stored


def test_a_signal_after_the_command_ended_keeps_its_status_from_being_recorded(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to run after the command has ended, before its status is stored: run was
    asked to stop, so, as for one passed on to the command, the status is not recorded
    (stderr says so, with it), run exits with it, and the lease is let go."""
    result, seen = _run_with_sigterm_in(  # the command is gone: run notes it
        cli, monkeypatch, _run_module, "_shell_status",
        "run", "--key", "ended", "--complete", "--", "sh", "-c", "exit 3",
    )  # fmt: skip
    assert result.exit_code == 3, result.output
    report = json.loads(result.stderr.splitlines()[-1])
    assert report["status"] == "interrupted" and report["exit_code"] == 3
    assert "run was sent SIGTERM: the command's status is not recorded" in report["error"]
    assert seen == []
    assert cli("acquire", "--key", "ended").exit_code == 0  # not recorded, and released


def test_a_signal_while_the_lease_is_released_does_not_cut_the_release_short(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the lease acquired to the lease let go, an interruption no step handles is
    noted, not acted on: a SIGTERM as run releases the lease lets the release finish
    (the default action would end run with the key held to its TTL)."""
    result, seen = _run_with_sigterm_in(
        cli, monkeypatch, LeaseClient, "release",
        "run", "--key", "releasing", "--ttl", "600", "--", "sh", "-c", "exit 4",
    )  # fmt: skip
    assert result.exit_code == 4, result.output
    assert seen == []
    assert cli("acquire", "--key", "releasing").exit_code == 0  # released


def test_a_signal_run_was_told_to_ignore_stays_ignored(cli: Cli, tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored), a SIGHUP neither reaches the command nor cancels
    recording its status."""
    ready = tmp_path / "ready"
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sender = _after_ready(ready, signal.SIGHUP)
        result = cli("run", "--key", "h", "--complete", "--",
                     "sh", "-c", f"touch {ready}; sleep 0.5; exit 0")  # fmt: skip
        sender.join()
    finally:
        signal.signal(signal.SIGHUP, before)
    assert result.exit_code == 0, result.output
    assert cli("acquire", "--key", "h").exit_code == EXIT_COMPLETED


def _failing_complete(cli: Cli, status: int, times: int) -> None:
    """Make the next ``times`` /lease/complete answers ``status`` refusals."""
    left = [times]
    body = {408: {"status": "timeout"}, 400: {"status": "invalid"}, 500: {"status": "internal"}}[
        status
    ]

    def fault(request: httpx.Request) -> httpx.Response | None:
        if request.url.path.endswith("/complete") and left[0]:
            left[0] -= 1
            return httpx.Response(status, json={"ok": False, "error": "no", **body})
        return None

    cli.client = lambda url=BASE_URL, timeout=10.0: LeaseClient(  # type: ignore[method-assign]
        BASE_URL, transport=bridge(cli.api, fault), timeout=timeout
    )


def test_run_complete_is_retried_and_a_failure_still_says_the_status(cli: Cli) -> None:
    """Recording a status refused for a passing reason (408) or by a 500 is tried again;
    one that cannot be stored is reported with the command's status, which is not lost."""
    _failing_complete(cli, 408, 1)
    result = cli("run", "--key", "r", "--complete", "--record-failures", "--", "sh", "-c", "exit 6")
    assert result.exit_code == 6, result.output
    assert "storing the result failed (timeout" in result.stderr
    assert cli("acquire", "--key", "r").exit_code == EXIT_COMPLETED

    _failing_complete(cli, 500, 1)  # a 500 says nothing of whether it was stored
    result = cli("run", "--key", "r500", "--complete", "--", "sh", "-c", "exit 0")
    assert result.exit_code == 0, result.output
    assert "storing the result failed (internal" in result.stderr
    assert cli("acquire", "--key", "r500").exit_code == EXIT_COMPLETED

    _failing_complete(cli, 400, 1)
    result = cli("run", "--key", "s", "--complete", "--record-failures", "--", "sh", "-c", "exit 7")
    assert result.exit_code == EXIT_INVALID
    report = orjson.loads(result.stderr.strip().splitlines()[-1])
    assert report["status"] == "invalid" and report["exit_code"] == 7


def test_run_complete_whose_answer_was_lost_still_records_and_passes_the_status(
    cli: Cli,
) -> None:
    """The status was stored but the answer lost (a read timeout): the retry, told lost,
    finds its own completion, and run exits with the command's status, not 11."""
    fault = answer_lost_after_complete(cli.api)
    cli.client = lambda url=BASE_URL, timeout=10.0: LeaseClient(  # type: ignore[method-assign]
        BASE_URL, transport=bridge(cli.api, fault), timeout=timeout
    )
    result = cli(
        "run", "--key", "lostanswer", "--complete", "--record-failures", "--", "sh", "-c", "exit 6"
    )
    assert result.exit_code == 6, result.output
    recorded = cli("acquire", "--key", "lostanswer")
    assert recorded.exit_code == EXIT_COMPLETED
    assert cli.json(recorded)["result"] == {"exit_code": 6}


def test_ctrl_c_while_waiting_exits_130(cli: Cli) -> None:
    """SIGINT while acquire --wait waits is 130, as a shell reports it, not click's 1."""
    assert cli("acquire", "--key", "busy", "--ttl", "86400").exit_code == 0
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        # The service waits (on timers that jump the fake clock): for ever, till the signal.
        result = cli("acquire", "--key", "busy", "--wait", "inf")
    finally:
        timer.join()
    assert result.exit_code == 130, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "http://[::1"], "--url or LEASEKEEPER_URL"),
        (["--url", "127.0.0.1:8787"], "--url or LEASEKEEPER_URL"),
        (["--timeout", "inf"], "--timeout"),
        (["--timeout", "1e10"], "--timeout"),
    ],
)
def test_a_bad_url_or_timeout_is_a_usage_error(args: list[str], message: str) -> None:
    """Not a traceback (httpx's InvalidURL, an OverflowError) or a retryable 14."""
    env = CliEnvironment(environ={"PATH": os.environ.get("PATH", "")})
    result = CliRunner().invoke(main, ["acquire", "--key", "k" * 40, *args], obj=env)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("url", ["127.0.0.1:8787", "ftp://lk.test", "http://lk.test:99999"])
def test_namespace_with_a_bad_url_is_a_usage_error_too(url: str) -> None:
    """``namespace`` builds its client as the other commands do: exit 2, not a traceback."""
    env = CliEnvironment(environ={"PATH": os.environ.get("PATH", ""), "LEASEKEEPER_URL": url})
    result = CliRunner().invoke(main, ["namespace"], obj=env)
    assert result.exit_code == 2, result.output
    assert "--url or LEASEKEEPER_URL" in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_the_url_flag_wins_over_the_variable_and_the_timeout_reaches_the_client(
    cli: Cli,
) -> None:
    """--url wins over LEASEKEEPER_URL, which wins over the default; --timeout (10 by
    default) is the client's per-request timeout."""
    made: list[tuple[str, float]] = []
    real_client = cli.client

    def recording(url: str = BASE_URL, timeout: float = 10.0) -> LeaseClient:
        made.append((url, timeout))
        return real_client(url, timeout)

    cli.client = recording  # type: ignore[method-assign]
    cli.environ["LEASEKEEPER_URL"] = "http://from-the-variable.test"
    assert cli("acquire", "--key", "a", "--url", "http://from-the-flag.test",
               "--timeout", "2.5").exit_code == 0  # fmt: skip
    assert cli("acquire", "--key", "b").exit_code == 0
    del cli.environ["LEASEKEEPER_URL"]
    assert cli("acquire", "--key", "c").exit_code == 0
    assert made == [
        ("http://from-the-flag.test", 2.5),
        ("http://from-the-variable.test", 10.0),
        ("http://127.0.0.1:8787", 10.0),
    ]


def _stdout_fails(monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """Writing to stdout fails as on a full disk or a closed pipe; stderr still works."""
    real_echo = click.echo

    def echo(message: Any = None, file: Any = None, nl: bool = True, err: bool = False) -> None:
        if not err:
            raise error
        real_echo(message, file=file, nl=nl, err=err)

    monkeypatch.setattr(click, "echo", echo)


def test_an_owner_token_that_cannot_be_written_lets_the_key_go(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody has the token: the key is released at once, not held for its TTL; exit 1."""
    with monkeypatch.context() as patched:
        _stdout_fails(patched, OSError(28, "No space left on device"))
        result = cli("acquire", "--key", "report", "--ttl", "600")
    assert result.exit_code == EXIT_ERROR, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    full = "[Errno 28] No space left on device"
    assert result.stderr == f"leasekeeper: cannot write the output: {full}\n"
    again = cli("acquire", "--key", "report", "--ttl", "600")
    assert again.exit_code == 0, again.output
    assert cli.json(again)["fencing_token"] == 2


def test_a_refusal_that_cannot_be_written_keeps_its_exit_code(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code still says what happened (held: 10), with one line on stderr."""
    assert cli("acquire", "--key", "busy", "--ttl", "60").exit_code == 0
    with monkeypatch.context() as patched:
        _stdout_fails(patched, BrokenPipeError(32, "Broken pipe"))
        result = cli("acquire", "--key", "busy")
    assert result.exit_code == EXIT_HELD, result.output
    assert result.stderr == "leasekeeper: cannot write the output: [Errno 32] Broken pipe\n"


def test_output_to_a_full_device_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """A real process: no traceback and no "Exception ignored" from Python's flush at exit."""
    with Path("/dev/full").open("wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", "leasekeeper.cli", "namespace", "--url", "http://127.0.0.1:9"],
            stdout=full,
            stderr=subprocess.PIPE,
            env={**os.environ, "LEASEKEEPER_URL": ""},
            timeout=60,
            check=False,
        )
    assert done.returncode == EXIT_UNAVAILABLE  # its refusal was not written; its code says it
    assert done.stderr.decode() == (
        "leasekeeper: cannot write the output: [Errno 28] No space left on device\n"
    )
