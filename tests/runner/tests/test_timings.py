from sandfork_runner.timings import PerTestClock


def test_each_test_took_the_gap_since_the_result_before_it() -> None:
    now = [100.0]
    clock = PerTestClock(lambda: now[0])
    for line, at in [
        (b"running 3 tests\n", 101.0),
        (b"test boots ... ok\n", 130.0),
        (b"sandfork-lab: something of the lab's own\n", 131.0),
        (b"test forks ... FAILED\n", 190.0),
        (b"test later ... ignored, lab: needs a guest\n", 190.5),
        (b"test result: FAILED. 1 passed; 1 failed\n", 191.0),
    ]:
        now[0] = at
        clock.saw(line)
    assert clock.took == {"boots": 30.0, "forks": 60.0, "later": 0.5}
    assert clock.slowest(2) == [("forks", 60.0), ("boots", 30.0)]


def test_a_result_line_split_by_other_output_is_not_timed() -> None:
    now = [0.0]
    clock = PerTestClock(lambda: now[0])
    now[0] = 5.0
    clock.saw(b"test boots ... sandfork-lab: a message\n")
    clock.saw(b"ok\n")
    assert clock.took == {}
