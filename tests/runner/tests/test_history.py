from pathlib import Path
from typing import Any

from sandfork_runner import history
from sandfork_runner.record import summary
from test_record import record


def run_line(**jobs: tuple[str, int, bool]) -> dict[str, Any]:
    """A history line whose jobs are (result, tries, stall)."""
    return {
        "started": "2026-12-06T07:00:00Z",
        "duration_s": 2100.0,
        "commit": "abc",
        "passed": all(r == "passed" for r, _, _ in jobs.values()),
        "jobs": {n: {"result": r, "tries": t, "stall": s} for n, (r, t, s) in jobs.items()},
    }


def test_an_entry_keeps_each_jobs_result_tries_and_a_stall_before_a_retry() -> None:
    data = summary(
        record(),
        started="2026-12-06T07:00:00Z",
        duration=2400.0,
        argv=[],
        run_dir="target/test-runs/x",
        interrupted=False,
    )
    line = history.entry(data, "0123456789ab")
    assert line["commit"] == "0123456789ab"
    assert line["passed"] is False
    assert line["jobs"]["snapshot"] == {
        "result": "failed",
        "tries": 3,
        "stall": True,
        "rerun": 0,
        "s": 360,
        "lane": "lane1",
    }
    assert line["jobs"]["sdk"] == {
        "result": "passed",
        "tries": 1,
        "stall": False,
        "rerun": 0,
        "s": 1020,
        "lane": "lane2",
    }
    assert line["jobs"]["clippy"] == {
        "result": "not run",
        "tries": 0,
        "stall": False,
        "rerun": 0,
        "s": 0,
        "lane": None,
    }


def test_the_history_is_appended_and_read_back_last_runs_first_torn_lines_skipped(
    tmp_path: Path,
) -> None:
    source = tmp_path / "runner" / "history.jsonl"
    for i in range(7):
        history.append({**run_line(sdk=("passed", 1, False)), "commit": str(i)}, source)
    with open(source, "a") as f:
        f.write('{"started": "cut short')
    runs = history.read(source, 5)
    assert [r["commit"] for r in runs] == ["2", "3", "4", "5", "6"]
    assert history.read(tmp_path / "none.jsonl", 5) == []


def test_a_job_retried_in_two_of_five_runs_is_a_defect_and_one_retry_is_not() -> None:
    runs = [
        run_line(sdk=("passed", 2, False), cluster=("passed", 2, False)),
        run_line(sdk=("passed", 1, False), cluster=("passed", 1, False)),
        run_line(sdk=("passed", 2, True), cluster=("passed", 1, False)),
        run_line(sdk=("passed", 1, False)),
        run_line(sdk=("passed", 1, False), cluster=("failed", 2, False)),
    ]
    rows = {r.job: r for r in history.rows(runs)}
    assert rows["sdk"].cells == ("ok/r", "ok", "ok/rs", "ok", "ok")
    assert rows["sdk"].retried == 2 and rows["sdk"].defect
    assert rows["cluster"].cells == ("ok/r", "ok", "ok", "-", "FAIL")
    assert rows["cluster"].failed == 1 and rows["cluster"].defect
    one = history.rows(runs[1:])
    assert [r.defect for r in one if r.job == "sdk"] == [False]
    text = history.table(runs)
    assert "defects (a retry in 2+ runs, or a failure): sdk, cluster" in text
    assert text.count("35.0 min") == 5


def test_tests_run_again_in_place_count_as_a_retry() -> None:
    runs = [run_line(rl=("passed", 1, False)) for _ in range(3)]
    runs[0]["jobs"]["rl"]["rerun"] = 1
    runs[2]["jobs"]["rl"]["rerun"] = 2
    (row,) = history.rows(runs)
    assert row.cells == ("ok/t", "ok", "ok/t")
    assert row.retried == 2 and row.defect


def test_a_skipped_job_is_shown_as_such_and_is_no_defect() -> None:
    runs = [run_line(harbor=("skipped", 1, False)), run_line(harbor=("passed", 1, False))]
    (row,) = history.rows(runs)
    assert row.cells == ("skip", "ok")
    assert not row.defect


def test_the_table_shows_each_jobs_minutes_in_the_newest_run_that_has_them() -> None:
    old = run_line(sdk=("passed", 1, False))
    new = run_line(sdk=("passed", 1, False))
    new["jobs"]["sdk"]["s"] = 750
    table = history.table([old, new])
    (sdk,) = [line for line in table.splitlines() if line.startswith("sdk")]
    assert sdk.split()[-1] == "12.5"
    assert history.rows([old])[0].minutes is None
