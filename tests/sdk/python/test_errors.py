"""Bad input: unknown template or sandbox, wrong key, malformed bodies, a
fork beyond the node's capacity."""

import httpx
import pytest
from conftest import API_URL, TEMPLATE
from e2b import (
    AuthenticationException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    ServiceBusyException,
)

MISSING = "sfnosuchsandbox0000"


def _error_body(r: httpx.Response):
    body = r.json()
    assert isinstance(body.get("code"), int), body
    assert isinstance(body.get("message"), str) and body["message"], body
    return body


def test_unknown_template():
    with pytest.raises(SandboxException) as e:
        Sandbox.create("no-such-template-sdk-test", timeout=60)
    assert not isinstance(e.value, AuthenticationException)


def test_unknown_template_wire(api):
    r = api.post("/v2/sandboxes", json={"templateID": "no-such-template-sdk-test"})
    assert r.status_code in (400, 404), r.text
    _error_body(r)


def test_unknown_sandbox():
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(MISSING)
    with pytest.raises(NotFoundException):
        Sandbox.connect(MISSING)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(MISSING, 60)
    assert Sandbox.kill(MISSING) is False


def test_unknown_sandbox_wire(api):
    for method, path in [
        ("GET", f"/sandboxes/{MISSING}"),
        ("DELETE", f"/sandboxes/{MISSING}"),
        ("POST", f"/sandboxes/{MISSING}/timeout"),
        ("POST", f"/v2/sandboxes/{MISSING}/connect"),
    ]:
        kwargs = {"json": {"timeout": 30}} if method == "POST" else {}
        r = api.request(method, path, **kwargs)
        assert r.status_code == 404, f"{method} {path}: {r.status_code} {r.text}"
        _error_body(r)


def test_wrong_api_key():
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="e2b_00000000000000000000000000000000")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_00000000000000000000000000000000").next_items()


def test_wrong_and_missing_key_wire():
    for headers in ({"X-API-KEY": "e2b_0123"}, {}):
        r = httpx.get(f"{API_URL}/v2/sandboxes", headers=headers, timeout=30)
        assert r.status_code == 401, f"{headers}: {r.status_code} {r.text}"
        assert _error_body(r)["code"] == 401


def test_health_needs_no_key():
    r = httpx.get(f"{API_URL}/health", timeout=30)
    assert r.status_code in (200, 204), r.text


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"templateID": 42}',
        b'{"templateID": "base", "timeout": -5}',
        b'{"templateID": "base", "metadata": "not-a-map"}',
        b"[]",
    ],
)
def test_malformed_create(api, body):
    r = api.post("/v2/sandboxes", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, f"{body!r}: {r.status_code} {r.text}"
    _error_body(r)


def test_malformed_timeout(api, sandbox):
    sid = sandbox.sandbox_id
    for body in (b"{", b'{"timeout": "soon"}'):
        r = api.post(
            f"/sandboxes/{sid}/timeout", content=body, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, f"{body!r}: {r.status_code} {r.text}"
        _error_body(r)
    assert sandbox.is_running()


def test_envd_rejects_wrong_access_token(sandbox):
    # Stat over Connect with the sandbox's routing headers but a wrong token.
    r = httpx.post(
        f"{API_URL}/filesystem.Filesystem/Stat",
        json={"path": "/home/user"},
        headers={
            "E2b-Sandbox-Id": sandbox.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": "wrong-token",
            "Connect-Protocol-Version": "1",
        },
        timeout=60,
    )
    assert r.status_code == 401, f"{r.status_code} {r.text}"


def test_envd_for_unknown_sandbox(sandbox):
    r = httpx.post(
        f"{API_URL}/filesystem.Filesystem/Stat",
        json={"path": "/"},
        headers={
            "E2b-Sandbox-Id": MISSING,
            "E2b-Sandbox-Port": "49983",
            "Connect-Protocol-Version": "1",
        },
        timeout=60,
    )
    assert r.status_code == 502, f"{r.status_code} {r.text}"
    assert "was not found" in r.text


FORK_MAX = 20


def test_fork_beyond_node_capacity_is_refused_whole(api, sandbox):
    # A fork of 20 children that needs more memory or vCPUs than the whole
    # node has can never fit: refused with 503 before anything starts, so it
    # takes nothing from the other tests sharing this server. Where the node
    # could hold 20 children the test would start them: skipped instead.
    detail = api.get(f"/sandboxes/{sandbox.sandbox_id}").json()
    before = api.get("/v1/node").json()
    if (
        FORK_MAX * detail["memoryMB"] <= before["memoryMB"]["total"]
        and FORK_MAX * detail["cpuCount"] <= before["vcpus"]["total"]
    ):
        pytest.skip(f"this node has room for {FORK_MAX} children: {before}")
    with pytest.raises(ServiceBusyException) as e:
        sandbox.fork(count=FORK_MAX, timeout=60)
    message = str(e.value)
    assert "over capacity" in message and f"a fork of {FORK_MAX} children" in message, message
    after = api.get("/v1/node").json()
    # Nothing held (sandboxes of other tests may have ended meanwhile).
    assert after["memoryMB"]["used"] <= before["memoryMB"]["used"], (before, after)
    assert after["vcpus"]["used"] <= before["vcpus"]["used"], (before, after)
    assert after["sandboxes"]["starting"] == 0, after
    assert sandbox.is_running()


@pytest.mark.parametrize(
    "body,message",
    [
        (b'{"count": 0}', "Count must be at least 1"),
        (b'{"count": -2}', "Count must be at least 1"),
        (b'{"count": 101}', "Count cannot be greater than 100"),
        (b'{"timeout": 0}', "Timeout must be greater than 0"),
        (b"{not json", None),
    ],
)
def test_malformed_fork_is_400_not_an_auth_error(api, sandbox, body, message):
    # The Python SDK checks count itself; the wire is what other clients see.
    r = api.post(
        f"/sandboxes/{sandbox.sandbox_id}/fork",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, f"{body!r}: {r.status_code} {r.text}"
    err = _error_body(r)
    if message:
        assert err["message"] == message, err
