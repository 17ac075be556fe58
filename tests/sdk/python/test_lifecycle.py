"""Pause and connect, fork, snapshots: the server's VM lifecycle features.
Marked `lifecycle` so a run can select the basic set first."""

import pytest
from conftest import RUN_ID, create
from e2b import Sandbox, SandboxException, SandboxNotFoundException, SandboxQuery, SandboxState
from polling import wait_until

pytestmark = pytest.mark.lifecycle

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.5; done"


def _counter(sbx) -> int:
    return int(sbx.files.read("/tmp/counter").strip() or 0)


def test_pause_then_connect_keeps_processes_and_files():
    sbx = create(metadata={"case": "pause"})
    try:
        sbx.files.write("/home/user/kept.txt", "before pause")
        proc = sbx.commands.run(COUNTER, background=True, timeout=0)
        wait_until(lambda: sbx.files.exists("/tmp/counter") and _counter(sbx) > 1, what="counter")
        assert sbx.pause() is True
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.state == "paused"
        assert Sandbox.pause(sbx.sandbox_id) is False  # 409: already paused
        paused, _ = _all(
            Sandbox.list(
                query=SandboxQuery(
                    metadata={"sdk_run": RUN_ID, "case": "pause"}, state=[SandboxState.PAUSED]
                )
            )
        )
        assert [p.sandbox_id for p in paused] == [sbx.sandbox_id]

        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.get_info().state == "running"
        assert again.files.read("/home/user/kept.txt") == "before pause"
        assert proc.pid in [p.pid for p in again.commands.list()]
        seen = _counter(again)
        wait_until(lambda: _counter(again) > seen, what="counter to advance after resume")
        # the envd token is unchanged: the old handle still works
        assert sbx.commands.run("echo still").stdout == "still\n"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_filesystem_only_pause_keeps_files_and_cold_boots_on_connect():
    sbx = create(metadata={"case": "pause-fs"})
    try:
        sbx.files.write("/home/user/kept.txt", "on disk")
        sbx.files.write("/tmp/in-memory.txt", "in tmpfs")
        proc = sbx.commands.run(COUNTER, background=True, timeout=0)
        wait_until(lambda: sbx.files.exists("/tmp/counter"), what="counter")
        assert sbx.pause(mode="filesystem") is True
        assert Sandbox.get_info(sbx.sandbox_id).state == "paused"

        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.get_info().state == "running"
        # the disk is kept; memory, tmpfs and processes are not (a cold boot)
        assert again.files.read("/home/user/kept.txt") == "on disk"
        assert not again.files.exists("/tmp/in-memory.txt")
        assert proc.pid not in [p.pid for p in again.commands.list()]
        # the same envd token still opens it
        assert sbx.commands.run("echo still").stdout == "still\n"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def _all(paginator):
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return items, None


def test_fork_children_diverge():
    parent = create(metadata={"case": "fork"})
    children = []
    try:
        parent.files.write("/home/user/origin.txt", "parent state")
        proc = parent.commands.run(COUNTER, background=True, timeout=0)
        wait_until(lambda: parent.files.exists("/tmp/counter"), what="counter")
        results = parent.fork(count=3, timeout=600)
        assert len(results) == 3
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors
        children = results
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 3 and parent.sandbox_id not in ids
        for n, child in enumerate(children):
            assert child.files.read("/home/user/origin.txt") == "parent state"
            # the running process came along
            assert proc.pid in [p.pid for p in child.commands.list()]
            child.files.write("/home/user/who.txt", f"child {n}")
            child.commands.run(f"echo {n} > /tmp/only-in-child-{n}")
        for n, child in enumerate(children):
            assert child.files.read("/home/user/who.txt") == f"child {n}"
            for m in range(3):
                assert child.files.exists(f"/tmp/only-in-child-{m}") is (m == n)
        assert parent.files.exists("/home/user/who.txt") is False
        assert parent.get_info().state == "running"
        # the parent keeps running its own process
        seen = _counter(parent)
        wait_until(lambda: _counter(parent) > seen, what="parent counter to advance")
        for child in children:
            assert child.get_info().state == "running"
    finally:
        for c in children:
            if not isinstance(c, Exception):
                c.kill()
        parent.kill()


