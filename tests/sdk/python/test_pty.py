"""A PTY session: create, send input, resize, read output, exit."""

import threading

from conftest import wait_until
from e2b import PtySize


def test_pty_session(sandbox):
    output = bytearray()
    lock = threading.Lock()

    def on_pty(data: bytes):
        with lock:
            output.extend(data)

    def text():
        with lock:
            return output.decode("utf-8", "replace")

    handle = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    assert handle.pid > 0
    result = {}

    def reader():
        try:
            result["value"] = handle.wait(on_pty=on_pty)
        except Exception as e:  # exit code of the shell, or a stream error
            result["error"] = e

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        sandbox.pty.send_stdin(handle.pid, b"echo pty-$((6*7))\n")
        wait_until(lambda: "pty-42" in text(), what="PTY echo output")
        sandbox.pty.send_stdin(handle.pid, b"stty size\n")
        wait_until(lambda: "24 80" in text(), what="initial PTY size")
        sandbox.pty.resize(handle.pid, PtySize(rows=40, cols=100))
        sandbox.pty.send_stdin(handle.pid, b"stty size; tty\n")
        wait_until(lambda: "40 100" in text(), what="PTY size after resize")
        wait_until(lambda: "/dev/pts/" in text(), what="tty name")
        sandbox.pty.send_stdin(handle.pid, b"exit 0\n")
        t.join(60)
        assert not t.is_alive(), "PTY stream did not end after exit"
        assert "error" not in result, result.get("error")
        assert result["value"].exit_code == 0
    finally:
        if t.is_alive():
            sandbox.pty.kill(handle.pid)


def test_pty_reconnect_gets_the_output_from_then_on(sandbox, api):
    first = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    pid = first.pid
    # The first handle goes away without reading its stream.
    first.disconnect()
    output = bytearray()
    lock = threading.Lock()

    def on_pty(data: bytes):
        with lock:
            output.extend(data)

    def text():
        with lock:
            return output.decode("utf-8", "replace")

    again = sandbox.pty.connect(pid, timeout=0)
    result = {}

    def reader():
        try:
            result["value"] = again.wait(on_pty=on_pty)
        except Exception as e:  # exit code of the shell, or a stream error
            result["error"] = e

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        # The typed line is echoed as typed; only the command's own output
        # has the computed value.
        sandbox.pty.send_stdin(pid, b"echo again-$((6*7))\n")
        try:
            wait_until(lambda: "again-42" in text(), what="the command's output")
        except AssertionError:
            print(repr(text()))
            print(api.get(f"/sandboxes/{sandbox.sandbox_id}/logs").text[-20000:])
            raise
        sandbox.pty.send_stdin(pid, b"sleep 1; echo later-$((2*3))\n")
        wait_until(lambda: "later-6" in text(), what="output after a pause")
        sandbox.pty.send_stdin(pid, b"exit 0\n")
        t.join(60)
        assert not t.is_alive(), "PTY stream did not end after exit"
        assert "error" not in result, result.get("error")
        assert result["value"].exit_code == 0
    finally:
        if t.is_alive():
            sandbox.pty.kill(pid)
