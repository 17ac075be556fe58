"""Template builds through the unmodified SDK's `Template.build`: RUN, COPY
(a directory, with owner and mode), ENV, WORKDIR and USER run in a microVM of
the base template, which is snapshotted into the template a sandbox is then
created from; a failing RUN reports its step."""

import secrets
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from conftest import API_KEY, API_URL, RUN_META


def _delete(name: str) -> None:
    httpx.delete(
        f"{API_URL}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=120
    )


def test_template_build_runs_every_step(tmp_path: Path):
    ctx = tmp_path / "ctx"
    (ctx / "files" / "sub").mkdir(parents=True)
    (ctx / "files" / "hello.txt").write_text("hello from the host\n")
    (ctx / "files" / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    name = f"sdk-tmpl-{secrets.token_hex(3)}"
    template = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .run_cmd("echo built > /opt/marker")
        .set_envs({"TMPL_VAR": "tmpl value"})
        .copy("files/", "/opt/app/", user="user", mode=0o750)
        .set_workdir("/opt/work")
        .run_cmd('pwd > /opt/pwd && echo "$TMPL_VAR" > /opt/env')
        .set_user("builder")
        .run_cmd("id -un > /tmp/whoami && touch ~/by-builder")
        .run_cmd("id -un > /opt/as-root", user="root")
    )
    logs: list[str] = []
    try:
        Template.build(
            template,
            name,
            on_build_logs=lambda e: logs.append(e.message),
        )
        assert any("[1/" in line for line in logs), logs
        sbx = Sandbox.create(name, metadata=RUN_META, timeout=300)
        try:

            def run(cmd: str) -> str:
                return sbx.commands.run(cmd, user="root").stdout.strip()

            assert run("cat /opt/marker") == "built"
            assert run("cat /opt/app/hello.txt") == "hello from the host"
            assert run("/opt/app/sub/run.sh") == "ran"
            assert run(
                "stat -c '%U:%G %a' /opt/app/hello.txt /opt/app/sub/run.sh"
            ).splitlines() == ["user:user 750", "user:user 750"]
            assert run("cat /opt/pwd") == "/opt/work"
            assert run("cat /opt/env") == "tmpl value"
            assert run("cat /tmp/whoami") == "builder"
            assert run("stat -c %U /home/builder/by-builder") == "builder"
            assert run("cat /opt/as-root") == "root"
            assert run("getent passwd builder | cut -d: -f6") == "/home/builder"
            # ENV is kept by the template's sandboxes
            assert run('echo "$TMPL_VAR"') == "tmpl value"
        finally:
            sbx.kill()
    finally:
        _delete(name)


def test_template_build_failing_step_is_reported(tmp_path: Path):
    name = f"sdk-tmpl-fail-{secrets.token_hex(3)}"
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .run_cmd("true")
        .set_envs({"A": "b"})
        .run_cmd("echo about to fail >&2; exit 3")
        .run_cmd("echo never")
    )
    try:
        with pytest.raises(BuildException) as err:
            Template.build(template, name)
        msg = str(err.value)
        assert "step 3" in msg and "exited 3" in msg, msg
        status = _status_of_last_build(name)
        assert status["status"] == "error"
        assert status["reason"]["step"] == "3"
    finally:
        _delete(name)


def _status_of_last_build(name: str) -> dict:
    h = {"X-API-KEY": API_KEY}
    t = httpx.get(f"{API_URL}/templates/{name}", headers=h, timeout=60).json()
    r = httpx.get(
        f"{API_URL}/templates/{t['templateID']}/builds/{t['buildID']}/status",
        headers=h,
        timeout=60,
    )
    return r.json()


def test_template_build_upload_links_need_their_token(api):
    r = api.post("/v3/templates", json={"name": f"sdk-tmpl-l-{secrets.token_hex(3)}"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert set(body) >= {"templateID", "buildID", "public", "names", "tags", "aliases"}
    tid = body["templateID"]
    assert api.get(f"/templates/{tid}/files/nothex").status_code == 400
    h = "ab" * 32
    link = api.get(f"/templates/{tid}/files/{h}")
    assert link.status_code == 201, link.text
    url = link.json()["url"]
    assert link.json()["present"] in (True, False)
    bad = url.rsplit("/", 1)[0] + "/" + "0" * 48
    assert httpx.put(bad, content=b"x", timeout=60).status_code == 404
    assert httpx.put(url, content=b"x", timeout=60).status_code == 200
    assert api.get(f"/templates/{tid}/files/{h}").json()["present"] is True
