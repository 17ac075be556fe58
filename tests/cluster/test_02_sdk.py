"""The unmodified Python SDK through the gateways: its tests of creates and
the lifecycle (pause and connect, forks, snapshots), and those of its
command and file tests that stream through the envd proxy (output, stdin, a
reconnect, a large transfer, a watch, signed URLs; the rest differ from
these only inside the guest, and run against one node in the SDK job). Its
control plane goes through one gateway, its envd traffic through the
other, the sandboxes placed over the nodes (pauses stored, forks spread).
SANDFORK_CLUSTER_SDK=all: the four files whole (40 tests, 4 more minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from harness import Cluster, log

SDK = Path(__file__).resolve().parents[1] / "sdk" / "python"
STREAMING_COMMANDS = [
    "stdout_and_exit_code",
    "streaming_callbacks",
    "stdin",
    "connect_to_running_command",
    "background_list_and_kill",
]
STREAMING_FILES = [
    "write_and_read_text",
    "large_file_upload_and_download",
    "watch_dir",
    "signed_urls",
]


def sdk_tests() -> list[str]:
    tests = [str(SDK / "test_create.py"), str(SDK / "test_lifecycle.py")]
    if os.environ.get("SANDFORK_CLUSTER_SDK") == "all":
        return [*tests, str(SDK / "test_commands.py"), str(SDK / "test_files.py")]
    tests += [f"{SDK / 'test_commands.py'}::test_{t}" for t in STREAMING_COMMANDS]
    tests += [f"{SDK / 'test_files.py'}::test_{t}" for t in STREAMING_FILES]
    return tests


def test_python_sdk_through_the_gateways(cluster: Cluster) -> None:
    control, envd = cluster.gateways
    env = dict(
        cluster.env,
        E2B_API_URL=control,
        E2B_SANDBOX_URL=envd,
        E2B_API_KEY=cluster.api_key,
        PYTHONDONTWRITEBYTECODE="1",
    )
    tests = sdk_tests()
    out = cluster.work / "sdk.log"
    start = time.monotonic()
    # Its own pytest run (its conftest reads the server from the environment
    # at import), with this interpreter: the SDK venv's.
    with open(out, "wb") as sink:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *tests],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    lines = out.read_text(errors="replace").splitlines()
    assert done.returncode == 0, (
        f"the SDK's tests through the gateways failed (exit {done.returncode}, log: {out}):\n"
        + "\n".join(lines[-40:])
    )
    log.info(
        "the Python SDK's tests through the gateways (%d files or tests): %s (%.0f s)",
        len(tests), lines[-1] if lines else "", time.monotonic() - start,
    )  # fmt: skip
