//! The job the lab's init runs: a POSIX shell script written by the host, and
//! the status lines the guest sends back on its own port.

use std::path::Path;

/// Quotes a string for POSIX sh: single quotes, with `'` written as `'\''`.
pub(crate) fn shell_quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('\'');
    for c in s.chars() {
        if c == '\'' {
            q.push_str("'\\''");
        } else {
            q.push(c);
        }
    }
    q.push('\'');
    q
}

/// The script run by the host root's /bin/sh inside the chroot (`argv` is not
/// empty: the caller checks). fd 3 is the
/// status port: the script reports a missing directory or command there (the
/// host turns that into an error, so nothing is printed), and closes it before
/// handing over to the command.
pub(crate) fn job_script(cwd: &Path, env: &[(String, String)], argv: &[String]) -> String {
    let mut s = String::from("# written by sandfork-lab\n");
    for (k, v) in env {
        s.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    let cwd = shell_quote(&cwd.to_string_lossy());
    s.push_str(&format!(
        "cd {cwd} 2>/dev/null || {{ echo SANDFORK-NOCWD >&3; exit 126; }}\n"
    ));
    let program = shell_quote(&argv[0]);
    s.push_str(&format!(
        "command -v {program} >/dev/null 2>&1 || {{ echo SANDFORK-NOTFOUND >&3; exit 127; }}\n"
    ));
    s.push_str("exec 3>&-\nexec");
    for a in argv {
        s.push(' ');
        s.push_str(&shell_quote(a));
    }
    s.push('\n');
    s
}

/// What the guest reported on the status port.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GuestStatus {
    pub exit_code: Option<i32>,
    pub not_found: bool,
    pub no_cwd: bool,
    pub error: Option<String>,
}

impl GuestStatus {
    /// Folds one line from the status port in; unknown lines are ignored.
    pub fn take_line(&mut self, line: &str) {
        let line = line.trim_end_matches(['\r', '\n']);
        if let Some(code) = line.strip_prefix("SANDFORK-EXIT ") {
            self.exit_code = code.trim().parse().ok();
        } else if line == "SANDFORK-NOTFOUND" {
            self.not_found = true;
        } else if line == "SANDFORK-NOCWD" {
            self.no_cwd = true;
        } else if let Some(msg) = line.strip_prefix("SANDFORK-ERROR ") {
            self.error = Some(msg.to_string());
        }
    }

    #[cfg(test)]
    pub fn parse(text: &str) -> Self {
        let mut s = GuestStatus::default();
        for line in text.lines() {
            s.take_line(line);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn quoting_survives_the_shell() {
        for s in ["plain", "", "it's", "a b\tc\nd", "$HOME `x` \\ \"q\" '' *"] {
            let out = Command::new("/bin/sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(s)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), s);
        }
    }

    /// Runs a job script with fd 3 captured, as the lab's init does.
    fn run_job(script: &str) -> (i32, String, String, GuestStatus) {
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("job.sh");
        let status = dir.path().join("status");
        std::fs::write(&job, script).unwrap();
        let out = Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "/bin/sh {} 3>{}",
                shell_quote(&job.to_string_lossy()),
                shell_quote(&status.to_string_lossy())
            ))
            .env_clear()
            .output()
            .unwrap();
        let st = GuestStatus::parse(&std::fs::read_to_string(status).unwrap());
        (
            out.status.code().unwrap(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
            st,
        )
    }

    #[test]
    fn job_runs_the_command_with_its_env_and_cwd() {
        let env = vec![
            ("PATH".to_string(), "/usr/bin:/bin".to_string()),
            ("GREETING".to_string(), "it's me".to_string()),
        ];
        let argv: Vec<String> = [
            "sh",
            "-c",
            "pwd; echo \"$GREETING\"; if { true >&3; } 2>/dev/null; then echo fd3-open; else echo fd3-closed; fi; exit 3",
        ]
        .map(String::from)
        .to_vec();
        let (code, out, _, st) = run_job(&job_script(Path::new("/usr"), &env, &argv));
        assert_eq!(code, 3);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[..2], ["/usr", "it's me"]);
        // The status fd was closed before the command started.
        assert_eq!(lines[2], "fd3-closed");
        assert_eq!(st, GuestStatus::default());
    }

    #[test]
    fn missing_command_and_cwd_are_reported() {
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let argv = vec!["no-such-command-here".to_string()];
        let (code, _, err, st) = run_job(&job_script(Path::new("/"), &env, &argv));
        assert_eq!(code, 127);
        assert!(st.not_found);
        assert_eq!(err, "");

        let argv = vec!["true".to_string()];
        let (code, _, _, st) = run_job(&job_script(Path::new("/no/such/dir"), &env, &argv));
        assert_eq!(code, 126);
        assert!(st.no_cwd);
    }

    #[test]
    fn status_lines_parse() {
        let st = GuestStatus::parse("SANDFORK-NOTFOUND\nnoise\nSANDFORK-EXIT 127\r\n");
        assert_eq!(st.exit_code, Some(127));
        assert!(st.not_found);
        let st = GuestStatus::parse("SANDFORK-ERROR cannot mount the host root over 9p\n");
        assert_eq!(st.exit_code, None);
        assert_eq!(
            st.error.as_deref(),
            Some("cannot mount the host root over 9p")
        );
        assert_eq!(GuestStatus::parse("SANDFORK-EXIT x\n").exit_code, None);
    }
}
