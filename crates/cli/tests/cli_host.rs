//! The `sandfork` client commands without a node: flags, configuration,
//! and the one-line errors for a missing key, a node that is down and bad
//! input. (`cli_node.rs` drives them against a real node.)

#![cfg(test)]

mod common;

use common::{Cli, closed_port, mode};

#[test]
fn bad_flags_are_refused_by_the_parser() {
    let cli = Cli::new();
    let r = cli.run(&["ls", "--bogus"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("unexpected argument '--bogus'"),
        "{}",
        r.stderr
    );
    let r = cli.run(&["exec", "abc"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("<CMD>"), "{}", r.stderr);
    let r = cli.run(&["ls", "--state", "sleeping"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("running, paused"), "{}", r.stderr);
    let r = cli.run(&["create", "--metadata", "novalue"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("is not KEY=VALUE"), "{}", r.stderr);
    let r = cli.run(&["template", "build", "t"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("--packages"), "{}", r.stderr);
    let r = cli.run(&[
        "template",
        "build",
        "t",
        "--packages",
        "jq",
        "--from-sandbox",
        "x",
    ]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("cannot be used with"), "{}", r.stderr);
}

#[test]
fn missing_key_says_how_to_log_in() {
    let cli = Cli::new();
    for args in [
        &["ls"][..],
        &["status"],
        &["create"],
        &["exec", "abc", "--", "true"],
    ] {
        let line = cli.run(args).one_line_error(1).to_owned();
        assert!(
            line.starts_with(
                "sandfork: error: no API key: run `sandfork auth login --url URL --key KEY`"
            ),
            "{args:?}: {line}"
        );
    }
}

#[test]
fn node_down_names_the_url_and_what_to_start() {
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    let cli = Cli::of_node(&url, "e2b_test");
    let want = format!(
        "sandfork: error: cannot reach the node at {url}: connection refused; is `sandfork serve` running?"
    );
    for args in [
        &["ls"][..],
        &["status"],
        &["create"],
        &["rm", "abc"],
        &["exec", "abc", "--", "true"],
        &["logs", "abc"],
        &["template", "ls"],
    ] {
        assert_eq!(cli.run(args).one_line_error(1), want, "{args:?}");
    }
}

#[test]
fn malformed_ids_and_urls_fail_before_any_request() {
    let cli = Cli::of_node("http://127.0.0.1:1", "k");
    assert_eq!(
        cli.run(&["exec", "Not-An-Id", "--", "true"])
            .one_line_error(1),
        "sandfork: error: no sandbox Not-An-Id; `sandfork ls` lists them"
    );
    let cli = Cli::of_node("ftp://node.example", "k");
    let line = cli.run(&["ls"]).one_line_error(1).to_owned();
    assert!(line.contains("is not an http:// URL"), "{line}");
    // an https:// node is a cluster's under TLS: without the cluster's
    // certificate named, the CLI says so before it dials
    let cli = Cli::of_node("https://node.example", "k");
    let line = cli.run(&["ls"]).one_line_error(1).to_owned();
    assert!(line.contains("SANDFORK_TLS_CERT"), "{line}");
}

#[test]
fn login_writes_a_private_config_file_that_the_commands_use() {
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    let cli = Cli::new();
    let r = cli.run(&[
        "auth",
        "login",
        "--url",
        &url,
        "--key",
        "e2b_0123456789abcdef",
    ]);
    r.ok();
    // The node is down: saved anyway, with a warning.
    assert!(
        r.stderr.contains("warning: cannot reach the node"),
        "{}",
        r.stderr
    );
    let file = cli.config_file();
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(file.parent().unwrap()), 0o700);
    let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(
        saved,
        serde_json::json!({"url": url, "key": "e2b_0123456789abcdef"})
    );

    // The commands now go to that node.
    let line = cli.run(&["ls"]).one_line_error(1).to_owned();
    assert!(
        line.contains(&format!("cannot reach the node at {url}")),
        "{line}"
    );

    // auth status: the key masked, where each setting came from.
    let r = cli.run(&["auth", "status", "--json"]);
    assert_eq!(r.code, 1);
    let s = r.json();
    assert_eq!(s["url"], url.as_str());
    assert_eq!(s["key"], "e2b_0123…cdef");
    assert_eq!(s["keySource"], file.display().to_string());
    assert_eq!(s["urlSource"], file.display().to_string());
    assert_eq!(s["ok"], false);
    assert!(s["error"].as_str().unwrap().contains("cannot reach"));

    // SANDFORK_* beat the file; E2B_* come after it.
    let r = Cli {
        config_home: cli.config_home,
        env: vec![
            ("SANDFORK_API_KEY".into(), "e2b_fromtheenvironment".into()),
            ("E2B_API_URL".into(), "http://127.0.0.1:9".into()),
        ],
    };
    let s = r.run(&["auth", "status", "--json"]).json();
    assert_eq!(s["keySource"], "$SANDFORK_API_KEY");
    assert_eq!(s["url"], url.as_str());

    // A config file others can read is refused with the fix.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let line = r.run(&["ls"]).one_line_error(1).to_owned();
    assert!(
        line.contains(&format!("run `chmod 600 {}`", file.display())),
        "{line}"
    );

    // Logout removes it.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    r.run(&["auth", "logout"]).ok();
    assert!(!file.exists());
}

#[test]
fn e2b_variables_are_the_fallback() {
    let cli = Cli::new()
        .with("E2B_API_URL", "http://127.0.0.1:9")
        .with("E2B_API_KEY", "e2b_sdkkeysdkkeysdkkey");
    let s = cli.run(&["auth", "status", "--json"]).json();
    assert_eq!(s["url"], "http://127.0.0.1:9");
    assert_eq!(s["urlSource"], "$E2B_API_URL");
    assert_eq!(s["keySource"], "$E2B_API_KEY");
    // Nothing at all: the default URL and no key.
    let s = Cli::new().run(&["auth", "status", "--json"]).json();
    assert_eq!(s["url"], "http://127.0.0.1:3000");
    assert_eq!(s["key"], serde_json::Value::Null);
    assert!(s["error"].as_str().unwrap().contains("no API key"));
}

#[test]
fn login_reads_the_key_from_stdin_for_scripts() {
    let cli = Cli::new();
    let url = format!("http://127.0.0.1:{}", closed_port());
    cli.run_with_input(
        &["auth", "login", "--url", &url, "--key-stdin"],
        b"e2b_piped\n",
    )
    .ok();
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cli.config_file()).unwrap()).unwrap();
    assert_eq!(saved["key"], "e2b_piped");
    let r = cli.run_with_input(&["auth", "login", "--key-stdin"], b"\n");
    assert!(r.one_line_error(1).contains("no key given"));
}

#[test]
fn completions_and_help() {
    let cli = Cli::new();
    for shell in ["bash", "zsh", "fish"] {
        let out = cli.run(&["completions", shell]);
        let text = out.ok();
        assert!(
            text.contains("sandfork") && text.contains("fork"),
            "{shell}"
        );
    }
    assert_eq!(cli.run(&["completions", "tcsh"]).code, 2);
    let help = cli.run(&["--help"]);
    assert!(help.ok().contains("Quick start:"));
    for cmd in ["exec", "fork", "ls", "create", "cp", "logs", "run"] {
        let h = cli.run(&[cmd, "--help"]);
        assert!(h.ok().contains("Examples:"), "{cmd}");
    }
}

#[test]
fn cp_needs_exactly_one_sandbox_side_and_run_a_terminal() {
    let cli = Cli::of_node("http://127.0.0.1:1", "k");
    assert!(
        cli.run(&["cp", "a", "b"])
            .one_line_error(1)
            .contains("neither side is in a sandbox")
    );
    assert!(
        cli.run(&["cp", "abc:/x", "def:/y"])
            .one_line_error(1)
            .contains("both sides are in a sandbox")
    );
    let dir = tempfile::tempdir().unwrap();
    let line = cli
        .run(&["cp", dir.path().to_str().unwrap(), "abc:/tmp/"])
        .one_line_error(1)
        .to_owned();
    assert!(line.contains("is a directory"), "{line}");
    // stdin is /dev/null here: no terminal for a shell.
    let line = cli.run(&["run"]).one_line_error(1).to_owned();
    assert!(line.contains("a shell needs a terminal"), "{line}");
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    // As `sandfork ls | head -n1` can: the reader is gone before the write.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Cli::new()
        .command(&["completions", "bash"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{out:?}");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A bench whose every part fails (a VMM that does not exist, an SDK
/// script that dies at once) still prints its JSON, with each error, and
/// exits 1.
#[test]
fn a_bench_that_fails_still_prints_what_it_has() {
    let cli = Cli::new();
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    let missing = missing.to_str().unwrap();
    let r = cli.run(&[
        "bench",
        "--in-lab",
        "--kernel",
        missing,
        "--rootfs",
        missing,
        "--vmm",
        missing,
        "--runs",
        "1",
        "--sdk-python",
        "/bin/false",
        "--timeout",
        "120",
    ]);
    assert_eq!(r.code, 1, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    let report = r.json();
    let errors = &report["errors"];
    assert!(
        errors["boot"].as_str().unwrap().contains(missing),
        "{report}"
    );
    assert!(errors["snapshot"].is_string(), "{report}");
    assert!(report["sdk_error"].is_string(), "{report}");
    assert_eq!(report["environment"], "lab");
}
