//! `sandfork auth`: where the node is and its API key, kept in the config
//! file (see `client::config`).

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::client::config::{self, FileConfig};
use crate::client::{Node, NodeError};

#[derive(clap::Subcommand)]
pub enum AuthCommand {
    /// Save the node's URL and API key in the config file (mode 0600).
    ///
    /// Without --url or --key, asks for them (the key without echo).
    #[command(
        after_help = "Examples:\n  sandfork auth login --url http://127.0.0.1:3000 --key $(cat /var/lib/sandfork/api-key)\n  sandfork auth login          # asks"
    )]
    Login {
        /// The node's URL [default: http://127.0.0.1:3000].
        #[arg(long)]
        url: Option<String>,
        /// The node's API key (printed by `sandfork serve`, in <data-dir>/api-key).
        #[arg(long)]
        key: Option<String>,
        /// Read the key from standard input (one line), for scripts.
        #[arg(long, conflicts_with = "key")]
        key_stdin: bool,
    },
    /// Show which node and key are in effect, and whether the node accepts them.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Remove the config file.
    Logout,
}

pub async fn run(cmd: AuthCommand) -> Result<ExitCode> {
    match cmd {
        AuthCommand::Login {
            url,
            key,
            key_stdin,
        } => login(url, key, key_stdin).await,
        AuthCommand::Status { json } => status(json).await,
        AuthCommand::Logout => {
            let path = config::path()?;
            match std::fs::remove_file(&path) {
                Ok(()) => eprintln!("removed {}", path.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    eprintln!("no config file at {}", path.display())
                }
                Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn prompt(question: &str) -> Result<String> {
    eprint!("{question}");
    std::io::stderr().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(line.trim().to_owned())
}

/// Reads a line with the terminal's echo off.
fn prompt_secret(question: &str) -> Result<String> {
    use nix::sys::termios::{self, LocalFlags, SetArg};
    let stdin = std::io::stdin();
    let saved = termios::tcgetattr(&stdin).ok();
    if let Some(t) = &saved {
        let mut quiet = t.clone();
        quiet.local_flags.remove(LocalFlags::ECHO);
        let _ = termios::tcsetattr(&stdin, SetArg::TCSANOW, &quiet);
    }
    let answer = prompt(question);
    if let Some(t) = &saved {
        let _ = termios::tcsetattr(&stdin, SetArg::TCSANOW, t);
        eprintln!();
    }
    answer
}

async fn login(url: Option<String>, key: Option<String>, key_stdin: bool) -> Result<ExitCode> {
    let interactive = std::io::stdin().is_terminal();
    let url = match url {
        Some(u) => u,
        None if interactive && key.is_none() => {
            let u = prompt(&format!("Node URL [{}]: ", config::DEFAULT_URL))?;
            if u.is_empty() {
                config::DEFAULT_URL.to_owned()
            } else {
                u
            }
        }
        None => config::DEFAULT_URL.to_owned(),
    };
    let key = match key {
        Some(k) => k,
        None if key_stdin || !interactive => {
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            line.trim().to_owned()
        }
        None => prompt_secret("API key (from `sandfork serve`, in <data-dir>/api-key): ")?,
    };
    if key.is_empty() {
        bail!("no key given: pass --key KEY (the node's key is in <data-dir>/api-key)");
    }
    let node = Node::new(&url, key.clone())?;
    // Check the pair before saving; an unreachable node is saved anyway
    // (logging in before starting the node is fine), a refused key is not.
    match node.call("GET", "/v1/node", None).await {
        Ok(_) => eprintln!("the node at {} accepts the key", node.url()),
        Err(e @ NodeError::Unauthorized(_)) => return Err(e.into()),
        Err(e) => eprintln!("warning: {e} (saved anyway)"),
    }
    let path = config::path()?;
    config::save(
        &path,
        &FileConfig {
            url: Some(node.url().to_owned()),
            key: Some(key),
        },
    )?;
    eprintln!("saved to {}", path.display());
    Ok(ExitCode::SUCCESS)
}

async fn status(json: bool) -> Result<ExitCode> {
    let resolved = config::resolve()?;
    let key = resolved.key.as_ref();
    let (reachable, problem) = match key {
        None => (false, Some(NodeError::NoKey.to_string())),
        Some((k, _)) => match Node::new(&resolved.url, k.clone()) {
            Ok(node) => match node.call("GET", "/v1/node", None).await {
                Ok(_) => (true, None),
                Err(e) => (false, Some(e.to_string())),
            },
            Err(e) => (false, Some(e.to_string())),
        },
    };
    if crate::output::wants_json(json) {
        crate::output::print_json(&serde_json::json!({
            "url": resolved.url,
            "urlSource": resolved.url_from.to_string(),
            "key": key.map(|(k, _)| config::mask(k)),
            "keySource": key.map(|(_, s)| s.to_string()),
            "configFile": resolved.file,
            "ok": reachable,
            "error": problem.as_ref().map_or(Value::Null, |p| Value::from(p.as_str())),
        }))?;
    } else {
        println!("node    {} (from {})", resolved.url, resolved.url_from);
        match key {
            Some((k, from)) => println!("key     {} (from {from})", config::mask(k)),
            None => println!("key     none"),
        }
        println!("config  {}", resolved.file.display());
        if reachable {
            println!("ok      the node accepts the key");
        }
    }
    match problem {
        Some(p) => bail!(p),
        None => Ok(ExitCode::SUCCESS),
    }
}
