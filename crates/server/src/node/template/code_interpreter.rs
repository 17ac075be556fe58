//! The `code-interpreter` template sandfork ships: the base image with a
//! Python venv (Jupyter's ipykernel and jupyter_client, numpy, pandas,
//! matplotlib, from `images/code-interpreter/requirements.txt`) and
//! sandfork's own server for the protocol `e2b_code_interpreter` speaks on
//! port 49999 (`images/code-interpreter/server.py`), started before the
//! template's snapshot with its default Python kernel warm, so `run_code`
//! answers right after a create.
//!
//! Built on request (`POST /templates` `{"from": {"builtin":
//! "code-interpreter"}}`, `sandfork template build code-interpreter
//! --builtin code-interpreter`) or on the first create that names it (or
//! `code-interpreter-v1`, the SDK's default). Its root filesystem is cached by
//! the content of its inputs (`template-build`, the venv apart from the
//! agent and the server), so pip runs once per machine.

pub use template_build::{ImageFile, PythonVenv};

/// The template's name, and the builtin's.
pub const NAME: &str = "code-interpreter";
/// The name `e2b_code_interpreter`'s `Sandbox.create()` asks for: the
/// template answers to it too.
pub const E2B_NAME: &str = "code-interpreter-v1";
/// Where the server and its venv live in the guest.
const DIR: &str = "/opt/sandfork/code-interpreter";
/// The port the SDK reaches the server on.
pub const PORT: u16 = 49999;
/// Kernels with pandas and matplotlib loaded want more than the base's memory.
pub const MIN_MEM_MIB: u64 = 1024;

const SERVER_PY: &str = include_str!("../../../../../images/code-interpreter/server.py");
const REQUIREMENTS: &str = include_str!("../../../../../images/code-interpreter/requirements.txt");

/// Whether a create of `name` builds this template when it is missing.
pub fn is_name(name: &str) -> bool {
    let name = name.strip_suffix(":default").unwrap_or(name);
    name == NAME || name == E2B_NAME
}

/// The names a build called `name` records: the E2B alias goes with
/// [`NAME`].
pub fn names(name: &str) -> Vec<String> {
    let mut names = vec![name.to_owned()];
    if name == NAME {
        names.push(E2B_NAME.to_owned());
    }
    names
}

/// What the root filesystem is made from.
pub fn source() -> PythonVenv {
    PythonVenv {
        dir: format!("{DIR}/venv"),
        requirements: REQUIREMENTS.to_owned(),
        files: vec![ImageFile {
            path: format!("{DIR}/server.py"),
            contents: SERVER_PY.as_bytes().to_vec(),
            mode: 0o644,
        }],
    }
}

/// Started before the snapshot, so running in every sandbox (as root, as
/// E2B's own interpreter runs; kernels start in `/home/user`).
pub fn start_cmd() -> String {
    format!("exec {DIR}/venv/bin/python {DIR}/server.py")
}

/// Passes once the server answers and its default kernel is warm.
pub fn ready_cmd() -> String {
    format!("curl -fsS -o /dev/null http://127.0.0.1:{PORT}/health")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_commands() {
        assert!(is_name("code-interpreter"));
        assert!(is_name("code-interpreter-v1"));
        assert!(is_name("code-interpreter-v1:default"));
        assert!(!is_name("base"));
        assert_eq!(names(NAME), [NAME, E2B_NAME]);
        assert_eq!(names("ci2"), ["ci2"]);
        let src = source();
        assert!(src.requirements.contains("ipykernel=="));
        assert!(start_cmd().contains(&src.files[0].path));
        assert!(start_cmd().starts_with(&format!("exec {}/bin/python ", src.dir)));
        assert!(ready_cmd().contains("49999/health"));
    }
}
