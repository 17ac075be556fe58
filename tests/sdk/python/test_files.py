"""files: write, read, list, exists, make_dir, rename, remove, get_info,
watch_dir, signed URLs, and a 50 MB upload and download."""

import hashlib
import io
import os
import time

import httpx
import pytest
from e2b import FileNotFoundException, FilesystemEventType, FileType
from polling import wait_until

BASE = "/home/user/sdk-files"


def test_write_and_read_text(sandbox):
    info = sandbox.files.write(f"{BASE}/a.txt", "héllo\n")
    assert info.path == f"{BASE}/a.txt"
    assert info.name == "a.txt"
    assert sandbox.files.read(f"{BASE}/a.txt") == "héllo\n"
    # owned by the default user, parent created
    r = sandbox.commands.run(f"stat -c '%U %a' {BASE} {BASE}/a.txt")
    assert r.stdout.splitlines()[0].split()[0] == "user"
    assert r.stdout.splitlines()[1].split()[0] == "user"


def test_write_bytes_and_read_formats(sandbox):
    data = bytes(range(256)) * 4
    sandbox.files.write(f"{BASE}/bin.dat", data)
    assert bytes(sandbox.files.read(f"{BASE}/bin.dat", format="bytes")) == data
    stream = sandbox.files.read(f"{BASE}/bin.dat", format="stream")
    assert b"".join(stream) == data


def test_write_as_root(sandbox):
    sandbox.files.write("/root/only-root.txt", "secret", user="root")
    assert sandbox.files.read("/root/only-root.txt", user="root") == "secret"


def test_write_files_many(sandbox):
    infos = sandbox.files.write_files(
        [
            {"path": f"{BASE}/many/one.txt", "data": "1"},
            {"path": f"{BASE}/many/two.txt", "data": b"2"},
        ]
    )
    assert sorted(i.path for i in infos) == [f"{BASE}/many/one.txt", f"{BASE}/many/two.txt"]
    assert sandbox.files.read(f"{BASE}/many/two.txt") == "2"


def test_a_write_makes_missing_parents_anywhere_owned_by_the_user(sandbox):
    # envd runs as root and hands the parents it makes to the writing user:
    # E2B snippets write outside the home directory as `user`
    sandbox.files.write("/0/py/x.txt", "zero")
    sandbox.files.write_files([{"path": "/0/py/deeper/y.txt", "data": "why"}])
    assert sandbox.files.read("/0/py/deeper/y.txt") == "why"
    r = sandbox.commands.run("stat -c '%U' /0 /0/py /0/py/deeper /0/py/x.txt")
    assert r.stdout.split() == ["user"] * 4
    # a file straight in a directory of root's stays refused
    with pytest.raises(Exception, match="ermission"):
        sandbox.files.write("/etc/not-users.txt", "no")


def test_read_missing_raises(sandbox):
    with pytest.raises(FileNotFoundException):
        sandbox.files.read(f"{BASE}/does-not-exist")


def test_list_and_get_info(sandbox):
    sandbox.files.write(f"{BASE}/list/x.txt", "xx")
    sandbox.files.make_dir(f"{BASE}/list/sub")
    sandbox.files.write(f"{BASE}/list/sub/deep.txt", "d")
    entries = {e.name: e for e in sandbox.files.list(f"{BASE}/list")}
    assert set(entries) == {"x.txt", "sub"}
    assert entries["x.txt"].type == FileType.FILE
    assert entries["x.txt"].size == 2
    assert entries["x.txt"].path == f"{BASE}/list/x.txt"
    assert entries["sub"].type == FileType.DIR
    deep = {e.path for e in sandbox.files.list(f"{BASE}/list", depth=2)}
    assert f"{BASE}/list/sub/deep.txt" in deep
    info = sandbox.files.get_info(f"{BASE}/list/x.txt")
    assert info.size == 2 and info.owner == "user" and info.type == FileType.FILE
    with pytest.raises(FileNotFoundException):
        sandbox.files.list(f"{BASE}/no-such-dir")


def test_exists_make_dir_rename_remove(sandbox):
    d = f"{BASE}/ops"
    assert sandbox.files.exists(d) is False
    assert sandbox.files.make_dir(d) is True
    assert sandbox.files.make_dir(d) is False  # already_exists
    assert sandbox.files.exists(d) is True
    sandbox.files.write(f"{d}/old.txt", "moved")
    moved = sandbox.files.rename(f"{d}/old.txt", f"{d}/new.txt")
    assert moved.path == f"{d}/new.txt"
    assert sandbox.files.exists(f"{d}/old.txt") is False
    assert sandbox.files.read(f"{d}/new.txt") == "moved"
    sandbox.files.remove(f"{d}/new.txt")
    assert sandbox.files.exists(f"{d}/new.txt") is False
    sandbox.files.remove(d)
    assert sandbox.files.exists(d) is False


def test_watch_dir(sandbox):
    d = f"{BASE}/watched"
    sandbox.files.make_dir(d)
    handle = sandbox.files.watch_dir(d)
    try:
        sandbox.files.write(f"{d}/new.txt", "x")
        sandbox.commands.run(f"rm {d}/new.txt")
        seen = []

        def got_remove():
            seen.extend(handle.get_new_events())
            return any(e.name == "new.txt" and e.type == FilesystemEventType.REMOVE for e in seen)

        wait_until(got_remove, timeout=30, what="watch events for new.txt")
        kinds = {e.type for e in seen if e.name == "new.txt"}
        assert FilesystemEventType.CREATE in kinds or FilesystemEventType.WRITE in kinds
    finally:
        handle.stop()


