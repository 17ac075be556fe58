from pathlib import Path

from sandfork_runner import failures

LIBTEST = """\
running 3 tests
test boots ... ok
test forks ... FAILED
test balloon ... FAILED
sandfork-lab: no heartbeat from the machine for 15.0 s
sandfork-lab: the machine beats again after 98.0 s

failures:

---- forks stdout ----

thread 'forks' (576) panicked at crates/vmm/tests/snapshot.rs:319:29:
dd: no answer from the guest agent within 60s
--- console ---
Linux version 6.1.192

failures:
    balloon
    forks

test result: FAILED. 1 passed; 2 failed; 0 ignored
sandfork-lab: the machine stood still 1 time(s); beats resumed after stop/cont 0, after an NMI 0
"""


def test_a_libtest_log_names_its_failed_tests_why_and_the_labs_stall() -> None:
    assert failures.digest(LIBTEST) == [
        "forks: crates/vmm/tests/snapshot.rs:319:29: dd: no answer from the guest agent within 60s",
        "balloon: failed",
        "sandfork-lab: the machine stood still 1 time(s); beats resumed after stop/cont 0, "
        "after an NMI 0",
    ]


def test_a_pytest_log_names_each_failed_test_once_with_its_reason() -> None:
    # pytest-rerunfailures' summary (-rR) names a test before pytest's own
    log = (
        "RERUN test_files.py::test_write\n"
        "FAILED test_files.py::test_write\n"
        "=== short test summary info ===\n"
        "FAILED test_files.py::test_write - AssertionError: 3 != 4\n"
        "FAILED test_pty.py::test_resize\n"
        "FAILED test_pty.py::test_resize\n"
        "FAILED test_ports.py::test_proxy - Timeout\n"
        "FAILED test_ports.py::test_proxy\n"
        "3 failed, 40 passed, 1 rerun\n"
    )
    assert failures.digest(log) == [
        "test_files.py::test_write: AssertionError: 3 != 4",
        "test_pty.py::test_resize: failed",
        "test_ports.py::test_proxy: Timeout",
    ]


def test_a_panic_outside_any_test_still_says_why() -> None:
    log = "thread 'main' panicked at src/main.rs:3:5:\nno kernel\n"
    assert failures.digest(log) == ["main: src/main.rs:3:5: no kernel"]


def test_a_passing_log_has_nothing_to_say() -> None:
    assert failures.digest("test boots ... ok\ntest result: ok. 1 passed\n") == []


def test_the_digest_is_bounded_in_lines_and_width() -> None:
    log = "".join(f"test t{i}{'x' * 300} ... FAILED\n" for i in range(40))
    out = failures.digest(log)
    assert len(out) == failures.MAX_LINES
    assert out[-1] == f"... and {40 - failures.MAX_LINES + 1} more"
    assert all(len(line) <= failures.MAX_WIDTH for line in out)


def test_kept_runs_are_copied_and_only_the_newest_stay(tmp_path: Path) -> None:
    into = tmp_path / "runs"
    for i in range(failures.KEPT_RUNS + 2):
        run = tmp_path / "target" / f"20261206T0{i:02d}000Z"
        run.mkdir(parents=True)
        (run / "microvm.log").write_text(f"run {i}\n")
        kept = failures.keep(run, into)
        assert (kept / "microvm.log").read_text() == f"run {i}\n"
    names = sorted(p.name for p in into.iterdir())
    assert len(names) == failures.KEPT_RUNS
    assert names[0] == "20261206T002000Z"
