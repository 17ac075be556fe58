"""A PTY session: create, send input, resize, read output, exit."""

import threading

from e2b import PtySize
from polling import wait_until


class PtyReader:
    """A PTY handle's stream read on a thread of its own: the output so far,
    and how the stream ended."""

    def __init__(self, handle):
        self.output = bytearray()
        self.lock = threading.Lock()
        self.result = {}
        self.thread = threading.Thread(target=self._read, args=(handle,), daemon=True)
        self.thread.start()

    def _read(self, handle):
        try:
            self.result["value"] = handle.wait(on_pty=self._on_pty)
        except Exception as e:  # exit code of the shell, or a stream error
            self.result["error"] = e

    def _on_pty(self, data: bytes):
        with self.lock:
            self.output.extend(data)

    def text(self):
        with self.lock:
            return self.output.decode("utf-8", "replace")

    def assert_exited_cleanly(self):
        self.thread.join(60)
        assert not self.thread.is_alive(), "PTY stream did not end after exit"
        assert "error" not in self.result, self.result.get("error")
        assert self.result["value"].exit_code == 0


def test_pty_session(sandbox):
    handle = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    assert handle.pid > 0
    pty = PtyReader(handle)
    try:
        sandbox.pty.send_stdin(handle.pid, b"echo pty-$((6*7))\n")
        wait_until(lambda: "pty-42" in pty.text(), what="PTY echo output")
        sandbox.pty.send_stdin(handle.pid, b"stty size\n")
        wait_until(lambda: "24 80" in pty.text(), what="initial PTY size")
        sandbox.pty.resize(handle.pid, PtySize(rows=40, cols=100))
        sandbox.pty.send_stdin(handle.pid, b"stty size; tty\n")
        wait_until(lambda: "40 100" in pty.text(), what="PTY size after resize")
        wait_until(lambda: "/dev/pts/" in pty.text(), what="tty name")
        sandbox.pty.send_stdin(handle.pid, b"exit 0\n")
        pty.assert_exited_cleanly()
    finally:
        if pty.thread.is_alive():
            sandbox.pty.kill(handle.pid)


def test_pty_reconnect_gets_the_output_from_then_on(sandbox, api):
    first = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=0)
    pid = first.pid
    # The first handle goes away without reading its stream.
    first.disconnect()
    pty = PtyReader(sandbox.pty.connect(pid, timeout=0))
    try:
        # The typed line is echoed as typed; only the command's own output
        # has the computed value.
        sandbox.pty.send_stdin(pid, b"echo again-$((6*7))\n")
        try:
            wait_until(lambda: "again-42" in pty.text(), what="the command's output")
        except AssertionError:
            print(repr(pty.text()))
            print(api.get(f"/sandboxes/{sandbox.sandbox_id}/logs").text[-20000:])
            raise
        sandbox.pty.send_stdin(pid, b"sleep 1; echo later-$((2*3))\n")
        wait_until(lambda: "later-6" in pty.text(), what="output after a pause")
        sandbox.pty.send_stdin(pid, b"exit 0\n")
        pty.assert_exited_cleanly()
    finally:
        if pty.thread.is_alive():
            sandbox.pty.kill(pid)
