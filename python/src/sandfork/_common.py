"""What the sync and async sandboxes share: errors, checkpoints, capability
probes and the default fork hook."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol
from urllib.parse import quote

import httpx
from e2b import NotFoundException, SandboxException
from e2b.api import SandboxCreateResponse, api_exception_from_code, handle_api_exception
from e2b.connection_config import ConnectionConfig
from packaging.version import Version

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
    """What a node offers for branching.

    ``max_fork_count`` is the most children one fork call may ask for (the
    node's limit and the SDK's, whichever is lower). ``fork_from_snapshot``:
    the node forks a snapshot into N sandboxes in one call
    (``POST /snapshots/{id}/fork``); ``fork_paused``: it forks a paused
    sandbox, which stays paused (``Sandbox.fork(paused_id, count=n)``);
    ``rollback``: a sandbox goes back to one of its own checkpoints in place
    (``Sandbox.rollback(ckpt)``, ``POST /sandboxes/{id}/rollback``).

    ``source`` says how they were found: ``"node"`` from the node's own
    list (``GET /v1/node``'s ``features``, one request), ``"probe"`` from
    side-effect-free requests to the routes (any E2B-compatible server; a
    paused fork cannot be probed so, and counts as absent).
    """

    fork: bool
    snapshot: bool
    fork_from_snapshot: bool
    max_fork_count: int
    fork_paused: bool = False
    rollback: bool = False
    source: Literal["node", "probe"] = "probe"

    @property
    def strategy(self) -> Strategy:
        """The best way to branch: fork, else snapshot and create, else
        create and replay."""
        if self.fork:
            return "fork"
        if self.snapshot:
            return "snapshot"
        return "replay"

    @classmethod
    def from_node_info(cls, info: Any) -> Capabilities | None:
        """From ``GET /v1/node``'s answer: its ``features``, or ``None`` for a
        node that does not list them."""
        features = info.get("features") if isinstance(info, dict) else None
        if not isinstance(features, dict):
            return None
        fork = features.get("fork") is True
        limit = features.get("maxForkCount")
        count = min(limit, SDK_MAX_FORK_COUNT) if isinstance(limit, int) else SDK_MAX_FORK_COUNT
        return cls(
            fork=fork,
            snapshot=features.get("snapshots") is True,
            fork_from_snapshot=features.get("forkSnapshot") is True,
            max_fork_count=max(0, count) if fork else 0,
            fork_paused=features.get("forkPaused") is True,
            rollback=features.get("rollback") is True,
            source="node",
        )


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


def _from_node(resp: httpx.Response) -> Capabilities | None:
    if resp.status_code != 200:
        return None
    try:
        return Capabilities.from_node_info(resp.json())
    except ValueError:
        return None


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


#: The probes: (method, path, body or query), in ``_capabilities``' order.
_PROBES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", f"/sandboxes/{_PROBE_ID}/fork", {"json": {"count": 0}}),
    ("POST", f"/sandboxes/{_PROBE_ID}/fork", {"json": {"count": 1_000_000}}),
    ("GET", "/snapshots", {"params": {"limit": 1}}),
    ("POST", f"/snapshots/{_PROBE_ID}/fork", {"json": {"count": 0}}),
]
_NODE_INFO = "/v1/node"


def probe_capabilities(config: ConnectionConfig) -> Capabilities:
    """The node's own list when it has one, else the probes."""
    base, headers = _probe_requests(config)
    with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
        found = _from_node(c.get(_NODE_INFO))
        if found is not None:
            return found
        return _capabilities(*(c.request(m, path, **kw) for m, path, kw in _PROBES))


async def probe_capabilities_async(config: ConnectionConfig) -> Capabilities:
    base, headers = _probe_requests(config)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as c:
        found = _from_node(await c.get(_NODE_INFO))
        if found is not None:
            return found
        return _capabilities(*[await c.request(m, path, **kw) for m, path, kw in _PROBES])


def snapshot_fork_request(
    snapshot_id: str,
    count: int,
    timeout: int | None,
    metadata: Mapping[str, str] | None,
) -> tuple[str, dict[str, Any]]:
    """The path and body of ``POST /snapshots/{id}/fork`` (E2B PR infra
    #3441's shape, served by sandfork): a name may hold ``/``."""
    body: dict[str, Any] = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    if metadata:
        body["metadata"] = dict(metadata)
    return f"/snapshots/{quote(snapshot_id, safe='')}/fork", body


def rollback_request(sandbox_id: str, checkpoint: Checkpoint | str) -> tuple[str, dict[str, Any]]:
    """The path and body of ``POST /sandboxes/{id}/rollback`` (sandfork's)."""
    snapshot_id = checkpoint.snapshot_id if isinstance(checkpoint, Checkpoint) else checkpoint
    return f"/sandboxes/{quote(sandbox_id, safe='')}/rollback", {"snapshotID": snapshot_id}


def raise_for_answer(resp: httpx.Response, missing: str) -> None:
    """Raises what the e2b SDK would for a call that failed: its
    ``NotFoundException`` for a 404 (the node's message, else ``missing``),
    its exception for the status otherwise."""
    if resp.status_code == 404:
        try:
            message = str(resp.json().get("message", ""))
        except ValueError:
            message = ""
        raise NotFoundException(message or missing)
    if resp.status_code >= 300:
        raise handle_api_exception(resp)


def rollback_answer(resp: httpx.Response, sandbox_id: str) -> None:
    """Raises for a failed rollback (404: the sandbox or snapshot is
    unknown; 409: not its own snapshot, or not running)."""
    raise_for_answer(resp, f"sandbox {sandbox_id} not found")


def fork_results(resp: httpx.Response, source: str) -> list[SandboxCreateResponse | Exception]:
    """A fork's answer as the e2b SDK reads its own: the call failed as a
    whole (raised), or one started sandbox or exception per child."""
    raise_for_answer(resp, f"{source} not found")
    results: list[SandboxCreateResponse | Exception] = []
    for item in resp.json():
        sandbox, error = item.get("sandbox"), item.get("error")
        if error is not None or not sandbox:
            if error is None:
                results.append(SandboxException("Failed to start forked sandbox"))
            elif error.get("code") == 404:
                results.append(NotFoundException(f"404: {error.get('message')}"))
            else:
                results.append(api_exception_from_code(int(error["code"]), error.get("message")))
            continue
        results.append(
            SandboxCreateResponse(
                sandbox_id=sandbox["sandboxID"],
                sandbox_domain=sandbox.get("domain"),
                envd_version=sandbox["envdVersion"],
                envd_access_token=sandbox.get("envdAccessToken"),
                traffic_access_token=sandbox.get("trafficAccessToken"),
            )
        )
    return results


def child_options(
    response: SandboxCreateResponse, params: Mapping[str, Any], logger: logging.Logger | None
) -> dict[str, Any]:
    """The constructor arguments of a sandbox the API just started, as the
    e2b SDK gives its fork children."""
    headers = {
        "E2b-Sandbox-Id": response.sandbox_id,
        "E2b-Sandbox-Port": str(ConnectionConfig.envd_port),
    }
    if response.envd_access_token is not None:
        headers["X-Access-Token"] = response.envd_access_token
    return {
        "sandbox_id": response.sandbox_id,
        "sandbox_domain": response.sandbox_domain,
        "envd_version": Version(response.envd_version),
        "envd_access_token": response.envd_access_token,
        "traffic_access_token": response.traffic_access_token,
        "connection_config": ConnectionConfig(
            extra_sandbox_headers=headers, logger=logger, **params
        ),
    }


def api_client(config: ConnectionConfig) -> httpx.Client:
    base, headers = _probe_requests(config)
    return httpx.Client(base_url=base, headers=headers, timeout=config.request_timeout)


def async_api_client(config: ConnectionConfig) -> httpx.AsyncClient:
    base, headers = _probe_requests(config)
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=config.request_timeout)


def chunks(count: int, size: int) -> list[int]:
    """``count`` split into fork calls of at most ``size`` children."""
    if count < 1:
        raise ValueError("count must be at least 1")
    size = max(1, size)
    return [min(size, count - start) for start in range(0, count, size)]
