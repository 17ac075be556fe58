"""Task images of 1-4 GiB for issue 39's `images` bench, made here since
Docker Hub is out of reach: Debian with Python and git (the base tree
scripts/build.sh caches, `rootfs-base/<key>/tree.tar`), a set of pip
dependencies, generated data, and per image a small git repository with its
own requirements, as SWE-bench-style task images hold. Pushed with skopeo
into a registry store of Debian's `docker-registry` (what the template
tests use), cached by content hash:

    <cache>/task-images/<key>/storage/   the registry's filesystem store
    <cache>/task-images/<key>/images.json  the images, their layers and sizes

Serve it with `docker-registry serve` (rootdirectory: that storage) and the
images are `task/<name>:v1`. The images, bottom layer first:

    swe-1g        debian, deps, data-1g, repo-00          about 1 GiB
    swe-4g        debian, deps, data-1g, data-3g, repo-00 about 4 GiB
    var-NN        debian, deps, data-1g, repo-NN           NN = 01..16

so every image shares the base layers (`debian`, `deps`, `data-1g`) and has
one small layer of its own. Layers are gzip level 1; the data is hex text
(about half of it compresses away, as source and data sets do). The key
covers `FORMAT`, the base tree's bytes and the sizes, so a change of any
remakes the images; `--prune` removes other keys' entries.

Usage: task_images.py [--cache DIR] [--base-tree TAR] [--prune]
prints the entry's directory."""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import oci_registry

MIB = 1 << 20
# The sizes of the generated layers (uncompressed file bytes).
DEPS_MIB = 160
DATA_1G_MIB = 600
DATA_3G_MIB = 2900
VARIANTS = 16
DATA_FILE_MIB = 16
MTIME = 1_700_000_000
TAG = "v1"
# Part of the cache key: bump it when what the images hold changes.
FORMAT = "task-images 1"


class Writer(Protocol):
    def write(self, b: bytes, /) -> int: ...


class Hashing(io.RawIOBase):
    """Passes writes on to `out`, counting and hashing them."""

    def __init__(self, out: Writer) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        data = bytes(b)
        self.sha.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)


Fill = Callable[[tarfile.TarFile], None]


