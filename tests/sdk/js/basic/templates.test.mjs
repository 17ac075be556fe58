// Template.build through the unmodified JS SDK: RUN, two COPY steps (the SDK
// uploads them in parallel), ENV, WORKDIR and USER run in a microVM of the
// base template; a sandbox of the result sees them; the same build again
// takes every step from the step cache.
import assert from 'node:assert/strict'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, describe, test } from 'node:test'
import { Sandbox, Template } from 'e2b'
import { API_KEY, API_URL, RUN_ID, SLOW, reapRun } from '../helpers.mjs'

after(reapRun)

const STEP = /^\[\d+\/\d+\] /

describe('template builds', SLOW, () => {
  test('build, create from it, build again from the cache', SLOW, async () => {
    const dir = mkdtempSync(join(tmpdir(), 'sdk-tmpl-'))
    mkdirSync(join(dir, 'a'))
    writeFileSync(join(dir, 'a', 'one.txt'), 'one\n')
    mkdirSync(join(dir, 'b'))
    writeFileSync(join(dir, 'b', 'two.txt'), 'two\n')
    const name = `sdk-js-tmpl-${RUN_ID}`
    const template = Template({ fileContextPath: dir })
      .fromTemplate('base')
      .runCmd('echo js > /opt/js-marker && echo js-step-output')
      .copy('a/', '/opt/a/')
      .copy('b/', '/opt/b/', { user: 'user', mode: 0o640 })
      .setEnvs({ JS_VAR: 'v', JS_PATH: '/opt/js:$PATH' })
      .setWorkdir('/opt/jsw')
      .setUser('user')
    try {
      const logs = []
      const built = await Template.build(template, name, {
        onBuildLogs: (e) => logs.push(e.message),
      })
      assert.ok(logs.includes('js-step-output'), logs.join('\n'))
      const sbx = await Sandbox.create(name, {
        timeoutMs: 300_000,
        metadata: { sdk_suite: 'js', sdk_run: RUN_ID },
      })
      try {
        const root = async (cmd) => (await sbx.commands.run(cmd, { user: 'root' })).stdout.trim()
        assert.equal(await root('cat /opt/js-marker'), 'js')
        assert.equal(await root('cat /opt/a/one.txt'), 'one')
        assert.equal(await root("stat -c '%U:%G %a' /opt/b/two.txt"), 'user:user 640')
        // the last USER and WORKDIR are the defaults; ENV expanded
        assert.equal((await sbx.commands.run('id -un')).stdout.trim(), 'user')
        assert.equal((await sbx.commands.run('pwd')).stdout.trim(), '/opt/jsw')
        assert.match((await sbx.commands.run('echo $JS_PATH')).stdout, /^\/opt\/js:\/.*bin/)
      } finally {
        await sbx.kill()
      }
      const logs2 = []
      const again = await Template.build(template, name, {
        onBuildLogs: (e) => logs2.push(e.message),
      })
      const steps = logs2.filter((l) => STEP.test(l))
      assert.equal(steps.length, 6, logs2.join('\n'))
      assert.equal(logs.filter((l) => STEP.test(l)).length, 6)
      assert.ok(steps.every((l) => l.includes(' CACHED ')), logs2.join('\n'))
      assert.ok(!logs2.includes('js-step-output'))
      assert.equal(again.templateId, built.templateId)
      assert.notEqual(again.buildId, built.buildId)
    } finally {
      await fetch(`${API_URL}/templates/${name}`, {
        method: 'DELETE',
        headers: { 'X-API-KEY': API_KEY },
      })
      rmSync(dir, { recursive: true, force: true })
    }
  })
})
