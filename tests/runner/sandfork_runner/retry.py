"""The one retry rule, for every job.

A test that failed is run again, once: lab guests used to be lost now and then
on a loaded host (README, "Hangs"), which a test bounded in time cannot tell
from a defect, and a real defect fails twice and still fails the run. A
second re-run only when the lab machine itself stood still (its kernel's
livelock, which its stall detector reports) during the try before it.

A job's tests are re-run where the job can name them: a test binary's by
name (the runner's next try), a pytest suite's in place (pytest-rerunfailures,
`--reruns 1`: the job's first try already holds the one re-run, which the
job's log names in its `RERUN` lines). Anything else re-runs the whole job.
"""

import re
from dataclasses import dataclass

# What the lab prints at the end of a run during which its machine stood still
# (crates/lab/src/stall.rs).
STALL_LINE = re.compile(rb"^sandfork-lab: the machine stood still", re.MULTILINE)
# pytest-rerunfailures' summary (`-rR`): one line a test it ran again
RERUN_LINE = re.compile(rb"^RERUN (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    stood_still: bool


def stood_still(log: bytes) -> bool:
    return STALL_LINE.search(log) is not None


def rerun_in_place(log: bytes) -> list[str]:
    """The tests a pytest suite ran again inside the try, once each."""
    return list(dict.fromkeys(m.decode(errors="replace") for m in RERUN_LINE.findall(log)))


def run_again(tries: list[Outcome], *, reruns_inside: bool = False) -> bool:
    """Whether a job whose tries so far ended so runs once more.
    `reruns_inside`: the job re-runs its failed tests itself, so its first try
    has had the one re-run already."""
    if not tries or tries[-1].passed:
        return False
    had = len(tries) + (1 if reruns_inside else 0)
    if had == 1:
        return True
    return had == 2 and tries[-1].stood_still
