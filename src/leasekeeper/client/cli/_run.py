"""``leasekeeper run``: a command run while the lease on its key is held and renewed.

Acquire (or find the stored status and exit with it), start the command in a process
group of its own (the lease covers the whole group), wait for it or the lease's loss,
stop what is left of the group, then (``--complete``) store a success, and with
``--record-failures`` a failure too (``--store-output``: with what the command printed).
Signals are passed on to the group; handlers are installed only from the main thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

import click

from leasekeeper._core.validation import MAX_RESULT_BYTES, MAX_TTL_SECONDS
from leasekeeper._errors import LeaseError, LeaseLost
from leasekeeper.client._http import decode, encode
from leasekeeper.client._sync import HeldLease, LeaseClient
from leasekeeper.client.cli._commands import (
    Progress,
    Seconds,
    connection_options,
    fingerprint_options,
    key_options,
    progress_option,
    read_target,
    wait_option,
)
from leasekeeper.client.cli._output import (
    EXIT_LOST,
    EXIT_NOT_STARTED,
    EXIT_OK,
    OutputLost,
    client_command,
    exit_code,
    fail,
    print_json,
    report,
)

__all__ = ["run_command"]

log = logging.getLogger("leasekeeper.client")


def _shell_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    """Send ``signum`` to the command's whole process group, if any of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    """Whether any process is left in the command's process group.

    Once the command itself has been waited for, the group's zombies that are ``run``'s
    own children (``run`` as PID 1 in a container, or a subreaper, inherits the orphans)
    are reaped first: a zombie has ended, but would still count for ``killpg``."""
    if process.returncode is not None:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-process.pid, os.WNOHANG)[0]:
                pass
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # one is there, and no longer ours to signal
        return True
    return True


#: Signals passed on to the command's group that end its status's claim to be recorded
#: (an interruption); and signals passed on that do not (USR1 and USR2 ask a program
#: to do something, such as reopen its logs, not to stop).
_INTERRUPTIONS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def _forward_signals(
    started: list[subprocess.Popen[bytes]],
    received: list[int],
    unsent: list[int],
    still_held: Callable[[], bool],
    terminated: list[float],
) -> Iterator[None]:
    """Pass SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 on to the command's
    process group while it runs, and stop the command with ``run`` (SIGTSTP, Ctrl-Z).

    The handlers are in place before the command starts (``started`` is empty until
    then): an interruption meanwhile is kept in ``received`` and ``unsent`` (the caller
    does not start the command, or passes it on once it has); a SIGUSR1 or SIGUSR2 is
    dropped. A signal ``run`` was started ignoring (``nohup``) stays ignored. Ctrl-Z
    would stop ``run`` and its renewals but not the command, in a group of its own: so
    the command is stopped first, and continues with ``run`` only if ``still_held()``,
    else after a SIGTERM (kept in ``terminated``, so that ``_stop`` sends no second one).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two of its steps, so "started" is either
        # empty (kept in "unsent": the caller passes it on once the command exists) or
        # not (passed on here): never both, never neither.
        if signum in _INTERRUPTIONS:
            received.append(signum)
        if started:
            _signal_group(started[0], signum)
        elif signum in _INTERRUPTIONS:
            unsent.append(signum)
        # else a request (USR1, USR2) to a command not yet there: it means nothing to it,
        # and sent just after it starts, before it could install a handler, would kill it.

    def pause(signum: int, frame: FrameType | None) -> None:
        if started:
            _signal_group(started[0], signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here, as asked; returns on SIGCONT
        signal.signal(signal.SIGTSTP, pause)
        if started:
            if not still_held():  # expired meanwhile: the loss is handled by the main loop
                _terminate(started[0], terminated)
            _signal_group(started[0], signal.SIGCONT)

    with _handling(forward, (*_INTERRUPTIONS, *_PASSED_ON)):
        before = signal.signal(signal.SIGTSTP, pause)  # ignored or not, as before
        try:
            yield
        finally:
            signal.signal(signal.SIGTSTP, before)


class _Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM, SIGHUP or SIGQUIT while ``run`` stores the command's status (a
    KeyboardInterrupt, so that the lease takes the ``complete`` under way as unsure)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _handling(
    handler: Callable[[int, FrameType | None], None],
    signals: tuple[int, ...] = _INTERRUPTIONS,
) -> Iterator[None]:
    """``handler`` for ``signals`` (SIGINT, SIGTERM, SIGHUP and SIGQUIT by default; not
    those ``run`` was started ignoring), then the handlers before it again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, handler)
        for signum in signals
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def _noting(noted: list[int]) -> contextlib.AbstractContextManager[None]:
    """From the lease acquired to the lease let go, an interruption that no step of
    ``run`` handles itself is kept in ``noted``: the default action would end ``run``
    at once, with the key held to its TTL and nothing said."""
    return _handling(lambda signum, frame: noted.append(signum))


def _interruptible(noted: list[int]) -> contextlib.AbstractContextManager[None]:
    """While storing the status: an interruption stops the storing (which may be retried
    for as long as the lease is held) with ``_Interrupted``, once; any later one is only
    kept in ``noted`` (it may come while the handlers are being put back)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        noted.append(signum)
        if len(noted) == 1:
            raise _Interrupted(signum)

    return _handling(interrupt)


