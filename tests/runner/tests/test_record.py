import json
from pathlib import Path

from sandfork_runner import jobs
from sandfork_runner.record import (
    SKIP_STATUS,
    JobRecord,
    Result,
    Try,
    clock,
    failure_report,
    outcome,
    summary,
)


def record() -> list[JobRecord]:
    snapshot = JobRecord(jobs.by_name("snapshot"), lane="lane1", result=Result.FAILED)
    snapshot.tries = [
        Try(1, 100.0, 240.0, 101, False, "target/test-runs/x/snapshot.log"),
        Try(2, 340.5, 60.0, 101, True, "target/test-runs/x/snapshot.try2.log", ["restore"]),
        Try(3, 400.5, 59.0, 101, False, "target/test-runs/x/snapshot.try3.log", ["restore"]),
    ]
    sdk = JobRecord(jobs.by_name("sdk"), lane="lane2", result=Result.PASSED)
    sdk.tries = [Try(1, 30.0, 1020.0, 0, False, "target/test-runs/x/sdk.log")]
    cli = JobRecord(
        jobs.by_name("cli"),
        lane="lane2",
        result=Result.FAILED,
        note="no test binary cli_node (the test build failed?)",
    )
    clippy = JobRecord(jobs.by_name("clippy"), note="the test build failed")
    return [sdk, snapshot, cli, clippy]


def test_summary_records_every_try_and_the_failures() -> None:
    data = summary(
        record(),
        started="2026-12-06T07:00:00Z",
        duration=2400.04,
        argv=["--lab-only"],
        run_dir="target/test-runs/x",
        interrupted=False,
    )
    # what it writes is JSON
    assert json.loads(json.dumps(data)) == data
    assert data["passed"] is False
    assert data["failed"] == ["snapshot", "cli"]
    assert data["retried"] == ["snapshot"]
    assert data["duration_s"] == 2400.0
    by_name = {j["name"]: j for j in data["jobs"]}
    snap = by_name["snapshot"]
    assert snap["start_s"] == 100.0
    assert snap["duration_s"] == 359.5
    assert snap["group"] == "lab" and snap["tier"] == "default" and snap["expected_min"] == 4
    assert [t["tests"] for t in snap["tries"]] == [None, ["restore"], ["restore"]]
    assert [t["lab_stood_still"] for t in snap["tries"]] == [False, True, False]
    assert snap["tries"][1]["log"] == "target/test-runs/x/snapshot.try2.log"
    assert by_name["clippy"]["result"] == "not run"
    assert by_name["clippy"]["start_s"] is None
    assert by_name["cli"]["note"].startswith("no test binary")


def test_an_interrupted_run_did_not_pass() -> None:
    sdk = record()[0]
    data = summary([sdk], started="", duration=1, argv=[], run_dir="", interrupted=True, error="")
    assert data["passed"] is False and data["failed"] == []
    assert summary([sdk], started="", duration=1, argv=[], run_dir="", interrupted=False)["passed"]


def test_the_failure_report_names_each_failed_job_its_logs_and_failed_tests(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "target/test-runs/x"
    logs.mkdir(parents=True)
    (logs / "snapshot.log").write_text(
        "test forks ... FAILED\n\nfailures:\n\n---- forks stdout ----\n"
        "thread 'forks' (576) panicked at crates/vmm/tests/snapshot.rs:319:29:\n"
        "dd ... && echo ok: no answer from the guest agent within 60s\n"
    )
    (logs / "snapshot.try2.log").write_text("test forks ... FAILED\n")
    assert failure_report(record(), tmp_path) == [
        "snapshot: failed (3 tries), logs:",
        "    target/test-runs/x/snapshot.log",
        "      forks: crates/vmm/tests/snapshot.rs:319:29: "
        "dd ... && echo ok: no answer from the guest agent within 60s",
        "    target/test-runs/x/snapshot.try2.log",
        "      forks: failed",
        "    target/test-runs/x/snapshot.try3.log",
        "      (its log cannot be read: [Errno 2] No such file or directory: "
        f"'{logs / 'snapshot.try3.log'}')",
        "cli: no test binary cli_node (the test build failed?)",
    ]


def test_clock() -> None:
    assert clock(0) == "0:00"
    assert clock(61.9) == "1:01"
    assert clock(3600) == "60:00"


def test_a_job_whose_last_try_exited_77_is_skipped_not_failed() -> None:
    skipped = Try(1, 0.0, 1.0, SKIP_STATUS, False, "target/test-runs/x/harbor.log")
    assert outcome(skipped) is Result.SKIPPED
    assert outcome(Try(1, 0.0, 1.0, 0, False, "x")) is Result.PASSED
    assert outcome(Try(1, 0.0, 1.0, 1, False, "x")) is Result.FAILED
    harbor = JobRecord(jobs.by_name("harbor"), result=Result.SKIPPED, tries=[skipped])
    data = summary(
        [harbor],
        started="2026-12-06T07:00:00Z",
        duration=1.0,
        argv=[],
        run_dir="target/test-runs/x",
        interrupted=False,
    )
    assert data["passed"] and data["skipped"] == ["harbor"] and data["failed"] == []
