"""``Sandbox``: the e2b SDK's sandbox plus branching.

A thin subclass: everything e2b does works unchanged, and the SDK builds fork
children with ``cls(...)``, so they come back as this class. Additions:
lineage, ``fork_all``, the ``after_fork`` hook, checkpoints, suspend/resume,
capabilities and ``branch`` with its fallbacks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import e2b
from e2b import CommandExitException, NotFoundException
from e2b.connection_config import ConnectionConfig
from e2b.sandbox.utils import class_method_variant
from typing_extensions import Self

from ._common import (
    SDK_MAX_FORK_COUNT,
    Capabilities,
    Checkpoint,
    ForkError,
    Strategy,
    api_client,
    child_options,
    chunks,
    fork_results,
    probe_capabilities,
    reseed,
    snapshot_fork_request,
)
from ._lineage import LINEAGE_PATH, Lineage

log = logging.getLogger("sandfork")

#: Called for every child of a fork, restore or replay before its lineage is
#: written to the guest: ``hook(child, branch_index)``.
AfterFork = Callable[["Sandbox", int], None]


class Sandbox(e2b.Sandbox):
    """An e2b ``Sandbox`` that knows its place in a fork tree."""

    lineage: Lineage

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

    def _adopt(
        self, lineage: Lineage, index: int, after_fork: AfterFork | None
    ) -> Self | Exception:
        """Gives a new child its lineage and runs the hook; a child that fails
        here is killed and reported as failed."""
        try:
            self.lineage = lineage
            if after_fork is not None:
                after_fork(self, index)
            self.write_lineage()
            return self
        except Exception as e:
            _kill_quietly(self)
            return e

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
        started = [r for r in results if not isinstance(r, Exception)]
        if parent_lineage is None:
            # Forked by id: the children carry the parent's file, if it had one.
            parent_lineage = Lineage.root(sandbox_id)
            if started:
                inherited = started[0].read_lineage()
                if inherited is not None and inherited.sandbox_id == sandbox_id:
                    parent_lineage = inherited
        return [
            r
            if isinstance(r, Exception)
            else r._adopt(
                parent_lineage.child(r.sandbox_id, index_base + i), index_base + i, after_fork
            )
            for i, r in enumerate(results)
        ]

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
        results: list[Self | Exception] = []
        api = self.connection_config.get_api_params(**opts)
        for n in chunks(count, max_per_call):
            try:
                results += type(self)._cls_fork_sandbox(
                    self.sandbox_id,
                    timeout=timeout,
                    count=n,
                    after_fork=after_fork,
                    parent_lineage=self.lineage,
                    index_base=len(results),
                    **api,
                )
            except Exception as e:
                results += [e] * n
        return _all_or_error(self.sandbox_id, results, cleanup_on_error)

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
        if fork is None:
            config = ConnectionConfig(**cls._resolve_api_params(**opts))
            fork = probe_capabilities(config).fork_from_snapshot
        results: list[Self | Exception] = []
        if fork:
            try:
                started = cls.fork_snapshot(
                    checkpoint.snapshot_id, count, timeout=timeout, metadata=metadata, **opts
                )
            except Exception as e:
                started = [e] * count
            results = [
                r
                if isinstance(r, Exception)
                else r._adopt(checkpoint.lineage.child(r.sandbox_id, i), i, after_fork)
                for i, r in enumerate(started)
            ]
            return _all_or_error(checkpoint.source_id, results, cleanup_on_error)
        for i in range(count):
            try:
                sbx = cls.create(checkpoint.snapshot_id, timeout=timeout, metadata=metadata, **opts)
            except Exception as e:
                results.append(e)
                continue
            results.append(sbx._adopt(checkpoint.lineage.child(sbx.sandbox_id, i), i, after_fork))
        return _all_or_error(checkpoint.source_id, results, cleanup_on_error)

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
        if strategy is None:
            caps = capabilities or self.capabilities()
            strategy = caps.strategy
            max_per_call = caps.max_fork_count or SDK_MAX_FORK_COUNT
        else:
            max_per_call = SDK_MAX_FORK_COUNT
        if strategy == "fork":
            return self.fork_all(
                count, timeout=timeout, after_fork=after_fork, max_per_call=max_per_call
            )
        if strategy == "replay" and replay is None:
            raise ValueError("create-and-replay needs the commands to replay (replay=[...])")
        # the copies carry the source's metadata, as fork children do
        info = self.get_info()
        metadata = dict(info.metadata or {})
        if strategy == "snapshot":
            ckpt = self.checkpoint()
            try:
                return type(self).from_checkpoint(
                    ckpt, count, timeout=timeout, metadata=metadata, after_fork=after_fork
                )
            finally:
                # the children run on unaffected
                type(self).delete_checkpoint(ckpt)
        results: list[Self | Exception] = []
        for i in range(count):
            try:
                sbx = type(self).create(
                    info.template_id,
                    timeout=timeout,
                    metadata=metadata,
                    **self.connection_config.get_api_params(),
                )
            except Exception as e:
                results.append(e)
                continue
            try:
                for cmd in replay or ():
                    # a command that failed the first time fails again: same state
                    with contextlib.suppress(CommandExitException):
                        sbx.commands.run(cmd, timeout=0)
            except Exception as e:
                _kill_quietly(sbx)
                results.append(e)
                continue
            results.append(sbx._adopt(self.lineage.child(sbx.sandbox_id, i), i, after_fork))
        return _all_or_error(self.sandbox_id, results, True)


def _kill_quietly(sbx: e2b.Sandbox) -> None:
    try:
        sbx.kill()
    except Exception as e:  # cleanup must not hide the error being reported
        log.warning("killing %s failed: %s", sbx.sandbox_id, e)


def _all_or_error(source_id: str, results: list[Any], cleanup_on_error: bool) -> list[Any]:
    failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
    if not failed:
        return results
    started = [r for r in results if not isinstance(r, Exception)]
    if cleanup_on_error:
        for r in started:
            _kill_quietly(r)
        started = []
    raise ForkError(source_id, len(results), failed, started)
