"""How busy the host's CPUs were through a run, from /proc/stat: what says
whether the 2-core machine has room for one more job beside the others, and
which job had the CPUs to itself."""

import threading
from collections.abc import Callable
from pathlib import Path

STAT = Path("/proc/stat")


def read_times(stat: Path = STAT) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs together; None where there is no
    /proc/stat. Busy is everything but idle and iowait."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 6 or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + values[4]
    # guest time is counted inside user and nice already
    total = sum(values[:8])
    return total - idle, total


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of all CPUs' time that was busy between two readings."""
    total = after[1] - before[1]
    if total <= 0:
        return None
    return max(0.0, min(1.0, (after[0] - before[0]) / total))


class CpuLoad:
    """Samples the CPUs every `every` seconds on its own thread; `busy`
    answers for any span of the run (seconds on the run's clock)."""

    def __init__(self, clock: Callable[[], float], every: float = 10.0) -> None:
        self.clock = clock
        self.every = every
        # (seconds into the run, busy fraction since the sample before)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _sample(self) -> None:
        last = read_times()
        while last is not None and not self._stop.wait(self.every):
            now = read_times()
            if now is None:
                return
            fraction = busy_fraction(last, now)
            last = now
            if fraction is not None:
                with self._lock:
                    self.samples.append((self.clock(), fraction))

    def busy(self, start: float, end: float) -> float | None:
        """The mean busy fraction of the samples whose middle lies in
        [start, end] (each covers the `every` seconds before it); None when
        there is none (a span shorter than a sample)."""
        half = self.every / 2
        with self._lock:
            inside = [f for t, f in self.samples if start + half <= t <= end + half]
        if not inside:
            return None
        return round(sum(inside) / len(inside), 2)

    def timeline(self) -> list[list[float]]:
        with self._lock:
            return [[round(t), round(f, 2)] for t, f in self.samples]
