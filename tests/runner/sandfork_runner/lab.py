"""The KVM lab: its machine-wide locks, and how a lab test binary is run."""

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

# One per lane: the lab keeps one host CPU busy, this host has two.
LOCKS = (Path("/tmp/sandfork-lab.lock"), Path("/tmp/sandfork-lab2.lock"))
LAB = Path("target/debug/sandfork-lab")


def lock(count: int, say: Callable[[str], None]) -> list[Path]:
    """Holds `count` of the lab locks for the rest of the run: those free
    first (a developer's run of one job need not wait behind another's lab
    on the first lock), then it waits for the others in order, saying so.
    Python's descriptors are not inherited (PEP 446), so no child (a cache
    server, a node left behind) keeps a lock after the run."""
    fds = {path: os.open(path, os.O_WRONLY | os.O_CREAT, 0o666) for path in LOCKS}
    held: list[Path] = []
    for path, fd in fds.items():
        if len(held) < count:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(path)
    for path, fd in fds.items():
        if len(held) < count and path not in held:
            say(f"waiting for the lab lock {path}")
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(path)
    for path, fd in fds.items():
        if path not in held:
            os.close(fd)
    return held


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
