"""The lab jobs' queue: taken by the lanes, longest first."""

import threading
from collections.abc import Callable, Iterable

from .jobs import Job


def longest_first(jobs: Iterable[Job]) -> list[Job]:
    """By expected minutes, longest first; the table's order among equals."""
    return sorted(jobs, key=lambda job: -job.minutes)


class JobQueue:
    """Shared by the lab lanes (threads)."""

    def __init__(self, jobs: Iterable[Job]) -> None:
        self._jobs = longest_first(jobs)
        self._lock = threading.Lock()
        self._closed = False

    def take(
        self, ready: Callable[[Job], bool], prefer: Callable[[Job], bool] = lambda job: False
    ) -> Job | None:
        """The longest job that is `ready` (its test binary built) and
        preferred (a lane whose node is up prefers the suites that share
        it), else the longest ready one, else the longest of all (its lane
        waits for the binary): a lane does not sit idle behind the test
        build while a job that needs none is left. None once the queue is
        empty or closed."""
        with self._lock:
            if self._closed or not self._jobs:
                return None
            ready_ones = [i for i, job in enumerate(self._jobs) if ready(job)]
            preferred = (i for i in ready_ones if prefer(self._jobs[i]))
            index = next(preferred, ready_ones[0] if ready_ones else 0)
            return self._jobs.pop(index)

    def close(self) -> list[Job]:
        """Takes no more jobs (the run is interrupted); those left, in order."""
        with self._lock:
            self._closed = True
            left, self._jobs = self._jobs, []
            return left

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)
