//! Sandbox lifecycle commands: `ls`, `create`, `pause`, `resume`, `fork`,
//! `snapshot`, `timeout`, `rm`.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{Result, bail};
use serde_json::{Value, json};

use crate::client::{Node, NodeError, check_id, escape};
use crate::output::{self, field};
use crate::progress::Spinner;

/// `k=v`, for `--metadata` and `--env`.
pub fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork ls\n  sandfork ls --state paused\n  sandfork ls --metadata owner=ci --json | jq -r '.[].sandboxID'"
)]
pub struct LsArgs {
    /// Only sandboxes in this state.
    #[arg(long, value_parser = ["running", "paused"])]
    state: Option<String>,
    /// Only sandboxes with this metadata (repeatable).
    #[arg(long, value_name = "KEY=VALUE", value_parser = key_value)]
    metadata: Vec<(String, String)>,
    /// Print JSON (the default when stdout is not a terminal).
    #[arg(long)]
    json: bool,
}

pub async fn ls(args: LsArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    let mut q = form_urlencoded::Serializer::new(String::new());
    if let Some(s) = &args.state {
        q.append_pair("state", s);
    }
    if !args.metadata.is_empty() {
        // The SDKs' encoding: key=value pairs, each part escaped, joined by &.
        let inner: Vec<String> = args
            .metadata
            .iter()
            .map(|(k, v)| format!("{}={}", escape(k), escape(v)))
            .collect();
        q.append_pair("metadata", &inner.join("&"));
    }
    let list = node.list_sandboxes(&q.finish()).await?;
    if output::wants_json(args.json) {
        output::print_json(&Value::Array(list))?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|s| {
            let metadata = s
                .get("metadata")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            let ends = if field(s, "state") == "paused" {
                "-".to_owned()
            } else {
                output::relative(field(s, "endAt"))
            };
            vec![
                field(s, "sandboxID").to_owned(),
                if field(s, "alias").is_empty() {
                    field(s, "templateID")
                } else {
                    field(s, "alias")
                }
                .to_owned(),
                field(s, "state").to_owned(),
                output::relative(field(s, "startedAt")),
                ends,
                format!(
                    "{}/{}M",
                    s.get("cpuCount").and_then(Value::as_u64).unwrap_or(0),
                    s.get("memoryMB").and_then(Value::as_u64).unwrap_or(0)
                ),
                metadata,
            ]
        })
        .collect();
    output::print_table(
        &[
            "ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "CPU/MEM", "METADATA",
        ],
        &rows,
    )?;
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork create                      # from the base template\n  id=$(sandfork create mytemplate --timeout 3600 --metadata owner=ci)\n  sandfork create --json | jq -r .envdAccessToken"
)]
pub struct CreateArgs {
    /// Template id or name (or a snapshot's) [default: base].
    template: Option<String>,
    /// Seconds until the sandbox is killed (or paused with --auto-pause).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Metadata to tag it with (repeatable).
    #[arg(long, value_name = "KEY=VALUE", value_parser = key_value)]
    metadata: Vec<(String, String)>,
    /// Environment variables of every command in it (repeatable).
    #[arg(long, short, value_name = "KEY=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Pause at the timeout instead of killing it.
    #[arg(long)]
    auto_pause: bool,
    /// Print the sandbox as JSON instead of its id.
    #[arg(long)]
    json: bool,
}

/// The create body for `template` and the options.
pub fn create_body(
    template: Option<&str>,
    timeout: u64,
    metadata: &[(String, String)],
    env: &[(String, String)],
    auto_pause: bool,
) -> Value {
    let map = |kv: &[(String, String)]| kv.iter().cloned().collect::<BTreeMap<_, _>>();
    let mut body = json!({
        "timeout": timeout,
        "metadata": map(metadata),
        "envVars": map(env),
        "autoPause": auto_pause,
    });
    if let Some(t) = template {
        body["templateID"] = json!(t);
    }
    body
}

pub async fn create(args: CreateArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    let body = create_body(
        args.template.as_deref(),
        args.timeout,
        &args.metadata,
        &args.env,
        args.auto_pause,
    );
    let sandbox = create_sandbox(&node, &body).await?;
    if args.json {
        output::print_json(&sandbox)?;
    } else {
        println!("{}", field(&sandbox, "sandboxID"));
    }
    Ok(ExitCode::SUCCESS)
}

/// `POST /v2/sandboxes`; a 404 names the unknown template.
pub async fn create_sandbox(node: &Node, body: &Value) -> Result<Value> {
    match node.json("POST", "/v2/sandboxes", Some(body)).await {
        Ok(v) => Ok(v),
        Err(NodeError::Api { status: 404, .. }) => {
            let t = body["templateID"].as_str().unwrap_or("base");
            bail!("no template {t}; `sandfork template ls` lists them")
        }
        Err(e) => Err(e.into()),
    }
}

