//! The deployment files in `deploy/` (systemd units, Kubernetes manifests)
//! name only `sandfork serve` flags that exist: a renamed flag fails here,
//! not on an operator's host.

#![cfg(test)]

mod common;

use std::path::Path;

use common::Cli;

/// The `--flag` words of `text`'s `sandfork serve` command lines: a unit's
/// ExecStart, or a manifest's `- --flag` argument items.
fn flags(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let words: Vec<&str> = if let Some(exec) = line.strip_prefix("ExecStart=") {
            exec.split_whitespace().collect()
        } else if let Some(item) = line.strip_prefix("- ") {
            vec![item]
        } else {
            continue;
        };
        found.extend(
            words
                .into_iter()
                .filter(|w| w.starts_with("--"))
                .map(|w| w.split('=').next().unwrap_or(w).to_owned()),
        );
    }
    found
}

#[test]
fn deployment_files_use_only_flags_serve_has() {
    let help = Cli::new().run(&["serve", "--help"]).ok().to_owned();
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let mut checked = 0;
    for sub in ["systemd", "kubernetes"] {
        for entry in std::fs::read_dir(deploy.join(sub)).expect("deploy dir") {
            let path = entry.expect("dir entry").path();
            let text = std::fs::read_to_string(&path).expect("read deploy file");
            for flag in flags(&text) {
                assert!(
                    help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                    "{} uses {flag}, which `sandfork serve` does not have",
                    path.display()
                );
                checked += 1;
            }
        }
    }
    // Both units and both manifests say --role and --listen at least.
    assert!(
        checked >= 8,
        "only {checked} flags found: is deploy/ there?"
    );
}

#[test]
fn the_flag_reader_finds_exec_and_list_flags() {
    let unit = "ExecStart=/usr/bin/sandfork serve --role node --listen=0.0.0.0:3000";
    assert_eq!(flags(unit), ["--role", "--listen"]);
    let yaml = "args:\n  - serve\n  - --data-dir\n  - /var/lib/sandfork\n";
    assert_eq!(flags(yaml), ["--data-dir"]);
}
