"""Fork per group: set a task up once, then start every rollout group from
that state.

RL recipes run groups of 8-16 rollouts that start from the same task state,
after 30-120 s of environment setup per task (a checkout, a dependency
install). ``TaskState.prepare`` runs that setup once in one sandbox;
``state.group(n, seeds=...)`` gives ``n`` ``SandboxEnv`` children of it, each
with its own seed (in ``/run/sandfork/seed`` and in ``$SANDFORK_SEED`` of every
step's command). Between training steps the state is kept running, paused
(``suspend()``: no VM runs) or as a snapshot (``snapshot()``), and forks the
same from each; ``ref()`` is a JSON-able handle another process (a rollout
worker, a framework's environment) reopens with ``TaskState.from_ref``.
``BranchingRunner.run(state=...)`` grows its tree from it.

Where the node has neither fork nor snapshots, a group is ``n`` fresh
sandboxes each running the setup again (``each``), which is also what the
frameworks do today.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypeVar

from . import _ops
from ._common import Checkpoint, reseed
from ._lineage import Lineage
from .env import EnvConfig, EpisodeState, SandboxEnv, SyncSandboxEnv, Task
from .sandbox_async import AsyncSandbox

#: How a set-up state is kept: a running sandbox, a paused one, a snapshot.
Keep = Literal["running", "paused", "snapshot"]
#: The variable every step command of a group's child sees its seed in.
SEED_ENV = "SANDFORK_SEED"

#: Run once after the task's setup commands: ``setup(sandbox)``, plain or async.
SetupFn = Callable[[AsyncSandbox], "Awaitable[None] | None"]


def group_seeds(seed: int, count: int, start: int = 0) -> list[int]:
    """Seeds for children ``start .. start + count - 1`` of a group, derived
    from one seed: the same for the same ``(seed, index)``, distinct across
    indices and groups (63 bits, as ``Lineage`` seeds)."""
    return [
        random.Random(f"sandfork-group/{seed}/{i}").getrandbits(63)
        for i in range(start, start + count)
    ]


def _seed_hook(seeds: Sequence[int] | None, fresh: bool) -> Any:
    """The ``after_fork`` hook giving child ``i`` ``seeds[i]``; without seeds,
    a fresh one (``reseed``) or the parent's."""
    if seeds is None:
        return reseed if fresh else None
    chosen = list(seeds)

    def seeded(child: Any, index: int) -> None:
        child.lineage = child.lineage.with_seed(chosen[index])

    return seeded


