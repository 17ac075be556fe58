import time
from pathlib import Path

from sandfork_runner.cpu import CpuLoad, busy_fraction, read_times


def test_busy_is_all_but_idle_and_iowait(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    assert read_times(stat) == (150, 1000)
    stat.write_text("cpu  400 0 150 900 50 0 0 0 0 0\n")
    after = read_times(stat)
    assert after == (550, 1500)
    assert busy_fraction((150, 1000), after) == 0.8
    assert busy_fraction(after, after) is None


def test_a_missing_or_strange_stat_reads_as_nothing(tmp_path: Path) -> None:
    assert read_times(tmp_path / "absent") is None
    strange = tmp_path / "stat"
    strange.write_text("intr 1 2 3\n")
    assert read_times(strange) is None


def test_a_span_gets_the_samples_whose_middle_lies_in_it() -> None:
    load = CpuLoad(lambda: 0.0, every=10.0)
    load.samples = [(10.0, 0.2), (20.0, 0.4), (30.0, 1.0), (40.0, 0.0)]
    # samples cover 0-10, 10-20, 20-30, 30-40
    assert load.busy(10.0, 30.0) == 0.7
    assert load.busy(0.0, 40.0) == 0.4
    assert load.busy(12.0, 13.0) is None
    assert load.timeline() == [[10, 0.2], [20, 0.4], [30, 1.0], [40, 0.0]]


def test_it_samples_the_real_host() -> None:
    ticks = iter(range(1000))
    load = CpuLoad(lambda: float(next(ticks)), every=0.05)
    load.start()
    time.sleep(0.5)
    load.stop()
    assert load.samples, "no sample of /proc/stat in half a second"
    assert all(0.0 <= f <= 1.0 for _, f in load.samples)
