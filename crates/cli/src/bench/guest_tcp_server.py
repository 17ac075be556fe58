"""A TCP sink and source, run in a guest by `sandfork bench`: the SDK bench's
`guest_tcp` phase (sdk_bench.py) and the VMM part's `vmm_guest_tcp_*`
(guest_tcp.rs) both start it as `python3 guest_tcp_server.py MIB SINK SOURCE`.

The sink reads a connection to its end and answers the byte count; the
source sends MIB MiB after a request byte (a probe that sends nothing gets
nothing).
"""

import contextlib
import socket
import sys
import threading
from collections.abc import Callable

MIB, SINK, SOURCE = (int(a) for a in sys.argv[1:4])
CHUNK = 1 << 20


def listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(4)
    return s


def sink(c: socket.socket) -> None:
    n = 0
    while True:
        b = c.recv(CHUNK)
        if not b:
            break
        n += len(b)
    c.sendall(str(n).encode())


def source(c: socket.socket) -> None:
    if c.recv(1) == b"g":
        block = b"\0" * CHUNK
        for _ in range(MIB):
            c.sendall(block)


def serve(listener: socket.socket, handle: Callable[[socket.socket], None]) -> None:
    while True:
        c, _ = listener.accept()
        with contextlib.suppress(OSError):
            handle(c)
        c.close()


listeners = [(listen(SINK), sink), (listen(SOURCE), source)]
for listener, handle in listeners:
    threading.Thread(target=serve, args=(listener, handle), daemon=True).start()
threading.Event().wait()
