"""Sandbox.list with metadata filters and pagination; set_timeout and expiry."""

import time
from datetime import datetime, timedelta, timezone

import pytest
from e2b import Sandbox, SandboxNotFoundException, SandboxQuery, SandboxState

from conftest import RUN_ID, create


def _all(paginator):
    items, pages = [], 0
    while paginator.has_next:
        items.extend(paginator.next_items())
        pages += 1
        assert pages < 50, "pagination does not end"
    return items, pages


@pytest.fixture(scope="module")
def three():
    boxes = [
        create(metadata={"case": "list", "i": str(i), "odd": "a b/ü&=x"}) for i in range(3)
    ]
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
        Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "case": "list"}, state=[SandboxState.RUNNING]))
    )
    assert len(running) == 3
    paused, _ = _all(
        Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "case": "list"}, state=[SandboxState.PAUSED]))
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
        now = datetime.now(timezone.utc)
        assert now + timedelta(seconds=800) < end < now + timedelta(seconds=960)
        sbx.set_timeout(5)  # may shorten
        end = sbx.get_info().end_at
        assert end < datetime.now(timezone.utc) + timedelta(seconds=30)
        deadline = time.monotonic() + 90
        while sbx.is_running() and time.monotonic() < deadline:
            time.sleep(1)
        assert not sbx.is_running(), "sandbox still running 90 s after its timeout"
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
        items, _ = _all(Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID, "case": "expiry"})))
        assert items == []
    finally:
        Sandbox.kill(sbx.sandbox_id)