def _info(
    name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, mode: int = 0o644
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.mode = mode
    info.mtime = MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _dirs(tar: tarfile.TarFile, path: str, made: set[str]) -> None:
    """The directories above `path`, once each."""
    parts = path.split("/")[:-1]
    for n in range(1, len(parts) + 1):
        d = "/".join(parts[:n])
        if d not in made:
            made.add(d)
            tar.addfile(_info(d, kind=tarfile.DIRTYPE, mode=0o755))


def _file(tar: tarfile.TarFile, made: set[str], path: str, data: bytes, mode: int = 0o644) -> None:
    _dirs(tar, path, made)
    tar.addfile(_info(path, len(data), mode=mode), io.BytesIO(data))


def layer(blobs: Path, fill: Fill | None = None, raw: Path | None = None) -> dict[str, object]:
    """A gzip layer blob in `blobs`: the tar `fill` writes, or the tar file
    `raw` as it is. Returns its descriptor fields and `diff_id`/`diff_size`."""
    tmp = blobs / f".layer-{os.getpid()}"
    with open(tmp, "wb") as f:
        compressed = Hashing(f)
        with gzip.GzipFile(fileobj=compressed, mode="wb", compresslevel=1, mtime=0) as gz:
            plain = Hashing(gz)
            if raw is not None:
                with open(raw, "rb") as src:
                    while chunk := src.read(8 * MIB):
                        plain.write(chunk)
            else:
                assert fill is not None
                with tarfile.open(fileobj=plain, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                    fill(tar)
    digest = compressed.sha.hexdigest()
    tmp.rename(blobs / digest)
    return {
        "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
        "digest": f"sha256:{digest}",
        "size": compressed.size,
        "diff_id": f"sha256:{plain.sha.hexdigest()}",
        "diff_size": plain.size,
    }


def _words(rng: random.Random, n: int) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(n))


WORDS = [
    "task",
    "repo",
    "data",
    "value",
    "index",
    "parse",
    "load",
    "store",
    "token",
    "batch",
    "model",
    "graph",
    "node",
    "edge",
    "cache",
    "frame",
    "table",
    "query",
    "field",
    "shape",
    "score",
    "label",
    "trace",
    "event",
    "queue",
    "state",
    "entry",
    "block",
]


def deps(tar: tarfile.TarFile) -> None:
    """Pure-Python packages in dist-packages (many small modules, as a
    dependency set is), with their dist-info."""
    rng = random.Random("deps")
    made: set[str] = set()
    root = "usr/local/lib/python3.11/dist-packages"
    written = 0
    pkg = 0
    while written < DEPS_MIB * MIB:
        name = f"{_words(rng, 2)}{pkg}"
        for mod in range(40):
            lines = [f'"""{name}.m{mod}: generated for the images bench."""', ""]
            for fn in range(rng.randint(20, 80)):
                args = ", ".join(_words(rng, 1) + str(i) for i in range(rng.randint(1, 4)))
                lines += [
                    f"def {_words(rng, 3)}_{fn}({args}):",
                    f"    return {rng.getrandbits(64)} ^ hash(({args},))",
                    "",
                ]
            data = "\n".join(lines).encode()
            _file(tar, made, f"{root}/{name}/m{mod}.py", data)
            written += len(data)
        _file(tar, made, f"{root}/{name}/__init__.py", b"")
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.{pkg}.0\n".encode()
        _file(tar, made, f"{root}/{name}-1.{pkg}.0.dist-info/METADATA", meta)
        pkg += 1


def data(name: str, mib: int) -> Fill:
    """`mib` MiB of generated data files (hex text lines) under /data/`name`."""

    def fill(tar: tarfile.TarFile) -> None:
        rng = random.Random(name)
        made: set[str] = set()
        for n in range(mib // DATA_FILE_MIB):
            raw = rng.randbytes(DATA_FILE_MIB * MIB // 2).hex().encode()
            lines = b"\n".join(raw[i : i + 127] for i in range(0, len(raw), 128))
            _file(tar, made, f"data/{name}/part-{n:04}.csv", lines)

    return fill


def repo(n: int, scratch: Path) -> Fill:
    """A small git repository at /testbed (a package, its tests, its pinned
    requirements, two commits), as a task image's repository is."""

    def fill(tar: tarfile.TarFile) -> None:
        work = scratch / f"repo-{n:02}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        rng = random.Random(f"repo-{n}")
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "sandfork",
            "GIT_AUTHOR_EMAIL": "bench@sandfork.invalid",
            "GIT_COMMITTER_NAME": "sandfork",
            "GIT_COMMITTER_EMAIL": "bench@sandfork.invalid",
            "GIT_AUTHOR_DATE": f"@{MTIME} +0000",
            "GIT_COMMITTER_DATE": f"@{MTIME} +0000",
        }

        def git(*args: str) -> None:
            subprocess.run(
                ["git", "-C", str(work), *args], env=env, check=True, capture_output=True
            )

        git("init", "-q", "-b", "main")
        (work / "requirements.txt").write_text(
            "".join(f"{_words(rng, 2)}{i}==1.{i}.0\n" for i in range(12))
        )
        src = work / f"task{n:02}"
        src.mkdir()
        (src / "__init__.py").write_text("")
        for m in range(30):
            body = "".join(
                f"def f{m}_{i}(x):\n    return x * {rng.randint(1, 99)} + {rng.randint(0, 9)}\n\n"
                for i in range(200)
            )
            (src / f"mod{m}.py").write_text(body)
        (work / "tests").mkdir()
        (work / "tests" / "test_task.py").write_text(
            f"from task{n:02}.mod0 import f0_0\n\n\ndef test_f():\n    assert f0_0(1) > 0\n"
        )
        # Its own wheels (bytes no other image has), as a task's extra deps.
        (work / "wheels").mkdir()
        (work / "wheels" / f"task{n:02}-0.1-py3-none-any.whl").write_bytes(rng.randbytes(6 * MIB))
        git("add", "-A")
        git("commit", "-q", "-m", "the task's repository")
        (src / "mod0.py").write_text((src / "mod0.py").read_text() + "# the task's bug\n")
        git("commit", "-q", "-am", "the task's change")
        for path in sorted(work.rglob("*")):
            rel = "testbed/" + str(path.relative_to(work))
            info = tar.gettarinfo(str(path), rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "root", "root"
            if path.is_file():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
        shutil.rmtree(work)

    return fill


def image(blobs: Path, layers: list[dict[str, object]], name: str) -> dict[str, object]:
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", f"TASK_IMAGE={name}"],
            "WorkingDir": "/testbed",
        },
        "rootfs": {"type": "layers", "diff_ids": [lay["diff_id"] for lay in layers]},
    }
    cbytes = json.dumps(config, sort_keys=True).encode()
    cd = hashlib.sha256(cbytes).hexdigest()
    (blobs / cd).write_bytes(cbytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": f"sha256:{cd}",
            "size": len(cbytes),
        },
        "layers": [{k: lay[k] for k in ("mediaType", "digest", "size")} for lay in layers],
    }
    mbytes = json.dumps(manifest, sort_keys=True).encode()
    md = hashlib.sha256(mbytes).hexdigest()
    (blobs / md).write_bytes(mbytes)
    return {"digest": f"sha256:{md}", "size": len(mbytes)}


