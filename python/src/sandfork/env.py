"""Text environments on sandboxes: an action is a shell command, an
observation is what it printed.

``SandboxEnv`` is async (every RL rollout loop surveyed is asyncio);
``SyncSandboxEnv`` mirrors it. Both can ``fork(n)`` mid-episode: the VM forks
(or, on a node without fork, is copied by snapshot or by replaying the
episode's commands) and the Python-side episode state is copied to every
child. Fork and checkpoint are trainer-side calls, never agent tools: call
them between steps, with no command running.
"""

from __future__ import annotations

import copy
import inspect
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from e2b import CommandExitException, TimeoutException

from ._common import Capabilities, Checkpoint, reseed
from .sandbox import Sandbox
from .sandbox_async import AsyncSandbox


@dataclass(frozen=True)
class Task:
    """What an episode is about: ``prompt`` is the first observation,
    ``setup`` runs in the sandbox at reset, ``data`` is for the verifier."""

    prompt: str
    setup: Sequence[str] = ()
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transition:
    action: str
    observation: str
    reward: float
    exit_code: int | None


@dataclass
class EpisodeState:
    """The Python side of an episode; ``fork`` and ``checkpoint`` copy it
    (``data`` deeply), so keep it picklable-simple."""

    task: Task | None = None
    seed: int | None = None
    steps: int = 0
    done: bool = False
    history: list[Transition] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> EpisodeState:
        return copy.deepcopy(self)

    def replay_commands(self) -> list[str]:
        """The commands that made the sandbox's state, for create-and-replay."""
        setup = list(self.task.setup) if self.task else []
        return setup + [t.action for t in self.history]


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@dataclass(frozen=True)
class Reward:
    """What a reward function may return instead of a bare float."""

    value: float
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


S = TypeVar("S")


@dataclass(frozen=True)
class StepContext(Generic[S]):
    """What the reward function sees after a command ran."""

    sandbox: S
    state: EpisodeState
    action: str
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool


#: ``reward_fn(ctx)`` -> float or ``Reward``; for ``SandboxEnv`` it may be async.
RewardFn = Callable[[StepContext[Any]], "float | Reward | Awaitable[float | Reward]"]


def format_observation(
    stdout: str, stderr: str, exit_code: int | None, max_chars: int, timed_out: bool = False
) -> str:
    """stdout, then stderr, then a status line when the command failed;
    longer than ``max_chars``, the middle is cut."""
    text = stdout + stderr
    if timed_out:
        text += "[command timed out]\n"
    elif exit_code:
        text += f"[exit code {exit_code}]\n"
    if len(text) <= max_chars:
        return text
    note = f"\n[... {len(text) - max_chars} characters cut ...]\n"
    keep = max(0, max_chars - len(note))
    head = keep // 2
    return text[:head] + note + text[len(text) - (keep - head) :]


@dataclass
class EnvConfig:
    """How a ``SandboxEnv`` makes and drives its sandboxes; children share it."""

    template: str = "base"
    reward_fn: RewardFn | None = None
    max_steps: int | None = None
    command_timeout: float = 60.0
    #: for the task's setup commands at reset (a checkout, an install);
    #: ``None``: ``command_timeout``
    setup_timeout: float | None = None
    max_observation_chars: int = 4096
    sandbox_timeout: int = 600
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None
    #: fresh seeds for fork children; ``False`` for identical copies
    reseed: bool = True
    #: found on first fork, shared by the whole tree
    capabilities: Capabilities | None = None

    @property
    def setup_seconds(self) -> float:
        return self.command_timeout if self.setup_timeout is None else self.setup_timeout


def _as_reward(value: float | Reward) -> Reward:
    return value if isinstance(value, Reward) else Reward(float(value))


def _task(task: str | Task | None) -> Task | None:
    return Task(task) if isinstance(task, str) else task


class _EnvBase:
    def __init__(self, config: EnvConfig) -> None:
        self.config = config
        self.state = EpisodeState()
        self.rng = random.Random()

    def _begin(self, task: Task | None, seed: int | None) -> tuple[str, dict[str, Any]]:
        self.state = EpisodeState(task=task, seed=seed)
        self.rng = random.Random(seed)
        return (task.prompt if task else ""), {"seed": seed}

    def _check_step(self) -> None:
        if self.state.done:
            raise RuntimeError("the episode is over: call reset()")

    def _finish(
        self, action: str, stdout: str, stderr: str, code: int | None, timed_out: bool, r: Reward
    ) -> StepResult:
        cfg = self.config
        obs = format_observation(stdout, stderr, code, cfg.max_observation_chars, timed_out)
        st = self.state
        st.steps += 1
        st.history.append(Transition(action, obs, r.value, code))
        truncated = cfg.max_steps is not None and st.steps >= cfg.max_steps and not r.terminated
        st.done = r.terminated or truncated
        info = {"exit_code": code, "timed_out": timed_out, "step": st.steps, **r.info}
        return StepResult(obs, r.value, r.terminated, truncated, info)

    def _adopted_state(self, state: EpisodeState, seed: int) -> EpisodeState:
        st = state.copy()
        if self.config.reseed:
            st.seed = seed
        return st


