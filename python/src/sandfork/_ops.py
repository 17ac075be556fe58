"""The branching logic of ``Sandbox`` and ``AsyncSandbox``, written once.

Every operation here is a generator that yields the I/O it needs and
returns its result. What it yields is a zero-argument callable (an SDK call:
it answers a value on ``Sandbox``, a coroutine on ``AsyncSandbox``, or
another operation, which is driven in turn) or ``Each`` (several such calls
at once: one after another when sync, gathered when async). An error of a
call is raised at its ``yield``. ``run_sync`` and ``run_async`` drive them,
so the two classes differ only in their signatures and ``await``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

from e2b import CommandExitException
from e2b.connection_config import ConnectionConfig

from ._common import SDK_MAX_FORK_COUNT, Capabilities, Checkpoint, ForkError, Strategy, chunks
from ._lineage import Lineage

log = logging.getLogger("sandfork")

T = TypeVar("T")
#: An operation: yields calls (or ``Each``), returns a ``T``.
Op = Generator[Any, Any, T]
Call = Callable[[], Any]


class Each:
    """Calls made at once; the answer is the list of their results, with the
    exception in the place of a call that raised."""

    def __init__(self, calls: Sequence[Call]) -> None:
        self.calls = list(calls)


def _bind(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Call:
    """``fn`` with its arguments, as a call to yield."""
    return functools.partial(fn, *args, **kwargs)


# --- the drivers ------------------------------------------------------------


def run_sync(op: Op[T]) -> T:
    """Runs ``op`` with blocking calls."""
    value: Any = None
    failed = False
    while True:
        try:
            request = op.throw(value) if failed else op.send(value)
        except StopIteration as stop:
            return stop.value
        try:
            value, failed = _sync(request), False
        except Exception as e:
            value, failed = e, True


def _sync(request: Any) -> Any:
    if isinstance(request, Each):
        out: list[Any] = []
        for call in request.calls:
            try:
                out.append(_sync_call(call))
            except Exception as e:
                out.append(e)
        return out
    return _sync_call(request)


def _sync_call(call: Call) -> Any:
    value = call()
    if inspect.isgenerator(value):
        return run_sync(value)
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()
        raise TypeError("an async call (a hook?) given to a blocking Sandbox")
    return value


async def run_async(op: Op[T]) -> T:
    """Runs ``op`` on the event loop, the calls of an ``Each`` concurrently."""
    value: Any = None
    failed = False
    while True:
        try:
            request = op.throw(value) if failed else op.send(value)
        except StopIteration as stop:
            return stop.value
        try:
            value, failed = await _async(request), False
        except Exception as e:
            value, failed = e, True


async def _async(request: Any) -> Any:
    if isinstance(request, Each):
        calls = (_async_call(c) for c in request.calls)
        return list(await asyncio.gather(*calls, return_exceptions=True))
    return await _async_call(request)


async def _async_call(call: Call) -> Any:
    value = call()
    if inspect.isgenerator(value):
        return await run_async(value)
    if inspect.isawaitable(value):
        return await value
    return value


# --- the operations ---------------------------------------------------------
#
# ``sbx`` is a sandfork Sandbox or AsyncSandbox, ``cls`` one of the classes.


def kill_quietly(sbx: Any) -> Op[None]:
    try:
        yield sbx.kill
    except Exception as e:  # cleanup must not hide the error being reported
        log.warning("killing %s failed: %s", sbx.sandbox_id, e)


def adopt(sbx: Any, lineage: Lineage, index: int, after_fork: Any) -> Op[Any]:
    """Gives a new child its lineage and runs the hook; a child that fails
    here is killed, and the error returned in its place."""
    try:
        sbx.lineage = lineage
        if after_fork is not None:
            yield lambda: after_fork(sbx, index)
        yield sbx.write_lineage
        return sbx
    except Exception as e:
        yield lambda: kill_quietly(sbx)
        return e


def adopt_all(
    results: Sequence[Any], parent: Lineage, after_fork: Any, index_base: int = 0
) -> Op[list[Any]]:
    """Every started child of ``results`` adopted (at once), as a child of
    ``parent``; the errors stay in their places."""

    def one(i: int, r: Any) -> Call:
        if isinstance(r, Exception):
            return lambda: r
        n = index_base + i
        return lambda: adopt(r, parent.child(r.sandbox_id, n), n, after_fork)

    adopted: list[Any] = yield Each([one(i, r) for i, r in enumerate(results)])
    return adopted


def forked(
    sandbox_id: str,
    results: Sequence[Any],
    parent_lineage: Lineage | None,
    index_base: int,
    after_fork: Any,
) -> Op[list[Any]]:
    """What one fork call answered, its children adopted. Forked by id (no
    lineage given), the children carry the parent's file, if it had one."""
    if parent_lineage is None:
        parent_lineage = Lineage.root(sandbox_id)
        started = [r for r in results if not isinstance(r, Exception)]
        if started:
            inherited = yield started[0].read_lineage
            if inherited is not None and inherited.sandbox_id == sandbox_id:
                parent_lineage = inherited
    return (yield from adopt_all(results, parent_lineage, after_fork, index_base))


