import io
import json
import os
from pathlib import Path

import pytest
from sandfork_runner.cargo import binaries, executables, failed_tests, main, relinked

LOG = """\
running 4 tests
test boots_and_halts ... ok
test restore_twice ... FAILED
test fork::children_answer ... ok
test fork::many ... [  12.3] some lab message
FAILED

failures:

---- fork::many stdout ----
guest lost
    not_a_test_name_from_the_first_block_is_still_taken

---- restore_twice stdout ----
thread 'restore_twice' panicked at crates/vmm/tests/snapshot.rs:10:5

failures:
    fork::many
    restore_twice

test result: FAILED. 2 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out
    after_the_result_line
"""


def test_failed_tests_from_every_kind_of_line() -> None:
    assert failed_tests(LOG) == [
        "fork::many",
        "not_a_test_name_from_the_first_block_is_still_taken",
        "restore_twice",
    ]


def test_a_test_split_over_lines_is_found_by_its_header_or_the_list() -> None:
    log = (
        "test a::b ... sandfork-lab: noise\nFAILED\n\nfailures:\n    a::b\n\ntest result: FAILED.\n"
    )
    assert failed_tests(log) == ["a::b"]


def test_a_passing_log_names_none() -> None:
    assert failed_tests("test a ... ok\n\ntest result: ok. 1 passed\n") == []


def test_a_log_without_names_names_none() -> None:
    assert failed_tests("sandfork-lab: timed out after 1800 s\n") == []


def artifact(name: str, kind: list[str], executable: str | None) -> str:
    return json.dumps(
        {
            "reason": "compiler-artifact",
            "target": {"name": name, "kind": kind},
            "executable": executable,
        }
    )


def test_test_binaries_are_the_test_targets_with_an_executable() -> None:
    lines = [
        artifact("microvm", ["test"], "/t/debug/deps/microvm-1a"),
        artifact("sandfork_vmm", ["lib"], "/t/debug/deps/sandfork_vmm-2b"),
        artifact("serde", ["lib"], None),
        artifact("sandfork", ["bin"], "/t/debug/sandfork"),
        json.dumps({"reason": "build-finished", "success": True}),
        "",
        "warning: not JSON",
    ]
    assert executables(lines) == {"microvm": "/t/debug/deps/microvm-1a"}


def test_main_prints_the_named_test_targets_executable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        artifact("cli_node", ["test"], "/t/debug/deps/cli_node-3c"),
        artifact("microvm", ["test"], "/t/debug/deps/microvm-1a"),
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["cli_node"]) == 0
    assert capsys.readouterr().out == "/t/debug/deps/cli_node-3c\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["lab_serve"]) == 1
    assert capsys.readouterr().out == ""


def test_relinked_names_the_new_and_the_changed() -> None:
    before = {"sandfork": (1, 10), "sandfork-vmm": (2, 20), "gone": (3, 30)}
    after = {"sandfork": (1, 10), "sandfork-vmm": (4, 20), "new": (5, 50)}
    assert relinked(before, after) == ["new", "sandfork-vmm"]
    assert relinked(before, before) == []


def test_binaries_lists_executable_regular_files_only(tmp_path: Path) -> None:
    (tmp_path / "sandfork").write_text("")
    (tmp_path / "sandfork").chmod(0o755)
    (tmp_path / "notes.d").write_text("")
    (tmp_path / "deps").mkdir()
    (tmp_path / "link").symlink_to("sandfork")
    found = binaries(tmp_path)
    assert list(found) == ["sandfork"]
    st = os.stat(tmp_path / "sandfork")
    assert found["sandfork"] == (st.st_ino, st.st_mtime_ns)
