"""SandboxEnv, SyncSandboxEnv and the Gymnasium wrapper on a real node."""

import gymnasium
import pytest
from conftest import RUN_META, TEMPLATE
from gymnasium.utils.env_checker import check_env

import sandfork.gym
from sandfork import EnvConfig, Reward, SandboxEnv, StepContext, Task

pytestmark = pytest.mark.node


def count_lines(ctx: StepContext) -> Reward:
    """1 per line printed; done when the action says so."""
    lines = len(ctx.stdout.splitlines())
    return Reward(float(lines), terminated=ctx.action.strip() == "echo done")


@pytest.mark.anyio
async def test_async_env_episode_fork_and_restore(no_leaks):
    env = SandboxEnv(template=TEMPLATE, metadata=RUN_META, reward_fn=count_lines, max_steps=5)
    kids: list[SandboxEnv] = []
    try:
        task = Task("count the files", setup=["mkdir -p /tmp/w && touch /tmp/w/a"])
        obs, info = await env.reset(task, seed=5)
        assert obs == "count the files" and info["seed"] == 5
        r = await env.step("ls /tmp/w")
        assert (r.observation, r.reward, r.terminated, r.truncated) == ("a\n", 1.0, False, False)
        r = await env.step("ls /nonexistent")
        assert r.info["exit_code"] == 2 and "[exit code 2]" in r.observation
        env.state.data["notes"] = ["kept"]

        ckpt = await env.checkpoint()
        kids = await env.fork(2)
        assert len(kids) == 2
        for i, k in enumerate(kids):
            assert k.state.steps == 2 and k.state.task == task
            assert k.state.data == {"notes": ["kept"]}
            assert k.state.data is not env.state.data
            assert k.state.seed != 5 and k.sandbox.lineage.branch_index == i
            await k.step(f"touch /tmp/w/child{i}")
        # each child went its own way; the parent did not move
        assert (await kids[0].step("ls /tmp/w")).observation == "a\nchild0\n"
        assert (await kids[1].step("ls /tmp/w")).observation == "a\nchild1\n"
        assert (await env.step("ls /tmp/w")).observation == "a\n"
        fin = await kids[0].step("echo done")
        assert fin.terminated and kids[0].state.done
        with pytest.raises(RuntimeError):
            await kids[0].step("true")

        # back to the checkpoint: two steps, the note, the same seed, and
        # the same sandbox (rolled back in place: the node can)
        await env.step("touch /tmp/w/late")
        before = env.sandbox.sandbox_id
        await env.restore(ckpt)
        assert env.sandbox.sandbox_id == before
        assert env.state.steps == 2 and env.state.seed == 5
        assert (await env.step("ls /tmp/w")).observation == "a\n"
        assert not (await env.step("true")).truncated
        last = await env.step("true")
        assert last.truncated and not last.terminated and last.info["step"] == 5
        await env.sandbox.delete_checkpoint(ckpt)
    finally:
        for k in kids:
            await k.close()
        await env.close()


def test_gymnasium_checker_and_fork(no_leaks):
    env = gymnasium.make(
        sandfork.gym.ENV_ID,
        task="run a command",
        max_action_chars=32,
        config=EnvConfig(template=TEMPLATE, metadata=RUN_META, max_steps=4),
    )
    try:
        # Gymnasium's own checker on the unwrapped env (make adds its own
        # checker wrappers), with real commands from the action space
        check_env(env.unwrapped, skip_render_check=True)
        obs, _ = env.reset(seed=1)
        assert obs == "run a command" and env.observation_space.contains(obs)
        obs, *_ = env.step("printf 'x\\ty\\n'; printf '\\xff'")
        assert obs == "x\ty\n?" and env.observation_space.contains(obs)
        (child,) = env.unwrapped.fork(1)
        try:
            assert child.step("echo child")[0] == "child\n"
            assert child.env.state.steps == 2
        finally:
            child.close()
    finally:
        env.close()
