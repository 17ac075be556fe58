"""Lifecycle webhooks (E2B's `/events/webhooks`, registered over HTTP as E2B
users do: the SDK has no call for it) seen by a receiver on loopback while
the SDK drives a sandbox through its life: created, paused, resumed (a
connect), forked (one event per child, naming its parent) and killed, each
delivery signed as E2B signs them, listed among the webhook's deliveries,
and the sandbox's events readable from `GET /events/sandboxes/{id}`."""

import base64
import hashlib
import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import create
from e2b import Sandbox
from polling import wait_until

LIFECYCLE = ("created", "paused", "resumed", "forked", "killed")


class Receiver:
    """An HTTP server on loopback keeping every POST: (headers, body)."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        lock = threading.Lock()
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.lock = lock
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events_of(self, ids: set[str]) -> list[tuple[dict[str, str], bytes, dict]]:
        with self.lock:
            got = list(self.got)
        parsed = [(h, b, json.loads(b)) for h, b in got]
        return [(h, b, e) for h, b, e in parsed if e["sandboxId"] in ids]


@pytest.fixture
def webhook(api) -> Iterator[tuple[Receiver, str, str]]:
    """A receiver and a webhook for the five lifecycle events sent to it:
    (receiver, webhook id, its secret); the webhook is deleted after."""
    receiver = Receiver()
    secret = secrets.token_hex(16)
    body = {
        "name": f"sdk-{secrets.token_hex(3)}",
        "url": receiver.url,
        "events": [f"sandbox.lifecycle.{e}" for e in LIFECYCLE],
        "signatureSecret": secret,
    }
    r = api.post("/events/webhooks", json=body)
    assert r.status_code == 201, r.text
    hook = r.json()["id"]
    try:
        yield receiver, hook, secret
    finally:
        api.delete(f"/events/webhooks/{hook}")
        receiver.server.shutdown()


@pytest.mark.lifecycle
def test_webhooks_see_each_lifecycle_event_signed(api, webhook):
    receiver, hook, secret = webhook
    sbx = create(metadata={"case": "webhooks"})
    sid = sbx.sandbox_id
    children: list = []
    try:
        sbx.pause()
        sbx = Sandbox.connect(sid)
        results = sbx.fork(count=2, timeout=600)
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors
        children = results
    finally:
        for c in children:
            c.kill()
        sbx.kill()
    kids = {c.sandbox_id for c in children}
    ids = {sid} | kids

    # 1 created, 1 paused, 1 resumed, 2 forked, 3 killed
    wait_until(
        lambda: len(receiver.events_of(ids)) >= 8,
        timeout=60,
        what=lambda: f"8 deliveries, got {[e['type'] for _, _, e in receiver.events_of(ids)]}",
    )
    events = receiver.events_of(ids)
    assert len(events) == 8, [e["type"] for _, _, e in events]
    for headers, body, _ in events:
        expected = base64.b64encode(hashlib.sha256(secret.encode() + body).digest()).rstrip(b"=")
        assert headers["e2b-signature"] == expected.decode()
        assert headers["e2b-signature-version"] == "v1"
        assert headers["e2b-webhook-id"] == hook

    def of(sandbox: str) -> list[tuple[str, str | None]]:
        kinds = []
        for _, _, e in events:
            if e["sandboxId"] == sandbox:
                parent = (e.get("eventData") or {}).get("parent_sandbox_id")
                kinds.append((e["type"].removeprefix("sandbox.lifecycle."), parent))
        return sorted(kinds)

    assert of(sid) == [("created", None), ("killed", None), ("paused", None), ("resumed", None)]
    for kid in kids:
        assert of(kid) == [("forked", sid), ("killed", None)]

    deliveries = api.get(f"/events/webhooks/{hook}/deliveries").json()
    ours = [d for d in deliveries if d["sandboxID"] in ids]
    assert len(ours) == 8 and all(d["status"] == "delivered" for d in ours), ours
    listed = api.get(f"/events/sandboxes/{sid}").json()
    types = sorted(e["type"].removeprefix("sandbox.lifecycle.") for e in listed)
    assert types == ["created", "killed", "paused", "resumed"], listed


def test_a_webhook_at_an_inward_address_is_refused(api):
    """The node delivers to public addresses and the networks its operator
    allows (this suite's node: 127.0.0.0/8): a cloud's metadata address or
    a private one is a 400 naming the flag, and nothing is registered."""
    before = api.get("/events/webhooks").json()
    for url in ("http://169.254.169.254/latest/meta-data", "http://10.1.2.3:8080/hook"):
        body = {
            "url": url,
            "events": ["sandbox.lifecycle.created"],
            "signatureSecret": "s",
        }
        r = api.post("/events/webhooks", json=body)
        assert r.status_code == 400, r.text
        assert "--webhook-allow-net" in r.text, r.text
    assert api.get("/events/webhooks").json() == before
