"""Running commands: their lines on the console, prefixed with the job's name,
and whole in the job's log file."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal

from .record import clock

Stdout = Literal["console", "discard", "capture"]


class Console:
    """The run's output: every line to stdout and to the run's own log."""

    def __init__(self, run_log: Path, started: float) -> None:
        self._lock = threading.Lock()
        self._log = open(run_log, "ab", buffering=0)  # noqa: SIM115  (closed by close())
        self.started = started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def write(self, data: bytes) -> None:
        if not data.endswith(b"\n"):
            data += b"\n"
        with self._lock:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            self._log.write(data)

    def line(self, prefix: str, line: bytes) -> None:
        self.write(prefix.encode() + b"| " + line)

    def stage(self, text: str) -> None:
        """A stage's start or end with the time into the run, so that a CI log
        shows where the minutes go."""
        self.write(f"== {text} (at {clock(self.elapsed())})".encode())

    def close(self) -> None:
        self._log.close()


class Processes:
    """The children running now, to stop them when the run is interrupted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()
        self.stopping = False

    def add(self, p: subprocess.Popen[bytes]) -> None:
        with self._lock:
            if self.stopping:
                p.terminate()
            self._running.add(p)

    def discard(self, p: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._running.discard(p)

    def terminate_all(self) -> None:
        with self._lock:
            self.stopping = True
            running = list(self._running)
        for p in running:
            # its own process group: the scripts' children go too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)


def _pump(
    stream: IO[bytes],
    name: str,
    log: IO[bytes],
    console: Console,
    on_line: Callable[[bytes], None] | None = None,
) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        console.line(name, line)
        if on_line is not None:
            on_line(line)


def run(
    argv: Sequence[str],
    *,
    name: str,
    log_path: Path,
    console: Console,
    processes: Processes,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    stdout: Stdout = "console",
    captured: list[bytes] | None = None,
    on_line: Callable[[bytes], None] | None = None,
) -> int:
    """Runs argv to its end; returns its exit code (128+N for signal N, 127
    when it could not start). stdout "capture" appends its stdout lines to
    `captured` (stderr goes to console and log). `on_line` sees each line
    that goes to the log, as it comes."""
    with open(log_path, "ab", buffering=0) as log:
        try:
            p = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL,
                stdout={"console": subprocess.PIPE, "discard": subprocess.DEVNULL}.get(
                    stdout, subprocess.PIPE
                ),
                stderr=subprocess.STDOUT if stdout == "console" else subprocess.PIPE,
                # a process group of its own, so that an interrupted run can
                # stop a job's whole tree; the terminal's Ctrl+C reaches the
                # runner, which stops them
                process_group=0,
            )
        except OSError as e:
            message = f"cannot run {argv[0]}: {e}\n".encode()
            log.write(message)
            console.line(name, message)
            return 127
        processes.add(p)
        try:
            if stdout == "capture":
                assert p.stdout is not None and p.stderr is not None
                errors = threading.Thread(
                    target=_pump, args=(p.stderr, name, log, console, on_line)
                )
                errors.start()
                for line in iter(p.stdout.readline, b""):
                    if captured is not None:
                        captured.append(line)
                errors.join()
            else:
                out = p.stdout if stdout == "console" else p.stderr
                assert out is not None
                _pump(out, name, log, console, on_line)
            code = p.wait()
        except BaseException:
            # interrupted (Ctrl+C reaches the runner alone): the job goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            raise
        finally:
            processes.discard(p)
    return 128 - code if code < 0 else code


def sourced_env(script: Path, cwd: Path) -> dict[str, str]:
    """The variables a bash script sets or changes when sourced with `set -a`
    (target/sandfork.env, scripts/sccache.sh), as bash itself reads them."""

    def env_after(source: str) -> dict[str, str]:
        out = subprocess.run(
            ["bash", "-c", f"set -a; {source} exec env -0", "bash", str(script)],
            cwd=cwd,
            check=True,
            stdout=subprocess.PIPE,
        ).stdout
        pairs = (item.split(b"=", 1) for item in out.split(b"\0") if b"=" in item)
        return {k.decode(): v.decode() for k, v in pairs}

    before = env_after("")
    after = env_after('. "$1";')
    return {k: v for k, v in after.items() if before.get(k) != v}
