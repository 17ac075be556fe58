//! The process.Process service of the real agent binary (host mode, TCP),
//! driven with Connect framing over raw HTTP/1.1.

#![cfg(test)]

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{Agent, LiveStream, Resp, b64, unb64};
use serde_json::{Value, json};

const START: &str = "/process.Process/Start";
const CONNECT: &str = "/process.Process/Connect";

/// What a finished Start/Connect stream carried.
#[derive(Debug, Default)]
struct Run {
    pid: u64,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    pty: Vec<u8>,
    keepalives: usize,
    end: Value,
    /// The end-stream object.
    trailer: Value,
}

impl Run {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Checks the event order (start first, one end last) and collects.
fn collect(messages: &[Value]) -> Run {
    let mut run = Run::default();
    let (trailer, events) = messages.split_last().unwrap();
    run.trailer = trailer.clone();
    assert!(
        events
            .first()
            .is_some_and(|e| e["event"]["start"]["pid"].is_u64()),
        "first event must be start: {messages:?}"
    );
    run.pid = events[0]["event"]["start"]["pid"].as_u64().unwrap();
    for (i, e) in events.iter().enumerate().skip(1) {
        let ev = &e["event"];
        if let Some(d) = ev.get("data") {
            for (k, dst) in [
                ("stdout", &mut run.stdout),
                ("stderr", &mut run.stderr),
                ("pty", &mut run.pty),
            ] {
                if let Some(s) = d.get(k) {
                    dst.extend(unb64(s.as_str().unwrap()));
                }
            }
        } else if ev.get("keepalive").is_some() {
            run.keepalives += 1;
        } else if let Some(end) = ev.get("end") {
            assert_eq!(i, events.len() - 1, "end must be the last event");
            run.end = end.clone();
        } else {
            panic!("unexpected event {e}");
        }
    }
    run
}

fn start(agent: &Agent, headers: &[(&str, &str)], req: Value) -> Run {
    let r = agent.stream(START, headers, &req);
    collect(&r.messages())
}

fn sh(script: &str) -> Value {
    json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": false})
}

/// The error of a stream that failed before any event.
fn stream_error(r: &Resp) -> Value {
    let m = r.messages();
    assert_eq!(m.len(), 1, "{m:?}");
    m[0]["error"].clone()
}

#[test]
fn start_reports_output_and_exit_codes() {
    let agent = Agent::start();
    let run = start(&agent, &[], sh("echo hello; echo warn >&2"));
    assert_eq!(run.stdout(), "hello\n");
    assert_eq!(run.stderr, b"warn\n");
    assert_eq!(
        run.end,
        json!({"exitCode": 0, "exited": true, "status": "exit status 0"})
    );
    assert_eq!(run.trailer, json!({}));

    let run = start(&agent, &[], sh("exit 1"));
    assert_eq!(
        run.end,
        json!({"exitCode": 1, "exited": true, "status": "exit status 1", "error": "exit status 1"})
    );

    let run = start(&agent, &[], sh("kill -9 $$"));
    assert_eq!(run.end["exitCode"], -1);
    assert_eq!(run.end["exited"], false);
    assert_eq!(run.end["status"], "signal: killed");

    // A missing binary fails the start.
    let r = agent.stream(START, &[], &json!({"process": {"cmd": "/no/such/binary"}}));
    assert_eq!(stream_error(&r)["code"], "invalid_argument");
}

#[test]
fn long_running_output_streams_as_it_is_produced() {
    let agent = Agent::start();
    let s = agent.open_stream(
        START,
        &[],
        &sh("for i in 1 2 3; do echo tick $i; sleep 1; done"),
    );
    let t0 = Instant::now();
    let mut live = LiveStream::open(s);
    assert_eq!(live.status, 200);
    let (_, first) = live.next_json().unwrap();
    assert!(first["event"]["start"].is_object());
    let mut ticks = Vec::new();
    loop {
        let (end_stream, m) = live.next_json().unwrap();
        if end_stream {
            assert_eq!(m, json!({}));
            break;
        }
        if let Some(d) = m["event"]["data"]["stdout"].as_str() {
            ticks.push((t0.elapsed(), String::from_utf8(unb64(d)).unwrap()));
        }
    }
    assert_eq!(ticks.len(), 3, "{ticks:?}");
    assert_eq!(ticks[0].1, "tick 1\n");
    // The first line arrived well before the command finished.
    assert!(ticks[0].0 < Duration::from_millis(1500), "{ticks:?}");
    assert!(ticks[2].0 >= Duration::from_secs(2), "{ticks:?}");
}

/// A stream lasts as long as its command: past the agent's 30 s header-read
/// timeout (it bounds only the wait for a request), across a silent stretch
/// that keepalives fill, with bulk output on both sides of it.
#[test]
fn a_stream_outlives_the_agents_connection_timeouts() {
    let agent = Agent::start();
    let started = Instant::now();
    let run = start(
        &agent,
        &[
            ("keepalive-ping-interval", "5"),
            ("connect-timeout-ms", "120000"),
        ],
        sh("echo before; seq 1 20000; sleep 36; echo after; seq 1 20000"),
    );
    assert!(started.elapsed() >= Duration::from_secs(36));
    assert_eq!(run.end["status"], "exit status 0", "{run:?}");
    assert_eq!(run.trailer, json!({}));
    assert!(run.keepalives >= 5, "{run:?}");
    let seq: String = (1..=20000).map(|i| format!("{i}\n")).collect();
    assert_eq!(run.stdout(), format!("before\n{seq}after\n{seq}"));
}

#[test]
fn env_and_cwd() {
    let agent = Agent::start();
    let init =
        json!({"envVars": {"SANDBOX_VAR": "s", "OVERRIDE": "sandbox"}, "defaultWorkdir": "/tmp"});
    assert_eq!(
        agent
            .request("POST", "/init", &[], init.to_string().as_bytes())
            .status,
        204
    );
    let run = start(
        &agent,
        &[("authorization", "Basic cm9vdDo=")],
        json!({"process": {
            "cmd": "/bin/sh",
            "args": ["-c", "echo $SANDBOX_VAR $OVERRIDE $REQ $HOME $USER $LOGNAME; pwd; test -n \"$PATH\" && echo path"],
            "envs": {"OVERRIDE": "request", "REQ": "r"}
        }}),
    );
    assert_eq!(run.stdout(), "s request r /root root root\n/tmp\npath\n");

    let run = start(
        &agent,
        &[],
        json!({"process": {"cmd": "pwd", "cwd": "/usr"}, "stdin": false}),
    );
    assert_eq!(run.stdout(), "/usr\n");

    let r = agent.stream(
        START,
        &[],
        &json!({"process": {"cmd": "pwd", "cwd": "/no/such/dir"}}),
    );
    let err = stream_error(&r);
    assert_eq!(err["code"], "invalid_argument");
    assert!(
        err["message"].as_str().unwrap().contains("/no/such/dir"),
        "{err}"
    );
}

#[test]
fn runs_as_the_requested_user() {
    let agent = Agent::start();
    let Ok(out) = std::process::Command::new("id")
        .args(["-u", "nobody"])
        .output()
    else {
        return;
    };
    let nobody_uid = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if nobody_uid.is_empty() || unsafe_euid() != 0 {
        eprintln!("SKIPPED: needs root and a `nobody` user");
        return;
    }
    let auth = format!("Basic {}", b64(b"nobody:"));
    let run = start(
        &agent,
        &[("authorization", &auth)],
        sh("id -u; id -un; echo $HOME"),
    );
    let lines: Vec<&str> = run
        .stdout
        .split(|&b| b == b'\n')
        .map(|l| std::str::from_utf8(l).unwrap())
        .collect();
    assert_eq!(lines[0], nobody_uid);
    assert_eq!(lines[1], "nobody");
    // An unknown user is refused.
    let auth = format!("Basic {}", b64(b"no-such-user-xyz:"));
    let r = agent.stream(START, &[("authorization", &auth)], &sh("true"));
    assert_eq!(r.status, 401, "{r:?}");
    assert_eq!(r.json()["code"], "unauthenticated");
}

fn unsafe_euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn unary_ok(agent: &Agent, method: &str, body: Value) -> Value {
    let r = agent.unary(&format!("/process.Process/{method}"), &[], &body);
    assert_eq!(
        r.status,
        200,
        "{method}: {r:?} {}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.header("content-type"), Some("application/json"));
    r.json()
}

fn unary_err(agent: &Agent, method: &str, body: Value) -> (u16, Value) {
    let r = agent.unary(&format!("/process.Process/{method}"), &[], &body);
    (r.status, r.json())
}

/// A SendSignal request: `signal` (a name or a number) to the `process` selected.
fn signal(process: Value, signal: Value) -> Value {
    json!({"process": process, "signal": signal})
}

/// Starts a process in the background; returns its pid and live stream.
fn start_bg(agent: &Agent, headers: &[(&str, &str)], req: Value) -> (u64, LiveStream) {
    let mut live = LiveStream::open(agent.open_stream(START, headers, &req));
    assert_eq!(live.status, 200);
    let (_, m) = live.next_json().unwrap();
    (m["event"]["start"]["pid"].as_u64().unwrap(), live)
}

/// Reads a live stream to its end.
fn finish(live: &mut LiveStream) -> Vec<Value> {
    let mut out = vec![json!({"event": {"start": {"pid": 0}}})];
    while let Some((_, m)) = live.next_json() {
        out.push(m);
    }
    out
}

#[test]
fn stdin_via_send_input_stream_input_and_close_stdin() {
    let agent = Agent::start();
    let (pid, mut live) = start_bg(
        &agent,
        &[],
        json!({"process": {"cmd": "cat"}, "stdin": true}),
    );
    unary_ok(
        &agent,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"one ")}}),
    );

    // StreamInput: start, then data envelopes, sent in separate writes.
    let mut s = agent.connect();
    let mut body = Vec::new();
    for m in [
        json!({"start": {"process": {"pid": pid}}}),
        json!({"data": {"input": {"stdin": b64(b"two ")}}}),
        json!({"keepalive": {}}),
        json!({"data": {"input": {"stdin": b64(b"three")}}}),
    ] {
        body.extend_from_slice(&envd_proto::envelope::encode(0, m.to_string().as_bytes()));
    }
    write!(
        s,
        "POST /process.Process/StreamInput HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\
         content-type: application/connect+json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    .unwrap();
    for piece in body.chunks(7) {
        write!(s, "{:x}\r\n", piece.len()).unwrap();
        s.write_all(piece).unwrap();
        s.write_all(b"\r\n").unwrap();
        s.flush().unwrap();
    }
    s.write_all(b"0\r\n\r\n").unwrap();
    let r = common::read_response(&mut s);
    let envs = r.envelopes();
    assert_eq!(envs.len(), 2, "{r:?}");
    assert_eq!(&envs[0].payload[..], b"{}");
    assert!(envs[1].is_end_stream());
    assert_eq!(&envs[1].payload[..], b"{}");

    unary_ok(&agent, "CloseStdin", json!({"process": {"pid": pid}}));
    let run = collect(&finish(&mut live));
    assert_eq!(run.stdout(), "one two three");
    assert_eq!(run.end["exitCode"], 0);

    // Without a stdin pipe, stdin is /dev/null and input is refused.
    let run = start(
        &agent,
        &[],
        json!({"process": {"cmd": "cat"}, "stdin": false}),
    );
    assert_eq!(run.stdout, b"");
    assert_eq!(run.end["exitCode"], 0);
    let (pid, mut live) = start_bg(
        &agent,
        &[],
        json!({"process": {"cmd": "sleep", "args": ["5"]}, "stdin": false}),
    );
    let (status, e) = unary_err(
        &agent,
        "SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": "YQ=="}}),
    );
    assert_eq!(
        (status, e["code"].as_str()),
        (400, Some("failed_precondition"))
    );
    unary_ok(
        &agent,
        "SendSignal",
        signal(json!({"pid": pid}), json!("SIGNAL_SIGKILL")),
    );
    finish(&mut live);
}

