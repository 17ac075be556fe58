"""``Sandbox``: the e2b SDK's sandbox plus branching.

A thin subclass: everything e2b does works unchanged, and the SDK builds fork
children with ``cls(...)``, so they come back as this class. Additions:
lineage, ``fork_all``, the ``after_fork`` hook, checkpoints, suspend/resume,
capabilities and ``branch`` with its fallbacks. The logic is ``_ops``',
shared with ``AsyncSandbox``: these methods only drive it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import e2b
from e2b import NotFoundException
from e2b.connection_config import ConnectionConfig
from e2b.sandbox.utils import class_method_variant
from typing_extensions import Self

from . import _ops
from ._common import (
    SDK_MAX_FORK_COUNT,
    Capabilities,
    Checkpoint,
    Strategy,
    api_client,
    child_options,
    fork_results,
    probe_capabilities,
    reseed,
    rollback_answer,
    rollback_request,
    snapshot_fork_request,
)
from ._lineage import LINEAGE_PATH, Lineage

#: Called for every child of a fork, restore or replay before its lineage is
#: written to the guest: ``hook(child, branch_index)``.
AfterFork = Callable[["Sandbox", int], None]


class Sandbox(e2b.Sandbox):
    """An e2b ``Sandbox`` that knows its place in a fork tree."""

    lineage: Lineage
    _probe = staticmethod(probe_capabilities)

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self.lineage = Lineage.root(self.sandbox_id)

    # --- lineage ------------------------------------------------------------

    def write_lineage(self) -> None:
        """Writes ``self.lineage`` to ``/run/sandfork/lineage.json`` (and the
        seed to ``/run/sandfork/seed``) in the guest."""
        self.commands.run(self.lineage.guest_script(), user="root", timeout=60)

    def read_lineage(self) -> Lineage | None:
        """The lineage file in the guest, if there is one. A fork child or a
        sandbox from a snapshot holds its source's until it is rewritten."""
        try:
            text = self.files.read(LINEAGE_PATH, user="root")
        except NotFoundException:
            return None
        return Lineage.from_json(text)

    def load_lineage(self) -> Lineage:
        """Sets ``self.lineage`` from the guest's file when that file is this
        sandbox's (a sandbox that never had one is a root)."""
        found = self.read_lineage()
        if found is not None and found.sandbox_id == self.sandbox_id:
            self.lineage = found
        return self.lineage

    # --- fork ---------------------------------------------------------------

    @class_method_variant("_cls_fork_sandbox")  # type: ignore[arg-type]
    def fork(
        self,
        timeout: int | None = None,
        count: int | None = None,
        *,
        after_fork: AfterFork | None = reseed,
        **opts: Any,
    ) -> list[Self | Exception]:
        """e2b's fork (one entry per child: a sandbox or why it failed), with
        lineage set and ``after_fork`` run on every child that started."""
        return type(self)._cls_fork_sandbox(
            self.sandbox_id,
            timeout=timeout,
            count=count,
            after_fork=after_fork,
            parent_lineage=self.lineage,
            **self.connection_config.get_api_params(**opts),
        )

    @classmethod
    def _cls_fork_sandbox(
        cls,
        sandbox_id: str,
        timeout: int | None = None,
        count: int | None = None,
        logger: logging.Logger | None = None,
        *,
        after_fork: AfterFork | None = reseed,
        parent_lineage: Lineage | None = None,
        index_base: int = 0,
        **opts: Any,
    ) -> list[Self | Exception]:
        results = super()._cls_fork_sandbox(
            sandbox_id, timeout=timeout, count=count, logger=logger, **opts
        )
        return _ops.run_sync(
            _ops.forked(sandbox_id, results, parent_lineage, index_base, after_fork)
        )

    def fork_all(
        self,
        count: int,
        *,
        timeout: int | None = None,
        after_fork: AfterFork | None = reseed,
        cleanup_on_error: bool = True,
        max_per_call: int = SDK_MAX_FORK_COUNT,
        **opts: Any,
    ) -> list[Self]:
        """``count`` children, or ``ForkError`` naming the ones that failed
        (the others killed unless ``cleanup_on_error=False``). More than
        ``max_per_call`` children take several fork calls."""
        return _ops.run_sync(
            _ops.fork_all(
                self,
                count,
                timeout=timeout,
                after_fork=after_fork,
                cleanup_on_error=cleanup_on_error,
                max_per_call=max_per_call,
                api=self.connection_config.get_api_params(**opts),
            )
        )

    @classmethod
    def branch_suspended(
        cls,
        sandbox_id: str,
        count: int,
        *,
        capabilities: Capabilities | None = None,
        timeout: int | None = None,
        after_fork: AfterFork | None = reseed,
        **opts: Any,
    ) -> list[Self]:
        """``count`` children of a suspended (paused) sandbox, which stays
        suspended: fork calls on it where the node forks paused sandboxes
        (``Capabilities.fork_paused``), else it is resumed, branched (fork,
        or a snapshot and creates) and suspended again. All or ``ForkError``."""
        return _ops.run_sync(
            _ops.branch_suspended(
                cls,
                sandbox_id,
                count,
                capabilities=capabilities,
                timeout=timeout,
                after_fork=after_fork,
                opts=opts,
            )
        )

    # --- checkpoints --------------------------------------------------------

    def checkpoint(self, name: str | None = None, data: dict[str, Any] | None = None) -> Checkpoint:
        """A snapshot of memory and disk (the sandbox keeps running)."""
        info = self.create_snapshot(name)
        return Checkpoint(
            snapshot_id=info.snapshot_id,
            source_id=self.sandbox_id,
            lineage=self.lineage,
            name=name,
            data=dict(data or {}),
        )

    def rollback(self, checkpoint: Checkpoint | str) -> None:
        """Back to ``checkpoint`` (or a snapshot id or name) in place: one of
        this sandbox's own snapshots. The sandbox keeps its id, access token
        and timeout; its memory, processes and disk are the checkpoint's, and
        so is its lineage. Raises ``NotFoundException`` for an unknown
        snapshot, ``SandboxException`` (409) for another sandbox's."""
        path, body = rollback_request(self.sandbox_id, checkpoint)
        with api_client(self.connection_config) as c:
            rollback_answer(c.post(path, json=body), self.sandbox_id)
        if isinstance(checkpoint, Checkpoint):
            self.lineage = checkpoint.lineage

    @classmethod
    def fork_snapshot(
        cls,
        snapshot_id: str,
        count: int = 1,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        logger: logging.Logger | None = None,
        **opts: Any,
    ) -> list[Self | Exception]:
        """``count`` sandboxes from a snapshot (its id or name) in one call to
        the node (``POST /snapshots/{id}/fork``): one entry per child, a
        sandbox or why it failed, as ``fork`` answers. No lineage is set: see
        ``from_checkpoint``."""
        params = cls._resolve_api_params(**opts)
        path, body = snapshot_fork_request(snapshot_id, count, timeout, metadata)
        with api_client(ConnectionConfig(**params)) as c:
            responses = fork_results(c.post(path, json=body), f"snapshot {snapshot_id}")
        return [
            r if isinstance(r, Exception) else cls(**child_options(r, params, logger))
            for r in responses
        ]

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        count: int = 1,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        after_fork: AfterFork | None = reseed,
        cleanup_on_error: bool = True,
        fork: bool | None = None,
        **opts: Any,
    ) -> list[Self]:
        """``count`` sandboxes started from a checkpoint, children of its
        source in the lineage; all of them or ``ForkError``. One fork call
        when the node forks snapshots (``fork=None`` asks it), else
        ``count`` creates."""
        return _ops.run_sync(
            _ops.from_checkpoint(
                cls,
                checkpoint,
                count,
                timeout=timeout,
                metadata=metadata,
                after_fork=after_fork,
                cleanup_on_error=cleanup_on_error,
                fork=fork,
                opts=opts,
            )
        )

    @classmethod
    def delete_checkpoint(cls, checkpoint: Checkpoint, **opts: Any) -> bool:
        return cls.delete_snapshot(checkpoint.snapshot_id, **opts)

    # --- suspend and resume -------------------------------------------------

    def suspend(self, **opts: Any) -> bool:
        """Pauses the sandbox to storage (``True``, or ``False`` if it already
        was); ``Sandbox.resume(id)`` brings it back."""
        return self.pause(**opts)

    @classmethod
    def resume(cls, sandbox_id: str, timeout: int | None = None, **opts: Any) -> Self:
        """Connects to (and so resumes) a suspended sandbox, lineage included."""
        sbx = cls._cls_connect_sandbox(sandbox_id, timeout=timeout, **opts)
        sbx.load_lineage()
        return sbx

    # --- capabilities and fallbacks -----------------------------------------

    def capabilities(self) -> Capabilities:
        """What this sandbox's node offers for branching."""
        return probe_capabilities(self.connection_config)

    def branch(
        self,
        count: int,
        *,
        replay: Sequence[str] | None = None,
        strategy: Strategy | None = None,
        capabilities: Capabilities | None = None,
        timeout: int | None = None,
        after_fork: AfterFork | None = reseed,
    ) -> list[Self]:
        """``count`` copies of this sandbox by the best means the node has:
        fork; else a snapshot and ``count`` creates; else ``count`` fresh
        sandboxes from its template running ``replay`` (the commands that made
        its state). All or ``ForkError``."""
        return _ops.run_sync(
            _ops.branch(
                self,
                count,
                replay=replay,
                strategy=strategy,
                capabilities=capabilities,
                timeout=timeout,
                after_fork=after_fork,
            )
        )
