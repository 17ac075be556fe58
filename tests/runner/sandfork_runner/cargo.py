"""Reading cargo's and the test harness's output.

`python3 -m sandfork_runner.cargo TARGET` (with PYTHONPATH=tests/runner)
reads `cargo test --no-run --message-format=json` on stdin and prints the
executable of the test target TARGET (scripts/cli-test.sh, which builds its
one test binary when the runner has not)."""

import json
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

_NAME = r"([A-Za-z0-9_:]+)"
_FAILED = re.compile(rf"^test {_NAME} \.\.\. FAILED$")
_STDOUT_HEADER = re.compile(rf"^---- {_NAME} stdout ----$")
_LISTED = re.compile(rf"^    {_NAME}$")


def failed_tests(log: str) -> list[str]:
    """The names of the tests a test binary's log says failed, sorted. A lab's
    own messages can split "test NAME ... FAILED" over lines, so the
    "---- NAME stdout ----" headers and the closing "failures:" list (up to
    "test result:") count too."""
    names: set[str] = set()
    in_failures = False
    for line in log.splitlines():
        if line == "failures:":
            in_failures = True
        for pattern in (_FAILED, _STDOUT_HEADER):
            if m := pattern.match(line):
                names.add(m[1])
        if in_failures:
            if m := _LISTED.match(line):
                names.add(m[1])
            if line.startswith("test result:"):
                in_failures = False
    return sorted(names)


def executables(messages: Iterable[str]) -> dict[str, str]:
    """Test target name -> executable, from `cargo test --no-run
    --message-format=json...` stdout (one JSON message a line)."""
    found: dict[str, str] = {}
    for line in messages:
        # a build script's or a tool's stray line is not cargo's
        if not line.startswith("{"):
            continue
        message = json.loads(line)
        if (
            message.get("reason") == "compiler-artifact"
            and message.get("executable")
            and message["target"]["kind"] == ["test"]
        ):
            found[message["target"]["name"]] = message["executable"]
    return found


# name -> (inode, modification time in ns)
Binaries = dict[str, tuple[int, int]]


def binaries(directory: Path) -> Binaries:
    """The workspace's binaries as the lab runs them (executable regular files
    directly in target/debug): inode and modification time of each."""
    found: Binaries = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            if st.st_mode & stat.S_IXUSR:
                found[entry.name] = (st.st_ino, st.st_mtime_ns)
    return found


def relinked(
    before: Mapping[str, tuple[int, int]], after: Mapping[str, tuple[int, int]]
) -> list[str]:
    """The binaries new or changed between two listings, sorted."""
    return sorted(name for name, seen in after.items() if before.get(name) != seen)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m sandfork_runner.cargo TARGET < cargo's JSON", file=sys.stderr)
        return 2
    found = executables(sys.stdin).get(argv[0])
    if found is None:
        print(f"cargo built no test target {argv[0]}", file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