def test_fork_of_paused_sandbox_branches_it_and_it_stays_paused():
    sbx = create(metadata={"case": "fork-paused"})
    children: list = []
    try:
        sbx.files.write("/home/user/before.txt", "paused state")
        assert sbx.pause() is True
        results = Sandbox.fork(sbx.sandbox_id, count=2)
        children = [r for r in results if not isinstance(r, Exception)]
        assert len(children) == 2, results
        for n, child in enumerate(children):
            assert child.files.read("/home/user/before.txt") == "paused state"
            child.files.write("/home/user/who.txt", str(n))
        for n, child in enumerate(children):
            assert child.files.read("/home/user/who.txt") == str(n)
        assert Sandbox.get_info(sbx.sandbox_id).state == "paused"
        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.files.read("/home/user/before.txt") == "paused state"
        assert resumed.files.exists("/home/user/who.txt") is False
    finally:
        for c in children:
            c.kill()
        Sandbox.kill(sbx.sandbox_id)


def test_fork_of_unknown_sandbox():
    with pytest.raises(SandboxNotFoundException):
        Sandbox.fork("sfnosuchsandbox0000", count=1)


def test_snapshot_then_create_from_it():
    src = create(metadata={"case": "snapshot"})
    made = None
    snap = None
    try:
        src.files.write("/home/user/snap.txt", "in the snapshot")
        snap = src.create_snapshot()
        assert snap.snapshot_id
        # the source keeps running and can diverge
        assert src.get_info().state == "running"
        src.files.write("/home/user/snap.txt", "changed after")
        listed = []
        p = src.list_snapshots()
        while p.has_next:
            listed.extend(p.next_items())
        assert snap.snapshot_id in [s.snapshot_id for s in listed]

        made = Sandbox.create(snap.snapshot_id, timeout=600, metadata={"sdk_run": RUN_ID})
        assert made.sandbox_id != src.sandbox_id
        assert made.files.read("/home/user/snap.txt") == "in the snapshot"
        assert src.files.read("/home/user/snap.txt") == "changed after"
        # As on E2B, deleting it while sandboxes run on its files succeeds:
        # the snapshot is gone, they run on unaffected.
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert snap.snapshot_id not in [s.snapshot_id for s in src.list_snapshots().next_items()]
        with pytest.raises(SandboxException):
            Sandbox.create(snap.snapshot_id, timeout=60)
        snap = None
        assert made.files.read("/home/user/snap.txt") == "in the snapshot"
        assert made.commands.run("echo alive").stdout == "alive\n"
        assert src.commands.run("echo alive").stdout == "alive\n"
    finally:
        if made is not None:
            made.kill()
        src.kill()
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)


def test_a_filesystem_only_snapshot_cold_boots_its_children():
    """E2B's `mode="filesystem"` (`memory: false`): a sandbox made from the
    snapshot has the source's files as they were, and none of its processes."""
    src = create(metadata={"case": "snapshot-fs"})
    made = None
    snap = None
    try:
        src.files.write("/home/user/fs.txt", "on the disk")
        src.commands.run("sleep 4242", background=True)
        snap = src.create_snapshot(mode="filesystem")
        src.files.write("/home/user/fs.txt", "changed after")
        # A cold boot takes longer than a restore: the kernel boots afresh.
        made = Sandbox.create(
            snap.snapshot_id, timeout=600, metadata={"sdk_run": RUN_ID}, request_timeout=300
        )
        assert made.files.read("/home/user/fs.txt") == "on the disk"
        assert made.commands.run("pgrep -f 'sleep 424[2]' || echo none").stdout == "none\n"
        assert src.commands.run("pgrep -f 'sleep 424[2]' >/dev/null && echo on").stdout == "on\n"
    finally:
        if made is not None:
            made.kill()
        src.kill()
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)


def test_pause_of_unknown_sandbox():
    with pytest.raises(SandboxNotFoundException):
        Sandbox.pause("sfnosuchsandbox0000")
