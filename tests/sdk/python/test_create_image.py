"""Creates that name a registry image (issue 39): as the template id
(`host:port/repo:tag`) and through the metadata key the node is started
with (`serve --image-metadata-key`, slime's way). The registry is
test_templates_image.py's (Debian's `docker-registry` on loopback with
htpasswd, the image pushed with skopeo); the node pulls with its own
credentials, from the file `SANDFORK_REGISTRY_AUTH` names, written here
(scripts/sdk-test.sh points the node and these tests at it): right ones for
`127.0.0.1:PORT`, wrong ones for `localhost:PORT`, the same registry.

The first create of an image converts it into a template named by the
image; creates of it meanwhile wait on that one conversion (or are told to
come back: 503 "is being built", which `_create` waits out as a client
would), so the node lists one template and one build for the image."""

import json
import os
import secrets
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, API_URL, RUN_META
from e2b import Sandbox
from e2b.exceptions import SandboxException, ServiceBusyException
from test_templates_image import HELLO, USER, registry  # noqa: F401 (a fixture)

# The lab converts and boots an image slowly (emulated KVM).
CONVERT_TIMEOUT = 900


@pytest.fixture(scope="module")
def node_auth(registry: tuple[str, str]) -> tuple[str, str]:  # noqa: F811
    """The node's credentials file for `registry`; yields (host, password)."""
    path = os.environ.get("SANDFORK_REGISTRY_AUTH")
    assert path, "SANDFORK_REGISTRY_AUTH unset: run through scripts/sdk-test.sh"
    host, password = registry
    port = host.rsplit(":", 1)[1]
    auths = {
        host: {"username": USER, "password": password},
        f"localhost:{port}": {"username": USER, "password": "wrong-password"},
    }
    Path(path).write_text(json.dumps({"auths": auths}))
    return host, password


def _push(host: str, password: str, tag: str) -> str:
    """`sdk/img:v1` again under `tag` (an image the node has not seen)."""
    creds = f"{USER}:{password}"
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            f"--src-creds={creds}",
            f"--dest-creds={creds}",
            f"docker://{host}/sdk/img:v1",
            f"docker://{host}/sdk/img:{tag}",
        ],
        check=True,
    )
    return f"{host}/sdk/img:{tag}"


def _create(template: str | None = None, metadata: dict[str, str] | None = None) -> Sandbox:
    """A sandbox of an image, waiting out "being built" answers."""
    deadline = time.monotonic() + CONVERT_TIMEOUT
    while True:
        try:
            md = {**RUN_META, **(metadata or {})}
            if template is None:
                return Sandbox.create(metadata=md, timeout=300)
            return Sandbox.create(template, metadata=md, timeout=300)
        except ServiceBusyException as e:
            if "being built" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(5)


def _image_templates(image: str) -> list[dict]:
    """The templates (and builds) the node lists under `image`."""
    r = httpx.get(f"{API_URL}/templates", headers={"X-API-KEY": API_KEY}, timeout=60)
    r.raise_for_status()
    return [t for t in r.json() if image in t["names"]]


def _delete(image: str) -> None:
    for t in _image_templates(image):
        httpx.delete(
            f"{API_URL}/templates/{t['templateID']}",
            headers={"X-API-KEY": API_KEY},
            timeout=120,
        )


def _sees_the_image(sbx: Sandbox) -> None:
    try:
        out = sbx.commands.run("cat /srv/hello.txt", user="root").stdout
        assert out == HELLO, out
    finally:
        sbx.kill()


def test_a_create_by_image_reference_runs_the_image(node_auth: tuple[str, str]) -> None:
    host, _ = node_auth
    image = f"{host}/sdk/img:v1"
    try:
        _sees_the_image(_create(image))
        # the second create restores the template: no second conversion
        started = time.monotonic()
        _sees_the_image(_create(image))
        listed = _image_templates(image)
        assert len(listed) == 1 and listed[0]["buildCount"] == 1, listed
        assert listed[0]["buildStatus"] == "ready", listed
        print(f"second create and command: {time.monotonic() - started:.1f} s")
    finally:
        _delete(image)


def test_eight_concurrent_creates_of_a_new_image_convert_it_once(
    node_auth: tuple[str, str],
) -> None:
    host, password = node_auth
    image = _push(host, password, f"c8-{secrets.token_hex(3)}")
    try:
        with ThreadPoolExecutor(8) as pool:
            sandboxes = list(pool.map(lambda _: _create(image), range(8)))
        for sbx in sandboxes:
            _sees_the_image(sbx)
        listed = _image_templates(image)
        assert len(listed) == 1, listed
        assert listed[0]["buildCount"] == 1 and listed[0]["buildStatus"] == "ready", listed
    finally:
        _delete(image)


def test_two_tags_of_one_image_share_its_template(node_auth: tuple[str, str]) -> None:
    """Two tags of an image no template holds, created at the same moment:
    each create pulls its tag (the blobs and the converted layers are cached
    by content, so the second costs a manifest), one boots the image, and
    the other then names that template: one template, one build, both
    names."""
    host, password = node_auth
    suffix = secrets.token_hex(3)
    tags = [_push(host, password, f"{p}-{suffix}") for p in ("ta", "tb")]
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            sandboxes = list(pool.map(_create, tags))
        print(f"two tags' creates at once: {time.monotonic() - started:.1f} s")
        for sbx in sandboxes:
            _sees_the_image(sbx)
        listed = _image_templates(tags[0])
        assert [t["templateID"] for t in _image_templates(tags[1])] == [
            t["templateID"] for t in listed
        ], listed
        assert len(listed) == 1 and set(tags) <= set(listed[0]["names"]), listed
        assert listed[0]["buildCount"] == 1, listed
    finally:
        _delete(tags[0])
    # one template, so deleting it by either name's id leaves neither
    assert _image_templates(tags[1]) == []


def test_the_metadata_key_names_the_image(node_auth: tuple[str, str]) -> None:
    host, password = node_auth
    key = os.environ.get("SDK_IMAGE_METADATA_KEY")
    assert key, "SDK_IMAGE_METADATA_KEY unset: run through scripts/sdk-test.sh"
    image = _push(host, password, f"md-{secrets.token_hex(3)}")
    try:
        _sees_the_image(_create(metadata={key: image}))
        assert len(_image_templates(image)) == 1
    finally:
        _delete(image)


@pytest.mark.parametrize(
    ("image", "status", "why"),
    [
        ("{host}/sdk/img:missing", 404, "not found"),
        ("localhost:{port}/sdk/img:v1", 403, "refused the credentials"),
    ],
)
def test_a_missing_image_or_refused_credentials_are_4xx(
    node_auth: tuple[str, str], image: str, status: int, why: str
) -> None:
    host, password = node_auth
    image = image.format(host=host, port=host.rsplit(":", 1)[1])
    for _ in range(2):
        r = httpx.post(
            f"{API_URL}/sandboxes",
            headers={"X-API-KEY": API_KEY},
            json={"templateID": image, "metadata": RUN_META},
            timeout=120,
        )
        assert r.status_code == status, r.text
        message = r.json()["message"]
        assert why in message and image in message, message
        assert password not in message and "wrong-password" not in message
        # nothing is left half-made: no template, no build
        assert _image_templates(image) == []
    with pytest.raises(SandboxException) as err:
        Sandbox.create(image, metadata=RUN_META)
    assert err.value.status_code == status and why in str(err.value), str(err.value)
