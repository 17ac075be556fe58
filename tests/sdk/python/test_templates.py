"""Template builds through the unmodified SDK's `Template.build`: RUN, COPY
(a directory, with owner and mode), ENV, WORKDIR and USER run in a microVM of
the base template, which is snapshotted into the template a sandbox is then
created from; a failing RUN reports its step; a second build takes its steps
from the step cache; names, tags and aliases."""

import re
import secrets
import time
from pathlib import Path

import httpx
import pytest
from conftest import RUN_META, delete_template, last_build_status
from e2b import Sandbox, Template
from e2b.api.client.api.tags import (
    get_templates_template_id_tags_count as tags_count,
)
from e2b.api.client.api.tags import (
    get_templates_template_id_tags_exists as tags_exists,
)
from e2b.api.client.api.tags import (
    get_templates_template_id_tags_groups as tags_groups,
)
from e2b.api.client.api.tags import (
    get_templates_template_id_tags_tag_assignments as tag_assignments,
)
from e2b.api.client.api.templates import get_default_templates
from e2b.api.client.models import (
    GetTemplatesTemplateIDTagsGroupsSort as GroupsSort,
)
from e2b.api.client.models import (
    TemplateTagAssignmentsResponse,
    TemplateTagExistsResponse,
    TemplateTagGroupsResponse,
    TemplateTagsCountResponse,
)
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import BuildException

STEP_LINE = re.compile(r"^\[\d+/\d+\] ")


def _steps(logs: list[str]) -> list[str]:
    """The build log's step lines (`[n/total] ...`)."""
    return [line for line in logs if STEP_LINE.match(line)]


@pytest.mark.timeout(1100)
def test_template_build_runs_every_step(tmp_path: Path):
    ctx = tmp_path / "ctx"
    (ctx / "files" / "sub").mkdir(parents=True)
    (ctx / "files" / "hello.txt").write_text("hello from the host\n")
    (ctx / "files" / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    name = f"sdk-tmpl-{secrets.token_hex(3)}"
    template = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .run_cmd("echo built > /opt/marker && echo step-output-marker")
        .set_envs({"TMPL_VAR": "tmpl value", "TMPL_PATH": "/opt/tool:$PATH"})
        .copy("files/", "/opt/app/", user="user", mode=0o750)
        .set_workdir("/opt/work")
        .run_cmd('pwd > /opt/pwd && echo "$TMPL_VAR" > /opt/env')
        .set_user("builder")
        .run_cmd("id -un > /tmp/whoami && touch ~/by-builder")
        .run_cmd("id -un > /opt/as-root", user="root")
    )
    logs: list[str] = []
    try:
        started = time.monotonic()
        first = Template.build(
            template,
            name,
            on_build_logs=lambda e: logs.append(e.message),
        )
        first_s = time.monotonic() - started
        assert any("[1/" in line for line in logs), logs
        assert "step-output-marker" in logs
        assert not any("CACHED" in line for line in _steps(logs)), logs
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
            # ENV is kept by the template's sandboxes, expanded as Docker does
            assert run('echo "$TMPL_VAR"') == "tmpl value"
            path = run('echo "$TMPL_PATH"')
            assert path.startswith("/opt/tool:") and "/bin" in path, path
            # the last USER and WORKDIR are the sandbox's defaults
            assert sbx.commands.run("id -un").stdout.strip() == "builder"
            assert sbx.commands.run("pwd").stdout.strip() == "/opt/work"
        finally:
            sbx.kill()

        # The same template again: the same template id, a new build, every
        # step from the cache (none runs: no step output), the COPY's files
        # already uploaded.
        logs2: list[str] = []
        started = time.monotonic()
        again = Template.build(template, name, on_build_logs=lambda e: logs2.append(e.message))
        again_s = time.monotonic() - started
        steps = _steps(logs2)
        assert len(steps) == len(_steps(logs)) == 8, logs2
        assert all(" CACHED " in line for line in steps), logs2
        assert "step-output-marker" not in logs2, logs2
        assert again.template_id == first.template_id
        assert again.build_id != first.build_id
        print(
            f"template build: first {first_s:.1f} s, cached rebuild {again_s:.1f} s "
            f"(ratio {again_s / first_s:.2f})"
        )
        sbx = Sandbox.create(name, metadata=RUN_META, timeout=300)
        try:
            assert sbx.commands.run("cat /opt/marker").stdout.strip() == "built"
            assert sbx.commands.run("id -un").stdout.strip() == "builder"
        finally:
            sbx.kill()
    finally:
        delete_template(name)