def _terminate(process: subprocess.Popen[bytes], terminated: list[float]) -> None:
    """SIGTERM the command's whole group once: ``terminated`` keeps when it was sent.

    A second SIGTERM would reach a command still handling the first, and many programs
    take a second one as "stop now, skip the clean-up"."""
    if not terminated:
        terminated.append(time.monotonic())
        _signal_group(process, signal.SIGTERM)


def _stop(process: subprocess.Popen[bytes], grace: float, terminated: list[float]) -> str:
    """SIGTERM the command's whole group (unless it already got it), then SIGKILL
    ``grace`` seconds after that SIGTERM to what is left of it (the leader, or
    processes it started); how it ended."""
    _terminate(process, terminated)
    deadline = terminated[0] + grace
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    else:
        while _group_alive(process) and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # not our children: nothing to wait on but this
    if process.poll() is None or _group_alive(process):
        _signal_group(process, signal.SIGKILL)
        process.wait()
        return "killed with SIGKILL after the grace period"
    return "stopped with SIGTERM"


#: The most of the command's stdout ``--store-output`` keeps in memory: past it, the output
#: is too large to store whatever it holds (pretty-printed JSON may compact below the limit).
_OUTPUT_KEPT = 1 << 20
#: Seconds to wait for the end of the command's stdout once its group is gone: a process
#: outside the group (started with setsid) may hold the pipe open for ever.
_OUTPUT_DRAIN_SECONDS = 5.0


class _Tee:
    """``--store-output``: copies the command's stdout to ``run``'s own as it comes (so a
    terminal or a log sees it at once), keeping the first ``_OUTPUT_KEPT`` bytes."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._sink = getattr(sys.stdout, "buffer", None)  # None: started with fd 1 closed
        self._kept = bytearray()
        self.size = 0
        self.thread = threading.Thread(target=self._copy, name="leasekeeper-run-tee", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        with self._pipe:
            while chunk := self._pipe.read1(65_536):
                self.size += len(chunk)
                if len(self._kept) <= _OUTPUT_KEPT:
                    self._kept += chunk
                if self._sink is not None:
                    try:
                        self._sink.write(chunk)
                        self._sink.flush()
                    except (OSError, ValueError):  # a closed pipe: the output is still kept
                        self._sink = None

    def drain(self) -> None:
        """Wait (a bounded time) for the rest of the output, so none is lost at exit."""
        self.thread.join(_OUTPUT_DRAIN_SECONDS)

    def output(self) -> Any:
        """What the command printed: the JSON value when it parses (a JSON string stays
        text, so that it is printed again as it was), else the text (UTF-8, any byte that
        is not replaced by U+FFFD); None when over ``_OUTPUT_KEPT`` bytes."""
        self.drain()
        if self.size > _OUTPUT_KEPT:
            return None
        data = bytes(self._kept)
        text = data.decode("utf-8", errors="replace")
        try:
            value = decode(data)
        except ValueError:
            return text
        return text if isinstance(value, str) else value


def _recorded(status: int, tee: _Tee | None) -> dict[str, Any]:
    """What ``--complete`` stores for a command that exited with ``status``: with
    ``--store-output``, its output too, or ``"output_too_large": true`` and its size in
    bytes when the result would be over the service's 32,768 bytes."""
    result: dict[str, Any] = {"exit_code": status}
    if tee is None:
        return result
    output = tee.output()
    if output is not None:
        stored = {**result, "output": output}
        if len(encode(stored)) <= MAX_RESULT_BYTES:
            return stored
    log.warning(
        "the command's output (%d bytes) is over the result's %d-byte limit: "
        "only its exit code is stored",
        tee.size,
        MAX_RESULT_BYTES,
    )
    return {**result, "output_too_large": True, "output_bytes": tee.size}


