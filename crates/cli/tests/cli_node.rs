//! The `sandfork` client commands against a real node, on real microVMs:
//! output, exit codes and JSON shapes. One node serves every test:
//! `scripts/cli-test.sh` starts it (in the KVM lab where /dev/kvm cannot boot
//! Linux) and runs these with its URL and key in SANDFORK_API_URL and
//! SANDFORK_API_KEY.

#![cfg(test)]

mod common;

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cli, binary};
use serde_json::Value;

fn node() -> Cli {
    let url = std::env::var("SANDFORK_API_URL")
        .expect("SANDFORK_API_URL is not set: run these through scripts/cli-test.sh");
    let key = std::env::var("SANDFORK_API_KEY")
        .expect("SANDFORK_API_KEY is not set: run these through scripts/cli-test.sh");
    Cli::of_node(&url, &key)
}

fn create(cli: &Cli, args: &[&str]) -> String {
    let mut all = vec!["create", "--timeout", "900"];
    all.extend_from_slice(args);
    let r = cli.run(&all);
    let id = r.ok().trim().to_owned();
    assert_eq!(id.len(), 20, "{id:?}");
    assert!(
        id.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    );
    id
}

/// Removes the sandboxes when the test ends, passed or not.
struct Cleanup<'a>(&'a Cli, Vec<String>);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        for id in &self.1 {
            let _ = self.0.run(&["rm", id]);
        }
    }
}

/// A sandbox for one test (created with `args`), removed when the guard drops.
fn sandbox<'a>(cli: &'a Cli, args: &[&str]) -> (String, Cleanup<'a>) {
    let id = create(cli, args);
    (id.clone(), Cleanup(cli, vec![id]))
}

/// `sh -c script` in the sandbox `id`: its output, once it succeeded.
fn sh(cli: &Cli, id: &str, script: &str) -> String {
    cli.run(&["exec", id, "--", "sh", "-c", script])
        .ok()
        .to_owned()
}

/// The one line of `args`' error, once it failed with exit code 1.
fn error_line(cli: &Cli, args: &[&str]) -> String {
    cli.run(args).one_line_error(1).to_owned()
}

