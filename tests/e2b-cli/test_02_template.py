"""A template through the CLI: create from a Dockerfile (FROM e2bdev/base
with ENV, WORKDIR and RUN; a sandbox of it sees them), list, unpublish,
delete; and kill --all of the sandboxes running then. One template for the
file, built by the `template` fixture (the build's own checks are
test_template_create's)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2bcli import E2bCli, Run

DOCKERFILE = """\
FROM e2bdev/base
ENV GREETING=from-the-cli
WORKDIR /opt/app
RUN echo "$GREETING" > built.txt && mkdir -p sub
RUN ls -d /opt/app/sub > dirs.txt
"""


@dataclass(frozen=True)
class Template:
    name: str
    created: Run


@pytest.fixture(scope="module")
def template(cli: E2bCli, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Template]:
    context: Path = tmp_path_factory.mktemp("tpl")
    (context / "e2b.Dockerfile").write_text(DOCKERFILE)
    name = f"cli-tpl-{os.getpid()}"
    created = cli.run(
        "template", "create", name, "--path", str(context), merged=True, check=False, timeout=1500
    )
    yield Template(name, created)
    # (test_template_delete deletes it; this, when a test before it failed)
    cli.run("template", "delete", name, "--yes", merged=True, check=False)


@pytest.fixture(scope="module")
def from_template(cli: E2bCli, template: Template) -> Iterator[str]:
    """a sandbox of the template: its id"""
    sandbox = cli.run("sandbox", "create", template.name, "--detach", "--timeout", "600").last_line
    yield sandbox
    # (test_sandbox_kill_all kills it; this, when a test before it failed)
    cli.run("sandbox", "kill", sandbox, check=False)


def test_template_create(template: Template) -> None:
    run = template.created
    assert run.status == 0, f"template create: {run}"
    assert "e2b.Dockerfile that will be used to build the sandbox template" in run.text, str(run)
    assert f"Building sandbox template {template.name} finished" in run.text, str(run)


def test_sandbox_from_template(cli: E2bCli, from_template: str) -> None:
    """the Dockerfile's ENV, WORKDIR and RUN, and the image's user"""
    script = "cat built.txt dirs.txt; echo $GREETING $(pwd) $(id -un)"
    run = cli.run("sandbox", "exec", from_template, "sh", "-c", script)
    expected = "from-the-cli\n/opt/app/sub\nfrom-the-cli /opt/app user"
    assert run.out == expected, f"a sandbox of the template: {run}"


def test_template_list(cli: E2bCli, template: Template) -> None:
    run = cli.run("template", "list")
    assert template.name in run.text, str(run)
    run = cli.run("template", "list", "--format", "json")
    cpus = [t["cpuCount"] >= 1 for t in run.json() if template.name in t["aliases"]]
    assert cpus == [True], f"template list --format json: {run}"


def test_template_unpublish(cli: E2bCli, template: Template) -> None:
    run = cli.run("template", "unpublish", template.name, "--yes", merged=True)
    assert template.name in run.text, str(run)


def test_sandbox_kill_all(cli: E2bCli, from_template: str) -> None:
    second = cli.run("sandbox", "create", "base", "--detach", "--timeout", "600").last_line
    run = cli.run("sandbox", "kill", "--all")
    assert f"Sandbox {from_template} has been killed" in run.text, str(run)
    assert f"Sandbox {second} has been killed" in run.text, str(run)
    assert re.search(r"Killed [0-9]+ running sandboxes", run.text), f"kill --all: {run}"
    run = cli.run("sandbox", "list", "--format", "json")
    assert len(run.json()) == 0, f"running after kill --all: {run}"
    run = cli.run("sandbox", "kill", "--all")
    assert "No running sandboxes" in run.text, str(run)


def test_template_delete(cli: E2bCli, template: Template) -> None:
    run = cli.run("template", "delete", template.name, "--yes", merged=True)
    assert "Deleting sandbox template" in run.text, str(run)
    run = cli.run("template", "list", "--format", "json")
    left = [t["templateID"] for t in run.json() if template.name in t["aliases"]]
    assert left == [], f"still listed after delete: {run}"
