"""Sandbox.list with metadata filters and pagination; set_timeout and expiry."""

import time
from datetime import UTC, datetime, timedelta, timezone

import pytest
from conftest import RUN_ID, create
from e2b import Sandbox, SandboxNotFoundException, SandboxQuery, SandboxState
from polling import wait_until


def _all(paginator):
    items, pages = [], 0
    while paginator.has_next:
        items.extend(paginator.next_items())
        pages += 1
        assert pages < 50, "pagination does not end"
    return items, pages


@pytest.fixture(scope="module")
def three():
    boxes = [create(metadata={"case": "list", "i": str(i), "odd": "a b/ü&=x"}) for i in range(3)]
    yield boxes
    for b in boxes:
        b.kill()


def test_list_filters_by_metadata(three):
    items, _ = _all(Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "case": "list"})))
    assert sorted(i.sandbox_id for i in items) == sorted(b.sandbox_id for b in three)
    for i in items:
        assert i.state == "running"
        assert i.metadata["case"] == "list"
    one, _ = _all(Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "i": "1"})))
    assert [i.sandbox_id for i in one] == [three[1].sandbox_id]
    # characters that need (multi-layer) URL encoding
    odd, _ = _all(Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "odd": "a b/ü&=x"})))
    assert len(odd) == 3
    none, _ = _all(Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "i": "9"})))
    assert none == []


def test_list_by_state(three):
    running, _ = _all(
        Sandbox.list(
            query=SandboxQuery(
                metadata={"sdk_run": RUN_ID, "case": "list"}, state=[SandboxState.RUNNING]
            )
        )
    )
    assert len(running) == 3
    paused, _ = _all(
        Sandbox.list(
            query=SandboxQuery(
                metadata={"sdk_run": RUN_ID, "case": "list"}, state=[SandboxState.PAUSED]
            )
        )
    )
    assert paused == []


def test_list_paginates(three, api):
    paginator = Sandbox.list(
        query=SandboxQuery(metadata={"sdk_run": RUN_ID, "case": "list"}), limit=1
    )
    items, pages = _all(paginator)
    assert pages == 3, f"limit=1 over 3 sandboxes gave {pages} pages"
    assert len({i.sandbox_id for i in items}) == 3
    # the wire: x-next-token header, absent or empty on the last page
    r = api.get("/v2/sandboxes", params={"limit": 2, "metadata": f"sdk_run={RUN_ID}&case=list"})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2
    token = r.headers.get("x-next-token")
    assert token
    r = api.get(
        "/v2/sandboxes",
        params={"limit": 2, "nextToken": token, "metadata": f"sdk_run={RUN_ID}&case=list"},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()) == 1
    assert not r.headers.get("x-next-token")


def test_set_timeout_moves_end_and_expiry_kills():
    sbx = create(metadata={"case": "expiry"})
    try:
        sbx.set_timeout(900)
        end = sbx.get_info().end_at
        now = datetime.now(UTC)
        assert now + timedelta(seconds=800) < end < now + timedelta(seconds=960)
        sbx.set_timeout(5)  # may shorten
        end = sbx.get_info().end_at
        assert end < datetime.now(UTC) + timedelta(seconds=30)
        deadline = time.monotonic() + 90
        while sbx.is_running() and time.monotonic() < deadline:
            time.sleep(1)
        assert not sbx.is_running(), "sandbox still running 90 s after its timeout"
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
        items, _ = _all(
            Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "case": "expiry"}))
        )
        assert items == []
    finally:
        Sandbox.kill(sbx.sandbox_id)


def _gone_soon(sbx, within=30):
    """True once the sandbox no longer runs (E2B ends it at once)."""
    deadline = time.monotonic() + within
    while sbx.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    return not sbx.is_running()


def test_set_timeout_zero_ends_now():
    # E2B: 0 is "end now", not an invalid timeout.
    sbx = create(metadata={"case": "timeout-zero"})
    try:
        sbx.set_timeout(0)
        assert _gone_soon(sbx), "set_timeout(0) left the sandbox running"

        # Its record goes when the kill has finished, a moment after envd
        # stops answering.
        def not_found():
            try:
                Sandbox.get_info(sbx.sandbox_id)
                return False
            except SandboxNotFoundException:
                return True

        wait_until(not_found, timeout=30, what="the ended sandbox to be not found")
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_set_timeout_zero_with_auto_pause_pauses_now():
    sbx = create(metadata={"case": "timeout-zero-pause"}, lifecycle={"on_timeout": "pause"})
    try:
        sbx.set_timeout(0)
        deadline = time.monotonic() + 120
        state = None
        while time.monotonic() < deadline:
            state = Sandbox.get_info(sbx.sandbox_id).state
            if state == SandboxState.PAUSED:
                break
            time.sleep(1)
        assert state == SandboxState.PAUSED, f"state {state} after set_timeout(0) with auto-pause"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_create_with_timeout_zero_ends_at_once():
    sbx = create(metadata={"case": "create-timeout-zero"}, timeout=0)
    try:
        assert _gone_soon(sbx), "a sandbox created with timeout=0 kept running"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_set_timeout_above_the_maximum_is_clamped(sandbox):
    sandbox.set_timeout(10 * 24 * 3600)
    end = sandbox.get_info().end_at
    assert end <= datetime.now(UTC) + timedelta(hours=24, minutes=1)
    sandbox.set_timeout(600)


def test_list_started_after(three):
    meta = {"sdk_run": RUN_ID, "case": "list"}
    earliest = min(Sandbox.get_info(b.sandbox_id).started_at for b in three)
    # The SDK sends astimezone().isoformat(): microseconds and a UTC offset;
    # a naive time is local, an aware one may be in any zone.
    for after in (
        earliest - timedelta(seconds=1),
        (earliest - timedelta(seconds=1)).astimezone(timezone(timedelta(hours=5, minutes=30))),
        datetime.now() - timedelta(days=1),
    ):
        items, _ = _all(Sandbox.list(query=SandboxQuery(metadata=meta, started_after=after)))
        assert len(items) == 3, f"started_after={after!r} gave {len(items)}"
    later, _ = _all(
        Sandbox.list(
            query=SandboxQuery(metadata=meta, started_after=datetime.now(UTC) + timedelta(hours=1))
        )
    )
    assert later == []
    by_template, _ = _all(Sandbox.list(query=SandboxQuery(metadata=meta, template="base")))
    assert len(by_template) == 3
