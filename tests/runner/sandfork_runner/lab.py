"""The KVM lab: its machine-wide locks, and how a lab test binary is run."""

import fcntl
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

# One per lane: the lab keeps one host CPU busy, this host has two.
LOCKS = (Path("/tmp/sandfork-lab.lock"), Path("/tmp/sandfork-lab2.lock"))
LAB = Path("target/debug/sandfork-lab")


class Locks:
    """The lab locks this run holds, one per lane, each for the rest of the
    run. Python's descriptors are not inherited (PEP 446), so no child (a
    cache server, a node left behind) keeps a lock after the run."""

    def __init__(self, paths: tuple[Path, ...] = LOCKS) -> None:
        self._paths = paths
        self._mutex = threading.Lock()
        # held, or waited for by one of this run's lanes
        self._taken: list[Path] = []
        self._fds: list[int] = []

    def take(self, say: Callable[[str], None], wanted: Callable[[], bool]) -> Path | None:
        """A free lock if there is one (a developer's run need not wait
        behind another's lab on the first lock), else the first that none
        of this run's lanes holds or waits for, once its holder lets go;
        None when it is no longer `wanted` (the other lanes took every job)."""
        with self._mutex:
            for path in self._paths:
                if path in self._taken:
                    continue
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._fds.append(fd)
                self._taken.append(path)
                return path
            path = next(p for p in self._paths if p not in self._taken)
            self._taken.append(path)
        say(f"waiting for the lab lock {path}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        self._fds.append(fd)
        # polled, as a blocking flock could not be given up
        while wanted():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return path
            except BlockingIOError:
                time.sleep(2)
        return None


def hardware_kvm(root: Path) -> bool:
    """Whether this host's /dev/kvm boots guests itself (`sandfork-lab detect`)."""
    out = subprocess.run(
        [str(root / LAB), "detect"], cwd=root, check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return out.startswith("hardware")


def in_lab(argv: list[str], rw_dir: str) -> list[str]:
    """A lab test binary's command inside the lab: one lab CPU, QEMU's default
    multi-threaded TCG (guests are lost early in boot with two CPUs, either TCG
    mode, and with single-threaded TCG: README, "Hangs"), the read-write share
    for tests that need one (SANDFORK_LAB_RW_DIR)."""
    return [str(LAB), "run", "--cpus", "1", "--timeout", "1800", "--rw", rw_dir, "--", *argv]
