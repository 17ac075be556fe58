"""A sandbox's life through the CLI: create --detach, list, info, exec,
connect (an interactive shell in tmux), logs, metrics, pause and resume,
snapshots, kill. One sandbox for the file, made by the `sandbox` fixture
(the create's own checks are test_sandbox_create's)."""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2bcli import SANDBOX_ID, E2bCli, Run, Tmux, pinned_version
from polling import wait_until


@dataclass(frozen=True)
class Sandbox:
    id: str
    created: Run


@pytest.fixture(scope="module")
def sandbox(cli: E2bCli) -> Iterator[Sandbox]:
    created = cli.run("sandbox", "create", "base", "--detach", "--timeout", "600")
    sbx = Sandbox(created.last_line, created)
    yield sbx
    # (test_sandbox_kill kills it; this, when a test before it failed)
    cli.run("sandbox", "kill", sbx.id, check=False)


def test_version(cli: E2bCli) -> None:
    run = cli.run("--version")
    assert pinned_version() in run.out, str(run)


def test_sandbox_create(sandbox: Sandbox) -> None:
    """--detach prints the new sandbox's id last"""
    assert SANDBOX_ID.fullmatch(sandbox.id), f"no sandbox id from create: {sandbox.created}"


def test_sandbox_list(cli: E2bCli, sandbox: Sandbox) -> None:
    """as a table and as JSON"""
    table = cli.run("sandbox", "list")
    assert sandbox.id in table.text, str(table)
    assert "Running" in table.text, str(table)
    listed = cli.run("sandbox", "list", "--format", "json")
    mine = [
        f"{s['state']} {s['templateId']}" for s in listed.json() if s["sandboxId"] == sandbox.id
    ]
    assert mine == ["running base"], str(listed)


def test_sandbox_info(cli: E2bCli, sandbox: Sandbox) -> None:
    info = cli.run("sandbox", "info", sandbox.id, "--format", "json")
    d = info.json()
    assert (d["sandboxId"], d["state"]) == (sandbox.id, "running"), str(info)
    table = cli.run("sandbox", "info", sandbox.id)
    assert f"Sandbox info for {sandbox.id}" in table.text, str(table)
    assert "State: running" in table.text, str(table)


def test_sandbox_exec(cli: E2bCli, sandbox: Sandbox) -> None:
    """output, exit code, options, piped stdin"""
    script = "echo out-$((6*7)); echo err >&2; exit 3"
    run = cli.run("sandbox", "exec", sandbox.id, "--", "sh", "-c", script, check=False)
    # (the CLI adds "exit status 3" to stderr)
    assert (run.status, run.out, run.err.split("\n")[0]) == (3, "out-42", "err"), str(run)
    script = "echo $(id -un) $(pwd) $GREET"
    run = cli.run("sandbox", "exec", "-u", "root", "-c", "/tmp", "-e", "GREET=hi", sandbox.id,
                  "sh", "-c", script)  # fmt: skip
    assert run.out == "root /tmp hi", f"exec with options: {run}"
    run = cli.run("sandbox", "exec", sandbox.id, "wc", "-l", stdin="line one\nline two\n")
    assert run.out == "2", f"exec with piped stdin: {run}"


def test_sandbox_connect(cli: E2bCli, sandbox: Sandbox, tmp_path: Path) -> None:
    """an interactive shell through tmux: a command, the terminal's size, exit"""
    exit_file = tmp_path / "connect.exit"
    script = tmp_path / "connect.sh"
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in cli.config.items())
    script.write_text(
        f"export {exports}\n"
        f"{shlex.join(cli.argv('sandbox', 'connect', sandbox.id))}\n"
        f"echo $? > {shlex.quote(str(exit_file))}\n"
        "sleep 30\n"
    )
    tmux = Tmux(f"e2b-cli-test-{os.getpid()}")
    try:
        tmux.start(100, 30, "sh", str(script))
        tmux.wait_screen(f"Terminal connecting to sandbox {sandbox.id}", 60)
        tmux.keys("echo MARK$((40+2)) | tee /tmp/connected; stty size")
        tmux.wait_screen("MARK42", 60)
        # the pane's size reached the sandbox's terminal
        tmux.wait_screen(tmux.pane_size(), 30)
        tmux.keys("exit")
        wait_until(
            lambda: exit_file.exists() and exit_file.stat().st_size > 0,
            60,
            lambda: f"sandbox connect did not end after exit:\n{tmux.screen()}",
        )
        status = exit_file.read_text().strip()
        assert status == "0", f"sandbox connect exited {status}:\n{tmux.screen()}"
        tmux.wait_screen(f"Closing terminal connection to sandbox {sandbox.id}", 10)
    finally:
        tmux.kill()
    run = cli.run("sandbox", "exec", sandbox.id, "cat", "/tmp/connected")
    assert run.out == "MARK42", f"what the shell wrote: {run}"


