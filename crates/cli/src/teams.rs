//! `sandfork team create | ls | set` and `sandfork key create | ls | revoke`:
//! teams and their API keys through a running node's admin routes
//! (`/admin/...`), which take the node's own key (the one in
//! `<data-dir>/api-key`, or `SANDFORK_API_KEY`) and no team's.

use std::process::ExitCode;

use anyhow::{Result, bail};
use serde_json::{Map, Value, json};

use crate::client::{Node, NodeError, escape};
use crate::output::{self, field};

#[derive(clap::Subcommand)]
pub enum TeamCommand {
    /// Make a team; prints its id. Give it keys with `sandfork key create`.
    #[command(
        after_help = "Examples:\n  sandfork team create research --max-sandboxes 20 --max-memory-mb 16384\n  sandfork key create research --name ci"
    )]
    Create {
        /// Unique on the node: letters, digits, '-', '_', '.'.
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
        #[arg(long)]
        json: bool,
    },
    /// List teams with their limits and use (a table on a terminal, JSON otherwise).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Change a team's limits (`none` removes one); `default` is the node's own team.
    Set {
        /// The team's id or name.
        team: String,
        #[command(flatten)]
        limits: LimitArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct LimitArgs {
    /// Sandboxes the team may run at once (creates beyond answer 429).
    #[arg(long, value_name = "N|none")]
    max_sandboxes: Option<String>,
    /// The sum of its running sandboxes' memoryMB at most (beyond: 429).
    #[arg(long, value_name = "MIB|none")]
    max_memory_mb: Option<String>,
    /// Requests per second of each of its keys (a burst of twice that)
    /// [default: the node's --key-rate-limit].
    #[arg(long, value_name = "N|none")]
    rate: Option<String>,
}

impl LimitArgs {
    /// The given limits as the admin routes take them (`none` is null).
    fn body(&self) -> Result<Map<String, Value>> {
        let mut body = Map::new();
        for (key, value) in [
            ("maxSandboxes", &self.max_sandboxes),
            ("maxMemoryMB", &self.max_memory_mb),
            ("requestsPerSecond", &self.rate),
        ] {
            let Some(value) = value else { continue };
            let v = match value.as_str() {
                "none" => Value::Null,
                n => match n.parse::<u64>() {
                    Ok(n) => json!(n),
                    Err(_) => bail!("{key}: {n:?} is not a whole number or `none`"),
                },
            };
            body.insert(key.to_owned(), v);
        }
        Ok(body)
    }
}

#[derive(clap::Subcommand)]
pub enum KeyCommand {
    /// Make an API key for a team; prints the key, shown this once (the
    /// node keeps only its hash).
    #[command(
        after_help = "Example:\n  E2B_API_KEY=$(sandfork key create research --name ci) python3 agent.py"
    )]
    Create {
        /// The team's id or name.
        team: String,
        /// A label for people (shown by `key ls`).
        #[arg(long, default_value = "")]
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// List a team's keys, masked.
    Ls {
        /// The team's id or name.
        team: String,
        #[arg(long)]
        json: bool,
    },
    /// Revoke keys by id (from `key ls`): their next request is refused (401).
    Revoke {
        #[arg(required = true, value_name = "KEY_ID")]
        ids: Vec<String>,
    },
}

fn admin_error(e: NodeError) -> anyhow::Error {
    match e {
        NodeError::Api { status: 403, .. } => anyhow::anyhow!(
            "the node refused: teams and keys need the node's own API key (its \
             <data-dir>/api-key, or SANDFORK_API_KEY), not a team's"
        ),
        e => e.into(),
    }
}

fn limit(v: &Value, key: &str) -> String {
    v.get("limits")
        .and_then(|l| l.get(key))
        .and_then(Value::as_u64)
        .map_or_else(|| "-".into(), |n| n.to_string())
}

