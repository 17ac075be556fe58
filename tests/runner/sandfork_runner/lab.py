"""The KVM lab: its machine-wide locks, and how a lab test binary is run."""

import fcntl
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

# One per lane: the lab keeps one host CPU busy, this host has two.
LOCKS = (Path("/tmp/sandfork-lab.lock"), Path("/tmp/sandfork-lab2.lock"))
LAB = Path("target/debug/sandfork-lab")


def lock(path: Path, say: Callable[[str], None]) -> int:
    """Holds `path`'s flock for the rest of the run; says so first when
    another holder makes it wait. Python's descriptors are not inherited
    (PEP 446), so no child (a cache server, a node left behind) keeps the
    lock after the run."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"waiting for the lab lock {path}")
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


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
