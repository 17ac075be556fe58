// Idempotent creates (E2B's Idempotency-Key) and the retry advice of the
// node's refusals (Retry-After), which the SDK's own retry obeys.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { API_KEY, API_URL, RUN_ID, SLOW, create } from '../helpers.mjs'

async function admin(path, body) {
  const r = await fetch(`${API_URL}${path}`, {
    method: 'POST',
    headers: { 'X-API-KEY': API_KEY, 'Content-Type': 'application/json' },
    body: JSON.stringify(body),
  })
  assert.equal(r.status, 201, await r.clone().text())
  return r.json()
}

test('a create retried with its Idempotency-Key returns the same sandbox', SLOW, async () => {
  // JS SDK 2.51 has no option for the key (Python's has): sent as a header.
  const headers = { 'Idempotency-Key': `sdk-${randomUUID()}` }
  const first = await create({ headers })
  try {
    const again = await create({ headers })
    assert.equal(again.sandboxId, first.sandboxId)
    assert.equal((await again.commands.run('echo same')).stdout.trim(), 'same')
    await assert.rejects(
      create({ headers, metadata: { changed: 'yes' } }),
      /409.*different request/
    )
  } finally {
    await first.kill()
  }
})

test('a team at its limit answers Retry-After and the SDK retry gets in', SLOW, async () => {
  const { teamID } = await admin('/admin/teams', { name: `sdk-js-limit-${RUN_ID}`, maxSandboxes: 1 })
  const { key } = await admin(`/admin/teams/${teamID}/keys`, { name: 'sdk' })
  const first = await create({ apiKey: key })
  let second
  try {
    const refused = await fetch(`${API_URL}/v2/sandboxes`, {
      method: 'POST',
      headers: { 'X-API-KEY': key, 'Content-Type': 'application/json' },
      body: '{}',
    })
    assert.equal(refused.status, 429, await refused.text())
    assert.equal(refused.headers.get('retry-after'), '1')
    // The JS SDK retries a 429 only when it says when: room frees in a
    // second. Retries above the default 3: a lab's kill can take seconds.
    setTimeout(() => first.kill().catch(() => {}), 1000)
    second = await create({ apiKey: key, retries: 10 })
    assert.notEqual(second.sandboxId, first.sandboxId)
  } finally {
    await first.kill().catch(() => {})
    if (second) await second.kill().catch(() => {})
  }
})
