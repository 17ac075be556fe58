// commands.run and a PTY session on one sandbox.
import assert from 'node:assert/strict'
import http from 'node:http'
import { after, before, describe, test } from 'node:test'
import { CommandExitError, TimeoutError } from 'e2b'
import { LONG, SLOW, create, reapRun, waitUntil } from '../helpers.mjs'

let sbx

before(async () => {
  sbx = await create({ envs: { SDK_SANDBOX_ENV: 'from-create' } })
}, SLOW)
after(async () => {
  await sbx?.kill()
  await reapRun()
})

describe('commands', SLOW, () => {
  test('stdout, stderr, callbacks', async () => {
    const out = []
    const err = []
    const r = await sbx.commands.run('echo hello; echo oops >&2', {
      onStdout: (d) => out.push(d),
      onStderr: (d) => err.push(d),
    })
    assert.equal(r.stdout, 'hello\n')
    assert.equal(r.stderr, 'oops\n')
    assert.equal(r.exitCode, 0)
    assert.equal(out.join(''), 'hello\n')
    assert.equal(err.join(''), 'oops\n')
  })

  test('non-zero exit rejects with CommandExitError', async () => {
    await assert.rejects(sbx.commands.run('echo partial; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError)
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'partial\n')
      return true
    })
  })

  test('envs, cwd, user', async () => {
    const r = await sbx.commands.run('echo "$FOO|$SDK_SANDBOX_ENV"', { envs: { FOO: 'bar' } })
    assert.equal(r.stdout, 'bar|from-create\n')
    assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
    assert.equal((await sbx.commands.run('whoami; pwd')).stdout, 'user\n/home/user\n')
  })

  test('background, list, kill', async () => {
    const h = await sbx.commands.run('sleep 600', { background: true, timeoutMs: 0 })
    assert.ok(h.pid > 0)
    await waitUntil(
      async () => (await sbx.commands.list()).some((p) => p.pid === h.pid),
      'process in list',
    )
    assert.equal(await h.kill(), true)
    await assert.rejects(h.wait(), CommandExitError)
    await waitUntil(
      async () => !(await sbx.commands.list()).some((p) => p.pid === h.pid),
      'process to leave list',
    )
    assert.equal(await sbx.commands.kill(h.pid), false)
  })

  test('stdin', async () => {
    const h = await sbx.commands.run('cat', { background: true, stdin: true, timeoutMs: 120_000 })
    await sbx.commands.sendStdin(h.pid, 'one\n')
    await h.sendStdin('two\n')
    await sbx.commands.closeStdin(h.pid)
    assert.equal((await h.wait()).stdout, 'one\ntwo\n')
  })

  // Longer than every bound on the way (the node's kept guest connections,
  // 15 s; the agent's header-read timeout, 30 s; the SDK's keepalive
  // interval, 50 s; the default command timeout, 60 s), with a silent stretch.
  // The long tier's: the Python SDK's test of the same stream (its client
  // keeps alive the same way) runs in every run, 1.5 min each.
  test('a long streaming command runs to its end', LONG, async () => {
    const started = Date.now()
    const r = await sbx.commands.run(
      'for i in $(seq 1 10); do echo tick-$i; seq 1 2000; sleep 1; done; ' +
        'echo quiet >&2; sleep 65; ' +
        'for i in $(seq 11 20); do echo tick-$i; seq 1 2000; sleep 1; done; echo finished',
      { timeoutMs: 600_000 },
    )
    assert.ok(Date.now() - started > 80_000)
    assert.equal(r.exitCode, 0)
    assert.equal(r.stderr, 'quiet\n')
    const ticks = r.stdout.split('\n').filter((l) => l.startsWith('tick-'))
    assert.deepEqual(
      ticks,
      Array.from({ length: 20 }, (_, i) => `tick-${i + 1}`),
    )
    assert.equal(r.stdout.split('\n2000\n').length - 1, 20)
    assert.ok(r.stdout.endsWith('finished\n'))
  })

  test('timeout rejects with TimeoutError', async () => {
    const start = Date.now()
    await assert.rejects(sbx.commands.run('sleep 60', { timeoutMs: 3_000 }), TimeoutError)
    assert.ok(Date.now() - start < 50_000)
  })
})