#[test]
fn signals_and_unknown_pids() {
    let agent = Agent::start();
    // By name and by number.
    for (sig, status) in [
        (json!("SIGNAL_SIGTERM"), "signal: terminated"),
        (json!(9), "signal: killed"),
    ] {
        let sleep = json!({"process": {"cmd": "sleep", "args": ["30"]}});
        let (pid, mut live) = start_bg(&agent, &[], sleep);
        unary_ok(&agent, "SendSignal", signal(json!({"pid": pid}), sig));
        let run = collect(&finish(&mut live));
        assert_eq!(run.end["status"], status);
        assert_eq!(run.end["exitCode"], -1);
    }

    let kill = json!("SIGNAL_SIGKILL");
    let (status, e) = unary_err(&agent, "SendSignal", signal(json!({"pid": 999_999}), kill));
    assert_eq!(status, 404);
    assert_eq!(
        e,
        json!({"code": "not_found", "message": "process with pid 999999 not found", "details": []})
    );
    let (status, e) = unary_err(&agent, "CloseStdin", json!({"process": {"tag": "nope"}}));
    assert_eq!((status, e["code"].as_str()), (404, Some("not_found")));
    let r = agent.stream(CONNECT, &[], &json!({"process": {"pid": 999_999}}));
    assert_eq!(stream_error(&r)["code"], "not_found");
}

