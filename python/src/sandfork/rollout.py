"""Branching rollouts: run a policy over a tree of forked environments.

``BranchingRunner(policy, env_factory, schedule).run(task)`` resets one
environment, then at every node asks the schedule how many ways to branch;
a node that branches keeps its sandbox as the template and forks children
from it (in as many fork calls as the bound on live sandboxes allows), each
child takes its own next step. Leaves, pruned branches and failed forks are
killed at once. The result is a ``TrajectoryTree``: export it as GRPO groups
(per tree or per branch point) or JSONL.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Literal, Protocol

from .env import SandboxEnv, Task

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


#: Any callable ``node -> width`` is a schedule too.
ScheduleFn = Callable[[Node], int]


def _width(schedule: FixedSchedule | ScheduleFn | BranchSchedule, node: Node) -> int:
    if isinstance(schedule, FixedSchedule) or not hasattr(schedule, "width"):
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
        schedule: FixedSchedule | ScheduleFn | BranchSchedule,
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

    async def run(
        self, task: str | Task | None = None, *, seed: int | None = None
    ) -> TrajectoryTree:
        slots = _Slots(self.max_live)
        self.stats = RunStats()
        t = Task(task) if isinstance(task, str) else task
        env = self.env_factory()
        await slots.take(1)
        try:
            obs, info = await env.reset(t, seed=seed)
        except BaseException:
            await env.close()
            await slots.give()
            raise
        root = Node(path=(), step=0, observation=obs, sandbox_id=info.get("sandbox_id"))
        await self._grow(env, root, [{"role": "user", "content": obs}], t, slots)
        self.stats.peak_live = slots.peak
        return TrajectoryTree(root, t)

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
                    await self._branch(env, node, messages, task, slots, width)
                    return
                node, messages = await self._step(env, node, messages, task, 0)
        finally:
            await env.close()
            await slots.give()

    async def _branch(
        self,
        env: SandboxEnv,
        node: Node,
        messages: list[dict[str, str]],
        task: Task | None,
        slots: _Slots,
        width: int,
    ) -> None:
        """Forks ``width`` children of ``node`` from ``env``, as many per fork
        call as there are free slots, and grows each."""
        tasks: list[asyncio.Task[None]] = []
        index = 0
        while index < width:
            k = await slots.take(width - index)
            children: list[SandboxEnv] | None = None
            error: BaseException | None = None
            for _ in range(1 + self.fork_retries):
                try:
                    self.stats.forks += 1
                    children = await env.fork(k)
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
