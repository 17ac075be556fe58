"""Volumes (issue 40): a volume made through the SDK's Volume class, mounted by
Sandbox.create(volume_mounts=...), and copied per fork child: each child sees
the parent's files and changes its own copy, unseen by the other child and by
the parent, which keeps the volume itself; a fork of the paused parent too.
get_info and Sandbox.list name each
sandbox's mounts (a child's copies as its parent's volume)."""

import pytest
from conftest import RUN_ID, create
from e2b import Sandbox, SandboxQuery, Volume

pytestmark = pytest.mark.lifecycle


def test_a_volume_written_in_a_parent_is_copied_per_fork_child():
    volume = Volume.create(f"sdk-{RUN_ID}")
    parent = create(metadata={"case": "volume"}, volume_mounts={"/data": volume})
    children: list = []
    try:
        parent.files.write("/data/shared.txt", "from the parent")
        assert parent.commands.run("findmnt -n -o FSTYPE /data").stdout == "ext4\n"
        mounts = [{"name": volume.name, "path": "/data"}]
        assert parent.get_info().volume_mounts == mounts
        results = parent.fork(count=2, timeout=600)
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors
        children = results
        for n, child in enumerate(children):
            assert child.files.read("/data/shared.txt") == "from the parent"
            child.files.write("/data/shared.txt", f"child {n}")
            child.files.write(f"/data/only-{n}.txt", str(n))
        for n, child in enumerate(children):
            assert child.files.read("/data/shared.txt") == f"child {n}"
            for m in range(2):
                assert child.files.exists(f"/data/only-{m}.txt") is (m == n)
        assert parent.files.read("/data/shared.txt") == "from the parent"
        listed = Sandbox.list(query=SandboxQuery(metadata={"case": "volume", "sdk_run": RUN_ID}))
        infos = {i.sandbox_id: i for i in listed.next_items()}
        assert set(infos) == {parent.sandbox_id, *(c.sandbox_id for c in children)}
        assert all(i.volume_mounts == mounts for i in infos.values())
        assert not parent.files.exists("/data/only-0.txt")
        assert not parent.files.exists("/data/only-1.txt")

        # A fork of the paused parent: the same rule, a copy for the child.
        assert parent.pause() is True
        late = Sandbox.fork(parent.sandbox_id, count=1, timeout=600)
        assert not [r for r in late if isinstance(r, Exception)], late
        children.extend(late)
        assert late[0].get_info().volume_mounts == mounts
        assert late[0].files.read("/data/shared.txt") == "from the parent"
        late[0].files.write("/data/shared.txt", "the late child")
        parent = Sandbox.connect(parent.sandbox_id)
        assert parent.files.read("/data/shared.txt") == "from the parent"
        assert late[0].files.read("/data/shared.txt") == "the late child"
    finally:
        for c in children:
            if not isinstance(c, Exception):
                c.kill()
        parent.kill()
        Volume.destroy(volume.volume_id)
