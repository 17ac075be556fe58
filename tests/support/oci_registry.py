"""A small registry image for the suites that pull one (the SDK's image
tests, the cluster test's task images): a merged-/usr root with the host's
bash and its libraries, busybox applets and a file to look for
(`/srv/hello.txt`, [`HELLO`]), written as an OCI layout; and Debian's
`docker-registry` serving a directory, optionally with htpasswd basic auth,
pushed to with `skopeo copy`. One copy of these for every suite."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

HELLO = "hello from the registry image\n"
APPLETS = ["sh", "cat", "ls", "id", "echo", "mkdir", "sleep", "env", "true", "rm"]
TOOLS = ["docker-registry", "skopeo", "htpasswd"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def libraries(binary: str) -> list[str]:
    """The shared objects `binary` loads (ldd), the loader included."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True)
    libs = []
    for line in out.stdout.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            libs.append(path)
    return libs


def layer() -> bytes:
    """A merged-/usr root: bash with its libraries, busybox applets, users."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:

        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, mode, 1_700_000_000
            info.uid = info.gid = 1000 if name.startswith("home/user") else 0
            info.linkname = link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        dirs = ["usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "proc", "sys"]
        dirs += ["dev", "run", "root", "home", "home/user", "srv", "opt"]
        lib_dirs = {os.path.dirname(os.path.realpath(p)) for p in libraries("/bin/bash")}
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
        for lib in libraries("/bin/bash"):
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


def layout(dir: Path, variant: str | None = None) -> None:
    """The image as an OCI layout in `dir` (one manifest, untagged); with
    `variant`, a label in its config makes it another image (its own
    manifest digest) over the same layer."""
    blobs = dir / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, object]:
        (blobs / sha(data)).write_bytes(data)
        return {"digest": f"sha256:{sha(data)}", "size": len(data)}

    root = layer()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/bin:/bin", "IMAGE_VAR=from the image"],
                "WorkingDir": "/srv",
                **({"Labels": {"sandfork.test.variant": variant}} if variant else {}),
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha(root)}"]},
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
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **put(root)}],
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(manifest)}],
    }
    (dir / "index.json").write_text(json.dumps(index))
    (dir / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')


def serve(
    dir: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    auth: tuple[str, str] | None = None,
    log: Path | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """`docker-registry` storing in `dir`, on `port` (a free one if None) of `host`, with
    basic auth for `auth` (user, password) if given; its access log to
    `log` (else none). Returns the process and `host:port` once it listens."""
    for tool in TOOLS:
        assert shutil.which(tool), f"{tool} missing: scripts/deps.sh installs it"
    dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port_on(host)
    config = "version: 0.1\nlog:\n  level: warn\n  accesslog:\n"
    config += f"    disabled: {'false' if log else 'true'}\n"
    config += f"storage:\n  filesystem:\n    rootdirectory: {dir / 'storage'}\n"
    config += f"http:\n  addr: {host}:{port}\n"
    if auth:
        user, password = auth
        entry = subprocess.run(
            ["htpasswd", "-Bbn", user, password], capture_output=True, check=True
        ).stdout
        (dir / "htpasswd").write_bytes(entry)
        config += f"auth:\n  htpasswd:\n    realm: sandfork-test\n    path: {dir / 'htpasswd'}\n"
    (dir / "config.yml").write_text(config)
    argv = ["docker-registry", "serve", str(dir / "config.yml")]
    if log:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=out)
    else:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("docker-registry did not listen") from None
            time.sleep(0.1)
    return proc, f"{host}:{port}"


def free_port_on(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def push(
    dir: Path,
    dest: str,
    creds: str | None = None,
    name: str | None = None,
    variant: str | None = None,
) -> None:
    """The image (its OCI layout made in `dir` first, when it has none, of
    `variant`; the one tagged `name` of a layout holding several) to `dest`
    (`host:port/repo:tag`) in plain HTTP, with `creds` (`user:password`)."""
    if not (dir / "index.json").exists():
        layout(dir, variant)
    argv = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if creds:
        argv.append(f"--dest-creds={creds}")
    source = f"oci:{dir}:{name}" if name else f"oci:{dir}"
    subprocess.run([*argv, source, f"docker://{dest}"], check=True)


def retag(src: str, dest: str) -> None:
    """`skopeo copy` of an image to another name in plain HTTP (no auth):
    a new reference to the same layers."""
    argv = ["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"]
    subprocess.run([*argv, f"docker://{src}", f"docker://{dest}"], check=True)


def main() -> None:
    """For a suite in another language (the JS SDK's): serves a registry in
    DIR holding the image under each NAME (`repo:tag`), prints its
    `host:port` on a line, and serves until its stdin closes."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("dir", type=Path)
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    proc, host = serve(args.dir)
    try:
        for name in args.names:
            push(args.dir / "layout", f"{host}/{name}")
        print(host, flush=True)
        sys.stdin.read()
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
