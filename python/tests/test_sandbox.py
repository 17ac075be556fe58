"""sandfork.Sandbox and AsyncSandbox against a real node."""

from dataclasses import replace

import pytest
from conftest import RUN_META, TEMPLATE
from e2b import NotFoundException, SandboxException, SandboxState

from sandfork import LINEAGE_PATH, SEED_PATH, AsyncSandbox, ForkError, Lineage, Sandbox

pytestmark = pytest.mark.node

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.5; done"


def test_fork_all_lineage_and_reseed(no_leaks):
    parent = Sandbox.create(TEMPLATE, metadata=RUN_META, timeout=600)
    try:
        caps = parent.capabilities()
        assert (caps.fork, caps.snapshot, caps.fork_from_snapshot) == (True, True, True)
        assert caps.strategy == "fork" and 1 <= caps.max_fork_count <= 20
        # from the node's own list (GET /v1/node), paused forks included
        assert caps.source == "node" and caps.fork_paused
        parent.files.write("/home/user/origin.txt", "parent state")
        proc = parent.commands.run(COUNTER, background=True, timeout=0)
        kids = parent.fork_all(2, timeout=600)
        assert all(type(k) is Sandbox for k in kids)
        assert [k.lineage.branch_index for k in kids] == [0, 1]
        seeds = set()
        for i, k in enumerate(kids):
            lin = k.lineage
            assert (lin.parent_id, lin.root_id, lin.depth) == (parent.sandbox_id,) * 2 + (1,)
            # the guest sees the same lineage, and its seed alone
            assert Lineage.from_json(k.files.read(LINEAGE_PATH)) == lin
            assert int(k.files.read(SEED_PATH)) == lin.seed
            assert k.files.read("/home/user/origin.txt") == "parent state"
            assert proc.pid in [p.pid for p in k.commands.list()]
            seeds.add(lin.seed)
            assert lin.sandbox_id == k.sandbox_id and i == lin.branch_index
        assert len(seeds | {parent.lineage.seed}) == 3, "reseed gave every child its own seed"

        # no hook: the grandchild keeps its parent's seed; fork by id finds the
        # lineage in the guest
        (gc,) = Sandbox.fork(kids[1].sandbox_id, count=1, after_fork=None, timeout=600)
        assert isinstance(gc, Sandbox)
        assert (gc.lineage.depth, gc.lineage.root_id) == (2, parent.sandbox_id)
        assert gc.lineage.parent_id == kids[1].sandbox_id
        assert gc.lineage.seed == kids[1].lineage.seed
        gc.kill()

        # all or an error naming which failed: a dead sandbox forks nothing
        kids[0].kill()
        with pytest.raises(ForkError) as err:
            kids[0].fork_all(2)
        assert sorted(err.value.failed) == [0, 1] and err.value.children == []
        assert kids[0].sandbox_id in str(err.value)
        kids[1].kill()
    finally:
        parent.kill()