def fork_chunks(
    cls: Any,
    sandbox_id: str,
    count: int,
    *,
    timeout: int | None,
    after_fork: Any,
    parent_lineage: Lineage | None,
    max_per_call: int,
    api: dict[str, Any],
) -> Op[list[Any]]:
    """``count`` children of ``sandbox_id`` in fork calls of at most
    ``max_per_call``; a call that fails counts for all of its children."""
    results: list[Any] = []
    for n in chunks(count, max_per_call):
        base = len(results)
        try:
            results += yield lambda n=n, base=base: cls._cls_fork_sandbox(
                sandbox_id,
                timeout=timeout,
                count=n,
                after_fork=after_fork,
                parent_lineage=parent_lineage,
                index_base=base,
                **api,
            )
        except Exception as e:
            results += [e] * n
    return results


def all_or_error(source_id: str, results: list[Any], cleanup_on_error: bool) -> Op[list[Any]]:
    """``results`` when every child started, else ``ForkError`` (the started
    ones killed first unless ``cleanup_on_error`` is off)."""
    failed = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
    if not failed:
        return results
    started = [r for r in results if not isinstance(r, Exception)]
    if cleanup_on_error:
        yield Each([_bind(kill_quietly, r) for r in started])
        started = []
    raise ForkError(source_id, len(results), failed, started)


def fork_all(
    sbx: Any,
    count: int,
    *,
    timeout: int | None,
    after_fork: Any,
    cleanup_on_error: bool,
    max_per_call: int,
    api: dict[str, Any],
) -> Op[list[Any]]:
    results = yield from fork_chunks(
        type(sbx),
        sbx.sandbox_id,
        count,
        timeout=timeout,
        after_fork=after_fork,
        parent_lineage=sbx.lineage,
        max_per_call=max_per_call,
        api=api,
    )
    return (yield from all_or_error(sbx.sandbox_id, results, cleanup_on_error))


def capabilities_of(cls: Any, opts: dict[str, Any]) -> Op[Capabilities]:
    config = ConnectionConfig(**cls._resolve_api_params(**opts))
    caps: Capabilities = yield lambda: cls._probe(config)
    return caps


def from_checkpoint(
    cls: Any,
    checkpoint: Checkpoint,
    count: int,
    *,
    timeout: int | None,
    metadata: dict[str, str] | None,
    after_fork: Any,
    cleanup_on_error: bool,
    fork: bool | None,
    opts: dict[str, Any],
) -> Op[list[Any]]:
    """``count`` sandboxes from a checkpoint, children of its source: one
    snapshot fork where the node has it (``fork=None`` asks), else creates."""
    if fork is None:
        fork = (yield from capabilities_of(cls, opts)).fork_from_snapshot
    started: list[Any]
    if fork:
        try:
            started = yield lambda: cls.fork_snapshot(
                checkpoint.snapshot_id, count, timeout=timeout, metadata=metadata, **opts
            )
        except Exception as e:
            started = [e] * count
    else:

        def create() -> Any:
            return cls.create(checkpoint.snapshot_id, timeout=timeout, metadata=metadata, **opts)

        started = yield Each([create] * count)
    results = yield from adopt_all(started, checkpoint.lineage, after_fork)
    return (yield from all_or_error(checkpoint.source_id, results, cleanup_on_error))


