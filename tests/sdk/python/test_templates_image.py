"""`Template().from_image(...)` pulling from a real registry on loopback:
Debian's `docker-registry` with htpasswd basic auth, started here on a free
port, holding a small image pushed with `skopeo copy` from an OCI layout made
here (the host's bash and its libraries, busybox, a few files). The node pulls
it (a node in the KVM lab reaches this host's loopback through the lab's
gateway), builds it into a template, runs the build's steps on top, and a
sandbox of the result sees the image's files. Wrong credentials and a missing
image fail the build at its base step."""

import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RUN_META, delete_template, last_build_status
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

USER = "sdkuser"
HELLO = "hello from the registry image\n"
APPLETS = ["sh", "cat", "ls", "id", "echo", "mkdir", "sleep", "env", "true", "rm"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _libraries(binary: str) -> list[str]:
    """The shared objects `binary` loads (ldd), the loader included."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True)
    libs = []
    for line in out.stdout.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            libs.append(path)
    return libs


def _layer() -> bytes:
    """A merged-/usr root: bash with its libraries, busybox applets, users."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:

        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = ""):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, mode, 1_700_000_000
            info.uid = info.gid = 1000 if name.startswith("home/user") else 0
            info.linkname = link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        dirs = ["usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "proc", "sys"]
        dirs += ["dev", "run", "root", "home", "home/user", "srv", "opt"]
        lib_dirs = {os.path.dirname(os.path.realpath(p)) for p in _libraries("/bin/bash")}
        for d in sorted(lib_dirs):
            parts = Path(d.lstrip("/")).parts
            for i in range(1, len(parts) + 1):
                dirs.append("/".join(parts[:i]))
        seen = set()
        for d in dirs:
            if d not in seen:
                seen.add(d)
                add(d, tarfile.DIRTYPE, 0o755)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        for name in ["bin", "lib", "lib64", "sbin"]:
            add(
                name,
                tarfile.SYMTYPE,
                0o777,
                link=f"usr/{name}" if name != "sbin" else "usr/bin",
            )
        add("usr/bin/bash", tarfile.REGTYPE, 0o755, Path("/bin/bash").read_bytes())
        add("usr/bin/busybox", tarfile.REGTYPE, 0o755, Path("/bin/busybox").read_bytes())
        for a in APPLETS:
            add(f"usr/bin/{a}", tarfile.SYMTYPE, 0o777, link="busybox")
        for lib in _libraries("/bin/bash"):
            real = os.path.realpath(lib)
            add(real.lstrip("/"), tarfile.REGTYPE, 0o755, Path(real).read_bytes())
            # the name the binary asks for, where it asks (through /lib, /lib64)
            asked = lib.lstrip("/")
            if asked.startswith(("lib/", "lib64/")):
                asked = "usr/" + asked
            if asked != real.lstrip("/"):
                add(asked, tarfile.SYMTYPE, 0o777, link=real)
        add(
            "etc/passwd",
            tarfile.REGTYPE,
            0o644,
            b"root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
        )
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\nuser:x:1000:\n")
        add("srv/hello.txt", tarfile.REGTYPE, 0o644, HELLO.encode())
    return buf.getvalue()


def _layout(dir: Path) -> None:
    blobs = dir / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        (blobs / _sha(data)).write_bytes(data)
        return {"digest": f"sha256:{_sha(data)}", "size": len(data)}

    layer = _layer()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/bin:/bin", "IMAGE_VAR=from the image"],
                "WorkingDir": "/srv",
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{_sha(layer)}"]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                **put(config),
            },
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **put(layer)}],
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(manifest)}],
    }
    (dir / "index.json").write_text(json.dumps(index))
    (dir / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A registry with basic auth holding `sdk/img:v1`; yields (host, password)."""
    for tool in ["docker-registry", "skopeo", "htpasswd"]:
        assert shutil.which(tool), f"{tool} missing: scripts/deps.sh installs it"
    dir = tmp_path_factory.mktemp("registry")
    password = secrets.token_hex(8)
    entry = subprocess.run(
        ["htpasswd", "-Bbn", USER, password], capture_output=True, check=True
    ).stdout
    (dir / "htpasswd").write_bytes(entry)
    port = _free_port()
    (dir / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {dir / 'storage'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
        f"auth:\n  htpasswd:\n    realm: sdk-test\n    path: {dir / 'htpasswd'}\n"
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(dir / "config.yml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "docker-registry did not listen"
                time.sleep(0.1)
        _layout(dir / "layout")
        subprocess.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                f"--dest-creds={USER}:{password}",
                f"oci:{dir / 'layout'}",
                f"docker://127.0.0.1:{port}/sdk/img:v1",
            ],
            check=True,
        )
        yield f"127.0.0.1:{port}", password
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
