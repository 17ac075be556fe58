//! The envd filesystem surface of the real agent binary in host mode, over TCP:
//! the filesystem.Filesystem Connect service, /files both ways (multipart,
//! octet-stream, gzip, Range, metadata, signatures), /files/compose, /metrics.

#![cfg(test)]

mod common;

use std::io::{BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Agent, LiveStream, Resp, read_head, write_request};
use serde_json::{Value, json};

const FS: &str = "/filesystem.Filesystem";
const ROOT: (&str, &str) = ("authorization", "Basic cm9vdDo=");
const NOBODY: (&str, &str) = ("authorization", "Basic bm9ib2R5Og==");
const OCTET: (&str, &str) = ("content-type", "application/octet-stream");
const JSON: (&str, &str) = ("content-type", "application/json");

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn rpc(agent: &Agent, method: &str, body: Value) -> Resp {
    agent.unary(&format!("{FS}/{method}"), &[ROOT], &body)
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// Whether `dir`'s filesystem takes `user.*` extended attributes.
fn user_xattrs_work(dir: &Path) -> bool {
    let probe = dir.join(".xattr-probe");
    std::fs::write(&probe, b"").unwrap();
    let c = std::ffi::CString::new(s(&probe)).unwrap();
    // SAFETY: NUL-terminated path and name; a 1-byte value.
    let r = unsafe {
        libc::setxattr(
            c.as_ptr(),
            c"user.probe".as_ptr(),
            c"x".as_ptr().cast(),
            1,
            0,
        )
    };
    std::fs::remove_file(&probe).unwrap();
    r == 0
}

/// A multipart/form-data body of `file` parts (filename, content), as the SDKs
/// send it.
fn multipart(parts: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "sandfork-test-boundary-7c1";
    let mut body = Vec::new();
    for (name, data) in parts {
        write!(
            body,
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .unwrap();
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    write!(body, "--{boundary}--\r\n").unwrap();
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// The /files URL of `path`.
fn files(path: &Path) -> String {
    format!("/files?path={}", q(path))
}

fn q(path: &Path) -> String {
    path.to_str()
        .unwrap()
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn stat_make_dir_move_list_remove() {
    let agent = Agent::start();
    let t = tempfile::tempdir().unwrap();
    let f = t.path().join("a.txt");
    std::fs::write(&f, b"hello").unwrap();

    let r = rpc(&agent, "Stat", json!({"path": s(&f)}));
    assert_eq!(r.status, 200, "{r:?}");
    let e = &r.json()["entry"];
    assert_eq!(e["name"], "a.txt");
    assert_eq!(e["type"], "FILE_TYPE_FILE");
    assert_eq!(e["path"], s(&f));
    assert_eq!(e["size"], "5");
    assert_eq!(e["permissions"], "-rw-r--r--");
    assert_eq!(e["mode"], 0o644);
    assert!(e["modifiedTime"].as_str().unwrap().ends_with('Z'));
    let r = rpc(&agent, "Stat", json!({"path": s(&t.path().join("nope"))}));
    r.assert_error(404, "not_found");

    let d = t.path().join("x/y/z");
    let r = rpc(&agent, "MakeDir", json!({"path": s(&d)}));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert!(d.is_dir());
    let r = rpc(&agent, "MakeDir", json!({"path": s(&d)}));
    r.assert_error(409, "already_exists");

    let moved = t.path().join("x/y/b.txt");
    let r = rpc(
        &agent,
        "Move",
        json!({"source": s(&f), "destination": s(&moved)}),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["entry"]["path"], s(&moved));
    assert!(!f.exists() && moved.is_file());
    let r = rpc(
        &agent,
        "Move",
        json!({"source": s(&f), "destination": s(&moved)}),
    );
    assert_eq!(r.status, 404);

    let names = |r: &Resp| -> Vec<String> {
        assert_eq!(r.status, 200, "{r:?}");
        r.json()["entries"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|e| {
                        e["path"].as_str().unwrap()[t.path().to_str().unwrap().len() + 1..]
                            .to_string()
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    std::fs::write(t.path().join("top.txt"), b"").unwrap();
    let r = rpc(&agent, "ListDir", json!({"path": s(t.path()), "depth": 1}));
    assert_eq!(names(&r), ["top.txt", "x"]);
    let r = rpc(&agent, "ListDir", json!({"path": s(t.path())}));
    assert_eq!(names(&r), ["top.txt", "x"], "depth 0 is 1");
    let r = rpc(&agent, "ListDir", json!({"path": s(t.path()), "depth": 2}));
    assert_eq!(names(&r), ["top.txt", "x", "x/y"]);
    let r = rpc(
        &agent,
        "ListDir",
        json!({"path": s(t.path()), "depth": "3"}),
    );
    assert_eq!(names(&r), ["top.txt", "x", "x/y", "x/y/b.txt", "x/y/z"]);
    let r = rpc(&agent, "ListDir", json!({"path": s(&moved), "depth": 1}));
    r.assert_error(400, "invalid_argument");
    let r = rpc(
        &agent,
        "ListDir",
        json!({"path": s(&t.path().join("nope"))}),
    );
    r.assert_error(404, "not_found");

    let r = rpc(&agent, "Remove", json!({"path": s(&t.path().join("x"))}));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json(), json!({}));
    assert!(!t.path().join("x").exists());
    // A second remove finds nothing and succeeds, as E2B's envd does.
    let r = rpc(&agent, "Remove", json!({"path": s(&t.path().join("x"))}));
    assert_eq!(r.status, 200, "{r:?}");
    let r = rpc(&agent, "Remove", json!({}));
    r.assert_error(400, "invalid_argument");
    assert!(t.path().join("top.txt").exists());

    // Bad requests: malformed JSON, wrong content type, unknown user.
    let r = agent.request("POST", &format!("{FS}/Stat"), &[JSON, ROOT], b"{\"path\":");
    r.assert_error(400, "invalid_argument");
    let r = agent.request(
        "POST",
        &format!("{FS}/Stat"),
        &[("content-type", "text/plain"), ROOT],
        b"{}",
    );
    assert_eq!(r.status, 400);
    let r = agent.unary(
        &format!("{FS}/Stat"),
        &[("authorization", "Basic bm9zdWNodXNlcjo=")],
        &json!({"path": "/"}),
    );
    r.assert_error(401, "unauthenticated");
}

#[test]
fn operations_run_with_the_users_permissions() {
    if !is_root() {
        eprintln!("SKIPPED: switching to user nobody needs root");
        return;
    }
    let agent = Agent::start();
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = t.path().join("secret");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();

    let r = agent.get(&format!("/files?path={}&username=nobody", q(&secret)), &[]);
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(r.json()["code"], 403);
    let r = agent.get(&format!("/files?path={}&username=root", q(&secret)), &[]);
    assert_eq!((r.status, r.body.as_slice()), (200, &b"root only"[..]));

    let private = t.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let r = agent.unary(
        &format!("{FS}/ListDir"),
        &[NOBODY],
        &json!({"path": s(&private)}),
    );
    r.assert_error(403, "permission_denied");
    let r = agent.unary(
        &format!("{FS}/MakeDir"),
        &[NOBODY],
        &json!({"path": s(&t.path().join("n"))}),
    );
    r.assert_error(403, "permission_denied");
    let r = agent.unary(
        &format!("{FS}/Remove"),
        &[NOBODY],
        &json!({"path": s(&secret)}),
    );
    r.assert_error(403, "permission_denied");
    assert!(secret.exists());

    // What nobody creates is nobody's, parents included.
    let open = t.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let target = open.join("sub/f.txt");
    let r = agent.post(
        &format!("/files?path={}&username=nobody", q(&target)),
        "application/octet-stream",
        b"mine",
    );
    assert_eq!(r.status, 200, "{r:?}");
    for p in [open.join("sub"), target.clone()] {
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!((md.uid(), md.gid()), (65534, 65534), "{}", p.display());
    }
    let r = agent.unary(
        &format!("{FS}/MakeDir"),
        &[NOBODY],
        &json!({"path": s(&open.join("d"))}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["entry"]["owner"], "nobody");
    assert_eq!(std::fs::metadata(open.join("d")).unwrap().uid(), 65534);

    // A write's missing parents are made wherever they are, as envd (root)
    // makes them, and are the writer's (the SDKs write `/0/x.txt` as
    // `user`); a file straight in a directory the writer may not write
    // stays refused.
    let deep = t.path().join("made/for/nobody/f.txt");
    let r = agent.post(
        &format!("/files?path={}&username=nobody", q(&deep)),
        "application/octet-stream",
        b"deep",
    );
    assert_eq!(r.status, 200, "{r:?}");
    for p in [
        "made",
        "made/for",
        "made/for/nobody",
        "made/for/nobody/f.txt",
    ] {
        let md = std::fs::metadata(t.path().join(p)).unwrap();
        assert_eq!((md.uid(), md.gid()), (65534, 65534), "{p}");
    }
    assert_eq!(std::fs::read(&deep).unwrap(), b"deep");
    let r = agent.request(
        "POST",
        &format!(
            "/files?path={}&username=nobody",
            q(&t.path().join("direct.txt"))
        ),
        &[OCTET],
        b"no",
    );
    assert_eq!(r.status, 403, "{r:?}");
    assert!(!t.path().join("direct.txt").exists());
}

fn start_watch(agent: &Agent, headers: &[(&str, &str)], body: Value) -> LiveStream {
    let mut h = vec![ROOT];
    h.extend_from_slice(headers);
    let s = agent.open_stream(&format!("{FS}/WatchDir"), &h, &body);
    let live = LiveStream::open(s);
    assert_eq!(live.status, 200);
    assert_eq!(
        live.headers
            .iter()
            .find(|(k, _)| k == "content-type")
            .map(|(_, v)| v.as_str()),
        Some("application/connect+json")
    );
    live
}

/// Reads filesystem events until `done` holds for the (name, type) pairs seen.
fn read_events(live: &mut LiveStream, done: impl Fn(&[(String, String)]) -> bool) -> Vec<Value> {
    live.raw
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut seen = Vec::new();
    let mut all = Vec::new();
    while !done(&seen) {
        let (end, msg) = live.next_json().expect("stream ended early");
        assert!(!end, "unexpected end {msg}; saw {all:?}");
        if let Some(ev) = msg.get("filesystem") {
            seen.push((
                ev["name"].as_str().unwrap().to_string(),
                ev["type"].as_str().unwrap().to_string(),
            ));
            all.push(ev.clone());
        }
    }
    all
}

fn has(seen: &[(String, String)], name: &str, t: &str) -> bool {
    seen.iter().any(|(n, ty)| n == name && ty == t)
}

#[test]
fn watch_dir_streams_events() {
    let agent = Agent::start();
    let t = tempfile::tempdir().unwrap();
    let mut live = start_watch(
        &agent,
        &[("keepalive-ping-interval", "1")],
        json!({"path": s(t.path()), "recursive": true, "includeEntry": true}),
    );
    assert_eq!(live.next_json().unwrap(), (false, json!({"start": {}})));

    let f = t.path().join("f.txt");
    std::fs::write(&f, b"data").unwrap();
    std::fs::rename(&f, t.path().join("g.txt")).unwrap();
    std::fs::create_dir(t.path().join("sub")).unwrap();
    let evs = read_events(&mut live, |s| has(s, "sub", "EVENT_TYPE_CREATE"));
    // The watch on the new subdirectory is in place once its create arrived.
    std::fs::write(t.path().join("sub/inner"), b"").unwrap();
    std::fs::remove_file(t.path().join("g.txt")).unwrap();
    let more = read_events(&mut live, |s| {
        has(s, "sub/inner", "EVENT_TYPE_CREATE") && has(s, "g.txt", "EVENT_TYPE_REMOVE")
    });
    let pairs: Vec<(String, String)> = evs
        .iter()
        .chain(&more)
        .map(|e| {
            (
                e["name"].as_str().unwrap().into(),
                e["type"].as_str().unwrap().into(),
            )
        })
        .collect();
    for (name, ty) in [
        ("f.txt", "EVENT_TYPE_CREATE"),
        ("f.txt", "EVENT_TYPE_WRITE"),
        ("f.txt", "EVENT_TYPE_RENAME"),
        ("g.txt", "EVENT_TYPE_CREATE"),
        ("sub", "EVENT_TYPE_CREATE"),
        ("sub/inner", "EVENT_TYPE_CREATE"),
        ("g.txt", "EVENT_TYPE_REMOVE"),
    ] {
        assert!(has(&pairs, name, ty), "{name} {ty} missing from {pairs:?}");
    }
    let sub = evs.iter().find(|e| e["name"] == "sub").unwrap();
    assert_eq!(sub["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(sub["entry"]["path"], s(&t.path().join("sub")));

    // Nothing happens for a while: keepalives arrive (interval 1 s).
    let start = Instant::now();
    loop {
        let (end, msg) = live.next_json().unwrap();
        assert!(!end);
        if msg.get("keepalive").is_some() {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "no keepalive");
    }
    drop(live);

    // A deadline ends the stream with deadline_exceeded.
    let mut live = start_watch(
        &agent,
        &[("connect-timeout-ms", "700")],
        json!({"path": s(t.path())}),
    );
    assert_eq!(live.next_json().unwrap(), (false, json!({"start": {}})));
    let (end, msg) = live.next_json().unwrap();
    assert!(end);
    assert_eq!(msg["error"]["code"], "deadline_exceeded");

    // A missing directory is not_found in the end-stream.
    let r = agent.stream(
        &format!("{FS}/WatchDir"),
        &[ROOT],
        &json!({"path": s(&t.path().join("nope"))}),
    );
    let msgs = r.messages();
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert_eq!(msgs[0]["error"]["code"], "not_found");
    // A request that is not an envelope: invalid_argument, and the agent lives on.
    let mut sock = agent.connect();
    write_request(
        &mut sock,
        "POST",
        &format!("{FS}/WatchDir"),
        &[("content-type", "application/connect+json")],
        b"\x00\x00\x00",
    );
    let r = common::read_response(&mut sock);
    let end = r.messages();
    assert_eq!(end.last().unwrap()["error"]["code"], "invalid_argument");
}

#[test]
fn polled_watchers() {
    let agent = Agent::start();
    let t = tempfile::tempdir().unwrap();
    let r = rpc(
        &agent,
        "CreateWatcher",
        json!({"path": s(t.path()), "recursive": false}),
    );
    assert_eq!(r.status, 200, "{r:?}");
    let id = r.json()["watcherId"].as_str().unwrap().to_string();

    std::fs::write(t.path().join("a"), b"1").unwrap();
    std::fs::rename(t.path().join("a"), t.path().join("b")).unwrap();
    std::fs::remove_file(t.path().join("b")).unwrap();
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !has(&seen, "b", "EVENT_TYPE_REMOVE") {
        assert!(Instant::now() < deadline, "{seen:?}");
        std::thread::sleep(Duration::from_millis(50));
        let r = rpc(&agent, "GetWatcherEvents", json!({"watcherId": id}));
        assert_eq!(r.status, 200, "{r:?}");
        for e in r.json()["events"].as_array().cloned().unwrap_or_default() {
            seen.push((
                e["name"].as_str().unwrap().into(),
                e["type"].as_str().unwrap().into(),
            ));
        }
    }
    for (n, ty) in [
        ("a", "EVENT_TYPE_CREATE"),
        ("a", "EVENT_TYPE_WRITE"),
        ("a", "EVENT_TYPE_RENAME"),
        ("b", "EVENT_TYPE_CREATE"),
    ] {
        assert!(has(&seen, n, ty), "{n} {ty} not in {seen:?}");
    }
    // Events are handed out once.
    let r = rpc(&agent, "GetWatcherEvents", json!({"watcher_id": id}));
    assert_eq!(r.json(), json!({}));
    assert_eq!(
        rpc(&agent, "RemoveWatcher", json!({"watcherId": id})).status,
        200
    );
    let r = rpc(&agent, "RemoveWatcher", json!({"watcherId": id}));
    r.assert_error(404, "not_found");
    let r = rpc(&agent, "GetWatcherEvents", json!({"watcherId": id}));
    assert_eq!(r.status, 404);
    let r = rpc(
        &agent,
        "CreateWatcher",
        json!({"path": s(&t.path().join("nope"))}),
    );
    r.assert_error(404, "not_found");
}

/// What a watcher sees of an upload: envd's sequence. A new file is created,
/// given to the user (chmod) and written; an existing one is given to the
/// user, truncated (a write) and written.
#[test]
fn uploads_emit_envds_watch_events() {
    let (agent, t) = root_agent(None);
    let r = rpc(&agent, "CreateWatcher", json!({"path": s(t.path())}));
    assert_eq!(r.status, 200, "{r:?}");
    let id = r.json()["watcherId"].as_str().unwrap().to_string();
    let events_until = |count: usize| {
        let mut seen: Vec<(String, String)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut settled = 0;
        // At least `count`, then whatever else comes within 300 ms.
        while seen.len() < count || settled < 6 {
            assert!(Instant::now() < deadline, "{seen:?}");
            std::thread::sleep(Duration::from_millis(50));
            let r = rpc(&agent, "GetWatcherEvents", json!({"watcherId": id}));
            let events = r.json()["events"].as_array().cloned().unwrap_or_default();
            settled = if events.is_empty() { settled + 1 } else { 0 };
            for e in events {
                seen.push((
                    e["name"].as_str().unwrap().into(),
                    e["type"].as_str().unwrap().into(),
                ));
            }
        }
        seen
    };
    let upload = |data: &[u8]| {
        let r = agent.post(
            &files(&t.path().join("f.txt")),
            "application/octet-stream",
            data,
        );
        assert_eq!(r.status, 200, "{r:?}");
    };
    let named = |types: &[&str]| -> Vec<(String, String)> {
        types
            .iter()
            .map(|ty| ("f.txt".to_string(), format!("EVENT_TYPE_{ty}")))
            .collect()
    };
    upload(b"new");
    assert_eq!(events_until(3), named(&["CREATE", "CHMOD", "WRITE"]));
    upload(b"again");
    // The truncation's write and the data's are one event when the kernel
    // queued both before the watcher read them.
    let seen = events_until(2);
    assert!(
        seen == named(&["CHMOD", "WRITE"]) || seen == named(&["CHMOD", "WRITE", "WRITE"]),
        "{seen:?}"
    );
}

/// An agent whose default user is root (with `token` as its access token),
/// and a scratch directory.
fn root_agent(token: Option<&str>) -> (Agent, tempfile::TempDir) {
    let agent = Agent::start();
    init_root(&agent, token);
    (agent, tempfile::tempdir().unwrap())
}

fn init_root(agent: &Agent, token: Option<&str>) {
    let mut body = json!({"defaultUser": "root"});
    if let Some(t) = token {
        body["accessToken"] = json!(t);
    }
    let r = agent.request("POST", "/init", &[], body.to_string().as_bytes());
    assert_eq!(r.status, 204, "{r:?}");
}

#[test]
fn upload_and_download() {
    let (agent, t) = root_agent(None);

    // Multipart, one file: the query path wins over the part's filename.
    let a = t.path().join("new/dir/a.txt");
    let (ct, body) = multipart(&[("/elsewhere/ignored.txt", b"alpha")]);
    let r = agent.post(&files(&a), &ct, &body);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.json(),
        json!([{"name": "a.txt", "type": "file", "path": s(&a)}])
    );
    assert_eq!(std::fs::read(&a).unwrap(), b"alpha");

    // Several parts without a path: each filename is the full target path.
    let (d1, d2) = (t.path().join("m/d1"), t.path().join("n/d2"));
    let (ct, body) = multipart(&[(&s(&d1), b"one"), (&s(&d2), &[0u8, 1, 2, 255])]);
    let r = agent.post("/files", &ct, &body);
    assert_eq!(r.status, 200, "{r:?}");
    let paths: Vec<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().into())
        .collect();
    assert_eq!(paths, [s(&d1), s(&d2)]);
    assert_eq!(std::fs::read(&d1).unwrap(), b"one");
    assert_eq!(std::fs::read(&d2).unwrap(), [0u8, 1, 2, 255]);

    // Octet-stream, plain and gzip-encoded; existing files are truncated.
    let b = t.path().join("b.bin");
    let octet = [OCTET];
    let r = agent.request("POST", &files(&b), &octet, b"a much longer first version");
    assert_eq!(r.status, 200);
    let r = agent.request(
        "POST",
        &files(&b),
        &[OCTET, ("content-encoding", "gzip")],
        &gzip(b"short"),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(std::fs::read(&b).unwrap(), b"short");

    // Download: raw with disposition, gzip, ranges.
    let r = agent.get(&files(&a), &[]);
    assert_eq!((r.status, r.body.as_slice()), (200, &b"alpha"[..]));
    assert_eq!(
        r.header("content-disposition"),
        Some("inline; filename=\"a.txt\"")
    );
    assert_eq!(r.header("content-length"), Some("5"));
    let r = agent.get(&files(&a), &[("accept-encoding", "gzip")]);
    assert_eq!(
        (r.status, r.header("content-encoding")),
        (200, Some("gzip"))
    );
    assert_eq!(gunzip(&r.body), b"alpha");
    let r = agent.get(&files(&a), &[("range", "bytes=1-3")]);
    assert_eq!((r.status, r.body.as_slice()), (206, &b"lph"[..]));
    assert_eq!(r.header("content-range"), Some("bytes 1-3/5"));
    let r = agent.get(&files(&a), &[("range", "bytes=-2")]);
    assert_eq!((r.status, r.body.as_slice()), (206, &b"ha"[..]));
    let r = agent.get(&files(&a), &[("range", "bytes=9-")]);
    assert_eq!(
        (r.status, r.header("content-range")),
        (416, Some("bytes */5"))
    );
    let r = agent.get(&files(&a), &[("accept-encoding", "br")]);
    assert_eq!((r.status, r.json()["code"].as_i64()), (406, Some(406)));

    // Errors: directory, missing, no path.
    let r = agent.get(&files(t.path()), &[]);
    assert_eq!((r.status, r.json()["code"].as_i64()), (400, Some(400)));
    let r = agent.get(&files(&t.path().join("none")), &[]);
    assert_eq!((r.status, r.json()["code"].as_i64()), (404, Some(404)));
    assert_eq!(agent.get("/files", &[]).status, 400);
    assert_eq!(
        agent
            .request("GET", "/files?username=nosuchuser&path=/x", &[], b"")
            .status,
        401
    );

    // Upload errors.
    let r = agent.request("POST", &files(t.path()), &octet, b"x");
    assert_eq!((r.status, r.json()["code"].as_i64()), (400, Some(400)));
    assert_eq!(
        agent.request("POST", "/files", &octet, b"x").status,
        400,
        "octet needs path"
    );
    let r = agent.post(&files(&b), "text/plain", b"x");
    assert_eq!(r.status, 400);
    let r = agent.request("POST", &files(&b), &[], b"x");
    assert_eq!(r.status, 400, "no content type");
    let r = agent.post(
        &files(&b),
        "multipart/form-data; boundary=zzz",
        b"--zzz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\nno end",
    );
    assert_eq!(r.status, 400, "truncated multipart: {r:?}");
    let r = agent.post("/files", "multipart/form-data", b"x");
    assert_eq!(r.status, 400, "multipart without boundary");
    let (ct, _) = multipart(&[]);
    let r = agent.post("/files", &ct, b"--sandfork-test-boundary-7c1--\r\n");
    assert_eq!(r.status, 400, "no file part");
    // A corrupt gzip body; an encoding not taken.
    for (encoding, body, status) in [
        ("gzip", &b"definitely not gzip"[..], 400),
        ("br", b"x", 415),
    ] {
        let r = agent.request(
            "POST",
            &files(&b),
            &[OCTET, ("content-encoding", encoding)],
            body,
        );
        assert_eq!(r.status, status, "{encoding}: {r:?}");
    }
    // A full disk is 507 (/dev/full fails every write with ENOSPC).
    let r = agent.request("POST", "/files?path=/dev/full", &octet, &[7u8; 4096]);
    assert_eq!(
        (r.status, r.json()["code"].as_i64()),
        (507, Some(507)),
        "{r:?}"
    );

    // compose concatenates.
    let c = t.path().join("c/out");
    let r = agent.request(
        "POST",
        "/files/compose",
        &[JSON],
        json!({"source_paths": [s(&a), s(&d1)], "destination": s(&c)})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["size"], "8");
    assert_eq!(std::fs::read(&c).unwrap(), b"alphaone");

    // /metrics has envd's fields.
    let r = agent.get("/metrics", &[]);
    assert_eq!(r.status, 200);
    let m = r.json();
    for k in [
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ] {
        assert!(m[k].is_number(), "{k} in {m}");
    }
    assert!(m["mem_total"].as_u64().unwrap() > 0);
}

#[test]
fn metadata_headers_become_xattrs() {
    let (agent, t) = root_agent(None);
    if !user_xattrs_work(t.path()) {
        eprintln!("SKIPPED: {} has no user xattrs", t.path().display());
        return;
    }
    let f = t.path().join("m.txt");
    let r = agent.request(
        "POST",
        &files(&f),
        &[
            OCTET,
            ("x-metadata-Owner", "alice"),
            ("X-Metadata-Stage", "draft"),
        ],
        b"x",
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.json()[0]["metadata"],
        json!({"owner": "alice", "stage": "draft"})
    );
    let r = rpc(&agent, "Stat", json!({"path": s(&f)}));
    assert_eq!(
        r.json()["entry"]["metadata"],
        json!({"owner": "alice", "stage": "draft"})
    );
    // A later write replaces the set.
    let (ct, body) = multipart(&[(&s(&f), b"y")]);
    let r = agent.request(
        "POST",
        "/files",
        &[("content-type", &ct), ("x-metadata-k", "v")],
        &body,
    );
    assert_eq!(r.status, 200, "{r:?}");
    let r = rpc(&agent, "Stat", json!({"path": s(&f)}));
    assert_eq!(r.json()["entry"]["metadata"], json!({"k": "v"}));
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn sign(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    use base64::Engine;
    use sha2::Digest;
    let mut text = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        text += &format!(":{e}");
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(sha2::Sha256::digest(text))
    )
}

/// The access token of [`signed_setup`]'s agent.
const TOKEN: &str = "tok_envd_secret";

/// An agent with [`TOKEN`], its scratch directory and a file in it (`signed`)
/// to read with a signature.
fn signed_setup() -> (Agent, tempfile::TempDir, std::path::PathBuf) {
    let (agent, t) = root_agent(Some(TOKEN));
    let f = t.path().join("s.txt");
    std::fs::write(&f, b"signed").unwrap();
    (agent, t, f)
}

fn enc(v: &str) -> String {
    q(Path::new(v)).replace('+', "%2B").replace('=', "%3D")
}

#[test]
fn signed_urls_and_tokens() {
    let (agent, t, f) = signed_setup();
    let token = TOKEN;
    let p = s(&f);
    let get = |query: String, headers: &[(&str, &str)]| {
        agent.request("GET", &format!("/files?{query}"), headers, b"")
    };

    // Refusals carry E2B envd's own texts, which clients compare.
    let r = get(format!("path={}", q(&f)), &[]);
    assert_eq!(r.status, 401, "neither token nor signature");
    assert_eq!(r.json()["message"], "missing signature query parameter");
    let sig = sign(&p, "read", "", token, None);
    let r = get(format!("path={}&signature={}", q(&f), enc(&sig)), &[]);
    assert_eq!((r.status, r.body.as_slice()), (200, &b"signed"[..]));
    let wrong = sign(&p, "read", "", "other", None);
    let r = get(format!("path={}&signature={}", q(&f), enc(&wrong)), &[]);
    assert_eq!((r.status, r.json()["code"].as_i64()), (401, Some(401)));
    assert_eq!(r.json()["message"], "invalid signature");
    let w = sign(&p, "write", "", token, None);
    assert_eq!(
        get(format!("path={}&signature={}", q(&f), enc(&w)), &[]).status,
        401,
        "write signature cannot read"
    );

    // root's read of f, signed to expire at `at`.
    let expiring = |sig: &str, at: i64| {
        format!(
            "path={}&username=root&signature={}&signature_expiration={at}",
            q(&f),
            enc(sig)
        )
    };
    let future = now() + 600;
    let sig = sign(&p, "read", "root", token, Some(future));
    let r = get(expiring(&sig, future), &[]);
    assert_eq!(r.status, 200, "{r:?}");
    let past = now() - 10;
    let sig = sign(&p, "read", "root", token, Some(past));
    let r = get(expiring(&sig, past), &[]);
    assert_eq!(r.status, 401, "expired");
    assert_eq!(r.json()["message"], "signature is already expired");

    // The header token wins over the signature.
    let sig = sign(&p, "read", "", token, None);
    let r = get(
        format!("path={}&signature={}", q(&f), enc(&sig)),
        &[("x-access-token", "bad")],
    );
    assert_eq!(r.status, 401);
    assert_eq!(
        r.json()["message"],
        "access token present in header but does not match"
    );
    assert_eq!(
        get(format!("path={}", q(&f)), &[("x-access-token", token)]).status,
        200
    );

    // Uploads with a write signature.
    let up = t.path().join("up.txt");
    let w = sign(&s(&up), "write", "", token, None);
    let r = agent.post(
        &format!("/files?path={}&signature={}", q(&up), enc(&w)),
        "application/octet-stream",
        b"up",
    );
    assert_eq!(r.status, 200, "{r:?}");
    let rsig = sign(&s(&up), "read", "", token, None);
    let r = agent.post(
        &format!("/files?path={}&signature={}", q(&up), enc(&rsig)),
        "application/octet-stream",
        b"no",
    );
    assert_eq!(r.status, 401);
    assert_eq!(std::fs::read(&up).unwrap(), b"up");
    // Connect calls and compose need the header token; signatures do not count.
    let r = agent.unary(&format!("{FS}/Stat"), &[], &json!({"path": p}));
    assert_eq!(r.status, 401);
    let r = agent.unary(
        &format!("{FS}/Stat"),
        &[("x-access-token", token)],
        &json!({"path": p}),
    );
    assert_eq!(r.status, 200);
    let r = agent.get("/metrics", &[]);
    assert_eq!(r.status, 401);
}

/// Peak and current resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Byte `i` of the large test file: varied, cheap, and position-dependent so
/// misplaced chunks are caught.
/// Starts a POST /files of `content_type` with a chunked body, the body left
/// to the caller; its socket waits up to `timeout` for the answer.
fn chunked_upload(agent: &Agent, content_type: &str, timeout: Duration) -> std::net::TcpStream {
    let mut sock = agent.connect();
    sock.set_read_timeout(Some(timeout)).unwrap();
    write!(
        sock,
        "POST /files HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\
         Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .unwrap();
    sock
}

fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

fn fill(buf: &mut [u8], offset: u64) {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = pattern(offset + k as u64);
    }
}

#[test]
fn large_transfers_are_streamed() {
    const SIZE: u64 = 300 * 1024 * 1024;
    const LIMIT_KIB: u64 = 64 * 1024;
    let (agent, t) = root_agent(None);
    let big = t.path().join("big.bin");

    // Upload as multipart with a chunked body generated on the fly.
    let boundary = "big-boundary-42";
    let head = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n",
        s(&big)
    );
    let tail = format!("\r\n--{boundary}--\r\n");
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let mut sock = chunked_upload(&agent, &content_type, Duration::from_secs(120));
    // A write error means the agent answered early: show its answer.
    let chunk = |sock: &mut std::net::TcpStream, data: &[u8]| -> std::io::Result<()> {
        write!(sock, "{:x}\r\n", data.len())?;
        sock.write_all(data)?;
        sock.write_all(b"\r\n")
    };
    let started = Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    let mut sent = 0u64;
    let mut peak_during = 0;
    let mut upload = chunk(&mut sock, head.as_bytes());
    while sent < SIZE && upload.is_ok() {
        fill(&mut buf, sent);
        upload = chunk(&mut sock, &buf);
        sent += buf.len() as u64;
        if sent.is_multiple_of(32 << 20) {
            peak_during = peak_during.max(rss_kib(agent.pid()).1);
        }
    }
    let upload = upload
        .and_then(|()| chunk(&mut sock, tail.as_bytes()))
        .and_then(|()| sock.write_all(b"0\r\n\r\n"));
    let r = common::read_response(&mut sock);
    assert!(
        upload.is_ok(),
        "upload cut at {sent} bytes: {upload:?}; agent answered {r:?}"
    );
    assert_eq!(r.status, 200, "{r:?}");
    let up = started.elapsed();
    assert_eq!(std::fs::metadata(&big).unwrap().len(), SIZE);
    let (hwm_up, _) = rss_kib(agent.pid());

    // Download, read and checked as it streams.
    let started = Instant::now();
    let mut sock = agent.connect();
    sock.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write_request(&mut sock, "GET", &files(&big), &[], b"");
    let mut r = BufReader::with_capacity(1 << 20, sock);
    let (status, headers) = read_head(&mut r);
    assert_eq!(status, 200);
    assert!(headers.contains(&("content-length".into(), SIZE.to_string())));
    let mut got = 0u64;
    let mut expect = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        fill(&mut expect[..n], got);
        assert!(buf[..n] == expect[..n], "content differs near byte {got}");
        got += n as u64;
        if got % (32 << 20) < n as u64 {
            peak_during = peak_during.max(rss_kib(agent.pid()).1);
        }
    }
    assert_eq!(got, SIZE);
    let down = started.elapsed();
    let (hwm, rss) = rss_kib(agent.pid());
    eprintln!(
        "300 MiB: upload {up:?}, download {down:?}; agent VmHWM after upload {hwm_up} KiB, \
         after download {hwm} KiB, VmRSS now {rss} KiB, max sampled {peak_during} KiB"
    );
    assert!(hwm < LIMIT_KIB, "agent peak RSS {hwm} KiB");
}

/// Method, path, headers, body.
type Request<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a [u8]);

/// envd refuses a second part for a path one upload already wrote (400, its
/// own text); the parts before it stay written, the later ones are not.
#[test]
fn one_upload_writes_a_path_once() {
    let (agent, t) = root_agent(None);
    let (a, b, c) = (t.path().join("a"), t.path().join("b"), t.path().join("c"));
    let (ct, body) = multipart(&[
        (&s(&a), b"first"),
        (&s(&b), b"other"),
        (&s(&a), b"second"),
        (&s(&c), b"later"),
    ]);
    let r = agent.post("/files", &ct, &body);
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(
        r.json()["message"],
        format!(
            "you cannot upload multiple files to the same path '{}' in one upload request, \
             only the first specified file was uploaded",
            s(&a)
        )
    );
    assert_eq!(std::fs::read(&a).unwrap(), b"first");
    assert_eq!(std::fs::read(&b).unwrap(), b"other");
    assert!(!c.exists());
}

/// An empty `X-Access-Token` is no token, as on envd: a signed file URL
/// still works with it; elsewhere it is refused as a missing token.
#[test]
fn an_empty_access_token_header_is_none() {
    let (agent, _dir, f) = signed_setup();
    let token = TOKEN;
    let sig = sign(&s(&f), "read", "", token, None);
    let empty = [("x-access-token", "")];
    let r = agent.request(
        "GET",
        &format!("/files?path={}&signature={}", q(&f), enc(&sig)),
        &empty,
        b"",
    );
    assert_eq!(
        (r.status, r.body.as_slice()),
        (200, &b"signed"[..]),
        "{r:?}"
    );
    let r = agent.request("GET", &files(&f), &empty, b"");
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["message"], "missing signature query parameter");
    let r = agent.unary(
        &format!("{FS}/Stat"),
        &[ROOT, empty[0]],
        &json!({"path": s(&f)}),
    );
    assert_eq!(r.status, 401, "{r:?}");
}

/// Like envd, an upload makes an existing file the writing user's, also one
/// the user may write but could not chown itself (root's, mode 0666); a file
/// the user may not write is refused and keeps its owner.
#[test]
fn an_upload_gives_an_existing_file_to_the_writing_user() {
    if !is_root() {
        eprintln!("SKIPPED: needs root to own files for another user");
        return;
    }
    let (agent, t) = root_agent(None);
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    // SAFETY: a NUL-terminated name; the entry is read at once.
    let nobody = unsafe { libc::getpwnam(c"nobody".as_ptr()).as_ref() }.expect("a nobody user");
    let (uid, gid) = (nobody.pw_uid, nobody.pw_gid);

    let shared = t.path().join("shared.txt");
    std::fs::write(&shared, b"root's old content").unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o666)).unwrap();
    let octet = [NOBODY, OCTET];
    let r = agent.request("POST", &files(&shared), &octet, b"new");
    assert_eq!(r.status, 200, "{r:?}");
    let md = std::fs::metadata(&shared).unwrap();
    assert_eq!((md.uid(), md.gid()), (uid, gid));
    assert_eq!(std::fs::read(&shared).unwrap(), b"new");

    let private = t.path().join("private.txt");
    std::fs::write(&private, b"root only").unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = agent.request("POST", &files(&private), &octet, b"x");
    assert_eq!(r.status, 403, "{r:?}");
    assert_eq!(std::fs::metadata(&private).unwrap().uid(), 0);
    assert_eq!(std::fs::read(&private).unwrap(), b"root only");
}

/// The multipart parser stops at the closing boundary; the agent must still read
/// the body to its end (here the chunk's CRLF and the terminating chunk, sent
/// late) before it answers and closes, or the close resets the connection and
/// the client's last writes fail with EPIPE (seen 6 of 11 runs of the test
/// above once uploads chowned their file).
#[test]
fn an_upload_is_read_to_its_end_before_the_answer() {
    let (agent, t) = root_agent(None);
    let target = t.path().join("late-end.txt");
    let (content_type, body) = multipart(&[(&s(&target), b"hello")]);
    let mut sock = chunked_upload(&agent, &content_type, Duration::from_secs(30));
    write!(sock, "{:x}\r\n", body.len()).unwrap();
    sock.write_all(&body).unwrap();
    // The whole multipart body is there; its chunk's CRLF and the end are not.
    std::thread::sleep(Duration::from_millis(500));
    let late = sock.write_all(b"\r\n").and_then(|()| {
        // Long enough for a reset to come back before the last write.
        std::thread::sleep(Duration::from_millis(300));
        sock.write_all(b"0\r\n\r\n")
    });
    let r = common::read_response(&mut sock);
    assert!(
        late.is_ok(),
        "the end of the body: {late:?}; agent answered {r:?}"
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(std::fs::read(&target).unwrap(), b"hello");
}

#[test]
fn bad_input_never_kills_the_agent() {
    let mut agent = Agent::start();
    init_root(&agent, None);
    // A FIFO nobody writes to or reads from must not block the agent.
    let t = tempfile::tempdir().unwrap();
    let fifo = t.path().join("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let fifo_get = format!("/files?path={}", q(&fifo));
    let garbage: &[Request] = &[
        ("POST", "/files?path=/dev/null/x", &[OCTET], b"x"),
        ("POST", "/files?path=a&path=b", &[OCTET], b"x"),
        (
            "POST",
            "/files",
            &[("content-type", "multipart/form-data; boundary=\"\"")],
            b"--\r\n",
        ),
        ("POST", "/files/compose", &[], b"{"),
        (
            "POST",
            "/files/compose",
            &[],
            b"{\"source_paths\":[],\"destination\":\"\"}",
        ),
        (
            "POST",
            "/filesystem.Filesystem/ListDir",
            &[JSON],
            b"\"a string\"",
        ),
        (
            "POST",
            "/filesystem.Filesystem/ListDir",
            &[JSON],
            b"{\"depth\":-1}",
        ),
        (
            "POST",
            "/filesystem.Filesystem/GetWatcherEvents",
            &[JSON],
            b"{\"watcherId\":7}",
        ),
        ("GET", "/files?path=/dev/zero", &[], b""),
        ("GET", &fifo_get, &[], b""),
        ("POST", &fifo_get, &[OCTET], b"x"),
    ];
    for (method, path, headers, body) in garbage {
        let r = agent.request(method, path, headers, body);
        assert!(
            (400..500).contains(&r.status),
            "{method} {path}: {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    assert!(agent.alive());
    assert_eq!(agent.get("/health", &[]).status, 204);
}
