"""The framework adapters with the frameworks' real packages: mini-swe-agent's
own agent loop on ``SandforkEnvironment``, skyrl-gym's registry and
``BaseTextEnv`` contract on ``SandforkTextEnv``."""

import pytest
from conftest import RUN_META, TEMPLATE

MINI_ENV = "sandfork.integrations.mini_swe_agent.SandforkEnvironment"
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def test_skyrl_parse_and_make_without_a_node():
    import skyrl_gym

    from sandfork.integrations.skyrl import SandforkTextEnv, parse_command, register

    assert parse_command("x\n```bash\nls\n```\nthen\n```sh\necho hi\n```") == "echo hi"
    assert parse_command("<bash> pwd </bash>") == "pwd"
    assert parse_command("no command here") is None
    assert parse_command("```bash\n\n```") is None
    register()
    register()  # twice is fine
    env = skyrl_gym.make("sandfork", env_config={"max_turns": 2}, extras={"setup": ["true"]})
    assert isinstance(env, SandforkTextEnv) and isinstance(env, skyrl_gym.Env)
    assert (env.max_turns, env.setup, env.sandbox_id) == (2, ["true"], None)


def test_mini_swe_agent_finds_the_class_and_the_submit_marker():
    from minisweagent.environments import get_environment_class
    from minisweagent.exceptions import Submitted

    from sandfork.integrations.mini_swe_agent import SandforkEnvironment, _check_finished

    assert get_environment_class(MINI_ENV) is SandforkEnvironment
    with pytest.raises(Submitted) as done:
        _check_finished({"output": f"\n{SUBMIT}\nthe answer\n", "returncode": 0})
    assert done.value.messages[0]["extra"]["submission"] == "the answer\n"
    # not on failure, nor unless it is the first line
    _check_finished({"output": f"{SUBMIT}\n", "returncode": 1})
    _check_finished({"output": f"x\n{SUBMIT}\n", "returncode": 0})


@pytest.mark.node
def test_mini_swe_agent_episode_and_fork(no_leaks):
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output

    env = get_environment(
        {"environment_class": MINI_ENV, "template": TEMPLATE, "metadata": RUN_META, "timeout": 120}
    )
    kids = []
    try:
        model = DeterministicModel(
            outputs=[
                make_output("write", [{"command": "echo 41 > state && cat state"}]),
                make_output("submit", [{"command": f"echo {SUBMIT}; expr $(cat state) + 1"}]),
            ]
        )
        agent = DefaultAgent(
            model,
            env,
            system_template="You run shell commands.",
            instance_template="{{task}} on {{system}} {{machine}} in {{cwd}}",
            step_limit=5,
        )
        result = agent.run("add one")
        assert (result["exit_status"], result["submission"]) == ("Submitted", "42\n")
        assert "Linux" in agent.messages[1]["content"], agent.messages[1]
        assert "<returncode>0</returncode>" in agent.messages[3]["content"]
        assert "41" in agent.messages[3]["content"]

        # branch the episode: each child has the parent's files, then its own
        kids = env.fork(2)
        for i, k in enumerate(kids):
            assert k.execute({"command": f"echo {i} >> state; cat state"})["output"] == f"41\n{i}\n"
            assert k.serialize()["info"]["config"]["lineage"]["parent_id"] == env.sandbox.sandbox_id
        assert env.execute({"command": "cat state"})["output"] == "41\n"
        # failures come back as mini-swe-agent's own environments give them
        failed = env.execute({"command": "echo oops >&2; exit 3"})
        assert (failed["returncode"], failed["output"]) == (3, "oops\n")
        late = env.execute({"command": "sleep 30"}, timeout=2)
        assert late["returncode"] == -1 and late["exception_info"]
    finally:
        for k in kids:
            k.close()
        env.close()


@pytest.mark.node
def test_skyrl_env_episode_fork_and_reward(no_leaks):
    import skyrl_gym

    from sandfork.integrations.skyrl import register

    register()
    env = skyrl_gym.make(
        "sandfork",
        env_config={"template": TEMPLATE, "max_turns": 3, "metadata": RUN_META},
        extras={"setup": ["echo 1 > /tmp/n"], "reward_spec": {"command": "test $(cat /tmp/n) = 3"}},
    )
    kids = []
    try:
        prompt = [{"role": "user", "content": "make n three"}]
        obs, info = env.init(prompt)
        assert obs == prompt and info["sandbox_id"] == env.sandbox_id
        out = env.step("Let me look.\n```bash\ncat /tmp/n\n```")
        assert (out["done"], out["reward"]) == (False, 0.0)
        assert out["observations"] == [{"role": "user", "content": "1\n"}]

        kids = env.fork(2)
        assert [k.turns for k in kids] == [1, 1]
        out = kids[0].step("```bash\necho 3 > /tmp/n\n```")
        assert out["done"] is False
        out = kids[0].step("I am done.")
        assert (out["done"], out["reward"], out["metadata"]["reason"]) == (True, 1.0, "no command")
        kids[1].step("<bash>echo 2 > /tmp/n</bash>")
        out = kids[1].step("```bash\ncat /tmp/n\n```")
        assert (out["done"], out["reward"], out["metadata"]["reason"]) == (True, 0.0, "max turns")
        assert out["observations"][0]["content"] == "2\n"
        # the parent never saw its children's writes
        assert env.step("```bash\ncat /tmp/n\n```")["observations"][0]["content"] == "1\n"
    finally:
        for k in kids:
            k.close()
        env.close()
