from pathlib import Path

import pytest
from sandfork_runner import jobs
from sandfork_runner.jobs import Group, Tier
from sandfork_runner.run import UnknownJob, expand, next_host_job, plan


def names(js: tuple[jobs.Job, ...]) -> list[str]:
    return [j.name for j in js]


def test_the_default_run() -> None:
    p = plan(lab_only=False, only=None, long=False, lanes=2)
    assert names(p.quick) == ["fmt", "fmt_fuzz", "shellcheck", "deny", "runner"]
    assert names(p.host) == ["docs", "clippy", "fuzz", "fast_tests"]
    # only the fast tests wait for the test build; the rest run beside it
    assert [j.name for j in p.host if j.after_tests] == ["fast_tests"]
    assert "sdk" in names(p.lab) and "cluster" in names(p.lab)
    assert all(j.tier is Tier.DEFAULT for j in p.lab)
    assert p.lanes == 2 and p.test_build
    assert names(tuple(p.jobs()))[:3] == ["deps", "build", "fmt"]
    # the lab jobs' integration tests are built first, by name, then the rest
    assert "lab_serve" in p.lab_binaries and "cli_node" in p.lab_binaries
    assert p.lab_binaries == sorted({j.binary for j in p.lab if j.binary})
    order = names(tuple(p.jobs()))
    assert order.index("lab_bins") + 1 == order.index("tests")


def test_long_adds_the_long_tier() -> None:
    p = plan(lab_only=False, only=None, long=True, lanes=2)
    assert {"soak_long", "stress_long"} <= set(names(p.lab))
    assert {"soak", "sdk"} <= set(names(p.lab))
    assert {"images_bench", "cluster_scale_bench"} <= set(names(p.host))
    default = plan(lab_only=False, only=None, long=False, lanes=2)
    assert not {"images_bench", "cluster_scale_bench"} & set(names(default.host))


def test_lab_only_leaves_out_the_quick_and_host_jobs() -> None:
    p = plan(lab_only=True, only=None, long=False, lanes=2)
    assert p.quick == () and p.host == ()
    assert len(p.lab) == len([j for j in jobs.LAB if j.tier is Tier.DEFAULT])


def test_only_runs_the_named_jobs_of_any_tier_with_no_more_lanes_than_jobs() -> None:
    p = plan(lab_only=False, only=["microvm"], long=False, lanes=2)
    assert names(p.lab) == ["microvm"] and p.quick == () and p.host == ()
    assert p.lanes == 1 and p.test_build and p.lab_binaries == ["microvm"]
    p = plan(lab_only=False, only=["soak_long", "fmt", "clippy"], long=False, lanes=2)
    assert names(p.lab) == ["soak_long"] and names(p.quick) == ["fmt"]
    assert names(p.host) == ["clippy"]
    assert not p.test_build


def test_host_jobs_alone_take_no_lab_lane() -> None:
    p = plan(lab_only=False, only=["fast_tests"], long=False, lanes=2)
    assert p.lanes == 0 and not p.test_build


def test_host_jobs_one_at_a_time_beside_the_lanes_then_two() -> None:
    host = list(plan(lab_only=False, only=None, long=False, lanes=2).host)
    docs, clippy, fuzz, fast = host
    # beside the lanes: one, and the fast tests only once the tests are built
    assert next_host_job(host, 0, lanes_over=False, tests_built=False) is docs
    assert next_host_job(host, 1, lanes_over=False, tests_built=True) is None
    assert next_host_job([fast], 0, lanes_over=False, tests_built=False) is None
    assert next_host_job([fast], 0, lanes_over=False, tests_built=True) is fast
    # the lanes done: a second beside the first, never a third
    assert next_host_job([fuzz, fast], 1, lanes_over=True, tests_built=True) is fuzz
    assert next_host_job([fast, fuzz], 1, lanes_over=True, tests_built=False) is fuzz
    assert next_host_job([fuzz, fast], 2, lanes_over=True, tests_built=True) is None
    assert next_host_job([], 0, lanes_over=True, tests_built=True) is None
    assert clippy.after_tests is False


def test_one_lane_when_asked_and_never_none_for_lab_jobs() -> None:
    assert plan(lab_only=True, only=None, long=False, lanes=1).lanes == 1
    assert plan(lab_only=True, only=None, long=False, lanes=0).lanes == 1
    assert plan(lab_only=True, only=None, long=False, lanes=5).lanes == 2


def test_an_unknown_job_is_an_error_naming_it() -> None:
    with pytest.raises(UnknownJob, match="no job nope"):
        plan(lab_only=False, only=["nope", "sdk"], long=False, lanes=2)
    # the build steps are not jobs one can pick: every run has them
    with pytest.raises(UnknownJob):
        plan(lab_only=False, only=["build"], long=False, lanes=2)


def test_the_table() -> None:
    every = [j.name for j in jobs.ALL]
    assert len(every) == len(set(every))
    for j in jobs.LAB:
        assert j.minutes > 0, j.name
        # a job that runs a test binary names it, and only such a job
        assert ("{bin}" in " ".join(j.command) + " ".join(v for _, v in j.env)) == (
            j.binary is not None
        ), j.name
        assert j.retried
    assert all(j.lab_tests == (j.binary == j.name and j.by_test_name) for j in jobs.LAB)
    assert not any(j.retried for j in jobs.QUICK) and not jobs.BUILD.retried
    assert all(j.group is Group.HOST for j in jobs.HOST)


def test_globs_expand_sorted_and_must_match(tmp_path: Path) -> None:
    for name in ("b.sh", "a.sh", "c.txt"):
        (tmp_path / name).write_text("")
    assert expand(["shellcheck", "*.sh", "x/init.sh"], tmp_path) == [
        "shellcheck",
        "a.sh",
        "b.sh",
        "x/init.sh",
    ]
    with pytest.raises(FileNotFoundError, match=r"\*\.py matches no file"):
        expand(["*.py"], tmp_path)