@pytest.mark.anyio
async def test_checkpoint_suspend_resume_and_replay(no_leaks):
    sbx = await AsyncSandbox.create(TEMPLATE, metadata=RUN_META, timeout=600)
    made: list[AsyncSandbox] = []
    try:
        await sbx.commands.run("echo v1 > /home/user/state.txt")
        ckpt = await sbx.checkpoint(data={"note": "step 1"})
        assert ckpt.source_id == sbx.sandbox_id and ckpt.data == {"note": "step 1"}
        await sbx.commands.run("echo v2 > /home/user/state.txt")
        # one call to the node: POST /snapshots/{id}/fork
        made = await AsyncSandbox.from_checkpoint(ckpt, count=2, timeout=600, metadata=RUN_META)
        assert [type(m) for m in made] == [AsyncSandbox] * 2
        for i, m in enumerate(made):
            assert (await m.files.read("/home/user/state.txt")) == "v1\n"
            assert (m.lineage.parent_id, m.lineage.branch_index) == (sbx.sandbox_id, i)
            got = Lineage.from_json(await m.files.read(LINEAGE_PATH))
            assert got == m.lineage
        assert await AsyncSandbox.delete_checkpoint(ckpt)

        # create-and-replay: the fallback for nodes without fork or snapshots
        (rep,) = await sbx.branch(1, strategy="replay", replay=["echo replayed > /tmp/r", "false"])
        made.append(rep)
        assert (await rep.files.read("/tmp/r")) == "replayed\n"
        assert rep.lineage.parent_id == sbx.sandbox_id
        with pytest.raises(ValueError):
            await sbx.branch(1, strategy="replay")

        # suspend to storage, resume with the lineage it had
        await sbx.write_lineage()
        assert await sbx.suspend() is True

        # a paused sandbox forks from its paused state (E2B's RL RFC) and
        # stays paused; the children diverge
        kids = await AsyncSandbox.fork(sbx.sandbox_id, count=2, timeout=600)
        made += [k for k in kids if isinstance(k, AsyncSandbox)]
        assert [type(k) for k in kids] == [AsyncSandbox] * 2, kids
        for i, k in enumerate(kids):
            assert (await k.files.read("/home/user/state.txt")) == "v2\n"
            assert (k.lineage.parent_id, k.lineage.branch_index) == (sbx.sandbox_id, i)
            await k.commands.run(f"echo kid{i} > /home/user/state.txt")
        for i, k in enumerate(kids):
            assert (await k.files.read("/home/user/state.txt")) == f"kid{i}\n"
        assert (await AsyncSandbox.get_info(sbx.sandbox_id)).state == SandboxState.PAUSED

        # where a node cannot fork a paused sandbox: resumed, forked, paused again
        caps = await kids[0].capabilities()
        (copy,) = await AsyncSandbox.branch_suspended(
            sbx.sandbox_id, 1, capabilities=replace(caps, fork_paused=False), timeout=600
        )
        made.append(copy)
        assert (await copy.files.read("/home/user/state.txt")) == "v2\n"
        assert copy.lineage.parent_id == sbx.sandbox_id
        assert (await AsyncSandbox.get_info(sbx.sandbox_id)).state == SandboxState.PAUSED

        back = await AsyncSandbox.resume(sbx.sandbox_id, timeout=600)
        assert back.lineage == sbx.lineage
        assert (await back.files.read("/home/user/state.txt")) == "v2\n"
    finally:
        for m in made:
            await m.kill()
        await AsyncSandbox.kill(sbx.sandbox_id)


def test_rollback_in_place_to_its_own_checkpoints(no_leaks):
    sbx = Sandbox.create(TEMPLATE, metadata=RUN_META, timeout=600)
    other = None
    try:
        assert sbx.capabilities().rollback
        # memory (a tmpfs) and disk, as the checkpoint will hold them
        sbx.files.write("/dev/shm/mem.txt", "at the checkpoint")
        sbx.files.write("/home/user/disk.txt", "at the checkpoint")
        name = f"rollback-{RUN_META['sdk_run']}"
        ckpt = sbx.checkpoint(name)
        end_before = sbx.get_info().end_at
        sbx.files.write("/dev/shm/mem.txt", "later")
        sbx.commands.run("rm /home/user/disk.txt && touch /home/user/later.txt")

        sbx.rollback(ckpt)
        # the same sandbox, its token and timeout; the checkpoint's state
        info = sbx.get_info()
        assert info.sandbox_id == ckpt.source_id and info.end_at == end_before
        assert sbx.files.read("/dev/shm/mem.txt") == "at the checkpoint"
        assert sbx.files.read("/home/user/disk.txt") == "at the checkpoint"
        assert not sbx.files.exists("/home/user/later.txt")
        assert sbx.lineage == ckpt.lineage

        # again, by name, after more changes: each rollback starts afresh
        sbx.files.write("/home/user/disk.txt", "second branch")
        sbx.rollback(name)
        assert sbx.files.read("/home/user/disk.txt") == "at the checkpoint"

        # only its own checkpoints; an unknown one is not found; it runs on
        other = Sandbox.create(TEMPLATE, metadata=RUN_META, timeout=600)
        with pytest.raises(SandboxException, match="own checkpoints"):
            other.rollback(ckpt)
        with pytest.raises(NotFoundException):
            sbx.rollback("no-such-snapshot")
        assert sbx.commands.run("cat /home/user/disk.txt").stdout == "at the checkpoint"
        Sandbox.delete_checkpoint(ckpt)
    finally:
        if other is not None:
            other.kill()
        sbx.kill()
