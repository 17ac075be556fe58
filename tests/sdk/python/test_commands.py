"""commands.run: output, exit codes, env, cwd, user, background, stdin, timeouts."""

import time

import pytest
from e2b import CommandExitException, TimeoutException
from polling import wait_until


def test_stdout_and_exit_code(sandbox):
    r = sandbox.commands.run("echo hello; echo world")
    assert r.stdout == "hello\nworld\n"
    assert r.stderr == ""
    assert r.exit_code == 0


def test_stderr(sandbox):
    r = sandbox.commands.run("echo oops >&2")
    assert r.stdout == ""
    assert r.stderr == "oops\n"


def test_streaming_callbacks(sandbox):
    out, err = [], []
    sandbox.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; done",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "out1\nout2\nout3\n"
    assert "".join(err) == "err1\nerr2\nerr3\n"


def test_non_zero_exit_raises(sandbox):
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo partial; echo bad >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n"
    assert e.value.stderr == "bad\n"


def test_envs(sandbox):
    r = sandbox.commands.run('echo "$FOO|$SDK_SANDBOX_ENV"', envs={"FOO": "bar baz"})
    assert r.stdout == "bar baz|from-create\n"


def test_cwd(sandbox):
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_default_user_and_workdir(sandbox):
    # E2B's defaults: user `user`, in /home/user.
    r = sandbox.commands.run("whoami; pwd; echo $HOME")
    assert r.stdout == "user\n/home/user\n/home/user\n"


def test_user(sandbox):
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"
    assert sandbox.commands.run("id -u", user="user").stdout == "1000\n"


def test_background_list_and_kill(sandbox):
    handle = sandbox.commands.run("sleep 600", background=True, timeout=0)
    assert handle.pid > 0
    listed = wait_until(
        lambda: [p for p in sandbox.commands.list() if p.pid == handle.pid],
        what="background process in commands.list()",
    )
    assert "sleep" in (listed[0].cmd + " " + " ".join(listed[0].args))
    assert handle.kill() is True
    with pytest.raises(CommandExitException):
        handle.wait()
    wait_until(
        lambda: all(p.pid != handle.pid for p in sandbox.commands.list()),
        what="killed process to leave commands.list()",
    )
    # a second kill of a gone process reports False (not_found)
    assert sandbox.commands.kill(handle.pid) is False


def test_background_output_arrives_while_running(sandbox):
    handle = sandbox.commands.run("echo started; sleep 2; echo done", background=True, timeout=120)
    result = handle.wait()
    assert result.stdout == "started\ndone\n"


def test_stdin(sandbox):
    handle = sandbox.commands.run("cat", background=True, stdin=True, timeout=120)
    sandbox.commands.send_stdin(handle.pid, "line one\n")
    sandbox.commands.send_stdin(handle.pid, b"line two\n")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "line one\nline two\n"


def test_connect_to_running_command(sandbox):
    handle = sandbox.commands.run(
        "sleep 1; echo from-connect; sleep 1", background=True, timeout=120
    )
    handle.disconnect()
    again = sandbox.commands.connect(handle.pid, timeout=120)
    assert "from-connect" in again.wait().stdout


def test_timeout_raises_and_kills(sandbox):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 60; echo late > /tmp/late", timeout=3)
    assert time.monotonic() - start < 50
    # The deadline is the process lifetime: it must be gone, not orphaned.
    # Looked for until 50 s in (a stalled lab is slow to reap it), well
    # before the command would have ended by itself.
    while True:
        procs = sandbox.commands.list()
        left = [p for p in procs if "sleep 60" in " ".join([p.cmd, *p.args])]
        if not left or time.monotonic() - start > 50:
            break
        time.sleep(1)
    assert not left, f"still running {time.monotonic() - start:.0f} s after the start: {left}"


# Longer than every bound on the way (the node's kept guest connections, 15 s;
# the agent's header-read timeout, 30 s; the SDK's keepalive interval, 50 s,
# and the default command timeout, 60 s): the stream must last as long as the
# command's own timeout allows, across a silent stretch and bulk output.
LONG_STREAM = (
    "for i in $(seq 1 10); do echo tick-$i; seq 1 2000; sleep 1; done; "
    "echo quiet >&2; sleep 65; "
    "for i in $(seq 11 20); do echo tick-$i; seq 1 2000; sleep 1; done; "
    "echo finished"
)


def test_long_streaming_command_runs_to_its_end(sandbox, api):
    started = time.monotonic()
    chunks = []
    try:
        r = sandbox.commands.run(LONG_STREAM, timeout=600, on_stdout=chunks.append)
    except Exception:
        # What the node saw of the sandbox when the stream broke.
        sid = sandbox.sandbox_id
        print(api.get(f"/v1/sandboxes/{sid}/diagnostics").text[-20000:])
        print(api.get(f"/sandboxes/{sid}/logs").text[-20000:])
        raise
    assert time.monotonic() - started > 80
    assert r.exit_code == 0
    assert r.stderr == "quiet\n"
    ticks = [line for line in r.stdout.splitlines() if line.startswith("tick-")]
    assert ticks == [f"tick-{i}" for i in range(1, 21)]
    assert r.stdout.count("\n2000\n") == 20
    assert r.stdout.endswith("finished\n")
    assert "".join(chunks) == r.stdout
