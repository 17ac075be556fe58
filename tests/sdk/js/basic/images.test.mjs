// Creates that name a registry image through the unmodified JS SDK (issue
// 39): as the template id, and under the metadata key the node is started
// with (SDK_IMAGE_METADATA_KEY, slime's way). The registry is Debian's
// `docker-registry` on loopback holding tests/support/oci_registry.py's
// image, served by that script for this file's time; the node pulls it
// anonymously (its credentials file has no entry for this registry).
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { once } from 'node:events'
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { after, before, describe, test } from 'node:test'
import { Sandbox } from 'e2b'
import { API_KEY, API_URL, RUN_ID, SLOW, reapRun } from '../helpers.mjs'

const SUPPORT = join(dirname(fileURLToPath(import.meta.url)), '../../../support/oci_registry.py')
const HELLO = 'hello from the registry image\n'
// The lab converts and boots an image slowly (emulated KVM).
const CONVERT_MS = 900_000

let registry
let dir

before(async () => {
  // The node reads the credentials file sdk-test.sh names at each pull; the
  // Python suite writes it, and this file may run without it.
  const auth = process.env.SANDFORK_REGISTRY_AUTH
  if (auth && !existsSync(auth)) writeFileSync(auth, '{"auths": {}}')
  dir = mkdtempSync(join(tmpdir(), 'sdk-js-registry-'))
  const child = spawn('python3', [SUPPORT, dir, 'sdk/js-img:v1'], {
    stdio: ['pipe', 'pipe', 'inherit'],
  })
  const host = await Promise.race([
    once(createInterface({ input: child.stdout }), 'line').then(([line]) => line),
    once(child, 'exit').then(([code]) => {
      throw new Error(`oci_registry.py exited (${code}) before serving`)
    }),
  ])
  registry = { host, child }
})

after(async () => {
  await reapRun()
  if (registry) {
    registry.child.stdin.end()
    await once(registry.child, 'exit')
  }
  if (dir) rmSync(dir, { recursive: true, force: true })
})

// A sandbox of an image, waiting out the node's "being built" answers as a
// client would.
async function createByImage(template, metadata = {}) {
  const deadline = Date.now() + CONVERT_MS
  const opts = { timeoutMs: 300_000, metadata: { sdk_suite: 'js', sdk_run: RUN_ID, ...metadata } }
  for (;;) {
    try {
      return template ? await Sandbox.create(template, opts) : await Sandbox.create(opts)
    } catch (e) {
      if (!String(e).includes('being built') || Date.now() > deadline) throw e
      await new Promise((r) => setTimeout(r, 5_000))
    }
  }
}

async function imageTemplates(image) {
  const r = await fetch(`${API_URL}/templates`, { headers: { 'X-API-KEY': API_KEY } })
  const text = await r.text()
  assert.equal(r.status, 200, text)
  return JSON.parse(text).filter((t) => t.names.includes(image))
}

async function readsTheImage(sbx) {
  try {
    const out = await sbx.commands.run('cat /srv/hello.txt', { user: 'root' })
    assert.equal(out.stdout, HELLO)
  } finally {
    await sbx.kill()
  }
}

describe('creates by image', SLOW, () => {
  test('by the template id, then by the metadata key: one conversion', SLOW, async () => {
    const key = process.env.SDK_IMAGE_METADATA_KEY
    assert.ok(key, 'SDK_IMAGE_METADATA_KEY unset: run through scripts/sdk-test.sh')
    const image = `${registry.host}/sdk/js-img:v1`
    try {
      await readsTheImage(await createByImage(image))
      // the template restored: no second pull or boot
      await readsTheImage(await createByImage(undefined, { [key]: image }))
      const listed = await imageTemplates(image)
      assert.equal(listed.length, 1, JSON.stringify(listed))
      assert.equal(listed[0].buildCount, 1, JSON.stringify(listed))
      assert.equal(listed[0].buildStatus, 'ready', JSON.stringify(listed))
    } finally {
      for (const t of await imageTemplates(image)) {
        await fetch(`${API_URL}/templates/${t.templateID}`, {
          method: 'DELETE',
          headers: { 'X-API-KEY': API_KEY },
        })
      }
    }
  })
})
