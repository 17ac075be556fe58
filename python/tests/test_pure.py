"""What needs no node: lineage, observations, trees, schedules, exports."""

import io
import json
import os

import pytest

import sandfork
from sandfork import FixedSchedule, Lineage, Node, Task, TrajectoryTree
from sandfork._common import chunks, fork_results, snapshot_fork_request
from sandfork.env import format_observation
from sandfork.rollout import normalized_advantages, write_groups_jsonl


def test_lineage_child_and_json_round_trip():
    root = Lineage.root("a", seed=7)
    assert (root.parent_id, root.root_id, root.depth, root.branch_index) == (None, "a", 0, None)
    c = root.child("b", 3).child("c", 1)
    assert (c.sandbox_id, c.parent_id, c.root_id, c.depth, c.branch_index) == ("c", "b", "a", 2, 1)
    assert c.seed == 7  # a child keeps the seed until a hook replaces it
    assert Lineage.from_json(c.to_json()) == c
    assert c.with_seed(9).seed == 9
    with pytest.raises(ValueError):
        Lineage.from_json('{"sandbox_id": "x"}')
    with pytest.raises(ValueError):
        Lineage.from_json("[1]")


def test_lineage_guest_script_quotes_the_json():
    script = Lineage.root("it's", seed=1).guest_script()
    assert "'\"'\"'" in script  # the quote inside the id is escaped for sh
    assert script.count("mv -f") == 2


def test_observation_format_and_cut():
    assert format_observation("out\n", "", 0, 100) == "out\n"
    assert format_observation("", "err\n", 2, 100) == "err\n[exit code 2]\n"
    assert format_observation("", "", None, 100, timed_out=True) == "[command timed out]\n"
    long = "a" * 500 + "b" * 500
    cut = format_observation(long, "", 0, 200)
    assert len(cut) <= 200
    assert cut.startswith("a") and cut.endswith("b") and "characters cut" in cut


def test_chunks():
    assert chunks(45, 20) == [20, 20, 5]
    assert chunks(4, 20) == [4]
    with pytest.raises(ValueError):
        chunks(0, 20)


def _tree() -> TrajectoryTree:
    """Branch 2 ways at the root, then 2 ways again below child 0:
    three leaves with rewards 1, 0 and 3, plus one failed fork."""
    root = Node(path=(), step=0, observation="task")
    a = Node(path=(0,), step=1, observation="oa", action="A", reward=1.0)
    b = Node(path=(1,), step=1, observation="ob", action="B", reward=3.0, terminated=True)
    a0 = Node(path=(0, 0), step=2, observation="oa0", action="A0", reward=0.0, terminated=True)
    a1 = Node(path=(0, 1), step=2, observation="oa1", action="A1", reward=-1.0, truncated=True)
    a2 = Node(path=(0, 2), step=2, observation="", error="fork failed")
    a.children = [a0, a1, a2]
    root.children = [a, b]
    return TrajectoryTree(root, Task("task", ("echo setup",), {"answer": 3}))


def test_tree_trajectories():
    tree = _tree()
    trajs = tree.trajectories()
    assert [t.leaf_id for t in trajs] == ["r/0/0", "r/0/1", "r/1"]
    assert [t.total_reward for t in trajs] == [1.0, 0.0, 3.0]
    assert trajs[0].messages == [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "oa"},
        {"role": "assistant", "content": "A0"},
        {"role": "user", "content": "oa0"},
    ]
    assert len(tree.trajectories(include_failed=True)) == 4
    assert [n.id for n in tree.branch_points()] == ["r", "r/0"]
    assert tree.get("r/0/1").parent_id == "r/0"


def test_grpo_groups_by_tree_and_branch():
    tree = _tree()
    (group,) = tree.grpo_groups("tree")
    assert {s.uid for s in group} == {"r"}
    assert [s.trajectory.leaf_id for s in group] == ["r/0/0", "r/0/1", "r/1"]
    adv = [s.advantage for s in group]
    assert abs(sum(adv)) < 1e-9 and adv[2] > adv[0] > adv[1]
    by_branch = tree.grpo_groups("branch")
    assert [g[0].uid for g in by_branch] == ["r", "r/0"]
    inner = by_branch[1]
    assert [s.trajectory.leaf_id for s in inner] == ["r/0/0", "r/0/1"]
    assert inner[0].advantage > 0 > inner[1].advantage
    with pytest.raises(ValueError):
        tree.grpo_groups("nope")  # type: ignore[arg-type]


def test_advantages_of_equal_rewards_are_zero():
    assert normalized_advantages([2.0, 2.0, 2.0]) == [0.0, 0.0, 0.0]


def test_tree_jsonl_round_trip():
    tree = _tree()
    buf = io.StringIO()
    tree.to_jsonl(buf)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 + 6
    back = TrajectoryTree.from_jsonl(lines)
    assert back.task == tree.task
    assert [n.to_record() for n in back.nodes()] == [n.to_record() for n in tree.nodes()]
    assert back.get("r/0/2").error == "fork failed"


