"""The branching runner on a real tree: one fork of 4."""

import io

import pytest
from conftest import RUN_META, TEMPLATE, live_ids

from sandfork import (
    Action,
    BranchingRunner,
    FixedSchedule,
    Node,
    Reward,
    SandboxEnv,
    TrajectoryTree,
    TreeGRPOSchedule,
)

pytestmark = pytest.mark.node


@pytest.mark.anyio
async def test_runner_tree_groups_and_jsonl(no_leaks):
    seen_live: list[int] = []

    async def policy(inp):
        n = inp.node
        if n.step == 0:
            return "echo base > /tmp/s; echo started"
        if n.step == 1:
            # every child's rng has its own seed: the choices differ
            k = inp.rng.randrange(1000)
            return Action(f"echo {k} >> /tmp/s; cat /tmp/s", tokens=[k], logprobs=[-0.5])
        seen_live.append(len(live_ids()))
        return "echo done"

    def reward(ctx):
        return Reward(float(len(ctx.stdout.splitlines())), terminated=ctx.action == "echo done")

    def prune(node: Node) -> bool:
        return node.step == 2 and node.path[1] == 3  # the fourth branch stops early

    runner = BranchingRunner(
        policy,
        lambda: SandboxEnv(template=TEMPLATE, metadata=RUN_META, reward_fn=reward),
        FixedSchedule(at=[1], width=4),
        max_live=5,
        max_steps=5,
        prune=prune,
    )
    tree = await runner.run("branch me", seed=3)
    assert runner.stats.forks == 1 and runner.stats.children == 4
    assert runner.stats.pruned == 1 and runner.stats.peak_live <= 5
    assert max(seen_live) <= 5
    assert [n.id for n in tree.branch_points()] == ["r/0"]
    first = tree.get("r/0")
    assert first.action.startswith("echo base") and first.observation == "started\n"
    kids = first.children
    assert [k.path for k in kids] == [(0, i) for i in range(4)]
    # every child saw the parent's file plus its own line
    for k in kids:
        lines = k.observation.splitlines()
        assert lines[0] == "base" and lines[1] == str(k.tokens[0])
    # fresh seeds per child: (almost surely) not all the same choice
    assert len({k.tokens[0] for k in kids}) > 1
    trajs = tree.trajectories()
    assert [t.leaf_id for t in trajs] == ["r/0/0/0", "r/0/1/0", "r/0/2/0", "r/0/3"]
    assert tree.get("r/0/3").pruned
    assert all(t.terminated for t in trajs[:3])
    (group,) = tree.grpo_groups("branch")
    assert group[0].uid == "r/0" and len(group) == 4
    assert group[3].advantage < 0 < group[0].advantage  # the pruned one earned less
    buf = io.StringIO()
    tree.to_jsonl(buf)
    back = TrajectoryTree.from_jsonl(buf.getvalue().splitlines())
    assert [n.id for n in back.nodes()] == [n.id for n in tree.nodes()]
    assert live_ids() == []  # every sandbox killed at once


@pytest.mark.anyio
@pytest.mark.parametrize("keep", ["auto", "suspend"])
async def test_tree_grpo_returns_to_kept_nodes(no_leaks, keep):
    """Two trees of a two-step chain; one round expands one node of each
    into two new branches, from the node's kept state: a checkpoint
    (``auto`` on a sandfork node) or a suspended fork child."""

    async def policy(inp):
        if inp.node.step == 0:
            return "echo base > /tmp/s; wc -l < /tmp/s"
        return Action(f"echo {inp.rng.randrange(1000)} >> /tmp/s; wc -l < /tmp/s")

    def reward(ctx):
        # ctx.state.steps counts the steps before this one: the second ends it
        return Reward(float(ctx.stdout.strip() or 0), terminated=ctx.state.steps >= 1)

    schedule = TreeGRPOSchedule(trees=2, rounds=1, nodes=1, width=2, keep=keep)
    runner = BranchingRunner(
        policy,
        lambda: SandboxEnv(template=TEMPLATE, metadata=RUN_META, reward_fn=reward),
        schedule,
        max_live=4,
        max_steps=4,
    )
    tree = await runner.run("tree search", seed=5)
    s = runner.stats
    assert (s.kept, s.expanded, s.fork_failures) == (2, 2, 0), s
    trees = tree.root.children
    assert [t.id for t in trees] == ["r/0", "r/1"]
    for t in trees:
        # the chain's first step, then its own second step and two new ones
        assert t.observation == "1\n"
        assert [c.path[-1] for c in t.children] == [0, 1, 2]
        # every branch continued from the kept state: one line more
        assert all(c.observation == "2\n" and c.error is None for c in t.children)
    group = tree.tree_grpo_group()
    assert len(group) == 6 and {x.uid for x in group} == {"r"}
    assert live_ids() == []  # kept states and branches all gone