def test_watch_dir_write_sequence_is_envds(sandbox):
    # envd opens the new file (CREATE), chowns it to the user (CHMOD), then
    # writes it (WRITE): clients waiting for one of them see the same order.
    d = f"{BASE}/watched-seq"
    sandbox.commands.run(f"rm -rf {d}")
    sandbox.files.make_dir(d)
    handle = sandbox.files.watch_dir(d)
    try:
        sandbox.files.write(f"{d}/new.txt", "x")
        seen = []

        def got_write():
            seen.extend(handle.get_new_events())
            return any(e.type == FilesystemEventType.WRITE for e in seen)

        wait_until(got_write, timeout=30, what="the write's events")
        time.sleep(1)
        seen.extend(handle.get_new_events())
        assert [(e.name, e.type) for e in seen] == [
            ("new.txt", FilesystemEventType.CREATE),
            ("new.txt", FilesystemEventType.CHMOD),
            ("new.txt", FilesystemEventType.WRITE),
        ]
    finally:
        handle.stop()


def test_recursive_watch_sees_directories_made_after_it(sandbox):
    d = f"{BASE}/watched-tree"
    sandbox.commands.run(f"rm -rf {d}")
    sandbox.files.make_dir(d)
    handle = sandbox.files.watch_dir(d, recursive=True)
    try:
        # The whole tree at once, before the watcher can add the new
        # directories: their entries are reported as created (as envd does).
        sandbox.commands.run(f"mkdir -p {d}/a/b && echo x > {d}/a/b/c.txt")
        sandbox.commands.run(f"mkdir {d}/later")
        time.sleep(1)
        sandbox.commands.run(f"echo y > {d}/later/e.txt")
        seen = []

        def created(name):
            return any(e.name == name and e.type == FilesystemEventType.CREATE for e in seen)

        def got_all():
            seen.extend(handle.get_new_events())
            return created("later/e.txt") and created("a/b/c.txt")

        wait_until(got_all, timeout=30, what="events in new directories")
        for name in ["a", "a/b", "a/b/c.txt", "later", "later/e.txt"]:
            assert created(name), (name, seen)
        assert any(e.name == "later/e.txt" and e.type == FilesystemEventType.WRITE for e in seen)
    finally:
        handle.stop()


def test_signed_urls(sandbox):
    # With E2B_SANDBOX_URL the URL names no sandbox: the signature is the handle.
    up = sandbox.upload_url(f"{BASE}/signed.txt")
    r = httpx.post(up, files={"file": ("signed.txt", b"via url")}, timeout=120)
    assert r.status_code == 200, r.text
    down = sandbox.download_url(f"{BASE}/signed.txt")
    r = httpx.get(down, timeout=120)
    assert r.status_code == 200, r.text
    assert r.content == b"via url"


def test_large_file_upload_and_download(sandbox):
    data = os.urandom(50 * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    path = f"{BASE}/big.bin"
    # a file-like object goes as one streamed octet-stream body
    sandbox.files.write(path, io.BytesIO(data))
    r = sandbox.commands.run(f"sha256sum {path}", timeout=300)
    assert r.stdout.split()[0] == digest
    back = sandbox.files.read(path, format="bytes", request_timeout=300)
    assert len(back) == len(data)
    assert hashlib.sha256(bytes(back)).hexdigest() == digest
    # and the multipart form (bytes) overwrites it
    sandbox.files.write(path, data[: 8 * 1024 * 1024])
    assert sandbox.files.get_info(path).size == 8 * 1024 * 1024
    sandbox.files.remove(path)


def test_get_info_of_a_symlink_reports_its_target(sandbox):
    # E2B's envd: a link to a file is a FILE with symlink_target set.
    sandbox.files.write(f"{BASE}/links/target.txt", "t")
    sandbox.commands.run(f"ln -sf {BASE}/links/target.txt {BASE}/links/link")
    info = sandbox.files.get_info(f"{BASE}/links/link")
    assert info.type == FileType.FILE, info
    assert info.symlink_target == f"{BASE}/links/target.txt", info
    assert info.name == "link"
    listed = {e.name: e for e in sandbox.files.list(f"{BASE}/links")}
    assert listed["link"].type == FileType.FILE
    assert listed["link"].symlink_target == f"{BASE}/links/target.txt"


def test_remove_of_a_missing_path_succeeds(sandbox):
    # E2B's envd removes with os.RemoveAll: nothing there is no error.
    sandbox.files.remove(f"{BASE}/never-existed")
    sandbox.files.remove(f"{BASE}/never/existed/either")


def test_signed_url_errors_are_envds_texts(sandbox):
    sandbox.files.write(f"{BASE}/signed-err.txt", "x")
    down = sandbox.download_url(f"{BASE}/signed-err.txt", use_signature_expiration=1)
    # The SDK's expiry is int(now) + 1 and envd's check is in whole guest
    # seconds, so the URL is refused from 1-2 s on by a guest clock that is
    # exact; the agent sets the guest clock at /init to the host's time when
    # it sent /init, so a guest may run behind by that request's latency
    # (seconds in a loaded lab): it must be refused within 15 s.
    time.sleep(1.5)
    deadline = time.monotonic() + 15
    while (r := httpx.get(down, timeout=120)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert r.status_code == 401, r.text
    assert r.json()["message"] == "signature is already expired"
    good = sandbox.download_url(f"{BASE}/signed-err.txt")
    wrong = good.replace("signature=v1_", "signature=v1_x")
    r = httpx.get(wrong, timeout=120)
    assert r.status_code == 401, r.text
    assert r.json()["message"] == "invalid signature"
