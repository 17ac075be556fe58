"""`Template().from_image(...)` pulling from a real registry on loopback:
Debian's `docker-registry` with htpasswd basic auth, started here on a free
port, holding a small image pushed with `skopeo copy` from an OCI layout made
by tests/support/oci_registry.py (the host's bash and its libraries,
busybox, a few files). The node pulls
it (a node in the KVM lab reaches this host's loopback through the lab's
gateway), builds it into a template, runs the build's steps on top, and a
sandbox of the result sees the image's files. Wrong credentials and a missing
image fail the build at its base step."""

import secrets
from collections.abc import Iterator

import oci_registry
import pytest
from conftest import RUN_META, delete_template, last_build_status
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from oci_registry import HELLO

USER = "sdkuser"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A registry with basic auth holding `sdk/img:v1`; yields (host, password)."""
    dir = tmp_path_factory.mktemp("registry")
    password = secrets.token_hex(8)
    proc, host = oci_registry.serve(dir, auth=(USER, password))
    try:
        oci_registry.push(dir / "layout", f"{host}/sdk/img:v1", f"{USER}:{password}")
        yield host, password
    finally:
        proc.kill()
        proc.wait()


def test_image_pull_failures_are_reported_at_the_base_step(registry):
    host, password = registry
    for image, user, pw, why in [
        (f"{host}/sdk/img:v1", USER, "wrong-password", "refused the credentials"),
        (f"{host}/sdk/img:v1", None, None, "needs credentials"),
        (f"{host}/sdk/img:missing", USER, password, "not found"),
    ]:
        name = f"sdk-img-bad-{secrets.token_hex(3)}"
        template = Template().from_image(image, username=user, password=pw).run_cmd("true")
        try:
            with pytest.raises(BuildException) as err:
                Template.build(template, name)
            assert why in str(err.value), str(err.value)
            assert password not in str(err.value)
            status = last_build_status(name)
            assert status["status"] == "error", status
            reason = status["reason"]
            assert reason["step"] == "base" and why in reason["message"], reason
        finally:
            delete_template(name)


def test_template_from_a_registry_image(registry):
    host, password = registry
    name = f"sdk-img-{secrets.token_hex(3)}"
    template = (
        Template()
        .from_image(f"{host}/sdk/img:v1", username=USER, password=password)
        .run_cmd("echo built-on-the-image > /opt/marker")
    )
    logs: list[str] = []
    try:
        Template.build(template, name, on_build_logs=lambda e: logs.append(e.message))
        assert any("pulled sha256:" in line for line in logs), logs
        sbx = Sandbox.create(name, metadata=RUN_META, timeout=300)
        try:

            def run(cmd: str) -> str:
                return sbx.commands.run(cmd, user="root").stdout

            assert run("cat /srv/hello.txt") == HELLO
            assert run("cat /opt/marker") == "built-on-the-image\n"
            assert run("ls /usr/bin/busybox") == "/usr/bin/busybox\n"
        finally:
            sbx.kill()
    finally:
        delete_template(name)