describe('pty', SLOW, () => {
  test('create, input, resize, output, exit', SLOW, async () => {
    const chunks = []
    const text = () => Buffer.concat(chunks).toString('utf8')
    const h = await sbx.pty.create({
      cols: 80,
      rows: 24,
      timeoutMs: 0,
      onData: (d) => chunks.push(Buffer.from(d)),
    })
    try {
      const enc = new TextEncoder()
      await sbx.pty.sendInput(h.pid, enc.encode('echo pty-$((6*7))\n'))
      await waitUntil(() => text().includes('pty-42'), 'pty echo')
      await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
      await waitUntil(() => text().includes('24 80'), 'initial size')
      await sbx.pty.resize(h.pid, { cols: 100, rows: 40 })
      await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
      await waitUntil(() => text().includes('40 100'), 'size after resize')
      await sbx.pty.sendInput(h.pid, enc.encode('exit 0\n'))
      const r = await h.wait()
      assert.equal(r.exitCode, 0)
    } finally {
      await sbx.pty.kill(h.pid).catch(() => {})
    }
  })
})

describe('pty reconnect', SLOW, () => {
  test('connect after the first handle went away gets the output from then on', SLOW, async () => {
    const first = await sbx.pty.create({ cols: 80, rows: 24, timeoutMs: 0, onData: () => {} })
    const pid = first.pid
    await first.disconnect()
    const chunks = []
    const text = () => Buffer.concat(chunks).toString('utf8')
    const again = await sbx.pty.connect(pid, {
      timeoutMs: 0,
      onData: (d) => chunks.push(Buffer.from(d)),
    })
    try {
      const enc = new TextEncoder()
      // The echo shows the line as typed; only the command prints the value.
      await sbx.pty.sendInput(pid, enc.encode('echo again-$((6*7))\n'))
      await waitUntil(() => text().includes('again-42'), "the command's output")
      await sbx.pty.sendInput(pid, enc.encode('sleep 1; echo later-$((2*3))\n'))
      await waitUntil(() => text().includes('later-6'), 'output after a pause')
      await sbx.pty.sendInput(pid, enc.encode('exit 0\n'))
      assert.equal((await again.wait()).exitCode, 0)
    } finally {
      await sbx.pty.kill(pid).catch(() => {})
    }
  })
})

// GET `path` from the node with `host` as the Host header: getHost names
// E2B's domain, and the node routes by the Host header as E2B's proxy does.
// (fetch may not set Host; node:http may.)
function getVia(host, path, headers = {}) {
  const node = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = http.request(
      { hostname: node.hostname, port: node.port, path, headers: { host, ...headers } },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (d) => (body += d))
        res.on('end', () => resolve({ status: res.statusCode, body }))
      },
    )
    req.on('error', reject)
    req.end()
  })
}

describe('ports', SLOW, () => {
  test('a server in the sandbox answers at getHost(port)', async () => {
    await sbx.files.write('/tmp/www-js/index.html', 'hello from js\n')
    const server = await sbx.commands.run('python3 -m http.server 8090 --directory /tmp/www-js', {
      background: true,
    })
    try {
      const host = sbx.getHost(8090)
      assert.ok(host.startsWith(`8090-${sbx.sandboxId}.`), host)
      const page = await waitUntil(async () => {
        const r = await getVia(host, '/index.html').catch(() => null)
        return r?.status === 200 ? r : null
      }, "the sandbox's server")
      assert.equal(page.body, 'hello from js\n')
      const closed = await getVia(sbx.getHost(8091), '/')
      assert.equal(closed.status, 502)
      assert.match(JSON.parse(closed.body).message, /port is not open/)
    } finally {
      await server.kill()
    }
  })

  test('a private sandbox answers only with its traffic token', async () => {
    assert.equal(sbx.trafficAccessToken, undefined)
    const priv = await create({ network: { allowPublicTraffic: false } })
    try {
      const token = priv.trafficAccessToken
      assert.ok(token, 'a private sandbox has a traffic access token')
      await priv.files.write('/tmp/www-js/index.html', 'private\n')
      const server = await priv.commands.run(
        'python3 -m http.server 8090 --directory /tmp/www-js',
        { background: true },
      )
      const host = priv.getHost(8090)
      const page = await waitUntil(async () => {
        const r = await getVia(host, '/index.html', { 'e2b-traffic-access-token': token }).catch(
          () => null,
        )
        return r?.status === 200 ? r : null
      }, "the private sandbox's server")
      assert.equal(page.body, 'private\n')
      const without = await getVia(host, '/index.html')
      assert.equal(without.status, 403)
      assert.match(JSON.parse(without.body).message, /is missing/)
      const info = await priv.getInfo()
      assert.equal(info.network.allowPublicTraffic, false)
      await server.kill()
    } finally {
      await priv.kill()
    }
  })
})