#[test]
fn list_connect_by_pid_and_tag_and_background_processes() {
    let agent = Agent::start();
    let req = json!({
        "process": {"cmd": "/bin/sh", "args": ["-c", "sleep 1; echo late; sleep 30"], "cwd": "/tmp"},
        "tag": "server",
        "stdin": false
    });
    let (pid, live) = start_bg(&agent, &[], req);
    // Dropping the Start stream must not end the process.
    drop(live);
    std::thread::sleep(Duration::from_millis(200));
    let list = unary_ok(&agent, "List", json!({}));
    let procs = list["processes"].as_array().unwrap();
    let p = procs.iter().find(|p| p["pid"] == pid).expect("listed");
    assert_eq!(p["tag"], "server");
    assert_eq!(p["config"]["cmd"], "/bin/sh");
    assert_eq!(p["config"]["cwd"], "/tmp");

    // Connect by tag sees the output produced after attaching.
    let mut by_tag =
        LiveStream::open(agent.open_stream(CONNECT, &[], &json!({"process": {"tag": "server"}})));
    let (_, m) = by_tag.next_json().unwrap();
    assert_eq!(m["event"]["start"]["pid"], pid);
    let mut by_pid =
        LiveStream::open(agent.open_stream(CONNECT, &[], &json!({"process": {"pid": pid}})));
    let (_, m) = by_pid.next_json().unwrap();
    assert_eq!(m["event"]["start"]["pid"], pid);
    for live in [&mut by_tag, &mut by_pid] {
        let (_, m) = live.next_json().unwrap();
        assert_eq!(
            unb64(m["event"]["data"]["stdout"].as_str().unwrap()),
            b"late\n"
        );
    }
    unary_ok(
        &agent,
        "SendSignal",
        signal(json!({"tag": "server"}), json!("SIGNAL_SIGKILL")),
    );
    for live in [&mut by_tag, &mut by_pid] {
        let msgs = finish(live);
        assert_eq!(collect(&msgs).end["status"], "signal: killed");
    }
    // Gone from the list, but a late Connect still gets start then end.
    let list = unary_ok(&agent, "List", json!({}));
    assert!(
        list["processes"]
            .as_array()
            .is_none_or(|v| v.iter().all(|p| p["pid"] != pid))
    );
    let run = start_connect(&agent, json!({"process": {"pid": pid}}));
    assert_eq!(run.pid, pid);
    assert_eq!(run.end["status"], "signal: killed");
    assert!(run.stdout.is_empty());
}