@dataclass
class TaskState:
    """A task set up once, kept to start rollout groups from (see the module).

    ``episode`` is the episode state every child starts with (the task, the
    seed of the set-up sandbox, no steps); ``config`` the children's
    ``EnvConfig``. Exactly one of ``sandbox_id`` (``running``, ``paused``)
    and ``checkpoint`` (``snapshot``) is set.
    """

    config: EnvConfig
    episode: EpisodeState
    keep: Keep
    sandbox_id: str | None = None
    checkpoint: Checkpoint | None = None
    #: the setup callable, for groups made by ``each`` (it cannot be
    #: serialized: give it again to ``from_ref``)
    setup: SetupFn | None = None
    _sandbox: AsyncSandbox | None = None
    # the node forks one sandbox once at a time (another fork of it meanwhile
    # is a 409): groups of a running or paused state take turns
    _forking: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)

    # --- making and keeping it ----------------------------------------------

    @classmethod
    async def prepare(
        cls,
        task: str | Task | None = None,
        setup: SetupFn | None = None,
        *,
        keep: Keep = "running",
        seed: int | None = None,
        config: EnvConfig | None = None,
        **options: Any,
    ) -> TaskState:
        """One sandbox reset to ``task`` (its ``setup`` commands run, bounded
        by ``EnvConfig.setup_timeout``), then ``setup(sandbox)``, then kept as
        ``keep``. ``options`` are ``EnvConfig`` fields."""
        env = SandboxEnv(config, **options)
        try:
            await _set_up(env, task, setup, seed)
            state = cls(env.config, env.state.copy(), "running", setup=setup)
            state._sandbox = env.sandbox
            state.sandbox_id = env._live().sandbox_id
            env.sandbox = None  # the state's now
            await state.keep_as(keep)
        except BaseException:
            await env.close()
            raise
        return state

    async def suspend(self) -> None:
        """Keeps it as a paused sandbox (no VM runs; forks of it stay paused)."""
        await self.keep_as("paused")

    async def snapshot(self) -> None:
        """Keeps it as a snapshot (memory and disk), the sandbox killed."""
        await self.keep_as("snapshot")

    async def keep_as(self, keep: Keep) -> None:
        """Changes how the state is kept (a snapshot brought back to running
        or paused is a new sandbox, with a new id)."""
        if keep == self.keep:
            return
        sbx = await self._running()
        if keep == "paused":
            await sbx.suspend()
            self._sandbox = None
        elif keep == "snapshot":
            self.checkpoint = await sbx.checkpoint(data={"episode": self.episode.copy()})
            await sbx.kill()
            self._sandbox, self.sandbox_id = None, None
        self.keep = keep

    async def _running(self) -> AsyncSandbox:
        """The set-up sandbox running: connected to (a state from ``ref``),
        resumed, or started from the snapshot."""
        cfg = self.config
        if self.keep == "running" and self._sandbox is not None:
            return self._sandbox
        if self.keep == "snapshot" and self.checkpoint is not None:
            ckpt = self.checkpoint
            (sbx,) = await AsyncSandbox.from_checkpoint(
                ckpt, 1, timeout=cfg.sandbox_timeout, metadata=cfg.metadata, after_fork=None
            )
            await AsyncSandbox.delete_checkpoint(ckpt)
            self.checkpoint = None
        elif self.sandbox_id is not None:
            sbx = await AsyncSandbox.resume(self.sandbox_id, timeout=cfg.sandbox_timeout)
        else:
            raise RuntimeError("this task state was closed")
        self._sandbox, self.sandbox_id, self.keep = sbx, sbx.sandbox_id, "running"
        return sbx

    async def close(self) -> None:
        """Removes the kept state (kills the sandbox, or deletes the snapshot);
        the children run on."""
        sbx, self._sandbox = self._sandbox, None
        sid, self.sandbox_id = self.sandbox_id, None
        ckpt, self.checkpoint = self.checkpoint, None
        if sbx is not None:
            await sbx.kill()
        elif sid is not None:
            await AsyncSandbox.kill(sid)
        if ckpt is not None:
            await AsyncSandbox.delete_checkpoint(ckpt)

    async def __aenter__(self) -> TaskState:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the groups ---------------------------------------------------------

    async def group(
        self,
        n: int,
        *,
        seeds: Sequence[int] | None = None,
        seed: int | None = None,
        config: EnvConfig | None = None,
    ) -> list[SandboxEnv]:
        """``n`` environments at the set-up state: forks of the running or
        paused sandbox (which stays as it was), or sandboxes from the
        snapshot, in one fork call each where the node can. Child ``i`` gets
        ``seeds[i]`` (or ``group_seeds(seed, n)[i]``; neither: a fresh seed
        unless ``config.reseed`` is off). ``config``: the children's (their
        reward function, limits), by default the state's. All ``n`` or
        ``ForkError``. Concurrent groups of one running or paused state take
        turns (the node forks a sandbox once at a time)."""
        if n < 1:
            raise ValueError("a group has at least one child")
        if seeds is None and seed is not None:
            seeds = group_seeds(seed, n)
        if seeds is not None and len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} children")
        cfg = self.config
        caps = cfg.capabilities
        if caps is None:
            caps = cfg.capabilities = await _ops.run_async(_ops.capabilities_of(AsyncSandbox, {}))
        kids = config or cfg
        if caps.strategy == "replay":
            return await self.each(n, seeds=seeds, config=kids)
        hook = _seed_hook(seeds, cfg.reseed)
        sbxs: list[AsyncSandbox]
        if self.keep == "snapshot" and self.checkpoint is not None:
            sbxs = await AsyncSandbox.from_checkpoint(
                self.checkpoint,
                n,
                timeout=cfg.sandbox_timeout,
                metadata=cfg.metadata,
                after_fork=hook,
                fork=caps.fork_from_snapshot,
            )
        elif self.keep == "paused" and self.sandbox_id is not None:
            async with self._forking:
                sbxs = await AsyncSandbox.branch_suspended(
                    self.sandbox_id,
                    n,
                    capabilities=caps,
                    timeout=cfg.sandbox_timeout,
                    after_fork=hook,
                )
        else:
            async with self._forking:
                sbx = await self._running()
                sbxs = await sbx.branch(
                    n,
                    replay=self.episode.replay_commands(),
                    capabilities=caps,
                    timeout=cfg.sandbox_timeout,
                    after_fork=hook,
                )
        return [attach_child(SandboxEnv, s, self.episode, kids, seeds is not None) for s in sbxs]

    async def each(
        self, n: int, *, seeds: Sequence[int] | None = None, config: EnvConfig | None = None
    ) -> list[SandboxEnv]:
        """``n`` environments each set up from scratch (a sandbox per child
        running the task's setup, at once): what a group costs without fork,
        and the fallback where the node has neither fork nor snapshots."""
        task = self.episode.task
        kids = config or self.config

        async def one(i: int) -> SandboxEnv:
            env = SandboxEnv(kids)
            try:
                await _set_up(env, task, self.setup, None if seeds is None else seeds[i])
            except BaseException:
                await env.close()
                raise
            return attach_child(SandboxEnv, env._live(), env.state, kids, seeds is not None)

        made = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        envs = [e for e in made if isinstance(e, SandboxEnv)]
        failed = [e for e in made if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)
            raise failed[0]
        return envs

    # --- a handle for another process ---------------------------------------

    def ref(self) -> dict[str, Any]:
        """A JSON-able handle of the kept state (the task, its seed, and the
        paused or running sandbox's id or the snapshot's)."""
        task = self.episode.task
        out: dict[str, Any] = {
            "keep": self.keep,
            "task": None if task is None else {**asdict(task), "setup": list(task.setup)},
            "seed": self.episode.seed,
        }
        if self.checkpoint is not None:
            out["snapshot_id"] = self.checkpoint.snapshot_id
            out["source_id"] = self.checkpoint.source_id
            out["lineage"] = self.checkpoint.lineage.to_dict()
        else:
            out["sandbox_id"] = self.sandbox_id
        return out

    @classmethod
    def from_ref(
        cls,
        ref: dict[str, Any],
        *,
        config: EnvConfig | None = None,
        setup: SetupFn | None = None,
        **options: Any,
    ) -> TaskState:
        """The state ``ref()`` described (no request is made: a running one is
        connected to on its first group)."""
        cfg = replace(config or EnvConfig(), **options)
        t = ref.get("task")
        task = None if t is None else Task(t["prompt"], tuple(t["setup"]), dict(t["data"]))
        episode = EpisodeState(task=task, seed=ref.get("seed"))
        keep = ref["keep"]
        if keep not in ("running", "paused", "snapshot"):
            raise ValueError(f"not a task state's keep: {keep!r}")
        if keep == "snapshot":
            ckpt = Checkpoint(
                snapshot_id=str(ref["snapshot_id"]),
                source_id=str(ref["source_id"]),
                lineage=Lineage.from_dict(ref["lineage"]),
                data={"episode": episode.copy()},
            )
            return cls(cfg, episode, "snapshot", checkpoint=ckpt, setup=setup)
        # a running one is connected to on its first use
        return cls(cfg, episode, keep, sandbox_id=str(ref["sandbox_id"]), setup=setup)


E = TypeVar("E", SandboxEnv, SyncSandboxEnv)


def attach_child(
    env_cls: type[E], sbx: Any, episode: EpisodeState, config: EnvConfig, seeded: bool
) -> E:
    """An environment (``SandboxEnv`` or ``SyncSandboxEnv``) on a child of a
    set-up state: the set-up episode, the child's own seed (``seeded``: the
    one its hook gave) in the episode and in ``$SANDFORK_SEED``."""
    env = env_cls.attach(sbx, episode, config)
    if seeded or config.reseed:
        env.state.seed = sbx.lineage.seed
        env.rng = random.Random(env.state.seed)
    if env.state.seed is not None:
        env.config = replace(config, envs={**config.envs, SEED_ENV: str(env.state.seed)})
    return env


async def _set_up(
    env: SandboxEnv, task: str | Task | None, setup: SetupFn | None, seed: int | None
) -> None:
    await env.reset(task, seed=seed)
    if setup is not None:
        done = setup(env._live())
        if inspect.isawaitable(done):
            await done
