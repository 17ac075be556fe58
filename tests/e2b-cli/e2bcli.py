"""The unmodified E2B CLI as a user runs it (its own Node.js process, configured
by environment variables only), and the tmux terminal its interactive shell
runs in. conftest.py makes one for the session."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polling import wait_until

HERE = Path(__file__).resolve().parent
# colours, should the CLI print any despite FORCE_COLOR=0
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SANDBOX_ID = re.compile(r"[a-z0-9]{20}")


def pinned_version() -> str:
    """The CLI's version as package.json pins it (the cache is `npm ci` of it)."""
    package = json.loads((HERE / "package.json").read_text())
    return str(package["dependencies"]["@e2b/cli"])


def plain(text: str) -> str:
    return ANSI.sub("", text)


@dataclass(frozen=True)
class Run:
    """One finished CLI command. out: its stdout (with stderr when merged),
    err: its stderr otherwise; both without their trailing newlines, as a
    shell's $(...) has them."""

    argv: tuple[str, ...]
    status: int
    out: str
    err: str

    @property
    def text(self) -> str:
        """out without colours"""
        return plain(self.out)

    @property
    def last_line(self) -> str:
        lines = self.out.splitlines()
        return lines[-1] if lines else ""

    def json(self) -> Any:
        return json.loads(self.out)

    def json_lines(self) -> list[Any]:
        """One JSON document a line, blank lines skipped (logs, metrics)."""
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]

    def __str__(self) -> str:
        said = f"e2b {shlex.join(self.argv)}: exit {self.status}\n{self.out}"
        return f"{said}\n--- stderr\n{self.err}" if self.err else said


class E2bCli:
    """`e2b ARGS...`: node running the CLI's entry point. The CLI's whole
    configuration is its environment: a fresh HOME (no ~/.e2b), no update
    check (it would ask the registry), no colours on plain output, the node's
    URL and key; E2B_DOMAIN and E2B_ACCESS_TOKEN unset."""

    def __init__(self, node: str, entry: str, home: Path, api_url: str, api_key: str) -> None:
        self.node = node
        self.entry = entry
        self.config = {
            "HOME": str(home),
            "NO_UPDATE_NOTIFIER": "1",
            "E2B_API_URL": api_url,
            "E2B_SANDBOX_URL": api_url,
            "E2B_API_KEY": api_key,
        }
        env = dict(os.environ, FORCE_COLOR="0", **self.config)
        for name in ("E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
            env.pop(name, None)
        self.env: Mapping[str, str] = env

    def argv(self, *args: str) -> list[str]:
        return [self.node, self.entry, *args]

    def run(
        self,
        *args: str,
        stdin: str | None = None,
        merged: bool = False,
        check: bool = True,
        timeout: float = 600,
    ) -> Run:
        """Runs the CLI to its end. stdin: text piped to it (the CLI streams
        a piped stdin to `exec`), else /dev/null (not a pipe). merged: stderr
        into out. check: fails unless it exited 0."""
        done = subprocess.run(
            self.argv(*args),
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
            env=self.env,
            text=True,
            timeout=timeout,
        )
        run = Run(
            tuple(args), done.returncode, done.stdout.rstrip("\n"), (done.stderr or "").rstrip("\n")
        )
        if check:
            assert run.status == 0, str(run)
        return run


class Tmux:
    """A tmux server of its own (-L socket) with one session `t`."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, f"tmux {shlex.join(args)}: {done.stderr}"
        return done.stdout

    def start(self, columns: int, rows: int, *command: str) -> None:
        self("new-session", "-d", "-s", "t", "-x", str(columns), "-y", str(rows), *command)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t")

    def wait_screen(self, text: str, timeout: float) -> None:
        wait_until(
            lambda: text in self.screen(),
            timeout,
            lambda: f'no "{text}" on the terminal:\n{self.screen()}',
        )

    def keys(self, line: str) -> None:
        """line, typed, then Enter"""
        self("send-keys", "-t", "t", "-l", line)
        self("send-keys", "-t", "t", "Enter")

    def pane_size(self) -> str:
        """rows and columns (the window less tmux's status line), as `stty size`"""
        return self("display-message", "-p", "-t", "t", "#{pane_height} #{pane_width}").strip()

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)