/// Runs `op` for each id; failures are reported one line each and make
/// the exit code 1, the others still run.
async fn each<F, Fut>(ids: &[String], op: F) -> Result<ExitCode>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let mut failed = false;
    for id in ids {
        match op(id.clone()).await {
            Ok(()) => println!("{id}"),
            Err(e) => {
                // Node-wide problems fail the same way for every id.
                if let Some(NodeError::Unreachable { .. } | NodeError::Unauthorized(_)) =
                    e.downcast_ref::<NodeError>()
                {
                    return Err(e);
                }
                eprintln!("sandfork: error: {e:#}");
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[derive(clap::Args)]
pub struct IdsArgs {
    /// Sandbox ids.
    #[arg(required = true, value_name = "ID")]
    ids: Vec<String>,
}

pub async fn rm(args: IdsArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    each(&args.ids, |id| {
        let node = &node;
        async move {
            check_id(&id)?;
            node.sandbox_call(&id, "DELETE", &format!("/sandboxes/{id}"), None)
                .await?;
            Ok(())
        }
    })
    .await
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork pause $id\n  sandfork pause $id --local   # in a cluster: not stored, lost with its node"
)]
pub struct PauseArgs {
    #[command(flatten)]
    ids: IdsArgs,
    /// In a cluster with an object store: keep the pause on its node only
    /// (not stored, so it cannot resume elsewhere and is lost with its node).
    #[arg(long)]
    local: bool,
}

pub async fn pause(args: PauseArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    let body = args.local.then(|| json!({"durable": false}));
    each(&args.ids.ids, |id| {
        let (node, body) = (&node, &body);
        async move {
            check_id(&id)?;
            match node
                .sandbox_call(
                    &id,
                    "POST",
                    &format!("/sandboxes/{id}/pause"),
                    body.as_ref(),
                )
                .await
            {
                Err(NodeError::Api { status: 409, .. }) => {
                    bail!("sandbox {id} is already paused; `sandfork resume {id}` runs it again")
                }
                r => r.map(drop).map_err(Into::into),
            }
        }
    })
    .await
}

#[derive(clap::Args)]
pub struct ResumeArgs {
    #[arg(required = true, value_name = "ID")]
    ids: Vec<String>,
    /// Seconds it may run from now.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

pub async fn resume(args: ResumeArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    let body = json!({ "timeout": args.timeout });
    each(&args.ids, |id| {
        let (node, body) = (&node, &body);
        async move {
            check_id(&id)?;
            match node
                .sandbox_call(&id, "POST", &format!("/sandboxes/{id}/resume"), Some(body))
                .await
            {
                Err(NodeError::Api { status: 409, .. }) => {
                    bail!("sandbox {id} is already running")
                }
                r => r.map(drop).map_err(Into::into),
            }
        }
    })
    .await
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork fork $id -n 4\n  for c in $(sandfork fork $id -n 3); do sandfork exec $c -- hostname; done"
)]
pub struct ForkArgs {
    /// The running sandbox to fork.
    id: String,
    /// How many children (1-20).
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    count: u32,
    /// Seconds each child may run.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Print the node's answer as JSON instead of the children's ids.
    #[arg(long)]
    json: bool,
}

pub async fn fork(args: ForkArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    check_id(&args.id)?;
    let path = format!("/sandboxes/{}/fork", args.id);
    let body = json!({ "count": args.count, "timeout": args.timeout });
    let children = if args.count == 1 { "child" } else { "children" };
    let progress = Spinner::start(&format!(
        "forking {} into {} {children}",
        args.id, args.count
    ));
    let answer = node
        .sandbox_call(&args.id, "POST", &path, Some(&body))
        .await;
    drop(progress);
    let answer = match answer {
        Err(NodeError::Api { status: 409, .. }) => {
            bail!(
                "sandbox {0} is paused; `sandfork resume {0}` first",
                args.id
            )
        }
        r => r?,
    };
    let results: Vec<Value> = crate::client::parse(&path, &answer.body)?;
    let mut failed = 0;
    if args.json {
        output::print_json(&Value::Array(results.clone()))?;
    }
    for r in &results {
        if let Some(s) = r.get("sandbox") {
            if !args.json {
                println!("{}", field(s, "sandboxID"));
            }
        } else {
            failed += 1;
            let msg = r
                .pointer("/error/message")
                .and_then(Value::as_str)
                .unwrap_or("unknown error");
            eprintln!("sandfork: error: a child failed: {msg}");
        }
    }
    Ok(if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork snapshot $id --name warmed-up\n  sandfork create warmed-up      # sandboxes start from the snapshot"
)]
pub struct SnapshotArgs {
    id: String,
    /// A name to create sandboxes from (as a template).
    #[arg(long)]
    name: Option<String>,
    /// Print the snapshot as JSON instead of its id.
    #[arg(long)]
    json: bool,
}

pub async fn snapshot(args: SnapshotArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    check_id(&args.id)?;
    let path = format!("/sandboxes/{}/snapshots", args.id);
    let body = match &args.name {
        Some(n) => json!({ "name": n }),
        None => json!({}),
    };
    let answer = match node
        .sandbox_call(&args.id, "POST", &path, Some(&body))
        .await
    {
        Err(NodeError::Api {
            status: 409,
            message,
        }) => bail!("{message}"),
        r => r?,
    };
    let snap: Value = crate::client::parse(&path, &answer.body)?;
    if args.json {
        output::print_json(&snap)?;
    } else {
        println!("{}", field(&snap, "snapshotID"));
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct TimeoutArgs {
    id: String,
    /// Seconds from now until the sandbox is killed (or paused).
    secs: u64,
}

pub async fn timeout(args: TimeoutArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    check_id(&args.id)?;
    node.sandbox_call(
        &args.id,
        "POST",
        &format!("/sandboxes/{}/timeout", args.id),
        Some(&json!({ "timeout": args.secs })),
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_values_need_a_key() {
        assert_eq!(key_value("a=b=c").unwrap(), ("a".into(), "b=c".into()));
        assert_eq!(key_value("a=").unwrap(), ("a".into(), String::new()));
        assert!(key_value("=b").is_err());
        assert!(key_value("ab").is_err());
    }

    #[test]
    fn create_body_names_the_template_only_when_given() {
        let b = create_body(None, 60, &[("k".into(), "v".into())], &[], true);
        assert_eq!(
            b,
            json!({"timeout": 60, "metadata": {"k": "v"}, "envVars": {}, "autoPause": true})
        );
        let b = create_body(Some("t"), 60, &[], &[], false);
        assert_eq!(b["templateID"], "t");
    }
}
