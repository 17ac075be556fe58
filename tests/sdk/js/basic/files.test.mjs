// files: write, read, list, exists, makeDir, rename, remove, watchDir, 50 MB.
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import { after, before, describe, test } from 'node:test'
import { FileNotFoundError, FileType, FilesystemEventType } from 'e2b'
import { SLOW, create, reapRun, waitUntil } from '../helpers.mjs'

const BASE = '/home/user/sdk-files-js'
let sbx

before(async () => {
  sbx = await create()
}, SLOW)
after(async () => {
  await sbx?.kill()
  await reapRun()
})

describe('files', SLOW, () => {
  test('write and read text and bytes', async () => {
    const info = await sbx.files.write(`${BASE}/a.txt`, 'héllo\n')
    assert.equal(info.path, `${BASE}/a.txt`)
    assert.equal(await sbx.files.read(`${BASE}/a.txt`), 'héllo\n')
    const data = new Uint8Array(1024).map((_, i) => i % 256)
    await sbx.files.write(`${BASE}/bin.dat`, data.buffer)
    assert.deepEqual(await sbx.files.read(`${BASE}/bin.dat`, { format: 'bytes' }), data)
    await assert.rejects(sbx.files.read(`${BASE}/missing`), FileNotFoundError)
  })

  test('list, getInfo, exists, makeDir, rename, remove', async () => {
    const d = `${BASE}/ops`
    assert.equal(await sbx.files.exists(d), false)
    assert.equal(await sbx.files.makeDir(d), true)
    assert.equal(await sbx.files.makeDir(d), false)
    await sbx.files.write(`${d}/x.txt`, 'xx')
    await sbx.files.makeDir(`${d}/sub`)
    const entries = Object.fromEntries((await sbx.files.list(d)).map((e) => [e.name, e]))
    assert.deepEqual(Object.keys(entries).sort(), ['sub', 'x.txt'])
    assert.equal(entries['x.txt'].type, FileType.FILE)
    assert.equal(entries['x.txt'].size, 2)
    assert.equal(entries.sub.type, FileType.DIR)
    assert.equal((await sbx.files.getInfo(`${d}/x.txt`)).owner, 'user')
    const moved = await sbx.files.rename(`${d}/x.txt`, `${d}/y.txt`)
    assert.equal(moved.path, `${d}/y.txt`)
    assert.equal(await sbx.files.exists(`${d}/x.txt`), false)
    await sbx.files.remove(d)
    assert.equal(await sbx.files.exists(d), false)
  })

  test('write several files in one call (one multipart upload)', async () => {
    const d = `${BASE}/many`
    const infos = await sbx.files.write([
      { path: `${d}/one.txt`, data: 'one' },
      { path: `${d}/deeper/two.bin`, data: new Uint8Array([0, 1, 2, 255]).buffer },
      { path: 'relative-js.txt', data: 'home' },
    ])
    assert.deepEqual(
      infos.map((i) => i.path),
      [`${d}/one.txt`, `${d}/deeper/two.bin`, '/home/user/relative-js.txt'],
    )
    assert.equal(await sbx.files.read(`${d}/one.txt`), 'one')
    assert.deepEqual(
      await sbx.files.read(`${d}/deeper/two.bin`, { format: 'bytes' }),
      new Uint8Array([0, 1, 2, 255]),
    )
    assert.equal(await sbx.files.read('/home/user/relative-js.txt'), 'home')
  })

  test('a write as user makes missing parents anywhere, the user\'s (as envd, root, does)', async () => {
    const infos = await sbx.files.write([
      { path: '/0/x.txt', data: 'zero' },
      { path: '/0/deeper/y.txt', data: 'why' },
    ])
    assert.deepEqual(
      infos.map((i) => i.path),
      ['/0/x.txt', '/0/deeper/y.txt'],
    )
    assert.equal(await sbx.files.read('/0/deeper/y.txt'), 'why')
    for (const p of ['/0', '/0/deeper', '/0/x.txt']) {
      assert.equal((await sbx.files.getInfo(p)).owner, 'user', p)
    }
  })

  test('getInfo of a symlink, remove of a missing path', async () => {
    await sbx.files.write(`${BASE}/links/target.txt`, 't')
    await sbx.commands.run(`ln -sf ${BASE}/links/target.txt ${BASE}/links/link`)
    const info = await sbx.files.getInfo(`${BASE}/links/link`)
    assert.equal(info.type, FileType.FILE)
    assert.equal(info.symlinkTarget, `${BASE}/links/target.txt`)
    await sbx.files.remove(`${BASE}/never-existed`)
  })

  test('watchDir', async () => {
    const d = `${BASE}/watched`
    await sbx.files.makeDir(d)
    const events = []
    const h = await sbx.files.watchDir(d, (e) => events.push(e), { timeoutMs: 0 })
    try {
      await sbx.files.write(`${d}/new.txt`, 'x')
      await sbx.commands.run(`rm ${d}/new.txt`)
      await waitUntil(
        () => events.some((e) => e.name === 'new.txt' && e.type === FilesystemEventType.REMOVE),
        'remove event',
        30_000,
      )
    } finally {
      await h.stop()
    }
  })

  test('watchDir: a write is create, chmod, write as on envd', async () => {
    const d = `${BASE}/watched-seq`
    await sbx.commands.run(`rm -rf ${d}`)
    await sbx.files.makeDir(d)
    const events = []
    const h = await sbx.files.watchDir(d, (e) => events.push(e), { timeoutMs: 0 })
    try {
      await sbx.files.write(`${d}/new.txt`, 'x')
      await waitUntil(
        () => events.some((e) => e.type === FilesystemEventType.WRITE),
        'write event',
        30_000,
      )
      await new Promise((r) => setTimeout(r, 1000))
      assert.deepEqual(
        events.map((e) => [e.name, e.type]),
        [
          ['new.txt', FilesystemEventType.CREATE],
          ['new.txt', FilesystemEventType.CHMOD],
          ['new.txt', FilesystemEventType.WRITE],
        ],
      )
    } finally {
      await h.stop()
    }
  })

  test('watchDir recursive sees directories made after it', async () => {
    const d = `${BASE}/watched-tree`
    await sbx.commands.run(`rm -rf ${d}`)
    await sbx.files.makeDir(d)
    const events = []
    const h = await sbx.files.watchDir(d, (e) => events.push(e), {
      recursive: true,
      timeoutMs: 0,
    })
    const created = (name) =>
      events.some((e) => e.name === name && e.type === FilesystemEventType.CREATE)
    try {
      await sbx.commands.run(`mkdir -p ${d}/a/b && echo x > ${d}/a/b/c.txt`)
      await sbx.commands.run(`mkdir ${d}/later`)
      await new Promise((r) => setTimeout(r, 1000))
      await sbx.commands.run(`echo y > ${d}/later/e.txt`)
      await waitUntil(
        () => created('later/e.txt') && created('a/b/c.txt'),
        'events in new directories',
        30_000,
      )
      for (const name of ['a', 'a/b', 'a/b/c.txt', 'later', 'later/e.txt']) {
        assert.ok(created(name), `${name} in ${JSON.stringify(events)}`)
      }
    } finally {
      await h.stop()
    }
  })

  test('50 MB upload and download', SLOW, async () => {
    const data = randomBytes(50 * 1024 * 1024)
    const digest = createHash('sha256').update(data).digest('hex')
    const path = `${BASE}/big.bin`
    await sbx.files.write(path, new Blob([data]), { requestTimeoutMs: 300_000 })
    const r = await sbx.commands.run(`sha256sum ${path}`, { timeoutMs: 300_000 })
    assert.equal(r.stdout.split(' ')[0], digest)
    const back = await sbx.files.read(path, { format: 'bytes', requestTimeoutMs: 300_000 })
    assert.equal(back.length, data.length)
    assert.equal(createHash('sha256').update(back).digest('hex'), digest)
    await sbx.files.remove(path)
  })
})