def _print_output(output: Any) -> None:
    """A stored output on stdout as the command printed it: text as it is, JSON as one line."""
    if sys.stdout is None:
        raise OutputLost("cannot write the output: it is closed")
    data = output.encode("utf-8") if isinstance(output, str) else encode(output) + b"\n"
    try:
        if hasattr(sys.stdout, "buffer"):
            sys.stdout.buffer.write(data)
        else:  # a text-only stream put in its place
            sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()
    except OSError as error:
        raise OutputLost(f"cannot write the output: {error}") from None


def _stored_status(result: Any) -> int:
    """The exit status a stored result holds (``_recorded``'s), else 0."""
    if isinstance(result, dict):
        code = result.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255:
            return code
    return EXIT_OK


@client_command("run", context_settings={"allow_interspersed_args": False})
@connection_options
@key_options
@fingerprint_options
@click.option(
    "--ttl",
    type=click.IntRange(1, MAX_TTL_SECONDS),
    default=30,
    show_default=True,
    help="Lease seconds.",
)
@wait_option
@click.option(
    "--complete",
    "record",
    is_flag=True,
    help="Record a success (exit 0), so later runs with this key and fingerprint are "
    "skipped; after a failure the key is released for the next run.",
)
@click.option(
    "--record-failures",
    is_flag=True,
    help="With --complete: record a failure too, so later runs skip it as well.",
)
@click.option(
    "--store-output",
    is_flag=True,
    help="With --complete: store what the command prints on stdout (still shown as it "
    "runs) in the result; later runs print it.",
)
@click.option(
    "--grace",
    type=Seconds(min=0, max=86_400),
    default=10.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when the lease is lost.",
)
@progress_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_command(command: tuple[str, ...], **options: Any) -> None:
    """Run COMMAND while holding the lease on the key, renewing it.

    The command gets LEASEKEEPER_FENCING_TOKEN in its environment and runs in its
    own process group. If the lease is lost, the group gets SIGTERM, then SIGKILL
    after --grace seconds, and run exits 11; what the command leaves running in its
    group when it exits is stopped the same way.

    With --complete a success is stored as {"exit_code": 0}; a failure is stored
    only with --record-failures, else the key is released for the next run. A
    later run with the same key and fingerprint does not run the command: it
    prints the stored result on stdout (with --store-output, what the command
    printed) and exits with the stored status.

    SIGINT, SIGTERM, SIGHUP and SIGQUIT are passed on to the command, and then its
    status is not recorded; SIGUSR1 and SIGUSR2 are passed on. Ctrl-Z stops the
    command with run.

    \b
    leasekeeper run --namespace-file ns.json --key nightly-report --wait 600 \\
        --complete -- ./report.sh
    """
    for flag in ("record_failures", "store_output"):
        if options[flag] and not options["record"]:
            raise click.UsageError(f"--{flag.replace('_', '-')} needs --complete")
    target = read_target(options, with_fingerprint=True)
    progress = Progress(options["progress"], options["wait"])
    wake = threading.Event()
    with target.client as client:
        held = client.lease(
            target.namespace,
            target.key,
            ttl=options["ttl"],
            fingerprint=target.fingerprint,
            wait=options["wait"],
            on_lost=lambda error: wake.set(),
            on_wait=progress.waiting,
        )
        try:
            held.__enter__()
        except LeaseError as error:
            fail(error, err=True)
        noted: list[int] = []
        with _noting(noted):
            try:
                code = _run_held(
                    client, held, command, options, target.environ, wake, progress, noted
                )
            finally:
                held.__exit__(None, None, None)
    sys.exit(code)


