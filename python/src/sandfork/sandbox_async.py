"""``AsyncSandbox``: the e2b SDK's async sandbox plus branching; the same
additions as ``sandfork.Sandbox``, with the children of one call set up
concurrently."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
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
    async_api_client,
    child_options,
    chunks,
    fork_results,
    probe_capabilities_async,
    reseed,
    snapshot_fork_request,
)
from ._lineage import LINEAGE_PATH, Lineage

log = logging.getLogger("sandfork")

#: Called for every new child before its lineage is written to the guest:
#: ``hook(child, branch_index)``, plain or async.
AsyncAfterFork = Callable[["AsyncSandbox", int], "Awaitable[None] | None"]


class AsyncSandbox(e2b.AsyncSandbox):
    """An e2b ``AsyncSandbox`` that knows its place in a fork tree."""

    lineage: Lineage

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self.lineage = Lineage.root(self.sandbox_id)

    # --- lineage ------------------------------------------------------------

    async def write_lineage(self) -> None:
        """Writes ``self.lineage`` to ``/run/sandfork/lineage.json`` (and the
        seed to ``/run/sandfork/seed``) in the guest."""
        await self.commands.run(self.lineage.guest_script(), user="root", timeout=60)

    async def read_lineage(self) -> Lineage | None:
        """The lineage file in the guest, if there is one. A fork child or a
        sandbox from a snapshot holds its source's until it is rewritten."""
        try:
            text = await self.files.read(LINEAGE_PATH, user="root")
        except NotFoundException:
            return None
        return Lineage.from_json(text)

    async def load_lineage(self) -> Lineage:
        """Sets ``self.lineage`` from the guest's file when that file is this
        sandbox's (a sandbox that never had one is a root)."""
        found = await self.read_lineage()
        if found is not None and found.sandbox_id == self.sandbox_id:
            self.lineage = found
        return self.lineage

    async def _adopt(
        self, lineage: Lineage, index: int, after_fork: AsyncAfterFork | None
    ) -> Self | Exception:
        try:
            self.lineage = lineage
            if after_fork is not None:
                done = after_fork(self, index)
                if inspect.isawaitable(done):
                    await done
            await self.write_lineage()
            return self
        except Exception as e:
            await _kill_quietly(self)
            return e

    # --- fork ---------------------------------------------------------------

    @class_method_variant("_cls_fork_sandbox")  # type: ignore[arg-type]
    async def fork(
        self,
        timeout: int | None = None,
        count: int | None = None,
        *,
        after_fork: AsyncAfterFork | None = reseed,
        **opts: Any,
    ) -> list[Self | Exception]:
        """e2b's fork (one entry per child: a sandbox or why it failed), with
        lineage set and ``after_fork`` run on every child that started."""
        return await type(self)._cls_fork_sandbox(
            self.sandbox_id,
            timeout=timeout,
            count=count,
            after_fork=after_fork,
            parent_lineage=self.lineage,
            **self.connection_config.get_api_params(**opts),
        )

    @classmethod
    async def _cls_fork_sandbox(
        cls,
        sandbox_id: str,
        timeout: int | None = None,
        count: int | None = None,
        logger: logging.Logger | None = None,
        *,
        after_fork: AsyncAfterFork | None = reseed,
        parent_lineage: Lineage | None = None,
        index_base: int = 0,
        **opts: Any,
    ) -> list[Self | Exception]:
        results = await super()._cls_fork_sandbox(
            sandbox_id, timeout=timeout, count=count, logger=logger, **opts
        )
        started = [r for r in results if not isinstance(r, Exception)]
        if parent_lineage is None:
            parent_lineage = Lineage.root(sandbox_id)
            if started:
                inherited = await started[0].read_lineage()
                if inherited is not None and inherited.sandbox_id == sandbox_id:
                    parent_lineage = inherited
        lineage = parent_lineage

        async def adopt(i: int, r: Self | Exception) -> Self | Exception:
            if isinstance(r, Exception):
                return r
            n = index_base + i
            return await r._adopt(lineage.child(r.sandbox_id, n), n, after_fork)

        return list(await asyncio.gather(*(adopt(i, r) for i, r in enumerate(results))))

    async def fork_all(
        self,
        count: int,
        *,
        timeout: int | None = None,
        after_fork: AsyncAfterFork | None = reseed,
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
                results += await type(self)._cls_fork_sandbox(
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
        return await _all_or_error(self.sandbox_id, results, cleanup_on_error)

    # --- checkpoints --------------------------------------------------------

    async def checkpoint(
        self, name: str | None = None, data: dict[str, Any] | None = None
    ) -> Checkpoint:
        """A snapshot of memory and disk (the sandbox keeps running)."""
        info = await self.create_snapshot(name)
        return Checkpoint(
            snapshot_id=info.snapshot_id,
            source_id=self.sandbox_id,
            lineage=self.lineage,
            name=name,
            data=dict(data or {}),
        )

    @classmethod
    async def fork_snapshot(
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
        async with async_api_client(ConnectionConfig(**params)) as c:
            resp = await c.post(path, json=body)
        responses = fork_results(resp, f"snapshot {snapshot_id}")
        return [
            r if isinstance(r, Exception) else cls(**child_options(r, params, logger))
            for r in responses
        ]

    @classmethod
    async def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        count: int = 1,
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        after_fork: AsyncAfterFork | None = reseed,
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
            fork = (await probe_capabilities_async(config)).fork_from_snapshot
        if fork:
            try:
                started = await cls.fork_snapshot(
                    checkpoint.snapshot_id, count, timeout=timeout, metadata=metadata, **opts
                )
            except Exception as e:
                started = [e] * count

            async def adopt(i: int, r: Self | Exception) -> Self | Exception:
                if isinstance(r, Exception):
                    return r
                return await r._adopt(checkpoint.lineage.child(r.sandbox_id, i), i, after_fork)

            results = list(await asyncio.gather(*(adopt(i, r) for i, r in enumerate(started))))
            return await _all_or_error(checkpoint.source_id, results, cleanup_on_error)

        async def one(i: int) -> Self | Exception:
            try:
                sbx = await cls.create(
                    checkpoint.snapshot_id, timeout=timeout, metadata=metadata, **opts
                )
            except Exception as e:
                return e
            return await sbx._adopt(checkpoint.lineage.child(sbx.sandbox_id, i), i, after_fork)

        results = list(await asyncio.gather(*(one(i) for i in range(count))))
        return await _all_or_error(checkpoint.source_id, results, cleanup_on_error)

    @classmethod
    async def delete_checkpoint(cls, checkpoint: Checkpoint, **opts: Any) -> bool:
        return await cls.delete_snapshot(checkpoint.snapshot_id, **opts)

    # --- suspend and resume -------------------------------------------------

    async def suspend(self, **opts: Any) -> bool:
        """Pauses the sandbox to storage (``True``, or ``False`` if it already
        was); ``AsyncSandbox.resume(id)`` brings it back."""
        return await self.pause(**opts)

    @classmethod
    async def resume(cls, sandbox_id: str, timeout: int | None = None, **opts: Any) -> Self:
        """Connects to (and so resumes) a suspended sandbox, lineage included."""
        sbx = await cls._cls_connect_sandbox(sandbox_id, timeout=timeout, **opts)
        await sbx.load_lineage()
        return sbx

    # --- capabilities and fallbacks -----------------------------------------

    async def capabilities(self) -> Capabilities:
        """What this sandbox's node offers for branching."""
        return await probe_capabilities_async(self.connection_config)

    async def branch(
        self,
        count: int,
        *,
        replay: Sequence[str] | None = None,
        strategy: Strategy | None = None,
        capabilities: Capabilities | None = None,
        timeout: int | None = None,
        after_fork: AsyncAfterFork | None = reseed,
    ) -> list[Self]:
        """``count`` copies of this sandbox by the best means the node has:
        fork; else a snapshot and ``count`` creates; else ``count`` fresh
        sandboxes from its template running ``replay``. All or ``ForkError``."""
        max_per_call = SDK_MAX_FORK_COUNT
        if strategy is None:
            caps = capabilities or await self.capabilities()
            strategy = caps.strategy
            max_per_call = caps.max_fork_count or SDK_MAX_FORK_COUNT
        if strategy == "fork":
            return await self.fork_all(
                count, timeout=timeout, after_fork=after_fork, max_per_call=max_per_call
            )
        if strategy == "replay" and replay is None:
            raise ValueError("create-and-replay needs the commands to replay (replay=[...])")
        # the copies carry the source's metadata, as fork children do
        info = await self.get_info()
        metadata = dict(info.metadata or {})
        if strategy == "snapshot":
            ckpt = await self.checkpoint()
            try:
                return await type(self).from_checkpoint(
                    ckpt, count, timeout=timeout, metadata=metadata, after_fork=after_fork
                )
            finally:
                await type(self).delete_checkpoint(ckpt)
        api = self.connection_config.get_api_params()

        async def one(i: int) -> Self | Exception:
            try:
                sbx = await type(self).create(
                    info.template_id, timeout=timeout, metadata=metadata, **api
                )
            except Exception as e:
                return e
            try:
                for cmd in replay or ():
                    # a command that failed the first time fails again: same state
                    with contextlib.suppress(CommandExitException):
                        await sbx.commands.run(cmd, timeout=0)
            except Exception as e:
                await _kill_quietly(sbx)
                return e
            return await sbx._adopt(self.lineage.child(sbx.sandbox_id, i), i, after_fork)

        results = list(await asyncio.gather(*(one(i) for i in range(count))))
        return await _all_or_error(self.sandbox_id, results, True)


async def _kill_quietly(sbx: e2b.AsyncSandbox) -> None:
    try:
        await sbx.kill()
    except Exception as e:  # cleanup must not hide the error being reported
        log.warning("killing %s failed: %s", sbx.sandbox_id, e)


async def _all_or_error(source_id: str, results: list[Any], cleanup_on_error: bool) -> list[Any]:
    failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
    if not failed:
        return results
    started = [r for r in results if not isinstance(r, Exception)]
    if cleanup_on_error:
        await asyncio.gather(*(_kill_quietly(r) for r in started))
        started = []
    raise ForkError(source_id, len(results), failed, started)