@pytest.mark.timeout(900)
def test_template_build_reuses_a_shared_prefix(tmp_path: Path):
    token = secrets.token_hex(4)

    def template(last: str) -> Template:
        return (
            Template(file_context_path=str(tmp_path))
            .from_template("base")
            .run_cmd(f"echo {token} > /opt/prefix && echo prefix-ran")
            .set_envs({"LAST": last})
            .run_cmd('echo "$LAST" > /opt/last && echo last-ran')
        )

    a, b = f"sdk-tmpl-a-{token}", f"sdk-tmpl-b-{token}"
    try:
        Template.build(template("a"), a)
        logs: list[str] = []
        Template.build(template("b"), b, on_build_logs=lambda e: logs.append(e.message))
        steps = _steps(logs)
        assert [" CACHED " in line for line in steps] == [True, False, False], logs
        assert "prefix-ran" not in logs and "last-ran" in logs, logs
        # skip_cache: every step runs again
        logs = []
        Template.build(
            template("b"),
            b,
            skip_cache=True,
            on_build_logs=lambda e: logs.append(e.message),
        )
        assert not any(" CACHED " in line for line in _steps(logs)), logs
        assert "prefix-ran" in logs, logs
        sbx = Sandbox.create(b, metadata=RUN_META, timeout=300)
        try:

            def run(cmd: str) -> str:
                return sbx.commands.run(cmd, user="root").stdout.strip()

            assert run("cat /opt/prefix") == token
            assert run("cat /opt/last") == "b"
        finally:
            sbx.kill()
    finally:
        delete_template(a)
        delete_template(b)


def _check_tag_reads(template_id: str, build_id: str) -> None:
    """The tag reads of the SDK's generated client, parsed by its own models
    (UUIDs and times included), on a template tagged v1 and stable."""
    client = get_api_client(ConnectionConfig())
    count = tags_count.sync(template_id, client=client)
    assert isinstance(count, TemplateTagsCountResponse) and count.total == 2, count
    found = tags_exists.sync(template_id, client=client, tag="Stable")
    assert isinstance(found, TemplateTagExistsResponse), found
    assert found.exists and found.normalized_tag == "stable"
    groups = tags_groups.sync(template_id, client=client, tags_limit=1, sort=GroupsSort.NAME_ASC)
    assert isinstance(groups, TemplateTagGroupsResponse), groups
    assert [g.tag for g in groups.tags] == ["stable"] and groups.next_cursor, groups
    assert str(groups.tags[0].assignments[0].build_id) == build_id
    assigned = tag_assignments.sync(template_id, "v1", client=client)
    assert isinstance(assigned, TemplateTagAssignmentsResponse), assigned
    assert [str(a.build_id) for a in assigned.data] == [build_id], assigned
    assert assigned.data[0].build_finished_at is not None
    defaults = get_default_templates.sync(client=client)
    assert isinstance(defaults, list) and defaults, defaults
    assert template_id not in {t.template_id for t in defaults}


def test_template_names_tags_and_aliases(api):
    token = secrets.token_hex(3)
    name = f"sdk-tmpl-tags-{token}"
    template = Template().from_template("base").run_cmd(f"echo {token} > /opt/tagged")
    try:
        assert not Template.exists(name)
        assert api.get(f"/templates/aliases/{name}").status_code == 404
        info = Template.build(template, f"{name}:v1", tags=["stable"])
        assert Template.exists(name)
        alias = api.get(f"/templates/aliases/{name}")
        assert alias.status_code == 200, alias.text
        assert alias.json()["templateID"] == info.template_id
        tags = {t.tag: t.build_id for t in Template.get_tags(info.template_id)}
        assert tags == {"v1": info.build_id, "stable": info.build_id}, tags
        _check_tag_reads(info.template_id, info.build_id)

        # no default tag yet: the bare name is not a template to create from
        listed = [t for t in api.get("/v2/templates").json() if t["templateID"] == info.template_id]
        assert len(listed) == 1, listed
        assert api.get(f"/templates/{name}").status_code == 404

        tagged = Template.assign_tags(f"{name}:v1", "default")
        assert tagged.build_id == info.build_id and tagged.tags == ["default"]
        Template.remove_tags(name, "stable")
        tags = {t.tag for t in Template.get_tags(info.template_id)}
        assert tags == {"v1", "default"}, tags
        sbx = Sandbox.create(name, metadata=RUN_META, timeout=300)
        try:
            out = sbx.commands.run("cat /opt/tagged", user="root").stdout.strip()
            assert out == token
        finally:
            sbx.kill()
    finally:
        delete_template(name)
    assert not Template.exists(name)


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
        status = last_build_status(name)
        assert status["status"] == "error"
        assert status["reason"]["step"] == "3"
    finally:
        delete_template(name)


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
