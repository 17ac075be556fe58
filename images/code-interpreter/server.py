"""sandfork's code interpreter: the HTTP protocol `e2b_code_interpreter` speaks on
port 49999, served from Jupyter kernels (ipykernel, driven with jupyter_client).

Routes (JSON):
  GET  /health                  200 "OK" once the default Python context is up
  POST /execute                 {"code", "context_id"?, "language"?, "env_vars"?}:
                                200, one JSON object per line while the code runs
                                (stdout, stderr, result, error, number_of_executions,
                                keepalive every 5 s of silence, end_of_execution last)
  POST /contexts                {"language"?, "cwd"?} -> {"id", "language", "cwd"}
  GET  /contexts                [{"id", "language", "cwd"}, ...]
  POST /contexts/{id}/restart   a fresh kernel, same id
  DELETE /contexts/{id}

One kernel per context; a context runs one execution at a time (the others wait).
A client that goes away mid-execution interrupts its kernel. Only the standard
library and jupyter_client: no web framework in the guest.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("SANDFORK_CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("SANDFORK_CODE_INTERPRETER_CWD", "/home/user")
# Silence on a stream for this long sends a keepalive line (and so notices a
# client that went away).
KEEPALIVE_S = 5.0
# How often a running execution checks that its client is still there.
POLL_S = 0.5
# A kernel start in an emulated lab takes tens of seconds.
KERNEL_READY_S = 600.0
# How long an interrupted execution may take to wind down.
INTERRUPT_S = 30.0
MAX_BODY = 16 << 20

# The languages this template runs, by the name the SDK sends, and their
# kernels. Aliases as the SDK documents them ("" and None mean Python).
KERNELS = {"python": "python3"}
ALIASES = {"": "python", "py": "python", "python3": "python"}

# Jupyter MIME types and the Result fields the SDK reads them into; anything
# else goes to "extra".
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}

# Run in every Python kernel when it starts (silently): a module `_sandfork`
# with the per-execution environment helpers, and a display formatter that adds
# an "e2b/data" representation (columns -> {index: value}) to pandas DataFrames,
# which the SDK reads into `Result.data`. pandas is looked up by name, so it is
# imported only if the user's code imports it.
KERNEL_INIT = r"""
def _sandfork_init():
    import json
    import os
    import sys
    import types

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    mod = types.ModuleType("_sandfork")
    saved = []

    def push_env(env):
        saved.append({k: os.environ.get(k) for k in env})
        os.environ.update(env)

    def pop_env():
        if not saved:
            return
        for k, v in saved.pop().items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    mod.push_env = push_env
    mod.pop_env = pop_env
    sys.modules["_sandfork"] = mod

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

    def frame(df):
        try:
            return json.loads(df.to_json(orient="columns", date_format="iso", default_handler=str))
        except (ValueError, TypeError):
            return None

    ip = get_ipython()
    fmt = DataFormatter(parent=ip.display_formatter)
    # pandas 3 names the class pandas.DataFrame, earlier ones by its module
    for module in ("pandas", "pandas.core.frame"):
        fmt.for_type_by_name(module, "DataFrame", frame)
    ip.display_formatter.formatters["e2b/data"] = fmt


_sandfork_init()
del _sandfork_init
"""

# Imported by the default Python kernel before it is reported ready, so that a
# template snapshot holds them loaded (and matplotlib's font cache built).
WARM_UP = "import numpy, pandas, matplotlib.pyplot"


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGoneError(Exception):
    """The HTTP client closed its connection mid-stream."""


def log(msg: str) -> None:
    print(f"code-interpreter: {msg}", file=sys.stderr, flush=True)


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HOME", "/root")
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    # Figures as PNG display data (ipykernel's inline backend).
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env.pop("SANDFORK_CODE_INTERPRETER_PORT", None)
    env.pop("SANDFORK_CODE_INTERPRETER_CWD", None)
    return env


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    manager: KernelManager
    client: BlockingKernelClient
    lock: threading.Lock = field(default_factory=threading.Lock)

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


def start_kernel(language: str, cwd: str) -> tuple[KernelManager, BlockingKernelClient]:
    manager = KernelManager(kernel_name=KERNELS[language])
    manager.start_kernel(cwd=cwd, env=kernel_env())
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=KERNEL_READY_S)
        run_silent(client, KERNEL_INIT)
    except Exception:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        raise
    return manager, client


def run_silent(client: BlockingKernelClient, code: str) -> None:
    """Runs `code` without output or history; raises if it fails."""
    msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
    while True:
        reply = client.get_shell_msg(timeout=KERNEL_READY_S)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    content = reply["content"]
    if content.get("status") != "ok":
        raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")


def timestamp(msg: dict[str, Any]) -> str:
    date = msg["header"].get("date")
    if isinstance(date, datetime):
        return date.isoformat()
    return str(date or datetime.now().astimezone().isoformat())


def unquote(text: str) -> str:
    """A str's repr without its quotes ("'a'" -> "a"), as the SDK's `.text` gives it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" and "\n" not in text:
        return text[1:-1]
    return text


