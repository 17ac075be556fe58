from sandfork_runner.retry import Outcome, rerun_in_place, run_again, stood_still

FAIL = Outcome(passed=False, stood_still=False)
STALL = Outcome(passed=False, stood_still=True)
PASS = Outcome(passed=True, stood_still=False)


def test_a_pass_is_not_run_again() -> None:
    assert not run_again([PASS])
    assert not run_again([FAIL, PASS])


def test_a_failure_is_run_again_once() -> None:
    assert run_again([FAIL])
    assert not run_again([FAIL, FAIL])


def test_a_second_re_run_only_when_the_lab_stood_still_during_the_first() -> None:
    assert run_again([FAIL, STALL])
    assert run_again([STALL, STALL])
    # the stall during the first try earns nothing more: the re-run is its answer
    assert not run_again([STALL, FAIL])


def test_never_a_fourth_try() -> None:
    assert not run_again([FAIL, STALL, STALL])


def test_no_try_no_re_run() -> None:
    assert not run_again([])


def test_a_job_that_reruns_its_tests_inside_runs_again_only_after_a_stall() -> None:
    # its first try re-ran its failed tests: that was the one re-run
    assert not run_again([FAIL], reruns_inside=True)
    assert run_again([STALL], reruns_inside=True)
    assert not run_again([STALL, STALL], reruns_inside=True)
    assert not run_again([PASS], reruns_inside=True)


def test_the_tests_pytest_ran_again_are_read_from_its_rerun_summary() -> None:
    log = (
        b"=========================== rerun test summary info ============================\n"
        b"RERUN test_x.py::test_flaky\n"
        b"RERUN test_x.py::test_bad\n"
        b"FAILED test_x.py::test_bad\n"
        b"===================== 1 failed, 2 passed, 2 rerun in 0.03s =====================\n"
        b"RERUN test_x.py::test_bad\n"
        b"  RERUN not_at_a_line_start\n"
    )
    assert rerun_in_place(log) == ["test_x.py::test_flaky", "test_x.py::test_bad"]
    assert rerun_in_place(b"") == []


def test_the_stall_line_is_the_lab_s_own_at_a_line_start() -> None:
    log = (
        b"test snapshot::restore ... FAILED\n"
        b"sandfork-lab: the machine stood still 1 time(s); beats resumed after stop/cont 1, "
        b"after an NMI 0\n"
    )
    assert stood_still(log)
    assert not stood_still(b"[ 576.3] sandfork-lab: this machine stood still for about 112 s\n")
    assert not stood_still(b"lane| sandfork-lab: the machine stood still\n")
    assert not stood_still(b"")