fn ls_ids(cli: &Cli, args: &[&str]) -> Vec<String> {
    let mut all = vec!["ls"];
    all.extend_from_slice(args);
    let r = cli.run(&all);
    r.ok();
    r.json()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn status_shows_capacity_and_counts() {
    let cli = node();
    // Piped: JSON.
    let s = cli.run(&["status"]).json();
    for key in ["vcpus", "memoryMB"] {
        for part in ["total", "used", "free"] {
            assert!(s[key][part].is_u64(), "{key}.{part}: {s}");
        }
    }
    for part in ["running", "paused", "starting", "max"] {
        assert!(s["sandboxes"][part].is_u64(), "{part}: {s}");
    }
    assert!(s["diskMB"]["free"].is_u64());
    assert_eq!(
        s["url"],
        std::env::var("SANDFORK_API_URL").unwrap().as_str()
    );
    assert!(s["version"].is_string() && s["envdVersion"].is_string());
    // The key must be right.
    let wrong = Cli::new()
        .with(
            "SANDFORK_API_URL",
            &std::env::var("SANDFORK_API_URL").unwrap(),
        )
        .with("SANDFORK_API_KEY", "e2b_wrong");
    let line = wrong.run(&["status"]).one_line_error(1).to_owned();
    assert!(
        line.contains("refused the API key; check `sandfork auth status`"),
        "{line}"
    );
    // auth status agrees.
    let a = cli.run(&["auth", "status", "--json"]);
    assert_eq!(a.json()["ok"], true);
    a.ok();
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn create_exec_ls_rm() {
    let cli = node();
    let id = create(
        &cli,
        &[
            "--metadata",
            "suite=cli",
            "--metadata",
            "case=exec",
            "-e",
            "GREETING=hi",
        ],
    );
    let mut cleanup = Cleanup(&cli, vec![id.clone()]);

    // Output streams and the exit code is the command's.
    let r = cli.run(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
    ]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert_eq!(r.stdout, "out\n");
    assert_eq!(r.stderr, "err\n");
    let r = cli.run(&[
        "exec",
        &id,
        "--cwd",
        "/tmp",
        "-e",
        "A=b",
        "--",
        "sh",
        "-c",
        "pwd; echo $A $GREETING",
    ]);
    assert_eq!(r.ok(), "/tmp\nb hi\n");
    let r = cli.run(&["exec", &id, "--user", "root", "--", "id", "-u"]);
    assert_eq!(r.ok(), "0\n");
    let r = cli.run(&["exec", &id, "--", "/no/such/program"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("sandfork: error:"), "{}", r.stderr);
    // -i: standard input goes to the command until EOF; without it the
    // command's stdin is empty.
    let input: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let r = cli.run_with_input(&["exec", "-i", &id, "--", "wc", "-c"], &input);
    assert_eq!(r.ok().trim(), "200000");
    let r = cli.run_with_input(&["exec", &id, "--", "wc", "-c"], b"not passed");
    assert_eq!(r.ok().trim(), "0");
    // Output arrives while the command runs, not at its end.
    let mut child = cli
        .command(&[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo first; sleep 5; echo second",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut out = child.stdout.take().unwrap();
    let mut buf = [0u8; 6];
    std::io::Read::read_exact(&mut out, &mut buf).unwrap();
    assert_eq!(&buf, b"first\n");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(child.wait().unwrap().success());

    // ls: JSON when piped, with the metadata filter.
    let r = cli.run(&["ls", "--metadata", "case=exec"]);
    let list = r.json();
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    let s = &list[0];
    assert_eq!(s["sandboxID"], id.as_str());
    assert_eq!(s["state"], "running");
    assert_eq!(s["templateID"], "base");
    assert_eq!(
        s["metadata"],
        serde_json::json!({"suite": "cli", "case": "exec"})
    );
    for key in ["startedAt", "endAt"] {
        assert!(s[key].is_string(), "{key}");
    }
    for key in ["cpuCount", "memoryMB"] {
        assert!(s[key].is_u64(), "{key}");
    }
    assert!(ls_ids(&cli, &["--metadata", "case=other"]).is_empty());
    assert!(!ls_ids(&cli, &["--state", "paused"]).contains(&id));
    assert!(ls_ids(&cli, &["--state", "running"]).contains(&id));
    // create --json: the Sandbox object.
    let r = cli.run(&["create", "--json", "--metadata", "suite=cli"]);
    let created = r.json();
    let second = created["sandboxID"].as_str().unwrap().to_owned();
    cleanup.1.push(second.clone());
    assert!(created["envdAccessToken"].is_string());
    assert_eq!(created["templateID"], "base");

    // timeout, then rm of two at once prints each id.
    cli.run(&["timeout", &id, "1200"]).ok();
    let r = cli.run(&["rm", &id, &second]);
    assert_eq!(r.ok(), format!("{id}\n{second}\n"));
    assert!(!ls_ids(&cli, &[]).contains(&id));

    // A gone sandbox: one line naming it, for every command.
    let want = format!("sandfork: error: no sandbox {id}; `sandfork ls` lists them");
    for args in [
        &["exec", &id, "--", "true"][..],
        &["rm", &id],
        &["pause", &id],
        &["resume", &id],
        &["fork", &id],
        &["snapshot", &id],
        &["timeout", &id, "60"],
        &["logs", &id],
        &["cp", &format!("{id}:/etc/hostname"), "-"],
    ] {
        assert_eq!(cli.run(args).one_line_error(1), want, "{args:?}");
    }
    let line = error_line(&cli, &["create", "no-such-template"]);
    assert_eq!(
        line,
        "sandfork: error: no template no-such-template; `sandfork template ls` lists them"
    );
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn pause_resume_fork_snapshot() {
    let cli = node();
    let (id, mut cleanup) = sandbox(&cli, &["--metadata", "suite=cli"]);
    sh(&cli, &id, "echo parent > ~/mark");

    assert_eq!(cli.run(&["pause", &id]).ok(), format!("{id}\n"));
    assert!(ls_ids(&cli, &["--state", "paused"]).contains(&id));
    let line = error_line(&cli, &["exec", &id, "--", "true"]);
    assert_eq!(
        line,
        format!("sandfork: error: sandbox {id} is paused; `sandfork resume {id}` first")
    );
    let line = error_line(&cli, &["pause", &id]);
    assert!(line.contains("already paused"), "{line}");
    assert_eq!(cli.run(&["resume", &id]).ok(), format!("{id}\n"));
    let line = error_line(&cli, &["resume", &id]);
    assert!(line.contains("already running"), "{line}");
    assert_eq!(sh(&cli, &id, "cat ~/mark"), "parent\n");

    // fork: one id per line, each child has the parent's file and its own.
    let r = cli.run(&["fork", &id, "-n", "2"]);
    let children: Vec<String> = r.ok().lines().map(str::to_owned).collect();
    cleanup.1.extend(children.clone());
    assert_eq!(children.len(), 2, "{}", r.stdout);
    for (i, c) in children.iter().enumerate() {
        assert_eq!(sh(&cli, c, "cat ~/mark"), "parent\n");
        sh(&cli, c, &format!("echo child{i} > ~/mark"));
    }
    assert_eq!(sh(&cli, &id, "cat ~/mark"), "parent\n");
    // --json: the node's answer, one {"sandbox": ...} per child.
    let r = cli.run(&["fork", &children[0], "-n", "1", "--json"]);
    let answer = r.json();
    let grandchild = answer[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap()
        .to_owned();
    cleanup.1.push(grandchild.clone());
    assert_eq!(sh(&cli, &grandchild, "cat ~/mark"), "child0\n");

    // snapshot --name, then sandboxes from it; the snapshot goes with template rm.
    let name = format!("cli-snap-{}", std::process::id());
    let r = cli.run(&["snapshot", &id, "--name", &name]);
    let snap = r.ok().trim().to_owned();
    assert!(!snap.is_empty());
    let from = create(&cli, &[&name]);
    cleanup.1.push(from.clone());
    assert_eq!(sh(&cli, &from, "cat ~/mark"), "parent\n");
    let line = error_line(&cli, &["snapshot", &id, "--name", &name]);
    assert!(line.contains("409"), "{line}");
    let r = cli.run(&["snapshot", &id, "--json"]);
    let s = r.json();
    for key in ["snapshotID", "sandboxID", "createdAt"] {
        assert!(s[key].is_string(), "{key}: {s}");
    }
    let unnamed = s["snapshotID"].as_str().unwrap().to_owned();

    // Clean up: the snapshots are removable once nothing stacks on them.
    drop(cleanup);
    // The second snapshot stacks on the first: removed first.
    let r = cli.run(&["template", "rm", &unnamed, &name]);
    assert_eq!(r.ok(), format!("{unnamed}\n{name}\n"));
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn logs_print_and_follow() {
    let cli = node();
    let (id, _cleanup) = sandbox(&cli, &["--metadata", "suite=cli"]);
    let r = cli.run(&["logs", &id]);
    assert!(!r.ok().is_empty(), "no log lines");
    let r = cli.run(&["logs", &id, "--json"]);
    let first: Value = serde_json::from_str(r.ok().lines().next().unwrap()).unwrap();
    for key in ["timestamp", "level", "message"] {
        assert!(first[key].is_string(), "{key}: {first}");
    }
    assert!(first["fields"]["source"].is_string());
    let r = cli.run(&["logs", &id, "-t"]);
    let line = r.ok().lines().next().unwrap().to_owned();
    assert!(
        humantime::parse_rfc3339_weak(line.split("  ").next().unwrap()).is_ok(),
        "{line}"
    );

    // -f prints each line once, then stops when the sandbox is gone.
    let mut follow = cli
        .command(&["logs", "-f", &id])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let seen = cli.run(&["logs", &id]).ok().to_owned();
    // Polled at least twice since: a cursor that re-printed lines would show.
    std::thread::sleep(Duration::from_secs(3));
    cli.run(&["rm", &id]).ok();
    let out = wait_timeout(&mut follow, Duration::from_secs(30));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let followed = String::from_utf8(out.stdout).unwrap();
    assert!(
        followed.starts_with(&seen),
        "followed:\n{followed}\nlogs:\n{seen}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("sandbox {id} is gone")));
}

fn wait_timeout(child: &mut std::process::Child, limit: Duration) -> std::process::Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    std::io::Read::read_to_end(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    std::process::Output {
        status: child.wait().unwrap(),
        stdout,
        stderr,
    }
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn cp_streams_large_files_both_ways() {
    let cli = node();
    let (id, _cleanup) = sandbox(&cli, &["--metadata", "suite=cli"]);
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.bin");
    // 24 MiB of varied bytes (not compressible to nothing).
    let mut data = Vec::with_capacity(24 << 20);
    let mut x: u64 = 0x9e3779b97f4a7c15;
    while data.len() < 24 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&big, &data).unwrap();
    let started = Instant::now();
    cli.run(&["cp", big.to_str().unwrap(), &format!("{id}:/tmp/big.bin")])
        .ok();
    eprintln!("upload of 24 MiB: {:?}", started.elapsed());
    let r = cli.run(&["exec", &id, "--", "wc", "-c", "/tmp/big.bin"]);
    assert_eq!(r.ok().split_whitespace().next(), Some("25165824"));
    // Into a directory: the file keeps its name.
    cli.run(&["cp", big.to_str().unwrap(), &format!("{id}:/tmp/dir/")])
        .ok();
    cli.run(&["exec", &id, "--", "cmp", "/tmp/big.bin", "/tmp/dir/big.bin"])
        .ok();

    let back = dir.path().join("back.bin");
    let started = Instant::now();
    cli.run(&["cp", &format!("{id}:/tmp/big.bin"), back.to_str().unwrap()])
        .ok();
    eprintln!("download of 24 MiB: {:?}", started.elapsed());
    assert!(
        std::fs::read(&back).unwrap() == data,
        "downloaded bytes differ"
    );
    // To a directory, and to stdout.
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    cli.run(&["cp", &format!("{id}:/tmp/big.bin"), out.to_str().unwrap()])
        .ok();
    assert_eq!(
        std::fs::metadata(out.join("big.bin")).unwrap().len(),
        24 << 20
    );
    let r = cli.run(&["cp", &format!("{id}:/etc/hostname"), "-"]);
    assert!(!r.ok().is_empty());
    // From stdin.
    cli.run_with_input(
        &["cp", "-", &format!("{id}:/tmp/piped.txt")],
        b"through a pipe\n",
    )
    .ok();
    assert_eq!(
        cli.run(&["exec", &id, "--", "cat", "/tmp/piped.txt"]).ok(),
        "through a pipe\n"
    );
    // A missing file: one line.
    let line = error_line(
        &cli,
        &["cp", &format!("{id}:/no/such/file"), back.to_str().unwrap()],
    );
    assert!(
        line.contains("404") || line.contains("no such file"),
        "{line}"
    );
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn template_build_from_a_sandbox_ls_rm() {
    let cli = node();
    let (id, mut cleanup) = sandbox(&cli, &["--metadata", "suite=cli"]);
    sh(&cli, &id, "echo built > ~/from-template");
    let name = format!("cli-tmpl-{}", std::process::id());
    let r = cli.run(&["template", "build", &name, "--from-sandbox", &id]);
    let template = r.ok().trim().to_owned();
    assert!(!template.is_empty());
    assert!(
        r.stderr.contains(&format!("building {name}")),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains(&format!("built {name}")), "{}", r.stderr);

    let list = cli.run(&["template", "ls"]).json();
    let t = list
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["templateID"] == template.as_str())
        .unwrap_or_else(|| panic!("{template} not in {list}"))
        .clone();
    assert_eq!(t["buildStatus"], "ready");
    assert!(
        t["names"]
            .as_array()
            .unwrap()
            .contains(&Value::from(name.clone()))
    );
    for key in ["kind", "createdAt"] {
        assert!(t[key].is_string(), "{key}: {t}");
    }
    let from = create(&cli, &[&name]);
    cleanup.1.push(from.clone());
    assert_eq!(sh(&cli, &from, "cat ~/from-template"), "built\n");
    drop(cleanup);
    assert_eq!(
        cli.run(&["template", "rm", &name]).ok(),
        format!("{name}\n")
    );
    let line = error_line(&cli, &["template", "rm", &name]);
    assert!(line.contains(&format!("no template {name}")), "{line}");
    let line = error_line(
        &cli,
        &["template", "build", "x", "--from-sandbox", "nosuchsandbox0"],
    );
    assert!(line.contains("no sandbox nosuchsandbox0"), "{line}");
}

static SESSIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// tmux drives `sandfork run` on a real pseudo-terminal.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap()
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.cmd(&["capture-pane", "-p", "-t", "t"]).stdout).into_owned()
    }

    fn wait_for(&self, text: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let s = self.screen();
            if s.contains(text) {
                return s;
            }
            assert!(Instant::now() < deadline, "no {text:?} on screen:\n{s}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn keys(&self, keys: &str) {
        assert!(
            self.cmd(&["send-keys", "-t", "t", "-l", keys])
                .status
                .success()
        );
        assert!(
            self.cmd(&["send-keys", "-t", "t", "Enter"])
                .status
                .success()
        );
    }
}

impl Tmux {
    /// A 100x30 tmux session running `sandfork ARGS`, whose exit status
    /// goes to `exit_file`.
    fn start(cli: &Cli, args: &[&str], exit_file: &std::path::Path) -> Tmux {
        let script = exit_file.with_extension("sh");
        let mut f = std::fs::File::create(&script).unwrap();
        writeln!(f, "#!/bin/sh").unwrap();
        for (k, v) in &cli.env {
            writeln!(f, "export {k}='{v}'").unwrap();
        }
        writeln!(
            f,
            "export XDG_CONFIG_HOME='{}'",
            cli.config_home.path().display()
        )
        .unwrap();
        writeln!(
            f,
            "'{}' {}; echo $? > '{}'; sleep 30",
            binary().display(),
            args.join(" "),
            exit_file.display()
        )
        .unwrap();
        drop(f);
        let tmux = Tmux {
            socket: format!(
                "sandfork-cli-test-{}-{}",
                std::process::id(),
                SESSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
        };
        let started = tmux.cmd(&[
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "100",
            "-y",
            "30",
            "sh",
            script.to_str().unwrap(),
        ]);
        assert!(
            started.status.success(),
            "{}",
            String::from_utf8_lossy(&started.stderr)
        );
        tmux
    }

    fn pane_size(&self) -> String {
        let out = self.cmd(&[
            "display-message",
            "-p",
            "-t",
            "t",
            "#{pane_height} #{pane_width}",
        ]);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn wait_exit(&self, exit_file: &std::path::Path) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !exit_file.exists() {
            assert!(
                Instant::now() < deadline,
                "it did not end:\n{}",
                self.screen()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        std::thread::sleep(Duration::from_millis(100));
        std::fs::read_to_string(exit_file)
            .unwrap()
            .trim()
            .to_owned()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn run_gives_a_shell_that_follows_the_terminal_size() {
    let cli = node();
    let dir = tempfile::tempdir().unwrap();
    let exit_file = dir.path().join("exit");
    let tmux = Tmux::start(
        &cli,
        &["run", "--rm", "--metadata", "suite=cli-run"],
        &exit_file,
    );
    let screen = tmux.wait_for("removed when the shell exits", Duration::from_secs(120));
    let id = screen
        .split_whitespace()
        .skip_while(|w| *w != "sandbox")
        .nth(1)
        .unwrap()
        .to_owned();
    assert!(ls_ids(&cli, &[]).contains(&id));
    tmux.keys("echo MARK$((40+2)); stty size");
    tmux.wait_for("MARK42", Duration::from_secs(60));
    // `stty size` is rows and columns: the pane's (the window less tmux's
    // status line).
    let size = tmux.pane_size();
    assert!(size.ends_with(" 100"), "{size}");
    tmux.wait_for(&size, Duration::from_secs(30));
    // Resize the terminal: the shell sees the new size.
    assert!(
        tmux.cmd(&["resize-window", "-t", "t", "-x", "120", "-y", "40"])
            .status
            .success()
    );
    std::thread::sleep(Duration::from_millis(500));
    tmux.keys("stty size");
    let size = tmux.pane_size();
    assert!(size.ends_with(" 120"), "{size}");
    tmux.wait_for(&size, Duration::from_secs(30));
    // A full-screen-ish interaction: Ctrl+C reaches the guest's shell.
    tmux.keys("sleep 100");
    std::thread::sleep(Duration::from_secs(1));
    assert!(tmux.cmd(&["send-keys", "-t", "t", "C-c"]).status.success());
    tmux.keys("echo after-$((6*7))");
    tmux.wait_for("after-42", Duration::from_secs(30));
    // The shell's exit code is run's; --rm removes the sandbox.
    tmux.keys("exit 7");
    assert_eq!(tmux.wait_exit(&exit_file), "7");
    assert!(!ls_ids(&cli, &[]).contains(&id));
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn exec_tty_attaches_to_an_existing_sandbox() {
    let cli = node();
    let (id, _cleanup) = sandbox(&cli, &["--metadata", "suite=cli"]);
    let dir = tempfile::tempdir().unwrap();
    let exit_file = dir.path().join("exit");
    let tmux = Tmux::start(&cli, &["exec", "-t", &id, "--", "sh"], &exit_file);
    tmux.keys("tty; echo X$((1+2))");
    tmux.wait_for("X3", Duration::from_secs(60));
    assert!(tmux.screen().contains("/dev/pts/"), "{}", tmux.screen());
    tmux.keys("exit 3");
    assert_eq!(tmux.wait_exit(&exit_file), "3");
    // The sandbox runs on.
    assert!(ls_ids(&cli, &["--state", "running"]).contains(&id));
}

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn tables_and_summaries_on_a_terminal() {
    let cli = node();
    let (id, _cleanup) = sandbox(&cli, &["--metadata", "suite=cli-table"]);
    let dir = tempfile::tempdir().unwrap();

    let exit_file = dir.path().join("ls");
    let tmux = Tmux::start(&cli, &["ls", "--metadata", "suite=cli-table"], &exit_file);
    assert_eq!(tmux.wait_exit(&exit_file), "0");
    let screen = tmux.screen();
    let mut lines = screen.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "CPU/MEM", "METADATA"
        ]
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(row[0], id);
    assert_eq!(&row[1..3], ["base", "running"]);
    assert_eq!(row.last(), Some(&"suite=cli-table"));
    drop(tmux);

    let exit_file = dir.path().join("status");
    let tmux = Tmux::start(&cli, &["status"], &exit_file);
    assert_eq!(tmux.wait_exit(&exit_file), "0");
    let screen = tmux.screen();
    for start in ["node ", "sandboxes ", "vCPUs ", "memory ", "disk "] {
        assert!(
            screen.lines().any(|l| l.starts_with(start)),
            "{start}:\n{screen}"
        );
    }
    assert!(screen.contains("running,"), "{screen}");
}

// The server tests' busybox image layout, shared rather than copied.
#[path = "../../server/tests/common/oci.rs"]
mod oci;

#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn template_build_from_an_oci_layout_streams_its_log() {
    let cli = node();
    // The node reads the layout by path: outside /tmp, which the lab does
    // not share (scripts/cli-test.sh names a directory it does share).
    let scratch = std::env::var_os("CLI_TEST_SCRATCH").map(std::path::PathBuf::from);
    let dir = match &scratch {
        Some(d) => {
            std::fs::create_dir_all(d).unwrap();
            tempfile::tempdir_in(d).unwrap()
        }
        None => tempfile::tempdir().unwrap(),
    };
    let layout = oci::busybox_oci_layout(dir.path());
    let name = format!("cli-oci-{}", std::process::id());
    let r = cli.run(&[
        "template",
        "build",
        &name,
        "--oci-layout",
        layout.to_str().unwrap(),
        "--start-cmd",
        "sleep 100000",
        "--ready-cmd",
        "test -f /etc/marker",
        "--memory-mb",
        "256",
    ]);
    let template = r.ok().trim().to_owned();
    // The build's own log came through, between the first and last lines.
    let log: Vec<&str> = r.stderr.lines().collect();
    assert!(log.len() > 2, "{}", r.stderr);
    assert!(
        log[0].starts_with(&format!("building {name}")),
        "{}",
        r.stderr
    );
    assert!(log.last().unwrap().starts_with(&format!("built {name}")));

    let (id, cleanup) = sandbox(&cli, &[&name]);
    let r = cli.run(&["exec", &id, "--user", "root", "--", "cat", "/etc/marker"]);
    assert_eq!(r.ok(), oci::MARKER);
    let r = cli.run(&["exec", &id, "--user", "root", "--", "pidof", "sleep"]);
    assert!(
        !r.ok().trim().is_empty(),
        "the start command is not running"
    );
    drop(cleanup);
    assert_eq!(
        cli.run(&["template", "rm", &template]).ok(),
        format!("{template}\n")
    );
}

/// Teams and keys through the node's own key: a team made with a limit, a
/// key for it that works on the control plane and not on the admin routes,
/// its sandboxes apart from the node's own team's, and revoked.
#[test]
#[ignore = "lab: needs a node (scripts/cli-test.sh)"]
fn teams_and_keys() {
    let admin = node();
    let name = format!("cli-{}", std::process::id());
    let team_id = admin
        .run(&["team", "create", &name, "--max-sandboxes", "0"])
        .ok()
        .trim()
        .to_owned();
    assert!(team_id.starts_with("team_"), "{team_id:?}");
    let teams = admin.run(&["team", "ls"]).json();
    let listed = teams
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["teamID"] == team_id.as_str())
        .expect("the new team is listed");
    assert_eq!(listed["limits"]["maxSandboxes"], 0);
    let key = admin
        .run(&["key", "create", &name, "--name", "ci"])
        .ok()
        .trim()
        .to_owned();
    assert!(key.starts_with("e2b_") && key.len() == 44, "{key:?}");

    let url = std::env::var("SANDFORK_API_URL").unwrap();
    let member = Cli::of_node(&url, &key);
    // Its own (empty) list; at its limit of none, a create is refused.
    assert_eq!(ls_ids(&member, &["--json"]), Vec::<String>::new());
    let refused = member.run(&["create"]);
    assert!(
        refused
            .one_line_error(1)
            .contains("maximum number of concurrent sandboxes (0)"),
        "{}",
        refused.stderr
    );
    // A team's key makes no teams.
    let denied = member.run(&["team", "ls"]);
    assert!(
        denied.one_line_error(1).contains("node's own API key"),
        "{}",
        denied.stderr
    );

    let keys = admin.run(&["key", "ls", &name, "--json"]).json();
    assert_eq!(keys[0]["name"], "ci");
    assert!(!keys.to_string().contains(&key[4..]));
    let key_id = keys[0]["keyID"].as_str().unwrap().to_owned();
    assert_eq!(admin.run(&["key", "revoke", &key_id]).ok().trim(), key_id);
    let after = member.run(&["ls", "--json"]);
    assert!(
        after.one_line_error(1).contains("refused the API key"),
        "{}",
        after.stderr
    );
    admin
        .run(&["team", "set", &name, "--max-sandboxes", "none"])
        .ok();
}
