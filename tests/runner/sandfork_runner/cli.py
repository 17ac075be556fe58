"""The command line: `scripts/test.sh [--lab-only] [--long] [--only JOB,...] [--list]
[--flakes [N]]`."""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from . import failures, history, jobs, proc
from .run import Plan, Run, UnknownJob, plan

ROOT = Path(__file__).resolve().parents[3]

EPILOG = """\
The jobs are data (tests/runner/sandfork_runner/jobs.py); --list shows them.
Env: SANDFORK_LAB_LANES=1 runs it all one after the other, the lab jobs in
one lane (default 2 lanes, one lab machine and lock each), SANDFORK_CACHE
(default /var/cache/sandfork).
Out: target/test-runs/<UTC time>/: each job's log (a re-run's: JOB.tryN.log),
run.log (the console), summary.json (every job's tries and timings);
target/test-runs/latest points at the last run. Exit status 0 when all passed.
A full run (no --only, no --lab-only) also adds a line to
$SANDFORK_CACHE/runner/history.jsonl, which --flakes reads.
"""


def parse(argv: list[str]) -> argparse.Namespace:
    long = [job.name for job in jobs.ALL if job.tier is jobs.Tier.LONG]
    p = argparse.ArgumentParser(
        prog="scripts/test.sh",
        description="The whole test suite: the build, the quick checks, then side by side "
        "the lab jobs in two lab lanes (longest first) and the host jobs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--lab-only",
        action="store_true",
        help="only the lab jobs (after the build): no quick checks, no host jobs",
    )
    p.add_argument(
        "--long",
        action="store_true",
        help=f"the long tier too ({', '.join(long)}): before a capability is called done",
    )
    p.add_argument(
        "--only",
        metavar="JOB[,JOB]",
        help="only these quick, lab or host jobs (any tier), after the build",
    )
    p.add_argument("--list", action="store_true", help="list the jobs and exit")
    p.add_argument(
        "--flakes",
        nargs="?",
        type=int,
        const=5,
        metavar="N",
        help="each job's passes and retries over the last N full runs on this machine "
        "(default 5), and exit",
    )
    return p.parse_args(argv)


def listing() -> str:
    lines = [f"{'job':<12} {'group':<6} {'tier':<8} {'min':>5}  {'binary':<12} what"]
    for job in jobs.ALL:
        minutes = f"{job.minutes:g}" if job.minutes else ""
        lines.append(
            f"{job.name:<12} {job.group.value:<6} {job.tier.value:<8} {minutes:>5}  "
            f"{job.binary or '':<12} {job.about}"
        )
    return "\n".join(lines)


def run_dir(root: Path) -> Path:
    """target/test-runs/<UTC time>, a new one, and `latest` pointing at it."""
    runs = root / "target/test-runs"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(100):
        path = runs / (stamp if n == 0 else f"{stamp}.{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        latest = runs / "latest"
        latest.unlink(missing_ok=True)
        latest.symlink_to(path.name)
        return path
    raise FileExistsError(f"{runs}/{stamp}.*")


def interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM (a CI's timeout) ends the run as Ctrl+C does: jobs stopped,
    # the summary written
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.list:
        print(listing())
        return 0
    if args.flakes is not None:
        print(history.table(history.read(history.path(), args.flakes)))
        return 0
    only = None if args.only is None else [n for n in args.only.split(",") if n]
    lanes_env = os.environ.get("SANDFORK_LAB_LANES", "2")
    try:
        the_plan: Plan = plan(
            lab_only=args.lab_only, only=only, long=args.long, lanes=int(lanes_env)
        )
    except UnknownJob as e:
        print(f"scripts/test.sh: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print(f"scripts/test.sh: SANDFORK_LAB_LANES={lanes_env}: not a number", file=sys.stderr)
        return 2
    os.chdir(ROOT)
    # The entry's path to this package, for the runner's own check alone
    # (jobs.QUICK "runner" sets it again): the jobs' Python does not see it.
    os.environ.pop("PYTHONPATH", None)
    signal.signal(signal.SIGTERM, interrupt)
    directory = run_dir(ROOT)
    console = proc.Console(directory / "run.log", time.monotonic())
    console.write(f"test run: {directory.relative_to(ROOT)}".encode())
    try:
        code = Run(ROOT, the_plan, directory, console, argv).main()
        if only is None and not args.lab_only:
            record_history(directory / "summary.json")
            keep_if_failed(directory)
        return code
    finally:
        console.close()


def keep_if_failed(directory: Path) -> None:
    """A full run that failed or retried a job leaves its logs in the cache
    (failures.keep): CI's clone, and its target/, is gone afterwards."""
    try:
        data = json.loads((directory / "summary.json").read_text())
        if data["passed"] and not data["retried"]:
            return
        kept = failures.keep(directory)
        print(f"scripts/test.sh: this run's logs are kept in {kept}", file=sys.stderr)
    except (OSError, ValueError, KeyError) as e:
        print(f"scripts/test.sh: this run's logs not kept: {e}", file=sys.stderr)


def record_history(summary: Path) -> None:
    """A full run's line in the history, unless it was cut short (an interrupt
    or the runner's own failure says nothing of the jobs); the run's verdict
    does not hang on it."""
    try:
        data = json.loads(summary.read_text())
        if data["interrupted"] or data["error"]:
            return
        history.append(history.entry(data, history.commit(ROOT)), history.path())
    except (OSError, ValueError, KeyError) as e:
        print(f"scripts/test.sh: the run's history line not written: {e}", file=sys.stderr)