def _run_held(
    client: LeaseClient,
    held: HeldLease,
    command: tuple[str, ...],
    options: Mapping[str, Any],
    environ: Mapping[str, str],
    wake: threading.Event,
    progress: Progress,
    noted: list[int],
) -> int:
    """Run the command under ``held``; the exit code for leasekeeper. ``noted`` holds
    the interruptions that came while no step handled them itself (``_noting``)."""
    if held.completion is not None:
        stored = _stored_status(held.result)
        progress.say(f"already completed (exit code {stored}); not running the command")
        skipped = {**held.completion.body, "skipped": True}
        if isinstance(held.result, dict) and "output" in held.result:
            _print_output(held.result["output"])  # stdout is the command's: the report aside
            report(skipped)
        else:
            print_json(skipped)
        return stored
    fence = held.fencing_token
    child_env = {**environ, "LEASEKEEPER_FENCING_TOKEN": str(fence)}
    received: list[int] = []
    unsent: list[int] = []
    started: list[subprocess.Popen[bytes]] = []
    terminated: list[float] = []  # when the command's group got its SIGTERM

    def still_held() -> bool:
        try:
            held.check()  # sets ``lost`` (and so ``wake``) when the lease expired
        except LeaseLost:
            return False
        return True

    with _forward_signals(started, received, unsent, still_held, terminated):
        progress.say(f"lease acquired (fencing token {fence}); running the command")
        received[:0] = noted  # those that came between the acquire and the handlers
        if received:  # interrupted before the command started: it is not started
            return 128 + received[0]
        piped = subprocess.PIPE if options["store_output"] else None
        try:
            process = subprocess.Popen(  # noqa: S603
                command, env=child_env, process_group=0, stdout=piped
            )
        except OSError as exc:
            why = f'cannot run "{command[0]}": {exc.strerror}'
            report({"ok": False, "status": "error", "error": why})
            return EXIT_NOT_STARTED
        started.append(process)  # from here the handler passes signals on itself
        tee = _Tee(process.stdout) if process.stdout is not None else None
        while unsent:  # those that came while it was starting
            _signal_group(process, unsent.pop(0))

        def watch() -> None:
            process.wait()
            wake.set()

        threading.Thread(target=watch, name="leasekeeper-run-watch", daemon=True).start()
        wake.wait()
        if held.lost.is_set() and process.poll() is None:
            how = _stop(process, options["grace"], terminated)
            if tee is not None:
                tee.drain()
            lost = held.lost_error.error if held.lost_error else "the lease was lost"
            report({"ok": False, "status": "lost", "error": lost, "command": how})
            return EXIT_LOST
        process.wait()
        if _group_alive(process):  # the lease covers the whole group: none of it outlives it
            log.warning(
                "the command exited and left processes in its group; they get SIGTERM "
                "(SIGKILL after %s s) before the lease ends",
                options["grace"],
            )
            _stop(process, options["grace"], terminated)
        if tee is not None:
            tee.drain()
    status = _shell_status(process.returncode)
    if held.lost.is_set():
        lost = held.lost_error.error if held.lost_error else "the lease was lost"
        report({"ok": False, "status": "lost", "error": lost, "exit_code": status})
        return EXIT_LOST
    if options["record"] and (received or noted):  # noted: since the command ended
        name = signal.Signals((received or noted)[0]).name
        why = f"run was sent {name}: the command's status is not recorded"
        report({"ok": False, "status": "interrupted", "error": why, "exit_code": status})
    elif options["record"] and status != EXIT_OK and not options["record_failures"]:
        # Released on the way out: the next run (or one waiting now) runs it again.
        progress.say(f"exit code {status} is not recorded (no --record-failures); key released")
    elif options["record"]:
        result = _recorded(status, tee)
        try:
            with _interruptible(noted):
                client._complete_once(held, result)  # retried while held
        except _Interrupted as stop:  # the lease is let go on the way out
            name = signal.Signals(stop.signum).name
            why = f"{name} while the status was being stored: it may not have been"
            report({"ok": False, "status": "interrupted", "error": why, "exit_code": status})
            return 128 + stop.signum
        except LeaseError as error:  # the status is said, since it could not be stored
            report({**error.body(), "exit_code": status})
            return exit_code(error)
        progress.say(f"recorded exit code {status}")
    return status
