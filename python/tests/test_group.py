"""Fork per group on a real node: a task set up once (a repository checkout
and a setup callable), then rollout groups forked from it, running, paused,
reopened by its ref, as a snapshot, through the branching runner and
through SkyRL's environment."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from conftest import RUN_META, TEMPLATE
from e2b import SandboxState

from sandfork import (
    AsyncSandbox,
    BranchingRunner,
    FixedSchedule,
    Reward,
    SandboxEnv,
    Task,
    TaskState,
    group_seeds,
)

pytestmark = pytest.mark.node

# The task's setup: a repository made and checked out (a clone, as from a
# remote), counted, so that a child can tell whether it ran the setup again.
TASK = Task(
    "fix the repository",
    setup=(
        "mkdir -p /tmp/origin && cd /tmp/origin && git init -q"
        " && echo 'def f(): return 1' > m.py && git add m.py"
        " && git -c user.name=t -c user.email=t@t commit -qm init",
        "git clone -q /tmp/origin /home/user/repo && echo ran >> /home/user/setup-runs",
    ),
)
# What every child prints: the setup's marks, its seed file and variable.
PROBE = (
    "cat /home/user/setup-runs /home/user/answer; cat /run/sandfork/seed; echo $SANDFORK_SEED;"
    " git -C /home/user/repo log --oneline | wc -l"
)


async def answer(sbx: AsyncSandbox) -> None:
    """The setup callable: run once, after the commands."""
    await sbx.commands.run("echo 41 > /home/user/answer")


def expected(seed: int) -> str:
    return f"ran\n41\n{seed}\n{seed}\n1\n"


async def check_group(envs: list[SandboxEnv], seeds: list[int] | None = None) -> list[int]:
    """Every child at the set-up state (the setup ran once), with its seed
    in the episode, the guest's file and $SANDFORK_SEED; the seeds seen."""
    seen = []
    for i, env in enumerate(envs):
        r = await env.step(PROBE)
        seed = env.state.seed
        assert seed is not None and (seeds is None or seed == seeds[i])
        assert r.observation == expected(seed), r.observation
        assert env.state.task == TASK and env.state.steps == 1
        seen.append(seed)
    return seen


async def close_all(envs: list[SandboxEnv]) -> None:
    for env in envs:
        await env.close()


@asynccontextmanager
async def prepared(keep: str) -> AsyncIterator[tuple[TaskState, list[SandboxEnv]]]:
    """The task set up once and kept as `keep`, and a list for the groups'
    environments: every one in it closed at the end, then the state."""
    state = await TaskState.prepare(
        TASK, answer, keep=keep, template=TEMPLATE, metadata=RUN_META, setup_timeout=300, seed=7
    )
    envs: list[SandboxEnv] = []
    try:
        yield state, envs
    finally:
        await close_all(envs)
        await state.close()


@pytest.mark.anyio
async def test_group_from_a_running_state_and_the_runner(no_leaks):
    async with prepared("running") as (state, envs):
        assert state.keep == "running" and state.episode.seed == 7
        envs += await state.group(2, seed=11)
        await check_group(envs, group_seeds(11, 2))
        await close_all(envs)
        envs.clear()

        # the runner: the group is the tree's first branch, from the state
        async def policy(inp):
            return "echo $SANDFORK_SEED; cat /home/user/answer"

        def reward(ctx):
            return Reward(1.0, terminated=True)

        runner = BranchingRunner(
            policy,
            lambda: SandboxEnv(template=TEMPLATE, metadata=RUN_META, reward_fn=reward),
            FixedSchedule(at=[0], width=2),
            max_live=2,
        )
        tree = await runner.run(state=state, seed=3)
        assert (runner.stats.forks, runner.stats.children) == (1, 2)
        assert tree.root.observation == TASK.prompt and tree.task == TASK
        leaves = tree.trajectories()
        assert [t.leaf_id for t in leaves] == ["r/0", "r/1"]
        for i, leaf in enumerate(tree.root.children):
            assert leaf.observation == f"{group_seeds(3, 2)[i]}\n41\n"
        # the state is the caller's: still there, and forks again
        assert state.sandbox_id is not None and state.keep == "running"


@pytest.mark.anyio
async def test_group_from_a_paused_state_and_its_ref(no_leaks):
    async with prepared("paused") as (state, envs):
        assert state.sandbox_id is not None
        envs += await state.group(2, seeds=[1, 2])
        await check_group(envs, [1, 2])
        # forks of the paused sandbox leave it paused
        assert (await AsyncSandbox.get_info(state.sandbox_id)).state == SandboxState.PAUSED
        # what a trainer hands a rollout worker: the ref, as JSON
        ref = json.loads(json.dumps(state.ref()))
        other = TaskState.from_ref(ref, template=TEMPLATE, metadata=RUN_META)
        envs += await other.group(1, seeds=[3])
        await check_group(envs[2:], [3])
        # two groups at once from one state take turns (the node forks a
        # sandbox once at a time: a second fork meanwhile would be a 409)
        pair = await asyncio.gather(state.group(1, seeds=[4]), state.group(1, seeds=[5]))
        envs += [env for group in pair for env in group]
        await check_group(envs[3:], [4, 5])


@pytest.mark.anyio
async def test_group_from_a_snapshot_and_skyrl(no_leaks):
    import skyrl_gym

    from sandfork.integrations.skyrl import register

    async with prepared("snapshot") as (state, envs):
        assert state.sandbox_id is None and state.checkpoint is not None
        envs += await state.group(2)
        seen = await check_group(envs)
        assert len(set(seen)) == 2  # fresh seeds, one per child

        # SkyRL's environment forks its sandbox from the state's ref
        register()
        sky = skyrl_gym.make(
            "sandfork",
            env_config={"template": TEMPLATE, "max_turns": 2, "metadata": RUN_META},
            extras={
                "task_state": state.ref(),
                "reward_spec": {"command": "test $(cat /home/user/answer) = 42"},
            },
        )
        try:
            prompt = [{"role": "user", "content": "make the answer 42"}]
            obs, info = sky.init(prompt)
            assert obs == prompt and info["sandbox_id"] == sky.sandbox_id
            out = sky.step("```bash\n" + PROBE + "\n```")
            assert out["observations"][0]["content"] == expected(info["seed"])
            out = sky.step("```bash\necho 42 > /home/user/answer\n```")
            assert (out["done"], out["reward"]) == (True, 1.0)
        finally:
            sky.close()