fn start_connect(agent: &Agent, req: Value) -> Run {
    collect(&agent.stream(CONNECT, &[], &req).messages())
}

#[test]
fn lifetime_deadline_kills_the_process_even_without_a_client() {
    let agent = Agent::start();
    let t0 = Instant::now();
    let run = start(&agent, &[("connect-timeout-ms", "1000")], sh("sleep 30"));
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(run.end["status"], "signal: killed");
    assert_eq!(run.trailer["error"]["code"], "deadline_exceeded");

    // Client gone right after start: the process still dies at its deadline.
    let (pid, live) = start_bg(&agent, &[("connect-timeout-ms", "1000")], sh("sleep 30"));
    drop(live);
    std::thread::sleep(Duration::from_millis(2500));
    let run = start_connect(&agent, json!({"process": {"pid": pid}}));
    assert_eq!(run.end["status"], "signal: killed");

    // Killed at its deadline, a process leaves List at once, even while an
    // orphaned child of it still holds its output open.
    let (pid, live) = start_bg(
        &agent,
        &[("connect-timeout-ms", "1000")],
        sh("sleep 30; echo late"),
    );
    drop(live);
    std::thread::sleep(Duration::from_millis(1400));
    let listed = unary_ok(&agent, "List", json!({}));
    let pids: Vec<u64> = listed["processes"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["pid"].as_u64()).collect())
        .unwrap_or_default();
    assert!(!pids.contains(&pid), "{listed}");
}