def result_line(content: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in content.get("data", {}).items():
        name = MIME_FIELDS.get(mime)
        if name == "text" and isinstance(value, str):
            value = unquote(value)
        if name is None:
            extra[mime] = value
        else:
            out[name] = value
    if extra:
        out["extra"] = extra
    return out


def output_line(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The stream line for one iopub message, or None for those not sent."""
    kind = msg["msg_type"]
    content = msg["content"]
    if kind == "stream":
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": name, "text": content.get("text", ""), "timestamp": timestamp(msg)}
    if kind == "execute_result":
        return result_line(content, True)
    if kind == "display_data":
        return result_line(content, False)
    if kind == "error":
        return {
            "type": "error",
            "name": content.get("ename", ""),
            "value": content.get("evalue", ""),
            "traceback": "\n".join(content.get("traceback", [])),
        }
    if kind == "execute_input":
        return {"type": "number_of_executions", "execution_count": content.get("execution_count")}
    return None


class Interpreter:
    """The contexts and their kernels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}

    def language(self, raw: str | None) -> str:
        lang = (raw or "").strip().lower()
        lang = ALIASES.get(lang, lang)
        if lang not in KERNELS:
            known = ", ".join(sorted(KERNELS))
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"language {raw!r} is not available in this template (only {known})",
            )
        return lang

    def create(self, language: str, cwd: str) -> Context:
        manager, client = start_kernel(language, cwd)
        ctx = Context(uuid.uuid4().hex, language, cwd, manager, client)
        with self._lock:
            self._contexts[ctx.id] = ctx
        log(f"context {ctx.id} ({language}, {cwd}) started")
        return ctx

    def default(self, language: str) -> Context:
        with self._lock:
            cid = self._defaults.get(language)
            ctx = self._contexts.get(cid) if cid else None
        if ctx is not None:
            return ctx
        ctx = self.create(language, DEFAULT_CWD)
        with self._lock:
            # Another request may have made one meanwhile: keep the first.
            first = self._contexts.get(self._defaults.get(language, ""))
            if first is None:
                self._defaults[language] = ctx.id
        if first is not None:
            self.remove(ctx.id)
            return first
        return ctx

    def get(self, cid: str) -> Context:
        with self._lock:
            ctx = self._contexts.get(cid)
        if ctx is None:
            raise HttpError(HTTPStatus.NOT_FOUND, f"context {cid} not found")
        return ctx

    def list(self) -> list[Context]:
        with self._lock:
            return list(self._contexts.values())

    def restart(self, cid: str) -> None:
        ctx = self.get(cid)
        with ctx.lock:
            ctx.client.stop_channels()
            ctx.manager.shutdown_kernel(now=True)
            ctx.manager, ctx.client = start_kernel(ctx.language, ctx.cwd)
        log(f"context {cid} restarted")

    def remove(self, cid: str) -> None:
        ctx = self.get(cid)
        with self._lock:
            self._contexts.pop(cid, None)
            for lang, d in list(self._defaults.items()):
                if d == cid:
                    del self._defaults[lang]
        with ctx.lock:
            ctx.client.stop_channels()
            ctx.manager.shutdown_kernel(now=True)
        log(f"context {cid} removed")

    def execute(
        self,
        ctx: Context,
        code: str,
        env: dict[str, str],
        send: Callable[[dict[str, Any]], None],
        alive: Callable[[], bool],
    ) -> None:
        """Runs `code` in `ctx`, calling `send` with each stream line. A client
        gone (`alive` false, or ClientGoneError from `send`) interrupts the
        kernel."""
        with ctx.lock:
            client = ctx.client
            if env and ctx.language == "python":
                run_silent(client, f"__import__('_sandfork').push_env({json.dumps(env)})")
            try:
                self._run(ctx, client, code, send, alive)
            finally:
                if env and ctx.language == "python":
                    run_silent(client, "__import__('_sandfork').pop_env()")

    def _run(
        self,
        ctx: Context,
        client: BlockingKernelClient,
        code: str,
        send: Callable[[dict[str, Any]], None],
        alive: Callable[[], bool],
    ) -> None:
        msg_id = client.execute(code, store_history=True, allow_stdin=False, stop_on_error=True)
        gone_at: float | None = None
        last_sent = time.monotonic()
        while True:
            now = time.monotonic()
            if gone_at is not None and now - gone_at > INTERRUPT_S:
                log(f"context {ctx.id}: not idle {INTERRUPT_S} s after the interrupt")
                break
            try:
                msg = client.get_iopub_msg(timeout=POLL_S)
            except queue.Empty:
                msg = None
            line: dict[str, Any] | None = None
            if msg is None:
                if gone_at is None and not alive():
                    gone_at = self._interrupt(ctx)
                elif time.monotonic() - last_sent >= KEEPALIVE_S:
                    line = {"type": "keepalive"}
            elif msg["parent_header"].get("msg_id") != msg_id:
                continue
            elif msg["msg_type"] == "status":
                if msg["content"].get("execution_state") == "idle":
                    break
            else:
                line = output_line(msg)
            if line is None or gone_at is not None:
                continue
            try:
                send(line)
                last_sent = time.monotonic()
            except ClientGoneError:
                gone_at = self._interrupt(ctx)
        self._drain_shell(client, msg_id, KERNEL_READY_S if gone_at is None else INTERRUPT_S)
        if gone_at is not None:
            raise ClientGoneError()

    @staticmethod
    def _interrupt(ctx: Context) -> float:
        log(f"context {ctx.id}: client gone, interrupting its kernel")
        ctx.manager.interrupt_kernel()
        return time.monotonic()

    @staticmethod
    def _drain_shell(client: BlockingKernelClient, msg_id: str, timeout: float) -> None:
        """Takes the execute_reply (and stale replies) off the shell channel."""
        while True:
            try:
                reply = client.get_shell_msg(timeout=timeout)
            except queue.Empty:
                return
            if reply["parent_header"].get("msg_id") == msg_id:
                return


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], interpreter: Interpreter) -> None:
        super().__init__(address, Handler)
        self.interpreter = interpreter
        self.ready = threading.Event()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        return

    # --- plumbing ---------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = self._chunked()
        else:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
            raw = self.rfile.read(length)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return body

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline().strip():
                    pass
                return bytes(out)
            if len(out) + size > MAX_BODY:
                raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
            out += self.rfile.read(size)
            self.rfile.readline()

    def _json(self, status: HTTPStatus, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._json(status, {"code": int(status), "message": message})

    def _route(self, method: str) -> None:
        try:
            self._dispatch(method)
        except HttpError as e:
            self._error(e.status, e.message)
        except ClientGoneError:
            self.close_connection = True
        except Exception as e:  # a kernel that failed to start, and the like
            log(f"{method} {self.path}: {type(e).__name__}: {e}")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # --- routes -----------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        interp = self.server.interpreter
        parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
        match (method, parts):
            case ("GET", ["health"]):
                if not self.server.ready.is_set():
                    raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "starting")
                self._json(HTTPStatus.OK, "OK")
            case ("POST", ["execute"]):
                self._execute(self._body())
            case ("GET", ["contexts"]):
                self._json(HTTPStatus.OK, [c.to_json() for c in interp.list()])
            case ("POST", ["contexts"]):
                body = self._body()
                lang = interp.language(body.get("language"))
                cwd = body.get("cwd") or DEFAULT_CWD
                if not isinstance(cwd, str):
                    raise HttpError(HTTPStatus.BAD_REQUEST, "cwd must be a string")
                self._json(HTTPStatus.OK, interp.create(lang, cwd).to_json())
            case ("POST", ["contexts", cid, "restart"]):
                interp.restart(cid)
                self._json(HTTPStatus.OK, None)
            case ("DELETE", ["contexts", cid]):
                interp.remove(cid)
                self._json(HTTPStatus.OK, None)
            case _:
                raise HttpError(HTTPStatus.NOT_FOUND, f"no route {method} {self.path}")

    def _execute(self, body: dict[str, Any]) -> None:
        interp = self.server.interpreter
        code = body.get("code")
        if not isinstance(code, str):
            raise HttpError(HTTPStatus.BAD_REQUEST, "code must be a string")
        cid = body.get("context_id")
        lang = body.get("language")
        if cid and lang:
            raise HttpError(HTTPStatus.BAD_REQUEST, "give context_id or language, not both")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise HttpError(HTTPStatus.BAD_REQUEST, "env_vars must map strings to strings")
        ctx = interp.get(cid) if cid else interp.default(interp.language(lang))

        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(line: dict[str, Any]) -> None:
            data = json.dumps(line).encode() + b"\n"
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError as e:
                raise ClientGoneError() from e

        def alive() -> bool:
            # The request is read: a readable socket now means EOF or reset.
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return not readable or self.connection.recv(1, socket.MSG_PEEK) != b""
            except OSError:
                return False

        try:
            interp.execute(ctx, code, env, send, alive)
        except ClientGoneError:
            raise
        except Exception as e:
            # The status line is sent: report it in the stream.
            log(f"execute in {ctx.id}: {type(e).__name__}: {e}")
            send({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})
        send({"type": "end_of_execution"})
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError as e:
            raise ClientGoneError() from e


def main() -> None:
    interp = Interpreter()
    server = Server(("0.0.0.0", PORT), interp)
    log(f"listening on port {PORT}")

    def warm() -> None:
        try:
            ctx = interp.default("python")
            run_silent(ctx.client, WARM_UP)
        except Exception as e:  # still serve: a context is made on demand
            log(f"warming the default context: {type(e).__name__}: {e}")
        server.ready.set()
        log("ready")

    threading.Thread(target=warm, name="warm-up", daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