fn print_teams(teams: &[Value], json: bool) -> Result<()> {
    if output::wants_json(json) {
        return output::print_json(&Value::Array(teams.to_vec()));
    }
    let rows: Vec<Vec<String>> = teams
        .iter()
        .map(|t| {
            let usage = |k: &str| {
                t.get("usage")
                    .and_then(|u| u.get(k))
                    .and_then(Value::as_u64)
                    .unwrap_or(0)
                    .to_string()
            };
            vec![
                field(t, "teamID").to_owned(),
                field(t, "name").to_owned(),
                format!("{}/{}", usage("sandboxes"), limit(t, "maxSandboxes")),
                format!("{}/{}", usage("memoryMB"), limit(t, "maxMemoryMB")),
                t.get("requestsPerSecond")
                    .and_then(Value::as_u64)
                    .map_or_else(|| "node's".into(), |n| n.to_string()),
                t.get("keys")
                    .and_then(Value::as_u64)
                    .unwrap_or(0)
                    .to_string(),
            ]
        })
        .collect();
    output::print_table(
        &["ID", "NAME", "SANDBOXES", "MEMORY MB", "REQ/S", "KEYS"],
        &rows,
    )
}

pub async fn team(cmd: TeamCommand) -> Result<ExitCode> {
    let node = Node::from_config()?;
    match cmd {
        TeamCommand::Create { name, limits, json } => {
            let mut body = limits.body()?;
            body.insert("name".into(), json!(name));
            let team: Value = node
                .json("POST", "/admin/teams", Some(&Value::Object(body)))
                .await
                .map_err(admin_error)?;
            if json {
                output::print_json(&team)?;
            } else {
                println!("{}", field(&team, "teamID"));
            }
        }
        TeamCommand::Ls { json } => {
            let teams: Vec<Value> = node
                .json("GET", "/admin/teams", None)
                .await
                .map_err(admin_error)?;
            print_teams(&teams, json)?;
        }
        TeamCommand::Set { team, limits, json } => {
            let body = limits.body()?;
            if body.is_empty() {
                bail!("nothing to change: give --max-sandboxes, --max-memory-mb or --rate");
            }
            let path = format!("/admin/teams/{}", escape(&team));
            let team: Value = node
                .json("PATCH", &path, Some(&Value::Object(body)))
                .await
                .map_err(admin_error)?;
            print_teams(&[team], json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn key(cmd: KeyCommand) -> Result<ExitCode> {
    let node = Node::from_config()?;
    match cmd {
        KeyCommand::Create { team, name, json } => {
            let path = format!("/admin/teams/{}/keys", escape(&team));
            let key: Value = node
                .json("POST", &path, Some(&json!({ "name": name })))
                .await
                .map_err(admin_error)?;
            if json {
                output::print_json(&key)?;
            } else {
                println!("{}", field(&key, "key"));
            }
        }
        KeyCommand::Ls { team, json } => {
            let path = format!("/admin/teams/{}/keys", escape(&team));
            let keys: Vec<Value> = node.json("GET", &path, None).await.map_err(admin_error)?;
            if output::wants_json(json) {
                output::print_json(&Value::Array(keys))?;
            } else {
                let rows: Vec<Vec<String>> = keys
                    .iter()
                    .map(|k| {
                        vec![
                            field(k, "keyID").to_owned(),
                            field(k, "mask").to_owned(),
                            field(k, "name").to_owned(),
                            output::relative(field(k, "createdAt")),
                        ]
                    })
                    .collect();
                output::print_table(&["ID", "KEY", "NAME", "CREATED"], &rows)?;
            }
        }
        KeyCommand::Revoke { ids } => {
            let mut failed = false;
            for id in ids {
                match node
                    .call("DELETE", &format!("/admin/keys/{}", escape(&id)), None)
                    .await
                {
                    Ok(_) => println!("{id}"),
                    Err(NodeError::Api { status: 404, .. }) => {
                        eprintln!(
                            "sandfork: error: no key {id}; `sandfork key ls TEAM` lists them"
                        );
                        failed = true;
                    }
                    Err(e) => return Err(admin_error(e)),
                }
            }
            if failed {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
