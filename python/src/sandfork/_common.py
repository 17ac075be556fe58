"""What the sync and async sandboxes share: errors, checkpoints, capability
probes and the default fork hook."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx
from e2b import SandboxException
from e2b.connection_config import ConnectionConfig

from ._lineage import Lineage, new_seed

if TYPE_CHECKING:
    from collections.abc import Mapping

#: How a set of children is made, best first.
Strategy = Literal["fork", "snapshot", "replay"]

#: The most children one `fork` call asks for: the e2b SDK's own check.
SDK_MAX_FORK_COUNT = 20

# An id no server holds: probes must never touch a real sandbox.
_PROBE_ID = "sandforkcapabilityprobe"


class ForkError(SandboxException):
    """Not every child of a branching call started.

    ``failed`` maps a child's index to why it failed; ``children`` holds the
    ones that did start, empty when they were killed (the default).
    """

    def __init__(
        self,
        source_id: str,
        count: int,
        failed: Mapping[int, BaseException],
        children: list[Any] | None = None,
    ) -> None:
        self.source_id = source_id
        self.count = count
        self.failed = dict(failed)
        self.children = list(children or [])
        which = ", ".join(f"{i}: {e}" for i, e in sorted(self.failed.items()))
        kept = f"; {len(self.children)} kept" if self.children else ""
        super().__init__(
            f"{len(self.failed)} of {count} children of {source_id} failed ({which}){kept}"
        )


class _HasLineage(Protocol):
    lineage: Lineage


def reseed(child: _HasLineage, index: int) -> None:
    """The default ``after_fork`` hook: a fresh seed for every child, so
    siblings diverge. Pass ``after_fork=None`` to keep the parent's seed
    (identical-state comparisons). The kernel RNG of a child is reseeded by
    the node either way."""
    child.lineage = child.lineage.with_seed(new_seed())


@dataclass(frozen=True)
class Checkpoint:
    """A snapshot of a sandbox (memory and disk) and where it was taken.

    ``Sandbox.from_checkpoint(ckpt, count=n)`` starts ``n`` sandboxes from it;
    ``data`` is free for the caller (``SandboxEnv`` keeps episode state there).
    """

    snapshot_id: str
    source_id: str
    lineage: Lineage
    name: str | None = None
    created_at: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a node offers for branching, found by side-effect-free probes.

    ``max_fork_count`` is the most children one fork call may ask for (the
    node's limit and the SDK's, whichever is lower).
    """

    fork: bool
    snapshot: bool
    fork_from_snapshot: bool
    max_fork_count: int

    @property
    def strategy(self) -> Strategy:
        """The best way to branch: fork, else snapshot and create, else
        create and replay."""
        if self.fork:
            return "fork"
        if self.snapshot:
            return "snapshot"
        return "replay"


# The node validates a fork's count before it looks the sandbox up (as E2B
# does), so a bad count against an unknown id answers 400 where fork exists.
_LIMIT = re.compile(r"greater than (\d+)")


def _probe_requests(config: ConnectionConfig) -> tuple[str, dict[str, str]]:
    headers = dict(config.headers)
    if config.api_key:
        headers["X-API-KEY"] = config.api_key
    return config.api_url.rstrip("/"), headers


def _fork_limit(resp: httpx.Response) -> int:
    try:
        message = str(resp.json().get("message", ""))
    except ValueError:
        message = ""
    m = _LIMIT.search(message)
    return min(int(m.group(1)), SDK_MAX_FORK_COUNT) if m else SDK_MAX_FORK_COUNT


def _capabilities(
    fork: httpx.Response, too_many: httpx.Response, snaps: httpx.Response, snap_fork: httpx.Response
) -> Capabilities:
    has_fork = fork.status_code == 400
    return Capabilities(
        fork=has_fork,
        snapshot=snaps.status_code == 200,
        fork_from_snapshot=snap_fork.status_code == 400,
        max_fork_count=_fork_limit(too_many) if has_fork else 0,
    )


def probe_capabilities(config: ConnectionConfig) -> Capabilities:
    base, headers = _probe_requests(config)
    with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
        return _capabilities(
            c.post(f"/sandboxes/{_PROBE_ID}/fork", json={"count": 0}),
            c.post(f"/sandboxes/{_PROBE_ID}/fork", json={"count": 1_000_000}),
            c.get("/snapshots", params={"limit": 1}),
            c.post(f"/snapshots/{_PROBE_ID}/fork", json={"count": 0}),
        )


async def probe_capabilities_async(config: ConnectionConfig) -> Capabilities:
    base, headers = _probe_requests(config)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as c:
        return _capabilities(
            await c.post(f"/sandboxes/{_PROBE_ID}/fork", json={"count": 0}),
            await c.post(f"/sandboxes/{_PROBE_ID}/fork", json={"count": 1_000_000}),
            await c.get("/snapshots", params={"limit": 1}),
            await c.post(f"/snapshots/{_PROBE_ID}/fork", json={"count": 0}),
        )


def chunks(count: int, size: int) -> list[int]:
    """``count`` split into fork calls of at most ``size`` children."""
    if count < 1:
        raise ValueError("count must be at least 1")
    size = max(1, size)
    return [min(size, count - start) for start in range(0, count, size)]
