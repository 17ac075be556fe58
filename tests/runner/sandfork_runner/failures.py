"""What failed inside a job, read from its log, and the logs of a run that
failed kept outside the checkout.

CI prints only the tail of the run and throws the fresh clone away with its
`target/test-runs`: a failure seen that way named the job and three log paths
that no longer existed (stop 42's microvm). So the end of a run names each
failed test with the first line of why, and a full run that failed or needed a
retry leaves its logs under $SANDFORK_CACHE/runner/runs/ for whoever looks next.
"""

import os
import re
import shutil
from pathlib import Path

# libtest: "test NAME ... FAILED"; pytest: "FAILED path::name - why"
LIBTEST_FAILED = re.compile(r"^test (\S+) \.\.\. FAILED\b")
PYTEST_FAILED = re.compile(r"^FAILED (\S+)(?: - (.*))?$")
# libtest's panic line; the message is the line after it
PANIC = re.compile(r"^thread '([^']+)'(?: \(\d+\))? panicked at (\S+):$")
# the lab's own account of a machine that stood still (crates/lab/src/stall.rs)
STALL = re.compile(r"^sandfork-lab: the machine stood still .*")

# per try: enough to say what failed, never the whole console dump
MAX_LINES = 12
MAX_WIDTH = 200
# the failed runs kept, newest first
KEPT_RUNS = 8


def runs_dir() -> Path:
    cache = Path(os.environ.get("SANDFORK_CACHE", "/var/cache/sandfork"))
    return cache / "runner" / "runs"


def _clip(line: str) -> str:
    return line if len(line) <= MAX_WIDTH else line[: MAX_WIDTH - 3] + "..."


def digest(log: str) -> list[str]:
    """The failed tests of one try's log, each with the first line of its
    panic or pytest's reason, and the lab's stall lines: at most MAX_LINES."""
    lines = log.splitlines()
    out: list[str] = []
    why: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = PANIC.match(line)
        if m:
            message = lines[i + 1].strip() if i + 1 < len(lines) else ""
            why.setdefault(m[1], f"{m[2]}: {message}")
    for line in lines:
        m = LIBTEST_FAILED.match(line)
        if m:
            name = m[1]
            out.append(f"{name}: {why.get(name, 'failed')}")
            continue
        p = PYTEST_FAILED.match(line)
        if p:
            # pytest-rerunfailures' summary names it again, without the reason
            if p[2] or not any(o.startswith(f"{p[1]}: ") for o in out):
                out = [o for o in out if o != f"{p[1]}: failed"]
                out.append(f"{p[1]}: {p[2] or 'failed'}")
            continue
        if STALL.match(line):
            out.append(line)
    # a panic outside any test (a harness, a build script) still says why
    if not out and why:
        out = [f"{name}: {reason}" for name, reason in why.items()]
    # the same test named by libtest's summary and its result line
    unique = list(dict.fromkeys(out))
    if len(unique) > MAX_LINES:
        unique = [*unique[: MAX_LINES - 1], f"... and {len(unique) - MAX_LINES + 1} more"]
    return [_clip(line) for line in unique]


def keep(run: Path, into: Path | None = None) -> Path:
    """Copies a run's directory (its logs and summary.json) under `into`
    (runs_dir()), and drops all but the newest KEPT_RUNS there."""
    into = into or runs_dir()
    into.mkdir(parents=True, exist_ok=True)
    target = into / run.name
    shutil.copytree(run, target, dirs_exist_ok=True)
    kept = sorted((p for p in into.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True)
    for old in kept[KEPT_RUNS:]:
        shutil.rmtree(old, ignore_errors=True)
    return target
