// Create, info, connect, list with metadata and pages, timeouts, kill, errors.
import assert from 'node:assert/strict'
import { after, describe, test } from 'node:test'
import {
  AuthenticationError,
  NotFoundError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
} from 'e2b'
import { API_URL, RUN_ID, SLOW, TEMPLATE, create, listAll, reapRun, waitUntil } from '../helpers.mjs'

const MISSING = 'sfnosuchsandbox0000'

after(reapRun)

describe('create and info', SLOW, () => {
  test('create (v2), run a command, get info, kill', SLOW, async () => {
    const sbx = await create({ metadata: { case: 'create' }, envs: { A: '1' } })
    try {
      assert.ok(sbx.sandboxId && !sbx.sandboxId.includes('-'))
      assert.equal((await sbx.commands.run('echo $A')).stdout, '1\n')
      const info = await sbx.getInfo()
      assert.equal(info.sandboxId, sbx.sandboxId)
      assert.equal(info.state, 'running')
      assert.equal(info.metadata.case, 'create')
      assert.equal(info.metadata.sdk_run, RUN_ID)
      assert.ok(info.startedAt instanceof Date && info.endAt > info.startedAt)
      const left = info.endAt.getTime() - Date.now()
      assert.ok(left > 400_000 && left < 660_000, `endAt ${info.endAt}`)
      assert.equal(await sbx.isRunning(), true)
      const again = await Sandbox.connect(sbx.sandboxId)
      assert.equal((await again.commands.run('echo $A')).stdout, '1\n')
    } finally {
      assert.equal(await sbx.kill(), true)
    }
    assert.equal(await sbx.isRunning(), false)
    await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
    assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  })

  test('set timeout moves the end and expiry kills', SLOW, async () => {
    const sbx = await create({ metadata: { case: 'expiry' } })
    try {
      await sbx.setTimeout(900_000)
      let end = (await sbx.getInfo()).endAt.getTime() - Date.now()
      assert.ok(end > 800_000 && end < 960_000, `end in ${end} ms`)
      await sbx.setTimeout(5_000)
      end = (await sbx.getInfo()).endAt.getTime() - Date.now()
      assert.ok(end < 30_000, `end in ${end} ms`)
      const deadline = Date.now() + 90_000
      while ((await sbx.isRunning()) && Date.now() < deadline) {
        await new Promise((r) => setTimeout(r, 1000))
      }
      assert.equal(await sbx.isRunning(), false)
      await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
    } finally {
      await Sandbox.kill(sbx.sandboxId)
    }
  })
})

describe('E2B timeout and validation semantics', SLOW, () => {
  const gone = async (sbx, ms = 30_000) => {
    const deadline = Date.now() + ms
    while ((await sbx.isRunning()) && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 500))
    }
    return !(await sbx.isRunning())
  }

  test('setTimeout(0) ends the sandbox now', SLOW, async () => {
    const sbx = await create({ metadata: { case: 'timeout-zero' } })
    try {
      await sbx.setTimeout(0)
      assert.equal(await gone(sbx), true, 'setTimeout(0) left it running')
      // Its record goes when the kill has finished, a moment after envd stops
      // answering.
      await waitUntil(
        () => Sandbox.getInfo(sbx.sandboxId).then(() => false, (e) => e instanceof SandboxNotFoundError),
        'the ended sandbox to be not found',
        30_000,
      )
    } finally {
      await Sandbox.kill(sbx.sandboxId)
    }
  })

  test('a fork count below 1 is a 400, not an auth error', SLOW, async () => {
    const sbx = await create({ metadata: { case: 'fork-count' } })
    try {
      for (const count of [0, -1]) {
        await assert.rejects(
          Sandbox.fork(sbx.sandboxId, { count }),
          (e) =>
            e instanceof SandboxError &&
            !(e instanceof AuthenticationError) &&
            e.message.includes('Count must be at least 1'),
        )
      }
    } finally {
      await sbx.kill()
    }
  })

  test('list with startedAfter', SLOW, async () => {
    const before = new Date(Date.now() - 1000)
    const sbx = await create({ metadata: { case: 'started-after' } })
    try {
      const meta = { sdk_run: RUN_ID, case: 'started-after' }
      const after = await listAll({ query: { metadata: meta, startedAfter: before } })
      assert.deepEqual(
        after.items.map((i) => i.sandboxId),
        [sbx.sandboxId],
      )
      const later = await listAll({
        query: { metadata: meta, startedAfter: new Date(Date.now() + 3_600_000) },
      })
      assert.equal(later.items.length, 0)
    } finally {
      await sbx.kill()
    }
  })
})

describe('list', SLOW, () => {
  test('metadata filters, state and pagination', SLOW, async () => {
    const boxes = await Promise.all(
      [0, 1, 2].map((i) => create({ metadata: { case: 'list', i: String(i), odd: 'a b/ü&=x' } })),
    )
    try {
      const ids = boxes.map((b) => b.sandboxId).sort()
      const all = await listAll({ query: { metadata: { sdk_run: RUN_ID, case: 'list' } } })
      assert.deepEqual(all.items.map((i) => i.sandboxId).sort(), ids)
      const one = await listAll({ query: { metadata: { sdk_run: RUN_ID, i: '1' } } })
      assert.deepEqual(one.items.map((i) => i.sandboxId), [boxes[1].sandboxId])
      const odd = await listAll({ query: { metadata: { sdk_run: RUN_ID, odd: 'a b/ü&=x' } } })
      assert.equal(odd.items.length, 3)
      const paused = await listAll({
        query: { metadata: { sdk_run: RUN_ID, case: 'list' }, state: ['paused'] },
      })
      assert.equal(paused.items.length, 0)
      const paged = await listAll({
        query: { metadata: { sdk_run: RUN_ID, case: 'list' } },
        limit: 1,
      })
      assert.equal(paged.pages, 3)
      assert.deepEqual(paged.items.map((i) => i.sandboxId).sort(), ids)
    } finally {
      await Promise.all(boxes.map((b) => b.kill()))
    }
  })
})

describe('errors', SLOW, () => {
  test('unknown template', async () => {
    await assert.rejects(
      Sandbox.create('no-such-template-sdk-test', { timeoutMs: 60_000 }),
      (e) => e instanceof SandboxError && !(e instanceof AuthenticationError),
    )
  })

  test('unknown sandbox', async () => {
    await assert.rejects(Sandbox.getInfo(MISSING), SandboxNotFoundError)
    await assert.rejects(Sandbox.connect(MISSING), NotFoundError)
    await assert.rejects(Sandbox.setTimeout(MISSING, 60_000), NotFoundError)
    assert.equal(await Sandbox.kill(MISSING), false)
  })

  test('wrong API key', async () => {
    const apiKey = 'e2b_00000000000000000000000000000000'
    await assert.rejects(Sandbox.create(TEMPLATE, { apiKey }), AuthenticationError)
    await assert.rejects(Sandbox.list({ apiKey }).nextItems(), AuthenticationError)
  })

  test('malformed create body gets 400 with an error body', async () => {
    const r = await fetch(`${API_URL}/v2/sandboxes`, {
      method: 'POST',
      headers: { 'X-API-KEY': process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
      body: '{"templateID": ',
    })
    assert.equal(r.status, 400)
    const body = await r.json()
    assert.equal(typeof body.code, 'number')
    assert.equal(typeof body.message, 'string')
  })
})
