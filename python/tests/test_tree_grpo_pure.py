"""Tree-GRPO's schedule and advantages, and the node's capability list:
what needs no node."""

import itertools
import random

import pytest

from sandfork import Capabilities, Node, TrajectoryTree, TreeGRPOSchedule
from sandfork.rollout import normalized_advantages


def _chain(tree: int, rewards: list[float]) -> Node:
    """Tree ``tree`` under the root: one chain, a reward per step."""
    nodes = [
        Node(path=(tree,) + (0,) * i, step=i + 1, observation=f"o{i}", action=f"a{i}", reward=r)
        for i, r in enumerate(rewards)
    ]
    for parent, child in itertools.pairwise(nodes):
        parent.children.append(child)
    return nodes[0]


def test_the_initial_branching_is_m_ways_at_the_reset():
    s = TreeGRPOSchedule(trees=3, rounds=2, nodes=2)
    assert [s(Node(path=(), step=k, observation="")) for k in range(3)] == [3, 1, 1]
    with pytest.raises(ValueError):
        TreeGRPOSchedule(trees=0)
    with pytest.raises(ValueError):
        TreeGRPOSchedule(rounds=-1)


def test_candidates_are_the_non_leaf_steps_of_one_tree():
    tree = _chain(0, [0.0, 0.0, 0.0, 1.0])  # r/0 - r/0/0 - r/0/0/0 - r/0/0/0/0
    tree.children.append(Node(path=(0, 1), step=2, observation="", error="fork failed"))
    s = TreeGRPOSchedule(nodes=2)
    assert [n.id for n in s.candidates(tree)] == ["r/0", "r/0/0", "r/0/0/0"]
    picked = s.pick(tree, random.Random(1))
    assert len(picked) == 2 and len({n.id for n in picked}) == 2
    assert {n.id for n in picked} <= {"r/0", "r/0/0", "r/0/0/0"}
    # the same seed, the same picks: a run is reproducible
    assert [n.id for n in s.pick(tree, random.Random(1))] == [n.id for n in picked]
    # only nodes whose state was kept
    assert [n.id for n in s.pick(tree, random.Random(0), {"r/0/0", "r/9"})] == ["r/0/0"]
    # fewer candidates than asked: all of them
    assert len(TreeGRPOSchedule(nodes=9).pick(tree, random.Random(0))) == 3
    assert TreeGRPOSchedule().pick(_chain(1, [1.0]), random.Random(0)) == []


def test_keep_mode_follows_what_the_node_offers():
    def caps(**kw: bool) -> Capabilities:
        base = {"fork": True, "snapshot": True, "fork_from_snapshot": False, "fork_paused": False}
        return Capabilities(max_fork_count=20, **{**base, **kw})

    auto = TreeGRPOSchedule()
    assert auto.keep_mode(caps(fork_from_snapshot=True, fork_paused=True)) == "snapshot"
    assert auto.keep_mode(caps(fork_paused=True)) == "suspend"
    assert auto.keep_mode(caps()) == "snapshot"
    assert auto.keep_mode(caps(fork=False, snapshot=False)) == "replay"
    assert TreeGRPOSchedule(keep="suspend").keep_mode(caps()) == "suspend"


def test_tree_grpo_advantages_are_intra_plus_inter_tree():
    root = Node(path=(), step=0, observation="task")
    t0 = _chain(0, [0.0, 1.0])  # leaf r/0/0: 1
    t0.children.append(Node(path=(0, 1), step=2, observation="", action="b", reward=0.0))
    t1 = _chain(1, [0.0, 3.0])  # leaf r/1/0: 3
    root.children = [t0, t1]
    group = TrajectoryTree(root).tree_grpo_group()
    assert [(s.uid, s.trajectory.leaf_id) for s in group] == [
        ("r", "r/0/0"),
        ("r", "r/0/1"),
        ("r", "r/1/0"),
    ]
    intra = [*normalized_advantages([1.0, 0.0]), 0.0]  # a one-leaf tree: none
    inter = normalized_advantages([1.0, 0.0, 3.0])
    for s, a, b in zip(group, intra, inter, strict=True):
        assert s.advantage == pytest.approx(a + b)
    assert TrajectoryTree(Node(path=(), step=0, observation="")).tree_grpo_group() == []


def test_capabilities_from_the_node_list_and_without_it():
    info = {
        "features": {
            "fork": True,
            "forkPaused": True,
            "forkSnapshot": True,
            "snapshots": True,
            "rollback": True,
            "maxForkCount": 100,
        }
    }
    caps = Capabilities.from_node_info(info)
    assert caps == Capabilities(
        fork=True,
        snapshot=True,
        fork_from_snapshot=True,
        max_fork_count=20,  # the e2b SDK's own limit per call
        fork_paused=True,
        rollback=True,
        source="node",
    )
    small = Capabilities.from_node_info({"features": {"fork": True, "maxForkCount": 3}})
    assert small is not None
    assert (small.max_fork_count, small.fork_paused, small.strategy) == (3, False, "fork")
    assert not small.rollback
    none = Capabilities.from_node_info({"features": {}})
    assert none is not None and none.strategy == "replay" and none.max_fork_count == 0
    # an older node, or E2B's API: no list, so the routes are probed
    assert Capabilities.from_node_info({"vcpus": {}}) is None
    assert Capabilities.from_node_info([1]) is None


def test_probes_of_a_server_without_a_node_list(monkeypatch):
    """Against an in-process server (httpx's mock transport): no
    ``/v1/node``, fork answers 400 for a bad count, no snapshots."""
    import httpx
    from e2b.connection_config import ConnectionConfig

    from sandfork import _common

    seen = []

    def answer(req: httpx.Request) -> httpx.Response:
        seen.append((req.method, req.url.path))
        if req.url.path.endswith("/fork") and req.url.path.startswith("/sandboxes/"):
            body = req.read()
            msg = "Count cannot be greater than 16" if b"1000000" in body else "bad count"
            return httpx.Response(400, json={"message": msg})
        return httpx.Response(404, json={"message": "no such route"})

    real = httpx.Client

    def client(**kw):  # the probe's client, on the mock transport
        return real(transport=httpx.MockTransport(answer), **kw)

    monkeypatch.setattr(_common.httpx, "Client", client)
    caps = _common.probe_capabilities(ConnectionConfig(api_url="http://node", api_key="k"))
    assert seen[0] == ("GET", "/v1/node")
    assert caps == Capabilities(
        fork=True, snapshot=False, fork_from_snapshot=False, max_fork_count=16
    )
    assert caps.source == "probe" and not caps.fork_paused