#[test]
fn keepalives_at_the_requested_interval() {
    let agent = Agent::start();
    let run = start(&agent, &[("keepalive-ping-interval", "1")], sh("sleep 3.5"));
    assert!((2..=4).contains(&run.keepalives), "{run:?}");
    assert_eq!(run.end["exitCode"], 0);
}

#[test]
fn pty_output_resize_and_input() {
    let agent = Agent::start();
    let req = json!({
        "process": {"cmd": "/bin/bash", "args": ["--norc", "--noprofile", "-i"], "envs": {"TERM": "dumb", "PS1": "$ "}},
        "pty": {"size": {"cols": 100, "rows": 30}}
    });
    let (pid, mut live) = start_bg(&agent, &[], req);
    let send = |data: &str| {
        unary_ok(
            &agent,
            "SendInput",
            json!({"process": {"pid": pid}, "input": {"pty": b64(data.as_bytes())}}),
        );
    };
    let mut seen = String::new();
    let mut wait_for = |live: &mut LiveStream, needle: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !seen.contains(needle) {
            assert!(Instant::now() < deadline, "no {needle:?} in {seen:?}");
            let (end, m) = live.next_json().expect("stream open");
            assert!(!end, "stream ended early: {seen:?}");
            if let Some(d) = m["event"]["data"]["pty"].as_str() {
                seen.push_str(&String::from_utf8_lossy(&unb64(d)));
            }
            assert!(m["event"]["data"]["stdout"].is_null());
        }
    };
    send("tty >/dev/null && echo IS-A-TTY; stty size\n");
    wait_for(&mut live, "IS-A-TTY");
    wait_for(&mut live, "30 100");
    unary_ok(
        &agent,
        "Update",
        json!({"process": {"pid": pid}, "pty": {"size": {"cols": 120, "rows": 40}}}),
    );
    send("stty size\n");
    wait_for(&mut live, "40 120");
    // CloseStdin is for pipes; a pty process gets ^D instead.
    let (status, _) = unary_err(&agent, "CloseStdin", json!({"process": {"pid": pid}}));
    assert_eq!(status, 400);
    send("exit 3\n");
    let run = collect(&finish(&mut live));
    assert_eq!(run.end["exitCode"], 3);
}

