"""A SkyRL environment on a sandfork sandbox: ``SandforkTextEnv``, a
skyrl-gym ``BaseTextEnv`` (text in, text out) whose actions are shell
commands the model writes in a fenced ``bash`` block (or ``<bash>...</bash>``).

``register()`` makes it ``skyrl_gym.make("sandfork", env_config=...,
extras=...)``, the way SkyRL's generator builds environments; set the E2B
variables to point at the node first (``sandfork.configure``).

- ``env_config`` (the SkyRL ``environment.skyrl_gym.sandfork`` section):
  ``template``, ``max_turns``, ``command_timeout``, ``sandbox_timeout``,
  ``max_observation_chars``, ``metadata``.
- ``extras`` (per dataset row): ``setup`` (commands run at ``init``) and
  ``reward_spec`` with a ``command``: at the end of the episode it runs in
  the sandbox and the reward is 1.0 if it exits 0, else 0.0. Or, fork per
  group: ``task_state``, a ``TaskState.ref()`` of a task the trainer set up
  once and keeps paused or as a snapshot: ``init`` forks its sandbox from
  that state (its own seed) instead of running ``setup``.

The episode ends when the model writes no command, when it submits (a
command printing ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` first), or after
``max_turns``. ``fork(n)`` gives ``n`` environments on forks of the sandbox
with the turn count copied: the seam for a tree generator
(``TrajectoryID.repetition_id`` as the branch path).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from e2b import CommandExitException
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from ..env import EnvConfig, SyncSandboxEnv, Task
from ..group import TaskState, attach_child
from ..sandbox import Sandbox

#: The id ``register()`` gives the environment in skyrl-gym's registry.
ENV_ID = "sandfork"
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_BLOCKS = (
    re.compile(r"```(?:bash|sh|shell)[^\n]*\n(.*?)```", re.DOTALL),
    re.compile(r"<bash>(.*?)</bash>", re.DOTALL),
)


def parse_command(text: str) -> str | None:
    """The last shell command block in a model's reply, or None."""
    for pattern in _BLOCKS:
        found = pattern.findall(text)
        if found:
            command = str(found[-1]).strip()
            return command or None
    return None


def _get(config: Any, key: str, default: Any) -> Any:
    """A key of a dict or an omegaconf ``DictConfig`` (SkyRL passes one)."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


class SandforkTextEnv(BaseTextEnv):
    """A multi-turn shell episode in a microVM that can be forked."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        self.max_turns = int(_get(env_config, "max_turns", 8))
        metadata = _get(env_config, "metadata", None)
        self.env = SyncSandboxEnv(
            EnvConfig(
                template=str(_get(env_config, "template", "base")),
                command_timeout=float(_get(env_config, "command_timeout", 60)),
                sandbox_timeout=int(_get(env_config, "sandbox_timeout", 1800)),
                max_observation_chars=int(_get(env_config, "max_observation_chars", 4096)),
                metadata={str(k): str(v) for k, v in dict(metadata or {}).items()},
            )
        )
        self.setup = [str(c) for c in extras.get("setup", ())]
        self.task_state: dict[str, Any] | None = extras.get("task_state")
        self.reward_command: str | None = _get(extras.get("reward_spec"), "command", None)

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Starts the sandbox and runs the task's setup (or forks it from the
        set-up ``task_state``); the prompt passes through."""
        if self.task_state is not None:
            return prompt, self._fork_from(self.task_state)
        _, info = self.env.reset(Task(prompt="", setup=self.setup))
        return prompt, info

    def _fork_from(self, ref: dict[str, Any]) -> dict[str, Any]:
        """This episode's sandbox: one child of a kept task state."""
        state = TaskState.from_ref(ref)
        cfg = self.env.config
        if state.checkpoint is not None:
            (sbx,) = Sandbox.from_checkpoint(
                state.checkpoint, 1, timeout=cfg.sandbox_timeout, metadata=cfg.metadata
            )
        elif state.keep == "paused" and state.sandbox_id is not None:
            (sbx,) = Sandbox.branch_suspended(state.sandbox_id, 1, timeout=cfg.sandbox_timeout)
        else:
            raise ValueError(
                "task_state must be kept paused or as a snapshot (TaskState.suspend(), snapshot())"
            )
        self.env.close()
        self.env = attach_child(SyncSandboxEnv, sbx, state.episode, cfg, True)
        return {"sandbox_id": sbx.sandbox_id, "seed": self.env.state.seed}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        command = parse_command(action)
        if command is None:
            return self._end([], {"reason": "no command"})
        result = self.env.step(command)
        obs = [{"role": "user", "content": result.observation}]
        meta = {"exit_code": result.info["exit_code"], "sandbox_id": self.sandbox_id}
        if result.observation.lstrip().startswith(SUBMIT_MARKER):
            return self._end(obs, {**meta, "reason": "submitted"})
        if self.turns >= self.max_turns:
            return self._end(obs, {**meta, "reason": "max turns"})
        return BaseTextEnvStepOutput(observations=obs, reward=0.0, done=False, metadata=meta)

    def _end(self, obs: list[dict[str, str]], meta: dict[str, Any]) -> BaseTextEnvStepOutput:
        reward = 0.0
        if self.reward_command is not None:
            sbx = self.env._live()
            try:
                code = sbx.commands.run(
                    self.reward_command, timeout=self.env.config.command_timeout
                ).exit_code
            except CommandExitException as e:
                code = e.exit_code
            reward = 1.0 if code == 0 else 0.0
            meta["reward_exit_code"] = code
        return BaseTextEnvStepOutput(observations=obs, reward=reward, done=True, metadata=meta)

    @property
    def sandbox_id(self) -> str | None:
        return self.env.sandbox.sandbox_id if self.env.sandbox else None

    def fork(self, n: int) -> list[SandforkTextEnv]:
        """``n`` environments continuing this episode from now, each on its
        own fork of the sandbox (call between steps)."""
        out = []
        for child in self.env.fork(n):
            env = SandforkTextEnv.__new__(SandforkTextEnv)
            env.__dict__.update(self.__dict__)
            env.env = child
            out.append(env)
        return out

    def close(self) -> None:
        self.env.close()

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}


def register(env_id: str = ENV_ID) -> None:
    """Registers ``SandforkTextEnv`` with skyrl-gym under ``env_id`` (once)."""
    import skyrl_gym

    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:SandforkTextEnv")
