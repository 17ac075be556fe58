"""The drivers of the operations ``Sandbox`` and ``AsyncSandbox`` share:
one operation, run blocking and on the event loop, gives the same answers."""

import asyncio

import pytest

from sandfork._ops import Each, run_async, run_sync


def _op(log: list[str], call, fail_call):
    """Two calls, an error caught at its yield, a nested operation and an
    ``Each`` with one failing call."""
    a = yield lambda: call("a")
    try:
        yield lambda: fail_call("b")
    except RuntimeError as e:
        log.append(f"caught {e}")

    def inner():
        got = yield lambda: call("c")
        return got + "!"

    c = yield inner
    many = yield Each([lambda: call("d"), lambda: fail_call("e"), lambda: call("f")])
    return a, c, [m if isinstance(m, str) else repr(m) for m in many]


def _expected(log):
    assert log == ["caught b"]
    return ("a", "c!", ["d", "RuntimeError('e')", "f"])


def test_the_blocking_driver():
    def fail(x):
        raise RuntimeError(x)

    log: list[str] = []
    assert run_sync(_op(log, lambda x: x, fail)) == _expected(log)

    def uncaught():
        yield lambda: fail("b")

    # an error nobody catches reaches the caller
    with pytest.raises(RuntimeError, match="b"):
        run_sync(uncaught())


def test_an_async_hook_in_a_blocking_sandbox_is_an_error():
    async def hook():
        return None

    def op():
        yield hook

    with pytest.raises(TypeError, match="async call"):
        run_sync(op())


@pytest.mark.anyio
async def test_the_async_driver_runs_each_at_once():
    started: list[str] = []
    both = asyncio.Event()

    async def call(x):
        started.append(x)
        if x in ("d", "f"):
            # d waits until f has started: only an Each run at once ends well
            if x == "f":
                both.set()
            await asyncio.wait_for(both.wait(), 5)
        return x

    async def fail(x):
        raise RuntimeError(x)

    log: list[str] = []
    got = await run_async(_op(log, call, fail))
    assert got == _expected(log)
    # plain values are fine too
    assert await run_async(_op([], lambda x: x, _raise)) == _expected(["caught b"])


def _raise(x):
    raise RuntimeError(x)
