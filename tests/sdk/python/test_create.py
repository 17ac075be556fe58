"""Create (v2 through the SDK, v1 by raw HTTP), get_info, connect, kill."""

from datetime import UTC, datetime, timedelta

import pytest
from conftest import RUN_ID, RUN_META, TEMPLATE, create
from e2b import Sandbox, SandboxNotFoundException


def test_create_v2_runs_a_command_and_reports_info():
    sbx = create(metadata={"case": "create"}, envs={"A": "1"})
    try:
        assert sbx.sandbox_id and "-" not in sbx.sandbox_id
        assert sbx.commands.run("echo $A").stdout == "1\n"
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.state == "running"
        assert info.metadata.get("case") == "create"
        assert info.metadata.get("sdk_run") == RUN_ID
        assert info.cpu_count >= 1 and info.memory_mb > 0
        assert info.envd_version
        now = datetime.now(UTC)
        assert info.started_at <= now + timedelta(seconds=5)
        # created with timeout=600
        assert now + timedelta(seconds=400) < info.end_at < now + timedelta(seconds=660)
        assert sbx.is_running()
    finally:
        assert sbx.kill() is True


def test_connect_by_id_reaches_the_same_sandbox(sandbox):
    sandbox.files.write("/tmp/connect-marker", "same sandbox")
    other = Sandbox.connect(sandbox.sandbox_id)
    assert other.sandbox_id == sandbox.sandbox_id
    assert other.files.read("/tmp/connect-marker") == "same sandbox"


def test_create_v1_route(api):
    body = {
        "templateID": TEMPLATE,
        "timeout": 300,
        "secure": True,
        "allow_internet_access": True,
        "metadata": dict(RUN_META, case="v1"),
        "envVars": {"V1": "yes"},
    }
    r = api.post("/sandboxes", json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    for field in ("sandboxID", "templateID", "clientID", "envdVersion"):
        assert field in created, f"{field} missing in {created}"
    sid = created["sandboxID"]
    try:
        assert isinstance(created.get("envdAccessToken"), str)
        detail = api.get(f"/sandboxes/{sid}")
        assert detail.status_code == 200, detail.text
        d = detail.json()
        for field in (
            "sandboxID",
            "templateID",
            "clientID",
            "startedAt",
            "endAt",
            "cpuCount",
            "memoryMB",
            "diskSizeMB",
            "state",
            "envdVersion",
        ):
            assert field in d, f"{field} missing in GET /sandboxes/{{id}}: {d}"
        assert d["state"] == "running"
        assert d.get("envdAccessToken") == created["envdAccessToken"]
        sbx = Sandbox.connect(sid)
        assert sbx.commands.run("echo $V1").stdout == "yes\n"
    finally:
        r = api.delete(f"/sandboxes/{sid}")
        assert r.status_code in (200, 204), r.text


def test_kill():
    sbx = create(metadata={"case": "kill"})
    sid = sbx.sandbox_id
    assert sbx.kill() is True
    assert not sbx.is_running()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sid)
    assert Sandbox.kill(sid) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sid)
