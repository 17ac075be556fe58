import threading

from sandfork_runner import jobs
from sandfork_runner.jobs import Group, Job
from sandfork_runner.queue import JobQueue, longest_first


def job(name: str, minutes: float, binary: str | None = None, shared: bool = False) -> Job:
    return Job(name, Group.LAB, ("true",), "", minutes=minutes, binary=binary, shared_node=shared)


def test_longest_first_keeps_the_table_order_among_equals() -> None:
    order = longest_first([job("a", 1), job("b", 5), job("c", 1), job("d", 5), job("e", 2)])
    assert [j.name for j in order] == ["b", "d", "e", "a", "c"]


def test_the_table_s_lab_jobs_start_with_the_longest() -> None:
    default = [j for j in jobs.LAB if j.tier is jobs.Tier.DEFAULT]
    order = [j.name for j in longest_first(default)]
    assert order[:3] == ["cluster", "sdk", "lab_serve"]
    assert order[-1] == "network"


def test_a_ready_job_goes_before_a_longer_one_that_waits_for_the_tests() -> None:
    q = JobQueue([job("sdk", 17), job("lab_serve", 11.5, "lab_serve"), job("rl", 6.5)])

    def ready(j: Job) -> bool:
        return not j.needs_tests

    first, second = q.take(ready), q.take(ready)
    assert first is not None and second is not None
    assert [first.name, second.name] == ["sdk", "rl"]
    # none is ready: the longest, whose lane waits for its binary
    third = q.take(ready)
    assert third is not None and third.name == "lab_serve"
    assert q.take(ready) is None


def test_when_none_is_ready_the_longest_is_taken() -> None:
    q = JobQueue([job("small", 1, "x"), job("big", 3, "y")])
    taken = q.take(lambda j: False)
    assert taken is not None and taken.name == "big"


def test_once_the_tests_are_built_it_is_longest_first() -> None:
    q = JobQueue([job("a", 1), job("b", 4, "b"), job("c", 2, "c")])
    names = []
    while (j := q.take(lambda j: True)) is not None:
        names.append(j.name)
    assert names == ["b", "c", "a"]


def test_a_closed_queue_gives_no_more_and_returns_what_was_left() -> None:
    q = JobQueue([job("a", 1), job("b", 2)])
    assert q.take(lambda j: True) is not None
    left = q.close()
    assert [j.name for j in left] == ["a"]
    assert q.take(lambda j: True) is None
    assert len(q) == 0


def test_two_lanes_take_each_job_once() -> None:
    q = JobQueue([job(f"j{n}", n % 7) for n in range(200)])
    taken: list[list[str]] = [[], []]

    def lane(mine: list[str]) -> None:
        while (j := q.take(lambda j: True)) is not None:
            mine.append(j.name)

    threads = [threading.Thread(target=lane, args=(t,)) for t in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken[0] + taken[1]) == sorted(f"j{n}" for n in range(200))


def test_a_lane_with_a_node_takes_the_suites_that_share_it_first() -> None:
    shared = [job("sdk", 13, shared=True), job("harbor", 5, shared=True), job("rl", 4, shared=True)]
    q = JobQueue([job("cluster", 14), job("serve", 7, "serve"), *shared])

    def ready(j: Job) -> bool:
        return not j.needs_tests

    def shares(j: Job) -> bool:
        return j.shared_node

    # no node yet: longest first
    first, second = q.take(ready), q.take(ready)
    assert first is not None and second is not None
    assert [first.name, second.name] == ["cluster", "sdk"]
    # the lane whose node is up: the longest of those that share it, ready
    taken = q.take(lambda j: True, shares)
    assert taken is not None and taken.name == "harbor"
    # one without a node: longest first, a shared one too
    taken = q.take(lambda j: True)
    assert taken is not None and taken.name == "serve"
    # a preference never waits for the tests: the longest ready one instead
    q2 = JobQueue([job("a", 5), job("b", 3, "b", shared=True)])
    taken = q2.take(ready, shares)
    assert taken is not None and taken.name == "a"
