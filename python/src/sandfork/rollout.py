"""Branching rollouts: run a policy over a tree of forked environments.

``BranchingRunner(policy, env_factory, schedule).run(task)`` resets one
environment, then at every node asks the schedule how many ways to branch;
a node that branches keeps its sandbox as the template and forks children
from it (in as many fork calls as the bound on live sandboxes allows), each
child takes its own next step. Leaves, pruned branches and failed forks are
killed at once. The result is a ``TrajectoryTree``: export it as GRPO groups
(per tree or per branch point), Tree-GRPO's advantages, or JSONL.

``TreeGRPOSchedule`` is Tree-GRPO's tree search (Ji et al., arXiv
2509.21240): M chains from the task, then L rounds, each expanding N
sampled non-leaf nodes of every tree into new branches run to the end. A node
is returned to from a kept copy of its state (a checkpoint, a suspended fork
child, or a replay of its commands: whatever the node offers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Literal, Protocol

from . import _ops
from ._common import Capabilities, Checkpoint, reseed
from .env import EnvConfig, EpisodeState, SandboxEnv, Task
from .group import TaskState, group_seeds
from .sandbox_async import AsyncSandbox

log = logging.getLogger("sandfork")

# --- the tree -------------------------------------------------------------


@dataclass
class Node:
    """One environment state: the root is the reset, every other node the
    step its ``action`` took. ``path`` is the branch index at every level
    (a node without siblings has index 0)."""

    path: tuple[int, ...]
    step: int
    observation: str
    action: str | None = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    error: str | None = None
    pruned: bool = False
    sandbox_id: str | None = None
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    children: list[Node] = field(default_factory=list)

    @property
    def id(self) -> str:
        return "/".join(["r", *map(str, self.path)])

    @property
    def parent_id(self) -> str | None:
        return None if not self.path else "/".join(["r", *map(str, self.path[:-1])])

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def to_record(self) -> dict[str, Any]:
        rec = {k: v for k, v in asdict(self).items() if k not in ("children", "path")}
        rec["path"] = list(self.path)
        rec["id"] = self.id
        rec["parent_id"] = self.parent_id
        return rec


@dataclass(frozen=True)
class Trajectory:
    """The path from the root to one leaf, as chat messages and per-step lists."""

    leaf_id: str
    messages: list[dict[str, str]]
    actions: list[str]
    rewards: list[float]
    total_reward: float
    terminated: bool
    truncated: bool
    tokens: list[list[int] | None]
    logprobs: list[list[float] | None]


@dataclass(frozen=True)
class GroupSample:
    """One trajectory in a GRPO group; ``uid`` names the group."""

    uid: str
    trajectory: Trajectory
    advantage: float


class TrajectoryTree:
    """What a branching run produced."""

    def __init__(self, root: Node, task: Task | None = None) -> None:
        self.root = root
        self.task = task

    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(n.children))

    def get(self, node_id: str) -> Node:
        for n in self.nodes():
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def _paths(self) -> Iterator[list[Node]]:
        def walk(n: Node, prefix: list[Node]) -> Iterator[list[Node]]:
            here = [*prefix, n]
            if n.is_leaf:
                yield here
            for c in n.children:
                yield from walk(c, here)

        yield from walk(self.root, [])

    def trajectories(self, include_failed: bool = False) -> list[Trajectory]:
        """One per leaf; leaves of failed forks only with ``include_failed``."""
        out = []
        for path in self._paths():
            leaf = path[-1]
            if leaf.error is not None and not include_failed:
                continue
            out.append(_trajectory(self.task, path))
        return out

    def branch_points(self) -> list[Node]:
        return [n for n in self.nodes() if len(n.children) > 1]

    def grpo_groups(
        self, by: Literal["tree", "branch"] = "tree", eps: float = 1e-6
    ) -> list[list[GroupSample]]:
        """GRPO groups with normalised advantages ((r - mean) / (std + eps)).

        ``by="tree"``: one group of every finished trajectory (uid: the
        task's root). ``by="branch"``: one group per branch point, of the
        trajectories below it (uid: the node id), Tree-GRPO's intra-tree
        groups; a trajectory is in one group per branch point it passes.
        """
        groups: list[tuple[str, list[Trajectory]]] = []
        if by == "tree":
            groups.append(("r", self.trajectories()))
        elif by == "branch":
            leaves = {t.leaf_id: t for t in self.trajectories()}
            for bp in self.branch_points():
                under = [leaves[n.id] for n in _subtree(bp) if n.is_leaf and n.id in leaves]
                groups.append((bp.id, under))
        else:
            raise ValueError(f"by must be 'tree' or 'branch', not {by!r}")
        out = []
        for uid, trajs in groups:
            if len(trajs) < 2:
                continue
            adv = normalized_advantages([t.total_reward for t in trajs], eps)
            out.append([GroupSample(uid, t, a) for t, a in zip(trajs, adv, strict=True)])
        return out

    def tree_grpo_group(self, eps: float = 1e-6) -> list[GroupSample]:
        """Tree-GRPO's advantages for a tree of ``TreeGRPOSchedule``, whose
        root's children are its M trees: each finished trajectory's
        advantage is its intra-tree one (normalised among the leaves of its
        own tree) plus its inter-tree one (among all leaves of the M trees),
        as in the paper. One group (uid ``r``); a tree with one leaf has no
        intra-tree part."""
        samples: list[tuple[Trajectory, float]] = []
        for tree in self.root.children:
            prefix = tree.id + "/"
            trajs = [
                t
                for t in self.trajectories()
                if t.leaf_id == tree.id or t.leaf_id.startswith(prefix)
            ]
            intra = (
                normalized_advantages([t.total_reward for t in trajs], eps)
                if len(trajs) > 1
                else [0.0] * len(trajs)
            )
            samples += zip(trajs, intra, strict=True)
        if not samples:
            return []
        inter = normalized_advantages([t.total_reward for t, _ in samples], eps)
        return [GroupSample("r", t, a + b) for (t, a), b in zip(samples, inter, strict=True)]

    def to_jsonl(self, out: IO[str]) -> None:
        """One JSON object per node, parents before children; ``from_jsonl``
        reads it back. The first line holds the task."""
        task = None if self.task is None else asdict(self.task)
        out.write(json.dumps({"task": task}) + "\n")
        for n in self.nodes():
            out.write(json.dumps(n.to_record(), sort_keys=True) + "\n")

    @classmethod
    def from_jsonl(cls, lines: Iterable[str]) -> TrajectoryTree:
        it = iter(lines)
        head = json.loads(next(it))
        t = head.get("task")
        task = None if t is None else Task(t["prompt"], tuple(t["setup"]), t["data"])
        by_id: dict[str, Node] = {}
        root: Node | None = None
        for line in it:
            if not line.strip():
                continue
            rec = json.loads(line)
            parent = rec.pop("parent_id")
            rec.pop("id")
            rec["path"] = tuple(rec["path"])
            node = Node(**rec)
            by_id[node.id] = node
            if parent is None:
                root = node
            else:
                by_id[parent].children.append(node)
        if root is None:
            raise ValueError("no root node in the JSONL")
        return cls(root, task)


def _subtree(n: Node) -> Iterator[Node]:
    yield n
    for c in n.children:
        yield from _subtree(c)


def _trajectory(task: Task | None, path: list[Node]) -> Trajectory:
    root, steps = path[0], path[1:]
    messages = [{"role": "user", "content": root.observation}]
    for n in steps:
        if n.action is None:
            continue
        messages.append({"role": "assistant", "content": n.action})
        messages.append({"role": "user", "content": n.observation})
    done = [n for n in steps if n.action is not None]
    leaf = path[-1]
    return Trajectory(
        leaf_id=leaf.id,
        messages=messages,
        actions=[n.action or "" for n in done],
        rewards=[n.reward for n in done],
        total_reward=sum(n.reward for n in done),
        terminated=leaf.terminated,
        truncated=leaf.truncated,
        tokens=[n.tokens for n in done],
        logprobs=[n.logprobs for n in done],
    )


def normalized_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def write_groups_jsonl(groups: Sequence[Sequence[GroupSample]], out: IO[str]) -> None:
    """One JSON object per sample: ``uid``, ``advantage`` and the trajectory."""
    for g in groups:
        for s in g:
            rec = {"uid": s.uid, "advantage": s.advantage, **asdict(s.trajectory)}
            out.write(json.dumps(rec, sort_keys=True) + "\n")


# --- schedules ------------------------------------------------------------


class BranchSchedule(Protocol):
    def width(self, node: Node) -> int:
        """How many ways to branch before the step after ``node`` (1: none)."""
        ...


@dataclass(frozen=True)
class FixedSchedule:
    """Branch ``width`` ways at the given steps (0: right after reset), or
    per step with a mapping ``{step: width}``."""

    at: Mapping[int, int] | Sequence[int]
    width: int = 2

    def width_at(self, step: int) -> int:
        if isinstance(self.at, Mapping):
            return int(self.at.get(step, 1))
        return self.width if step in self.at else 1

    # BranchSchedule
    def __call__(self, node: Node) -> int:
        return self.width_at(node.step)

    def levels(self) -> int:
        """How many branch points a path crosses."""
        keys = self.at.keys() if isinstance(self.at, Mapping) else self.at
        return sum(1 for k in keys if self.width_at(k) > 1)


@dataclass(frozen=True)
class TreeGRPOSchedule:
    """Tree-GRPO's tree search (Ji et al., "Tree Search for LLM Agent
    Reinforcement Learning", arXiv 2509.21240): ``trees`` (M) chains from the
    task (a fork of the reset sandbox M ways, each run to its end), then
    ``rounds`` (L) expansions: in each, ``nodes`` (N) non-leaf nodes of every
    tree are sampled at random and each grows ``width`` new branches (the
    paper: one), run to their end. A tree ends with at most 1 + L * N *
    width leaves; ``TrajectoryTree.tree_grpo_group()`` gives the paper's
    intra- plus inter-tree advantages.

    ``keep`` is how a node's state is kept to return to it: ``"snapshot"``
    (a checkpoint per step; branches from it in one fork call where the node
    forks snapshots, else creates), ``"suspend"`` (a fork child per step,
    suspended; branches by a fork of the paused sandbox where the node can,
    else resume, fork and suspend again), ``"replay"`` (nothing kept; a
    branch is a fresh sandbox running the node's commands again), or
    ``"auto"``: see ``keep_mode``. Kept states do not count against
    ``max_live`` (they run no VM) and are all removed at the end."""

    trees: int = 2
    rounds: int = 1
    nodes: int = 2
    width: int = 1
    keep: Literal["auto", "snapshot", "suspend", "replay"] = "auto"

    def __post_init__(self) -> None:
        if min(self.trees, self.nodes, self.width) < 1 or self.rounds < 0:
            raise ValueError("trees, nodes and width must be at least 1, rounds at least 0")

    def __call__(self, node: Node) -> int:
        """The initial branching: M ways right after the reset."""
        return self.trees if node.step == 0 else 1

    def candidates(self, tree: Node) -> list[Node]:
        """The nodes of one tree a round may expand: those with a step after
        them (not leaves), not failed."""
        return [
            n for n in _subtree(tree) if n.children and n.error is None and n.action is not None
        ]

    def pick(
        self, tree: Node, rng: random.Random, usable: Container[str] | None = None
    ) -> list[Node]:
        """``nodes`` of ``candidates(tree)`` (of those whose ids are in
        ``usable``: the states kept) sampled without replacement, all when
        there are fewer."""
        found = [n for n in self.candidates(tree) if usable is None or n.id in usable]
        return rng.sample(found, min(self.nodes, len(found)))

    def keep_mode(self, caps: Capabilities) -> Literal["snapshot", "suspend", "replay"]:
        """``keep``, or for ``"auto"`` the cheapest the node offers: a
        checkpoint per step where snapshots fork in one call, else a
        suspended fork child where paused sandboxes fork, else a checkpoint
        where snapshots exist, else replay."""
        if self.keep != "auto":
            return self.keep
        if caps.fork_from_snapshot:
            return "snapshot"
        if caps.fork_paused:
            return "suspend"
        return "snapshot" if caps.snapshot else "replay"


#: Any callable ``node -> width`` is a schedule too.
ScheduleFn = Callable[[Node], int]


def _width(
    schedule: FixedSchedule | TreeGRPOSchedule | ScheduleFn | BranchSchedule, node: Node
) -> int:
    if isinstance(schedule, FixedSchedule | TreeGRPOSchedule) or not hasattr(schedule, "width"):
        return max(1, int(schedule(node)))
    return max(1, int(schedule.width(node)))


# --- the policy -----------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """A policy's answer with what the trainer needs of it."""

    text: str
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyInput:
    """What a policy sees: the chat so far (OpenAI-style messages), the node
    it acts from and an RNG seeded per branch."""

    messages: list[dict[str, str]]
    node: Node
    task: Task | None
    rng: random.Random


Policy = Callable[[PolicyInput], "Awaitable[str | Action]"]


class _Slots:
    """The bound on live sandboxes; ``take`` waits for at least one free."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.peak = 0
        self.cond = asyncio.Condition()

    async def take(self, want: int) -> int:
        async with self.cond:
            await self.cond.wait_for(lambda: self.used < self.limit)
            got = min(want, self.limit - self.used)
            self.used += got
            self.peak = max(self.peak, self.used)
            return got

    async def give(self, n: int = 1) -> None:
        async with self.cond:
            self.used -= n
            self.cond.notify_all()


@dataclass
class RunStats:
    forks: int = 0
    fork_failures: int = 0
    children: int = 0
    pruned: int = 0
    peak_live: int = 0
    #: Tree-GRPO: node states kept, and nodes expanded
    kept: int = 0
    expanded: int = 0


@dataclass
class _Kept:
    """A node's state to return to (``TreeGRPOSchedule``): the episode
    state and chat at the node, and the checkpoint or suspended sandbox."""

    state: EpisodeState
    messages: list[dict[str, str]]
    checkpoint: Checkpoint | None = None
    suspended_id: str | None = None


class BranchingRunner:
    """Runs ``policy`` over a tree of environments from ``env_factory``.

    ``max_live`` bounds the sandboxes alive at once (a branching node keeps
    its own until all its children are done, so it must exceed the number
    of branch points on a path); ``prune(node)`` returning true ends a branch
    at once; ``max_steps`` ends every path; a fork that fails is retried
    ``fork_retries`` times, then recorded as failed children (``error``).
    """

    def __init__(
        self,
        policy: Policy,
        env_factory: Callable[[], SandboxEnv],
        schedule: FixedSchedule | TreeGRPOSchedule | ScheduleFn | BranchSchedule,
        *,
        max_live: int = 8,
        max_steps: int = 16,
        prune: Callable[[Node], bool] | None = None,
        fork_retries: int = 1,
    ) -> None:
        if isinstance(schedule, FixedSchedule) and max_live < schedule.levels() + 1:
            raise ValueError(
                f"max_live={max_live} cannot hold {schedule.levels()} branch points"
                " plus a child: it would wait forever"
            )
        if max_live < 1:
            raise ValueError("max_live must be at least 1")
        self.policy = policy
        self.env_factory = env_factory
        self.schedule = schedule
        self.max_live = max_live
        self.max_steps = max_steps
        self.prune = prune
        self.fork_retries = fork_retries
        self.stats = RunStats()
        # Tree-GRPO: kept node states by node id, while a run needs them
        self._kept: dict[str, _Kept] | None = None
        self._keep_mode: str = "replay"
        # keep states on new branches (not in the last round)
        self._kept_more = True

    async def run(
        self,
        task: str | Task | None = None,
        *,
        seed: int | None = None,
        state: TaskState | None = None,
    ) -> TrajectoryTree:
        """The tree from ``task``: a reset environment from ``env_factory``,
        or, given ``state`` (a task set up once, ``TaskState``), the set-up
        state, whose first branch (the schedule's width at step 0: the group)
        is forked from it, child ``i`` seeded ``group_seeds(seed, n)[i]``
        when ``seed`` is given. The state stays the caller's: it is not
        closed, nor counted in ``max_live``."""
        slots = _Slots(self.max_live)
        self.stats = RunStats()
        t = Task(task) if isinstance(task, str) else task
        tree_grpo = self.schedule if isinstance(self.schedule, TreeGRPOSchedule) else None
        start: Callable[[], Awaitable[None]]
        if state is not None:
            t = t or state.episode.task
            root = Node(path=(), step=0, observation=t.prompt if t else "")
            root.sandbox_id = state.sandbox_id
            # the children's config (reward, limits) is the factory's
            config = self.env_factory().config
            if config.capabilities is None:
                config.capabilities = state.config.capabilities
            messages = [{"role": "user", "content": root.observation}]
            from_state = state

            async def group(k: int, first: int) -> list[SandboxEnv]:
                seeds = None if seed is None else group_seeds(seed, k, first)
                return await from_state.group(k, seeds=seeds, config=config)

            width = _width(self.schedule, root)
            start = functools.partial(self._branch, group, root, messages, t, slots, width)

            env: SandboxEnv | None = None
        else:
            env = self.env_factory()
            await slots.take(1)
            try:
                obs, info = await env.reset(t, seed=seed)
            except BaseException:
                await env.close()
                await slots.give()
                raise
            root = Node(path=(), step=0, observation=obs, sandbox_id=info.get("sandbox_id"))
            config = env.config
            messages = [{"role": "user", "content": obs}]
            start = functools.partial(self._grow, env, root, messages, t, slots)

        if tree_grpo is None or tree_grpo.rounds == 0:
            await start()
        else:
            self._kept = {}
            try:
                caps = config.capabilities
                if caps is None:
                    caps = config.capabilities = await _ops.run_async(
                        _ops.capabilities_of(AsyncSandbox, {})
                    )
                self._keep_mode = tree_grpo.keep_mode(caps) if caps else "replay"
                template = config
                self._kept_more = True
                await start()
                rng = random.Random(seed)
                for round_ in range(tree_grpo.rounds):
                    # states on the last round's branches are never returned to
                    self._kept_more = round_ < tree_grpo.rounds - 1
                    kept_ids = set(self._kept)
                    picked = [
                        n for tree in root.children for n in tree_grpo.pick(tree, rng, kept_ids)
                    ]
                    await asyncio.gather(
                        *(
                            self._expand(n, tree_grpo.width, t, slots, template, seed)
                            for n in picked
                        )
                    )
                    for n in picked:
                        n.children.sort(key=lambda c: c.path)
            finally:
                kept, self._kept = self._kept, None
                await self._drop_kept(kept)
        self.stats.peak_live = slots.peak
        return TrajectoryTree(root, t)

    # --- Tree-GRPO: keeping node states and returning to them ---------------

    async def _keep(self, env: SandboxEnv, node: Node, messages: list[dict[str, str]]) -> None:
        """Keeps ``node``'s state (``env`` is at it, about to step on)."""
        kept = _Kept(env.state.copy(), list(messages))
        sbx = env.sandbox
        try:
            if self._keep_mode == "snapshot" and sbx is not None:
                kept.checkpoint = await sbx.checkpoint()
            elif self._keep_mode == "suspend" and sbx is not None:
                (copy,) = await sbx.fork_all(1, after_fork=None)
                kept.suspended_id = copy.sandbox_id
                await copy.suspend()
        except Exception as e:
            # the branch goes on; this node is just not returned to
            log.warning("keeping the state of %s failed: %s", node.id, e)
            await self._drop_kept({node.id: kept})
            return
        if self._kept is not None:
            self._kept[node.id] = kept
            self.stats.kept += 1

    async def _restore(
        self, kept: _Kept, count: int, task: Task | None, template: EnvConfig, seed: int | None
    ) -> list[SandboxEnv]:
        """``count`` environments at a kept node state."""
        cfg = template
        hook = reseed if cfg.reseed else None
        if kept.checkpoint is not None:
            sbxs = await AsyncSandbox.from_checkpoint(
                kept.checkpoint,
                count,
                timeout=cfg.sandbox_timeout,
                metadata=cfg.metadata,
                after_fork=hook,
                fork=cfg.capabilities.fork_from_snapshot if cfg.capabilities else None,
            )
            return [SandboxEnv.attach(s, kept.state, cfg) for s in sbxs]
        if kept.suspended_id is not None:
            sbxs = await AsyncSandbox.branch_suspended(
                kept.suspended_id,
                count,
                capabilities=cfg.capabilities,
                timeout=cfg.sandbox_timeout,
                after_fork=hook,
            )
            return [SandboxEnv.attach(s, kept.state, cfg) for s in sbxs]
        envs: list[SandboxEnv] = []
        try:
            for _ in range(count):
                env = self.env_factory()
                envs.append(env)
                await env.reset(task, seed=None if cfg.reseed else seed)
                sbx = env._live()
                for action in [tr.action for tr in kept.state.history]:
                    with contextlib.suppress(Exception):  # it failed the first time too
                        await sbx.commands.run(
                            action, timeout=cfg.command_timeout, cwd=cfg.cwd, user=cfg.user
                        )
                state = kept.state.copy()
                if cfg.reseed:
                    state.seed = env.state.seed
                env.state, env.rng = state, random.Random(state.seed)
        except BaseException:
            await asyncio.gather(*(e.close() for e in envs), return_exceptions=True)
            raise
        return envs

    async def _expand(
        self,
        node: Node,
        width: int,
        task: Task | None,
        slots: _Slots,
        template: EnvConfig,
        seed: int | None,
    ) -> None:
        """``width`` new branches from ``node``, each run to its end."""
        kept = (self._kept or {}).get(node.id)
        if kept is None:
            return
        self.stats.expanded += 1
        tasks: list[asyncio.Task[None]] = []
        made, base = 0, len(node.children)
        while made < width:
            k = await slots.take(width - made)
            first = base + made
            try:
                envs = await self._restore(kept, k, task, template, seed)
            except Exception as e:
                self.stats.fork_failures += 1
                await slots.give(k)
                for i in range(first, first + k):
                    node.children.append(
                        Node(path=(*node.path, i), step=node.step + 1, observation="", error=str(e))
                    )
                made += k
                continue
            self.stats.children += k
            for i, env in enumerate(envs):
                tasks.append(
                    asyncio.create_task(
                        self._first(env, node, kept.messages, task, slots, first + i)
                    )
                )
            made += k
        try:
            await asyncio.gather(*tasks)
        finally:
            for tk in tasks:
                tk.cancel()

    async def _drop_kept(self, kept: dict[str, _Kept] | None) -> None:
        async def drop(k: _Kept) -> None:
            try:
                if k.checkpoint is not None:
                    await AsyncSandbox.delete_checkpoint(k.checkpoint)
                if k.suspended_id is not None:
                    await AsyncSandbox.kill(k.suspended_id)
            except Exception as e:  # the node removes them at their end of life
                log.warning("removing a kept node state: %s", e)

        await asyncio.gather(*(drop(k) for k in (kept or {}).values()))

    async def _grow(
        self,
        env: SandboxEnv,
        node: Node,
        messages: list[dict[str, str]],
        task: Task | None,
        slots: _Slots,
    ) -> None:
        """Takes ``env`` (holding one slot) on from ``node``; closes it."""
        try:
            while True:
                if node.error is not None or node.terminated or node.truncated:
                    return
                if node.step >= self.max_steps:
                    return
                if self.prune is not None and node.action is not None and self.prune(node):
                    node.pruned = True
                    self.stats.pruned += 1
                    return
                width = _width(self.schedule, node)
                if width > 1:

                    async def fork(k: int, _first: int, env: SandboxEnv = env) -> list[SandboxEnv]:
                        return await env.fork(k)

                    await self._branch(fork, node, messages, task, slots, width)
                    return
                if self._kept is not None and self._kept_more and node.action is not None:
                    await self._keep(env, node, messages)
                node, messages = await self._step(env, node, messages, task, len(node.children))
        finally:
            await env.close()
            await slots.give()

    async def _branch(
        self,
        fork: Callable[[int, int], Awaitable[list[SandboxEnv]]],
        node: Node,
        messages: list[dict[str, str]],
        task: Task | None,
        slots: _Slots,
        width: int,
    ) -> None:
        """``width`` children of ``node``, ``fork(k, first)`` making children
        ``first .. first + k - 1`` (as many per call as there are free
        slots), and grows each."""
        tasks: list[asyncio.Task[None]] = []
        index = 0
        while index < width:
            k = await slots.take(width - index)
            children: list[SandboxEnv] | None = None
            error: BaseException | None = None
            for _ in range(1 + self.fork_retries):
                try:
                    self.stats.forks += 1
                    children = await fork(k, index)
                    break
                except Exception as e:
                    self.stats.fork_failures += 1
                    error = e
            if children is None:
                await slots.give(k)
                for i in range(index, index + k):
                    node.children.append(
                        Node(
                            path=(*node.path, i),
                            step=node.step + 1,
                            observation="",
                            error=str(error),
                        )
                    )
                index += k
                continue
            self.stats.children += k
            for child in children:
                tasks.append(
                    asyncio.create_task(self._first(child, node, messages, task, slots, index))
                )
                index += 1
        try:
            await asyncio.gather(*tasks)
        finally:
            for tk in tasks:
                tk.cancel()
        node.children.sort(key=lambda n: n.path)

    async def _first(
        self,
        env: SandboxEnv,
        parent: Node,
        messages: list[dict[str, str]],
        task: Task | None,
        slots: _Slots,
        index: int,
    ) -> None:
        try:
            node, msgs = await self._step(env, parent, messages, task, index)
        except BaseException:
            await env.close()
            await slots.give()
            raise
        await self._grow(env, node, msgs, task, slots)

    async def _step(
        self,
        env: SandboxEnv,
        node: Node,
        messages: list[dict[str, str]],
        task: Task | None,
        index: int,
    ) -> tuple[Node, list[dict[str, str]]]:
        """One policy call and one env step from ``node``: the new child."""
        answer = self.policy(PolicyInput(list(messages), node, task, env.rng))
        got = await answer if inspect.isawaitable(answer) else answer
        act = got if isinstance(got, Action) else Action(str(got))
        try:
            r = await env.step(act.text)
        except Exception as e:
            # the sandbox is lost: the branch ends here, the tree goes on
            child = Node(
                path=(*node.path, index),
                step=node.step + 1,
                observation="",
                action=act.text,
                error=f"step failed: {e}",
            )
            node.children.append(child)
            return child, messages
        child = Node(
            path=(*node.path, index),
            step=node.step + 1,
            observation=r.observation,
            action=act.text,
            reward=r.reward,
            terminated=r.terminated,
            truncated=r.truncated,
            sandbox_id=env.sandbox.sandbox_id if env.sandbox else None,
            tokens=act.tokens,
            logprobs=act.logprobs,
            info={**act.info, **r.info},
        )
        node.children.append(child)
        msgs = [
            *messages,
            {"role": "assistant", "content": act.text},
            {"role": "user", "content": r.observation},
        ]
        return child, msgs
