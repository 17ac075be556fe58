// Pause and connect, fork, snapshots: the server's VM lifecycle features.
import assert from 'node:assert/strict'
import { after, describe, test } from 'node:test'
import { Sandbox } from 'e2b'
import { RUN_ID, SLOW, create, reapRun, waitUntil } from '../helpers.mjs'

const COUNTER = 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.5; done'
const counter = async (s) => Number((await s.files.read('/tmp/counter')).trim() || 0)

after(reapRun)

describe('lifecycle', SLOW, () => {
  test('pause then connect keeps a process and a file', SLOW, async () => {
    const sbx = await create({ metadata: { case: 'pause' } })
    try {
      await sbx.files.write('/home/user/kept.txt', 'before pause')
      const p = await sbx.commands.run(COUNTER, { background: true, timeoutMs: 0 })
      await waitUntil(async () => (await sbx.files.exists('/tmp/counter')) && (await counter(sbx)) > 1, 'counter')
      assert.equal(await sbx.pause(), true)
      assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
      const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
      assert.equal(await again.files.read('/home/user/kept.txt'), 'before pause')
      assert.ok((await again.commands.list()).some((x) => x.pid === p.pid))
      const seen = await counter(again)
      await waitUntil(async () => (await counter(again)) > seen, 'counter after resume')
    } finally {
      await Sandbox.kill(sbx.sandboxId)
    }
  })

  test('fork into children that diverge', SLOW, async () => {
    const parent = await create({ metadata: { case: 'fork' } })
    let children = []
    try {
      await parent.files.write('/home/user/origin.txt', 'parent state')
      const results = await parent.fork({ count: 3, timeoutMs: 600_000 })
      assert.equal(results.length, 3)
      assert.deepEqual(results.filter((r) => r instanceof Error), [])
      children = results
      assert.equal(new Set(children.map((c) => c.sandboxId)).size, 3)
      for (const [n, c] of children.entries()) {
        assert.equal(await c.files.read('/home/user/origin.txt'), 'parent state')
        await c.files.write('/home/user/who.txt', `child ${n}`)
      }
      for (const [n, c] of children.entries()) {
        assert.equal(await c.files.read('/home/user/who.txt'), `child ${n}`)
      }
      assert.equal(await parent.files.exists('/home/user/who.txt'), false)
    } finally {
      await Promise.all(children.map((c) => c.kill().catch(() => {})))
      await parent.kill()
    }
  })

  test('fork of a paused sandbox branches it and it stays paused', SLOW, async () => {
    const sbx = await create({ metadata: { case: 'fork-paused' } })
    let children = []
    try {
      await sbx.files.write('/home/user/before.txt', 'paused state')
      assert.equal(await sbx.pause(), true)
      const results = await Sandbox.fork(sbx.sandboxId, { count: 2 })
      children = results.filter((r) => !(r instanceof Error))
      assert.equal(children.length, 2, String(results))
      for (const [n, child] of children.entries()) {
        assert.equal(await child.files.read('/home/user/before.txt'), 'paused state')
        await child.files.write('/home/user/who.txt', String(n))
      }
      for (const [n, child] of children.entries()) {
        assert.equal(await child.files.read('/home/user/who.txt'), String(n))
      }
      assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
      const resumed = await Sandbox.connect(sbx.sandboxId)
      assert.equal(await resumed.files.read('/home/user/before.txt'), 'paused state')
      assert.equal(await resumed.files.exists('/home/user/who.txt'), false)
    } finally {
      await Promise.all(children.map((c) => c.kill().catch(() => {})))
      await Sandbox.kill(sbx.sandboxId)
    }
  })

  test('snapshot then create from it', SLOW, async () => {
    const src = await create({ metadata: { case: 'snapshot' } })
    let made
    let snap
    try {
      await src.files.write('/home/user/snap.txt', 'in the snapshot')
      snap = await src.createSnapshot()
      assert.ok(snap.snapshotId)
      await src.files.write('/home/user/snap.txt', 'changed after')
      made = await Sandbox.create(snap.snapshotId, {
        timeoutMs: 600_000,
        metadata: { sdk_suite: 'js', sdk_run: RUN_ID },
      })
      assert.equal(await made.files.read('/home/user/snap.txt'), 'in the snapshot')
      assert.equal(await src.files.read('/home/user/snap.txt'), 'changed after')
    } finally {
      await made?.kill()
      await src.kill()
      if (snap) assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    }
  })
})