def test_sandbox_logs(cli: E2bCli, sandbox: Sandbox) -> None:
    run = cli.run("sandbox", "logs", sandbox.id)
    assert f"Logs for sandbox {sandbox.id}" in run.text, str(run)
    # the agent's log of the create's /init and of the commands above
    assert "logger: 'agent'" in run.text, str(run)
    assert "/init applied" in run.text, str(run)
    # one JSON object a line (after a blank one)
    run = cli.run("sandbox", "logs", sandbox.id, "--format", "json", "--loggers", "agent")
    lines = run.json_lines()
    assert lines, f"sandbox logs --loggers agent: {run}"
    assert all(line["logger"] == "agent" and line["message"] for line in lines), str(run)
    run = cli.run("sandbox", "logs", sandbox.id, "--level", "ERROR")
    assert "/init applied" not in run.text, str(run)


def test_sandbox_metrics(cli: E2bCli, sandbox: Sandbox) -> None:
    # One JSON object a line (after a blank one, as logs); the node samples
    # every few seconds, so the first may take a moment.
    for _ in range(15):
        run = cli.run("sandbox", "metrics", sandbox.id, "--format", "json")
        if run.out.strip():
            break
        time.sleep(2)
    lines = run.json_lines()
    assert lines, f"sandbox metrics --format json: {run}"
    first = lines[0]
    assert first["cpuCount"] >= 1, str(run)
    assert first["memTotal"] > 0, str(run)
    assert first["diskTotal"] > 0, str(run)
    run = cli.run("sandbox", "metrics", sandbox.id)
    assert f"Metrics for sandbox {sandbox.id}" in run.text, str(run)
    assert "CPU:" in run.text, str(run)
    assert "MiB" in run.text, str(run)


def test_sandbox_pause_resume(cli: E2bCli, sandbox: Sandbox) -> None:
    # what the sandbox holds before the pause (its own, so that this test
    # does not need test_sandbox_connect's)
    cli.run("sandbox", "exec", sandbox.id, "sh", "-c", "echo MARK42 > /tmp/paused")
    run = cli.run("sandbox", "pause", sandbox.id)
    assert f"Sandbox {sandbox.id} has been paused" in run.text, str(run)
    run = cli.run("sandbox", "list", "--state", "paused", "--format", "json")
    assert sandbox.id in [s["sandboxId"] for s in run.json()], f"not listed as paused: {run}"
    run = cli.run("sandbox", "list", "--format", "json")
    running = [s["sandboxId"] for s in run.json()]
    assert sandbox.id not in running, f"a paused sandbox listed as running: {run}"
    # its logs are still there while it is paused
    run = cli.run("sandbox", "logs", sandbox.id)
    assert "/init applied" in run.text, str(run)
    run = cli.run("sandbox", "resume", sandbox.id)
    assert f"Sandbox {sandbox.id} has been resumed" in run.text, str(run)
    run = cli.run("sandbox", "exec", sandbox.id, "cat", "/tmp/paused")
    assert run.out == "MARK42", f"after the resume: {run}"


def test_sandbox_snapshot(cli: E2bCli, sandbox: Sandbox) -> None:
    """create, list, delete"""
    run = cli.run("sandbox", "snapshot", "create", sandbox.id)
    assert f"from sandbox {sandbox.id}" in run.text, str(run)
    made = re.search(r"^Created snapshot (\S+) from sandbox", run.text, re.MULTILINE)
    assert made, f"no snapshot id: {run}"
    snap = made[1]
    run = cli.run("sandbox", "snapshot", "list", sandbox.id, "--format", "json")
    assert [s["snapshotId"] for s in run.json()] == [snap], f"snapshot list: {run}"
    run = cli.run("sandbox", "snapshot", "delete", snap)
    assert f"Snapshot {snap} has been deleted" in run.text, str(run)


def test_sandbox_kill(cli: E2bCli, sandbox: Sandbox) -> None:
    run = cli.run("sandbox", "kill", sandbox.id, merged=True)
    assert f"Sandbox {sandbox.id} has been killed" in run.text, str(run)
    run = cli.run("sandbox", "kill", sandbox.id, merged=True)
    assert f"Sandbox {sandbox.id} wasn't found" in run.text, str(run)
    run = cli.run("sandbox", "info", sandbox.id, merged=True, check=False)
    assert run.status != 0, f"info of a killed sandbox: {run}"
    assert "wasn't found" in run.text, str(run)
