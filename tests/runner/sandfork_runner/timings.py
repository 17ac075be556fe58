"""Where a test binary's minutes go: each test's time, from when its result
line came. The lab's test binaries run with --test-threads=1, one test after
the other, so a test took the gap since the result before it (the first's
includes the lab machine's boot)."""

import re
import threading
from collections.abc import Callable

# libtest prints "test NAME ... " as a test starts and its result as it ends:
# the whole line arrives at the end
RESULT = re.compile(rb"^test (\S+) \.\.\. (?:ok|FAILED|ignored)\b")


class PerTestClock:
    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._last = now()
        self._lock = threading.Lock()
        self.took: dict[str, float] = {}

    def saw(self, line: bytes) -> None:
        """Called with each line of the binary's output as it comes."""
        m = RESULT.match(line)
        if m is None:
            return
        with self._lock:
            now = self._now()
            self.took[m[1].decode(errors="replace")] = now - self._last
            self._last = now

    def slowest(self, n: int) -> list[tuple[str, float]]:
        with self._lock:
            ranked = sorted(self.took.items(), key=lambda kv: kv[1], reverse=True)
        return [(name, round(s, 1)) for name, s in ranked[:n]]