def test_groups_jsonl():
    buf = io.StringIO()
    write_groups_jsonl(_tree().grpo_groups("branch"), buf)
    recs = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(r["uid"], r["leaf_id"]) for r in recs] == [
        ("r", "r/0/0"),
        ("r", "r/0/1"),
        ("r", "r/1"),
        ("r/0", "r/0/0"),
        ("r/0", "r/0/1"),
    ]
    assert all({"messages", "advantage", "total_reward"} <= r.keys() for r in recs)


def test_fixed_schedule():
    s = FixedSchedule(at=[0, 2], width=4)
    assert [s(Node(path=(), step=k, observation="")) for k in range(4)] == [4, 1, 4, 1]
    assert s.levels() == 2
    m = FixedSchedule(at={1: 3, 2: 1})
    assert [m.width_at(k) for k in range(3)] == [1, 3, 1]
    assert m.levels() == 1


def test_runner_refuses_a_bound_that_would_deadlock():
    from sandfork import BranchingRunner

    async def policy(_):
        return "true"

    with pytest.raises(ValueError, match="wait forever"):
        BranchingRunner(policy, lambda: None, FixedSchedule(at=[0, 1], width=2), max_live=2)  # type: ignore[arg-type,return-value]


def test_configure_sets_the_sdk_variables(monkeypatch):
    for v in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_VALIDATE_API_KEY"):
        monkeypatch.delenv(v, raising=False)
    sandfork.configure("http://127.0.0.1:9", "k")
    assert os.environ["E2B_API_URL"] == os.environ["E2B_SANDBOX_URL"] == "http://127.0.0.1:9"
    assert (os.environ["E2B_API_KEY"], os.environ["E2B_VALIDATE_API_KEY"]) == ("k", "false")


def test_snapshot_fork_request_quotes_the_name():
    path, body = snapshot_fork_request("team/rl-ckpt:default", 3, 60, {"k": "v"})
    assert path == "/snapshots/team%2Frl-ckpt%3Adefault/fork"
    assert body == {"count": 3, "timeout": 60, "metadata": {"k": "v"}}
    assert snapshot_fork_request("s", 1, None, None)[1] == {"count": 1}


def test_fork_results_as_the_sdk_reads_its_own():
    import httpx
    from e2b import NotFoundException, RateLimitException, SandboxException

    started = {
        "sandboxID": "abc",
        "envdVersion": "0.5.0",
        "envdAccessToken": "tok",
        "domain": None,
        "trafficAccessToken": None,
    }
    resp = httpx.Response(
        201,
        json=[
            {"sandbox": started},
            {"error": {"code": 429, "message": "full"}},
            {"error": {"code": 404, "message": "gone"}},
            {},
        ],
    )
    ok, limited, gone, empty = fork_results(resp, "snapshot s")
    assert not isinstance(ok, Exception)
    assert (ok.sandbox_id, ok.envd_access_token, ok.envd_version) == ("abc", "tok", "0.5.0")
    assert isinstance(limited, RateLimitException)
    assert isinstance(gone, NotFoundException)
    assert isinstance(empty, SandboxException)
    with pytest.raises(NotFoundException, match="no such snapshot"):
        fork_results(httpx.Response(404, json={"code": 404, "message": "no such snapshot"}), "s")
    with pytest.raises(SandboxException, match="Count must be at least 1"):
        fork_results(
            httpx.Response(400, json={"code": 400, "message": "Count must be at least 1"}), "s"
        )


def test_group_seeds_are_fixed_per_index_and_distinct():
    from sandfork import group_seeds

    a = group_seeds(11, 4)
    assert a == group_seeds(11, 4) and len(set(a)) == 4
    # chunked groups (the runner forks as slots free up) get the same seeds
    assert group_seeds(11, 2) + group_seeds(11, 2, start=2) == a
    assert set(a).isdisjoint(group_seeds(12, 4))
    assert all(0 <= s < 2**63 for s in a)


def test_task_state_ref_round_trips_as_json():
    from sandfork import Checkpoint, EnvConfig, TaskState
    from sandfork.env import EpisodeState

    task = Task("fix it", setup=("git clone /srv/r /w", "pip install six"), data={"k": 1})
    episode = EpisodeState(task=task, seed=5)
    paused = TaskState(EnvConfig(), episode, "paused", sandbox_id="sbx1")
    ref = json.loads(json.dumps(paused.ref()))
    back = TaskState.from_ref(ref, template="custom")
    assert (back.keep, back.sandbox_id, back.checkpoint) == ("paused", "sbx1", None)
    assert back.episode.task == task and back.episode.seed == 5
    assert back.config.template == "custom"

    ckpt = Checkpoint("snap1", "sbx1", Lineage.root("sbx1", seed=5))
    snap = TaskState(EnvConfig(), episode, "snapshot", checkpoint=ckpt)
    back = TaskState.from_ref(json.loads(json.dumps(snap.ref())))
    assert back.keep == "snapshot" and back.sandbox_id is None
    assert back.checkpoint is not None
    assert (back.checkpoint.snapshot_id, back.checkpoint.source_id) == ("snap1", "sbx1")
    assert back.checkpoint.lineage == ckpt.lineage
    assert back.checkpoint.data["episode"].task == task
    with pytest.raises(ValueError):
        TaskState.from_ref({**ref, "keep": "frozen"})