def push(layout: Path, work: Path, names: list[str]) -> None:
    """Pushes every tagged image of the layout into `work`/storage, the
    store of a `docker-registry` run for the time of the push."""
    proc, where = oci_registry.serve(work)
    try:
        for name in names:
            oci_registry.push(layout, f"{where}/task/{name}:{TAG}", name=name)
    finally:
        proc.kill()
        proc.wait()


def base_tree(cache: Path) -> Path:
    """The newest base tree scripts/build.sh cached."""
    trees = sorted((cache / "rootfs-base").glob("*/tree.tar"), key=lambda p: p.stat().st_mtime)
    if not trees:
        raise SystemExit(f"no base tree under {cache}/rootfs-base: run scripts/build.sh first")
    return trees[-1]


def key_of(tree: Path) -> str:
    sizes = (DEPS_MIB, DATA_1G_MIB, DATA_3G_MIB, VARIANTS, DATA_FILE_MIB, TAG)
    h = hashlib.sha256(f"{FORMAT} {sizes}".encode())
    with open(tree, "rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()[:16]


def make(entry: Path, tree: Path, log: Callable[[str], None]) -> None:
    """Makes the images into `entry` (a new directory renamed into place)."""
    work = Path(tempfile.mkdtemp(prefix=".making-", dir=entry.parent))
    try:
        layout = work / "layout"
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        made: dict[str, dict[str, object]] = {}

        def add(what: str, fill: Fill | None = None, raw: Path | None = None) -> dict[str, object]:
            started = time.monotonic()
            made[what] = {**layer(blobs, fill, raw), "what": what}
            log(
                f"task images: layer {what}: {made[what]['diff_size']} bytes, "
                f"{made[what]['size']} gzipped, {time.monotonic() - started:.0f} s"
            )
            return made[what]

        debian = add("debian", raw=tree)
        dep = add("deps", deps)
        d1 = add("data-1g", data("1g", DATA_1G_MIB))
        d3 = add("data-3g", data("3g", DATA_3G_MIB))
        plans: dict[str, list[dict[str, object]]] = {}
        for n in range(VARIANTS + 1):
            r = add(f"repo-{n:02}", repo(n, work))
            if n == 0:
                plans["swe-1g"] = [debian, dep, d1, r]
                plans["swe-4g"] = [debian, dep, d1, d3, r]
            else:
                plans[f"var-{n:02}"] = [debian, dep, d1, r]
        index: list[dict[str, object]] = []
        images: dict[str, object] = {}
        for name, layers in plans.items():
            desc = image(blobs, layers, name)
            index.append(
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    **desc,
                    "annotations": {"org.opencontainers.image.ref.name": name},
                }
            )
            images[name] = {
                "reference": f"task/{name}:{TAG}",
                "manifest": desc["digest"],
                "bytes": sum(int(str(lay["diff_size"])) for lay in layers),
                "layers": [
                    {k: lay[k] for k in ("what", "digest", "size", "diff_size")} for lay in layers
                ],
            }
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": index}))
        push(layout, work, list(plans))
        shutil.rmtree(layout)
        (work / "images.json").write_text(json.dumps({"tag": TAG, "images": images}, indent=1))
        work.chmod(0o755)
        work.rename(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cache", type=Path, default=Path(os.environ.get("SANDFORK_CACHE", "/var/cache/sandfork"))
    )
    p.add_argument(
        "--base-tree", type=Path, help="the Debian tree tar [default: the newest cached]"
    )
    p.add_argument("--prune", action="store_true", help="remove other keys' entries")
    args = p.parse_args()
    tree = args.base_tree or base_tree(args.cache)
    root = args.cache / "task-images"
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key_of(tree)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.prune:
        for old in root.iterdir():
            if old != entry:
                log(f"task images: removing {old}")
                shutil.rmtree(old, ignore_errors=True)
    if not entry.exists():
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not entry.exists():
                log(f"task images: making {entry} (a few minutes, about 3 GB)")
                make(entry, tree, log)
    print(entry)


if __name__ == "__main__":
    main()
