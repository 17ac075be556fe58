"""Waiting on a condition, for the Python suites (the SDK's, the E2B CLI's,
the cluster's): their pytest.ini puts this folder on the path."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    what: str | Callable[[], str] = "the condition",
    interval: float = 0.2,
) -> T:
    """Calls predicate until it returns something truthy (returned) or
    `timeout` seconds have passed: then an AssertionError naming `what` (or
    what it returns then, for a message that says the last state seen)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"timed out after {timeout:g} s: {said}")
        time.sleep(interval)
