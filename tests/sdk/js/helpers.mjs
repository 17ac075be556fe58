// Shared helpers: the server under test comes from E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY, as for any E2B user (scripts/sdk-test.sh
// sets them). Every sandbox carries the run's metadata.
import { randomBytes } from 'node:crypto'
import { Sandbox } from 'e2b'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[name]) {
    throw new Error(`set ${name} (scripts/sdk-test.sh does)`)
  }
}

export const API_URL = process.env.E2B_API_URL
export const API_KEY = process.env.E2B_API_KEY
export const TEMPLATE = process.env.SDK_TEST_TEMPLATE || 'base'
export const RUN_ID = randomBytes(4).toString('hex')
// Lab microVMs are 20-50x slower than hardware.
export const SLOW = { timeout: 600_000 }
// A case of the long tier (scripts/test.sh --only sdk_long sets
// SANDFORK_TEST_TIER=long): skipped, and said so, in every other run.
export const LONG = {
  ...SLOW,
  skip: process.env.SANDFORK_TEST_TIER === 'long' ? false : 'long tier (scripts/test.sh --only sdk_long)',
}

export function create(opts = {}) {
  return Sandbox.create(TEMPLATE, {
    timeoutMs: 600_000,
    ...opts,
    metadata: { sdk_suite: 'js', sdk_run: RUN_ID, ...(opts.metadata || {}) },
  })
}

export async function listAll(opts) {
  const paginator = Sandbox.list(opts)
  const items = []
  let pages = 0
  while (paginator.hasNext) {
    items.push(...(await paginator.nextItems()))
    if (++pages > 50) throw new Error('pagination does not end')
  }
  return { items, pages }
}

export async function waitUntil(predicate, what, timeoutMs = 60_000) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const value = await predicate()
    if (value) return value
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 200))
  }
}

export async function reapRun() {
  try {
    const { items } = await listAll({ query: { metadata: { sdk_run: RUN_ID } } })
    await Promise.all(items.map((i) => Sandbox.kill(i.sandboxId)))
  } catch (e) {
    console.error(`cleanup of run ${RUN_ID} failed: ${e}`)
  }
}