#[test]
fn access_token_is_required_once_set() {
    let agent = Agent::start();
    let init = json!({"accessToken": "tok"}).to_string();
    assert_eq!(
        agent.request("POST", "/init", &[], init.as_bytes()).status,
        204
    );
    let r = agent.stream(START, &[], &sh("true"));
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["code"], 401);
    let run = start(&agent, &[("x-access-token", "tok")], sh("echo ok"));
    assert_eq!(run.stdout(), "ok\n");
    assert_eq!(agent.get("/health", &[]).status, 204);
}

#[test]
fn bad_input_never_hurts_the_agent() {
    let mut agent = Agent::start();
    // Wrong content types.
    let r = agent.post(START, "application/json", b"{}");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["code"], "invalid_argument");
    let r = agent.post("/process.Process/List", "text/plain", b"{}");
    assert_eq!(r.status, 400);
    // Unknown method.
    let r = agent.unary("/process.Process/Frobnicate", &[], &json!({}));
    assert_eq!(r.status, 501);
    assert_eq!(r.json()["code"], "unimplemented");
    // Invalid JSON, unary and streamed.
    let r = agent.post("/process.Process/List", "application/json", b"{nope");
    r.assert_error(400, "invalid_argument");
    let stream_headers = [("content-type", "application/connect+json")];
    let body = envd_proto::envelope::encode(0, b"{nope");
    let r = agent.request("POST", START, &stream_headers, &body);
    assert_eq!(stream_error(&r)["code"], "invalid_argument");
    // Truncated envelope, empty body, compressed flag.
    let r = agent.request("POST", START, &stream_headers, &[0, 0, 0, 0, 50, b'{']);
    assert_eq!(stream_error(&r)["code"], "invalid_argument");
    let r = agent.request("POST", START, &stream_headers, b"");
    assert_eq!(stream_error(&r)["code"], "invalid_argument");
    let r = agent.request(
        "POST",
        START,
        &stream_headers,
        &envd_proto::envelope::encode(1, b"{}"),
    );
    assert_eq!(stream_error(&r)["code"], "unimplemented");
    // A huge declared length is refused from the header alone (the body is
    // not that long, and the answer comes without waiting for it).
    let mut s = agent.connect();
    write!(
        s,
        "POST {START} HTTP/1.1\r\nHost: a\r\nConnection: close\r\ncontent-type: application/connect+json\r\n\
         content-length: 4294967300\r\n\r\n"
    )
    .unwrap();
    s.write_all(&[0, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let r = common::read_response(&mut s);
    assert_eq!(stream_error(&r)["code"], "resource_exhausted");
    // Wrong shapes.
    let (status, e) = unary_err(
        &agent,
        "SendSignal",
        signal(json!({"pid": "x"}), json!("SIGNAL_SIGKILL")),
    );
    assert_eq!(
        (status, e["code"].as_str()),
        (400, Some("invalid_argument"))
    );
    let (status, _) = unary_err(
        &agent,
        "SendSignal",
        signal(json!({"pid": 1}), json!("SIGNAL_SIGHUP")),
    );
    assert_eq!(status, 400);
    let r = agent.stream(START, &[], &json!({"process": {"cmd": ""}}));
    assert_eq!(stream_error(&r)["code"], "invalid_argument");
    // Still serving.
    assert!(agent.alive());
    assert_eq!(agent.get("/health", &[]).status, 204);
    let run = start(&agent, &[], sh("echo still"));
    assert_eq!(run.stdout(), "still\n");
}

#[test]
fn large_output_arrives_whole_and_children_get_default_sigpipe() {
    let agent = Agent::start();
    // 8 MiB through a reading client: backpressure, nothing dropped.
    let run = start(&agent, &[], sh("head -c 8388608 /dev/zero"));
    assert_eq!(run.stdout.len(), 8 << 20);
    assert_eq!(run.end["exitCode"], 0);
    // The agent ignores SIGPIPE (Rust does); its children must not.
    let run = start(&agent, &[], sh("yes | head -n 1"));
    assert_eq!(run.stdout.split(|&b| b == b'\n').next(), Some(&b"y"[..]));
    assert!(
        run.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}
