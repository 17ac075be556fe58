"""What a run records of each job, and the JSON summary written at its end."""

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from . import failures
from .jobs import Job

# The exit status of a job that cannot run here (automake's convention); the
# job's last line of output says why.
SKIP_STATUS = 77


class Result(Enum):
    PASSED = "passed"
    FAILED = "failed"
    # its command said it cannot run on this machine (exit status SKIP_STATUS,
    # the reason its last line): a prerequisite the README lists is missing
    SKIPPED = "skipped"
    # never started: the run ended first (a failed build or quick check, an
    # interrupt), or what it needed failed (the test build, for host jobs)
    NOT_RUN = "not run"


@dataclass
class Try:
    number: int
    # seconds into the run
    start: float
    duration: float
    exit_code: int
    stood_still: bool
    log: str
    # the tests this try ran by name; None: the whole job
    tests: list[str] | None = None
    # a test binary's slowest tests, (name, seconds), slowest first
    slowest: list[tuple[str, float]] = field(default_factory=list)
    # the tests its pytest suites ran again in place (retry.py)
    rerun: list[str] = field(default_factory=list)
    # how busy the host's CPUs were meanwhile, 0-1 of all of them (cpu.py);
    # None for a try shorter than one sample
    cpu_busy: float | None = None

    @property
    def passed(self) -> bool:
        return self.exit_code == 0

    @property
    def skipped(self) -> bool:
        return self.exit_code == SKIP_STATUS


def outcome(last: Try) -> Result:
    """A job's result from its last try."""
    if last.passed:
        return Result.PASSED
    return Result.SKIPPED if last.skipped else Result.FAILED


@dataclass
class JobRecord:
    job: Job
    lane: str = ""
    tries: list[Try] = field(default_factory=list)
    result: Result = Result.NOT_RUN
    # why it failed without a try, or was not run
    note: str = ""

    @property
    def start(self) -> float | None:
        return self.tries[0].start if self.tries else None

    @property
    def duration(self) -> float:
        """From the first try's start to the last one's end."""
        if not self.tries:
            return 0.0
        last = self.tries[-1]
        return last.start + last.duration - self.tries[0].start

    @property
    def retried(self) -> bool:
        """A second try, or a test run again inside a try."""
        return len(self.tries) > 1 or any(t.rerun for t in self.tries)

    def logs(self) -> list[str]:
        return [t.log for t in self.tries]


def _try_json(t: Try) -> dict[str, Any]:
    return {
        "try": t.number,
        "start_s": round(t.start, 1),
        "duration_s": round(t.duration, 1),
        "exit_code": t.exit_code,
        "passed": t.passed,
        "tests": t.tests,
        "lab_stood_still": t.stood_still,
        "rerun_tests": t.rerun,
        "slowest_tests": [[name, s] for name, s in t.slowest],
        "cpu_busy": t.cpu_busy,
        "log": t.log,
    }


def job_json(r: JobRecord) -> dict[str, Any]:
    start = r.start
    return {
        "name": r.job.name,
        "group": r.job.group.value,
        "tier": r.job.tier.value,
        "lane": r.lane or None,
        "expected_min": r.job.minutes or None,
        "start_s": None if start is None else round(start, 1),
        "duration_s": round(r.duration, 1),
        "result": r.result.value,
        "retried": r.retried,
        "note": r.note or None,
        "tries": [_try_json(t) for t in r.tries],
    }


def summary(
    records: list[JobRecord],
    *,
    started: str,
    duration: float,
    argv: list[str],
    run_dir: str,
    interrupted: bool,
    error: str = "",
    cpu_busy: list[list[float]] | None = None,
) -> dict[str, Any]:
    """The whole run as one JSON object (summary.json)."""
    failed = [r.job.name for r in records if r.result is Result.FAILED]
    return {
        "started": started,
        "duration_s": round(duration, 1),
        "argv": argv,
        "run_dir": run_dir,
        "passed": not failed and not interrupted and not error,
        "interrupted": interrupted,
        "error": error or None,
        "failed": failed,
        "retried": [r.job.name for r in records if r.retried],
        "skipped": [r.job.name for r in records if r.result is Result.SKIPPED],
        "jobs": [job_json(r) for r in records],
        # [seconds into the run, busy share of all CPUs over the sample before]
        "cpu_busy": cpu_busy or [],
    }


def clock(seconds: float) -> str:
    """m:ss"""
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


def failure_report(records: list[JobRecord], root: Path) -> list[str]:
    """Per failed job: its tries, where their logs are (relative to `root`)
    and, under each, the tests that failed in it and why."""
    lines = []
    for r in records:
        if r.result is not Result.FAILED:
            continue
        if not r.tries:
            lines.append(f"{r.job.name}: {r.note}")
            continue
        tries = "1 try" if len(r.tries) == 1 else f"{len(r.tries)} tries"
        lines.append(f"{r.job.name}: failed ({tries}), logs:")
        for t in r.tries:
            lines.append(f"    {t.log}")
            try:
                text = (root / t.log).read_text(errors="replace")
            except OSError as e:
                lines.append(f"      (its log cannot be read: {e})")
                continue
            lines.extend(f"      {line}" for line in failures.digest(text))
    return lines
