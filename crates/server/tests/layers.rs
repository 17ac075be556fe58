//! The server's floors hold: `node/` imports nothing from the floors above
//! it (`cluster`, `http`) nor the cluster crate, `cluster/` nothing from
//! `http/`, and `wire` (E2B's JSON and sandfork's headers) nothing from the
//! crate at all. Rust allows circles between modules; this test is what
//! keeps a new upward import from compiling into a green build. Comments
//! and test modules may name anything.

// A test: a file it cannot read is a failure to see at once.
#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, or `dir` itself when it is a file.
fn sources(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_owned()];
    }
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The lines of `path` that are code outside its tests: comments,
/// `#[cfg(test)]` modules and files named `tests.rs` left out.
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return Vec::new();
    }
    let text = std::fs::read_to_string(path).expect("reading a source file");
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate().peekable();
    while let Some((n, line)) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|(_, next)| next.trim_start().starts_with("mod "))
        {
            // A test module runs to the end of the file, as ours are written.
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        out.push((n + 1, line.to_owned()));
    }
    out
}

/// Each line under `floor` (relative to the server's `src/`) that names
/// one of `forbidden`.
fn upward_imports(floor: &str, forbidden: &[&str]) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in sources(&src.join(floor)) {
        for (n, line) in code_lines(&file) {
            if let Some(name) = forbidden.iter().find(|f| line.contains(**f)) {
                let file = file.strip_prefix(&src).unwrap_or(&file).display();
                found.push(format!("src/{file}:{n} names {name}: {}", line.trim()));
            }
        }
    }
    found
}

#[test]
fn the_node_imports_nothing_from_above() {
    let mut found = upward_imports(
        "node",
        &[
            "crate::http",
            "crate::cluster",
            "sandfork_cluster",
            "axum::Router",
        ],
    );
    found.extend(upward_imports(
        "node.rs",
        &["crate::http", "crate::cluster", "sandfork_cluster"],
    ));
    assert!(found.is_empty(), "upward imports:\n{}", found.join("\n"));
}

#[test]
fn the_cluster_part_imports_nothing_from_http() {
    let server_side = [
        "crate::http",
        "ApiError",
        "axum::Router",
        "axum::extract",
        "axum::response",
    ];
    let mut found = upward_imports("cluster", &server_side);
    found.extend(upward_imports("cluster.rs", &server_side));
    assert!(found.is_empty(), "upward imports:\n{}", found.join("\n"));
}

#[test]
fn the_wire_contract_imports_nothing_of_the_server() {
    let mut found = upward_imports("wire", &["crate::"]);
    found.extend(upward_imports("wire.rs", &["crate::"]));
    assert!(found.is_empty(), "wire imports:\n{}", found.join("\n"));
}

/// The guard itself: an upward import in a node file is found.
#[test]
fn an_upward_import_is_found() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = dir.path().join("a.rs");
    std::fs::write(
        &file,
        "//! uses crate::http in a comment only\nuse crate::http::api::ApiError;\n\
         #[cfg(test)]\nmod tests {\n    use crate::cluster::Node;\n}\n",
    )
    .expect("writing a file");
    let lines = code_lines(&file);
    let named: Vec<&(usize, String)> = lines
        .iter()
        .filter(|(_, l)| l.contains("crate::http") || l.contains("crate::cluster"))
        .collect();
    assert_eq!(named.len(), 1, "{lines:?}");
    assert_eq!(named[0].0, 2);
}