def branch(
    sbx: Any,
    count: int,
    *,
    replay: Sequence[str] | None,
    strategy: Strategy | None,
    capabilities: Capabilities | None,
    timeout: int | None,
    after_fork: Any,
) -> Op[list[Any]]:
    """``count`` copies of ``sbx``: fork; else a snapshot and creates; else
    fresh sandboxes of its template running ``replay``. All or ``ForkError``."""
    max_per_call = SDK_MAX_FORK_COUNT
    if strategy is None:
        caps = capabilities or (yield sbx.capabilities)
        strategy = caps.strategy
        max_per_call = caps.max_fork_count or SDK_MAX_FORK_COUNT
    if strategy == "fork":
        return (
            yield lambda: sbx.fork_all(
                count, timeout=timeout, after_fork=after_fork, max_per_call=max_per_call
            )
        )
    if strategy == "replay" and replay is None:
        raise ValueError("create-and-replay needs the commands to replay (replay=[...])")
    cls = type(sbx)
    # the copies carry the source's metadata, as fork children do
    info = yield sbx.get_info
    metadata = dict(info.metadata or {})
    if strategy == "snapshot":
        ckpt = yield sbx.checkpoint
        try:
            return (
                yield lambda: cls.from_checkpoint(
                    ckpt, count, timeout=timeout, metadata=metadata, after_fork=after_fork
                )
            )
        finally:
            # the children run on unaffected
            yield lambda: cls.delete_checkpoint(ckpt)
    api = sbx.connection_config.get_api_params()

    def replayed(i: int) -> Op[Any]:
        try:
            new = yield lambda: cls.create(
                info.template_id, timeout=timeout, metadata=metadata, **api
            )
        except Exception as e:
            return e
        try:
            for cmd in replay or ():
                # a command that failed the first time fails again: same state
                with contextlib.suppress(CommandExitException):
                    yield _bind(new.commands.run, cmd, timeout=0)
        except Exception as e:
            yield lambda: kill_quietly(new)
            return e
        return (yield from adopt(new, sbx.lineage.child(new.sandbox_id, i), i, after_fork))

    results = yield Each([_bind(replayed, i) for i in range(count)])
    return (yield from all_or_error(sbx.sandbox_id, results, True))


def branch_suspended(
    cls: Any,
    sandbox_id: str,
    count: int,
    *,
    capabilities: Capabilities | None,
    timeout: int | None,
    after_fork: Any,
    opts: dict[str, Any],
) -> Op[list[Any]]:
    """``count`` children of a suspended sandbox, which stays suspended: fork
    calls on it where the node forks paused sandboxes, else resume, branch,
    suspend again."""
    if capabilities is None:
        capabilities = yield from capabilities_of(cls, opts)
    if capabilities.fork_paused:
        results = yield from fork_chunks(
            cls,
            sandbox_id,
            count,
            timeout=timeout,
            after_fork=after_fork,
            parent_lineage=None,
            max_per_call=capabilities.max_fork_count or SDK_MAX_FORK_COUNT,
            api=cls._resolve_api_params(**opts),
        )
        return (yield from all_or_error(sandbox_id, results, True))
    sbx = yield lambda: cls.resume(sandbox_id, **opts)
    try:
        return (
            yield lambda: sbx.branch(
                count, capabilities=capabilities, timeout=timeout, after_fork=after_fork
            )
        )
    finally:
        yield sbx.suspend