class SandboxEnv(_EnvBase):
    """An async shell environment on one ``AsyncSandbox``."""

    def __init__(self, config: EnvConfig | None = None, **options: Any) -> None:
        super().__init__(replace(config or EnvConfig(), **options))
        self.sandbox: AsyncSandbox | None = None

    async def reset(
        self, task: str | Task | None = None, *, seed: int | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox (the old one is killed) with the task's setup run;
        the observation is the task's prompt."""
        await self.close()
        t = _task(task)
        cfg = self.config
        sbx = await AsyncSandbox.create(
            cfg.template, timeout=cfg.sandbox_timeout, metadata=cfg.metadata, envs=cfg.envs
        )
        self.sandbox = sbx
        if seed is not None:
            sbx.lineage = sbx.lineage.with_seed(seed)
        obs, info = self._begin(t, sbx.lineage.seed)
        await sbx.write_lineage()
        for cmd in t.setup if t else ():
            await sbx.commands.run(cmd, timeout=cfg.setup_seconds, cwd=cfg.cwd, user=cfg.user)
        info["sandbox_id"] = sbx.sandbox_id
        return obs, info

    def _live(self) -> AsyncSandbox:
        if self.sandbox is None:
            raise RuntimeError("no sandbox: call reset() first")
        return self.sandbox

    async def step(self, action: str) -> StepResult:
        """Runs ``action`` as a shell command; the observation is its output."""
        self._check_step()
        sbx, cfg = self._live(), self.config
        timed_out, code, out, err = False, None, "", ""
        try:
            res = await sbx.commands.run(
                action, timeout=cfg.command_timeout, cwd=cfg.cwd, user=cfg.user, envs=cfg.envs
            )
            code, out, err = res.exit_code, res.stdout, res.stderr
        except CommandExitException as e:
            code, out, err = e.exit_code, e.stdout or "", e.stderr or ""
        except TimeoutException:
            timed_out = True
        r = Reward(0.0)
        if cfg.reward_fn is not None:
            ctx = StepContext(sbx, self.state, action, code, out, err, timed_out)
            value = cfg.reward_fn(ctx)
            if inspect.isawaitable(value):
                value = await value
            r = _as_reward(value)
        return self._finish(action, out, err, code, timed_out, r)

    async def fork(self, n: int) -> list[SandboxEnv]:
        """``n`` copies of this environment at this step: the sandbox
        branched, the episode state copied, fresh seeds unless
        ``reseed=False``."""
        sbx, cfg = self._live(), self.config
        if cfg.capabilities is None:
            cfg.capabilities = await sbx.capabilities()
        children = await sbx.branch(
            n,
            replay=self.state.replay_commands(),
            capabilities=cfg.capabilities,
            timeout=cfg.sandbox_timeout,
            after_fork=reseed if cfg.reseed else None,
        )
        return [self._child(c) for c in children]

    def _child(self, sbx: AsyncSandbox) -> SandboxEnv:
        return SandboxEnv.attach(sbx, self.state, self.config)

    @classmethod
    def attach(cls, sandbox: AsyncSandbox, state: EpisodeState, config: EnvConfig) -> SandboxEnv:
        """An environment on ``sandbox`` (a copy of the one that was at
        ``state``: a fork child, a sandbox from a checkpoint) with a copy of
        ``state``, its seed the sandbox's unless ``config.reseed`` is off."""
        env = cls(config)
        env.sandbox = sandbox
        env.state = env._adopted_state(state, sandbox.lineage.seed)
        env.rng = random.Random(env.state.seed)
        return env

    async def checkpoint(self, name: str | None = None) -> Checkpoint:
        """A snapshot of the sandbox holding a copy of the episode state."""
        return await self._live().checkpoint(name, data={"episode": self.state.copy()})

    async def restore(self, checkpoint: Checkpoint) -> None:
        """Back to a checkpoint, the episode state the checkpoint's (same
        seed): this sandbox rolled back in place when the checkpoint is its
        own and the node rolls back (``Capabilities.rollback``), else a
        sandbox from its snapshot replaces this one."""
        cfg = self.config
        sbx = self._live()
        if cfg.capabilities is None:
            cfg.capabilities = await sbx.capabilities()
        if cfg.capabilities.rollback and checkpoint.source_id == sbx.sandbox_id:
            await sbx.rollback(checkpoint)
        else:
            (sbx,) = await AsyncSandbox.from_checkpoint(
                checkpoint, 1, timeout=cfg.sandbox_timeout, metadata=cfg.metadata, after_fork=None
            )
            await self.close()
            self.sandbox = sbx
        self.state = checkpoint.data["episode"].copy()
        self.rng = random.Random(self.state.seed)

    async def close(self) -> None:
        """Kills the sandbox (if any)."""
        sbx, self.sandbox = self.sandbox, None
        if sbx is not None:
            await sbx.kill()

    async def __aenter__(self) -> SandboxEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SyncSandboxEnv(_EnvBase):
    """The blocking mirror of ``SandboxEnv`` on a ``Sandbox``."""

    def __init__(self, config: EnvConfig | None = None, **options: Any) -> None:
        super().__init__(replace(config or EnvConfig(), **options))
        self.sandbox: Sandbox | None = None

    def reset(
        self, task: str | Task | None = None, *, seed: int | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox (the old one is killed) with the task's setup run;
        the observation is the task's prompt."""
        self.close()
        t = _task(task)
        cfg = self.config
        sbx = Sandbox.create(
            cfg.template, timeout=cfg.sandbox_timeout, metadata=cfg.metadata, envs=cfg.envs
        )
        self.sandbox = sbx
        if seed is not None:
            sbx.lineage = sbx.lineage.with_seed(seed)
        obs, info = self._begin(t, sbx.lineage.seed)
        sbx.write_lineage()
        for cmd in t.setup if t else ():
            sbx.commands.run(cmd, timeout=cfg.setup_seconds, cwd=cfg.cwd, user=cfg.user)
        info["sandbox_id"] = sbx.sandbox_id
        return obs, info

    def _live(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("no sandbox: call reset() first")
        return self.sandbox

    def step(self, action: str) -> StepResult:
        """Runs ``action`` as a shell command; the observation is its output."""
        self._check_step()
        sbx, cfg = self._live(), self.config
        timed_out, code, out, err = False, None, "", ""
        try:
            res = sbx.commands.run(
                action, timeout=cfg.command_timeout, cwd=cfg.cwd, user=cfg.user, envs=cfg.envs
            )
            code, out, err = res.exit_code, res.stdout, res.stderr
        except CommandExitException as e:
            code, out, err = e.exit_code, e.stdout or "", e.stderr or ""
        except TimeoutException:
            timed_out = True
        r = Reward(0.0)
        if cfg.reward_fn is not None:
            value = cfg.reward_fn(StepContext(sbx, self.state, action, code, out, err, timed_out))
            if inspect.isawaitable(value):
                raise TypeError("SyncSandboxEnv needs a plain (not async) reward_fn")
            r = _as_reward(value)
        return self._finish(action, out, err, code, timed_out, r)

    def fork(self, n: int) -> list[SyncSandboxEnv]:
        """``n`` copies of this environment at this step (see ``SandboxEnv.fork``)."""
        sbx, cfg = self._live(), self.config
        if cfg.capabilities is None:
            cfg.capabilities = sbx.capabilities()
        children = sbx.branch(
            n,
            replay=self.state.replay_commands(),
            capabilities=cfg.capabilities,
            timeout=cfg.sandbox_timeout,
            after_fork=reseed if cfg.reseed else None,
        )
        return [self._child(c) for c in children]

    def _child(self, sbx: Sandbox) -> SyncSandboxEnv:
        return SyncSandboxEnv.attach(sbx, self.state, self.config)

    @classmethod
    def attach(cls, sandbox: Sandbox, state: EpisodeState, config: EnvConfig) -> SyncSandboxEnv:
        """See ``SandboxEnv.attach``."""
        env = cls(config)
        env.sandbox = sandbox
        env.state = env._adopted_state(state, sandbox.lineage.seed)
        env.rng = random.Random(env.state.seed)
        return env

    def checkpoint(self, name: str | None = None) -> Checkpoint:
        """A snapshot of the sandbox holding a copy of the episode state."""
        return self._live().checkpoint(name, data={"episode": self.state.copy()})

    def restore(self, checkpoint: Checkpoint) -> None:
        """Back to a checkpoint (see ``SandboxEnv.restore``)."""
        cfg = self.config
        sbx = self._live()
        if cfg.capabilities is None:
            cfg.capabilities = sbx.capabilities()
        if cfg.capabilities.rollback and checkpoint.source_id == sbx.sandbox_id:
            sbx.rollback(checkpoint)
        else:
            (sbx,) = Sandbox.from_checkpoint(
                checkpoint, 1, timeout=cfg.sandbox_timeout, metadata=cfg.metadata, after_fork=None
            )
            self.close()
            self.sandbox = sbx
        self.state = checkpoint.data["episode"].copy()
        self.rng = random.Random(self.state.seed)

    def close(self) -> None:
        """Kills the sandbox (if any)."""
        sbx, self.sandbox = self.sandbox, None
        if sbx is not None:
            sbx.kill()

    def __enter__(self) -> SyncSandboxEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
