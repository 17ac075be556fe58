import fcntl
import os
import threading
import time
from pathlib import Path

from sandfork_runner.lab import Locks, in_lab


def hold(path: Path) -> int:
    """Another holder (flock is per open file, so this process can be one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_free_lock_first_then_the_other_once_let_go(tmp_path: Path) -> None:
    first, second = tmp_path / "lab.lock", tmp_path / "lab2.lock"
    other = hold(first)
    locks = Locks((first, second))
    said: list[str] = []
    assert locks.take(said.append, lambda: True) == second
    assert said == []
    got: list[Path | None] = []
    waiter = threading.Thread(target=lambda: got.append(locks.take(said.append, lambda: True)))
    waiter.start()
    for _ in range(500):
        if said:
            break
        time.sleep(0.01)
    os.close(other)
    waiter.join(timeout=10)
    assert got == [first]
    assert said == [f"waiting for the lab lock {first}"]


def test_a_lane_gives_up_waiting_when_no_job_is_left(tmp_path: Path) -> None:
    first, second = tmp_path / "lab.lock", tmp_path / "lab2.lock"
    others = [hold(first), hold(second)]
    wanted = [True, False]
    locks = Locks((first, second))
    assert locks.take(lambda _: None, lambda: wanted.pop(0)) is None
    for fd in others:
        os.close(fd)


def test_in_lab() -> None:
    assert in_lab(["/t/deps/microvm-1", "--ignored"], "/c/lab-rw") == [
        "target/debug/sandfork-lab",
        "run",
        "--cpus",
        "1",
        "--timeout",
        "1800",
        "--rw",
        "/c/lab-rw",
        "--",
        "/t/deps/microvm-1",
        "--ignored",
    ]
