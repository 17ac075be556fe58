"""The one retry rule, for every job.

A job that failed is run again, once: lab guests used to be lost now and then
on a loaded host (README, "Hangs"), which a test bounded in time cannot tell
from a defect, and a real defect fails twice and still fails the run. A
second re-run only when the lab machine itself stood still (its kernel's
livelock, which its stall detector reports) during the try before it.
"""

import re
from dataclasses import dataclass

# What the lab prints at the end of a run during which its machine stood still
# (crates/lab/src/stall.rs).
STALL_LINE = re.compile(rb"^sandfork-lab: the machine stood still", re.MULTILINE)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    stood_still: bool


def stood_still(log: bytes) -> bool:
    return STALL_LINE.search(log) is not None


def run_again(tries: list[Outcome]) -> bool:
    """Whether a job whose tries so far ended so runs once more."""
    if not tries or tries[-1].passed:
        return False
    if len(tries) == 1:
        return True
    return len(tries) == 2 and tries[-1].stood_still
