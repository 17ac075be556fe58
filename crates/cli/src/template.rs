//! `sandfork template build | ls | rm`: templates through the node's
//! `/templates` routes, with the build's log streamed while it runs.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::client::{Node, NodeError, escape};
use crate::output::{self, field};
use crate::progress::Spinner;

const POLL: Duration = Duration::from_millis(1000);

#[derive(clap::Subcommand)]
pub enum TemplateCommand {
    /// Build a template from Debian packages, an OCI image or a running sandbox.
    ///
    /// Streams the build log, then prints the template's id.
    #[command(
        after_help = "Examples:\n  sandfork template build py --packages python3,python3-pip\n  sandfork template build app --oci-layout ./image --start-cmd 'app serve' --ready-cmd 'curl -fs localhost:8080'\n  docker save myimage -o img.tar && sandfork template build app --docker-archive img.tar\n  sandfork template build warmed --from-sandbox $id\n  sandfork template build code-interpreter --builtin code-interpreter\n  sandfork create py"
    )]
    Build(BuildArgs),
    /// List templates (a table on a terminal, JSON otherwise).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove templates or snapshots (by id or name).
    Rm {
        #[arg(required = true, value_name = "TEMPLATE")]
        ids: Vec<String>,
    },
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true)
    .args(["packages", "oci_layout", "docker_archive", "from_sandbox", "builtin"])))]
pub struct BuildArgs {
    /// The template's name (what `sandfork create NAME` takes).
    name: String,
    /// Debian packages installed over the base image (comma-separated).
    #[arg(long, value_delimiter = ',', value_name = "PKG,...")]
    packages: Vec<String>,
    /// An OCI image layout directory (e.g. from `skopeo copy ... oci:DIR`).
    #[arg(long, value_name = "DIR")]
    oci_layout: Option<PathBuf>,
    /// A `docker save` tarball.
    #[arg(long, value_name = "TAR")]
    docker_archive: Option<PathBuf>,
    /// Snapshot this running sandbox as the template.
    #[arg(long, value_name = "ID")]
    from_sandbox: Option<String>,
    /// A template sandfork ships: `code-interpreter` (Jupyter and the
    /// server `e2b_code_interpreter` talks to on port 49999).
    #[arg(long, value_name = "NAME")]
    builtin: Option<String>,
    /// Started in the background in every sandbox (`/bin/sh -c`).
    #[arg(long, value_name = "CMD")]
    start_cmd: Option<String>,
    /// Run each second until it exits 0 before the snapshot is taken.
    #[arg(long, value_name = "CMD")]
    ready_cmd: Option<String>,
    #[arg(long)]
    vcpus: Option<u8>,
    #[arg(long, value_name = "MIB")]
    memory_mb: Option<u64>,
    /// Print the finished build's status as JSON instead of the id.
    #[arg(long)]
    json: bool,
}

pub async fn run(cmd: TemplateCommand) -> Result<ExitCode> {
    let node = Node::from_config()?;
    match cmd {
        TemplateCommand::Build(args) => build(&node, args).await,
        TemplateCommand::Ls { json } => ls(&node, json).await,
        TemplateCommand::Rm { ids } => {
            let mut failed = false;
            for id in ids {
                match node
                    .call("DELETE", &format!("/templates/{}", escape(&id)), None)
                    .await
                {
                    Ok(_) => println!("{id}"),
                    Err(e @ (NodeError::Unreachable { .. } | NodeError::Unauthorized(_))) => {
                        return Err(e.into());
                    }
                    Err(NodeError::Api { status: 404, .. }) => {
                        eprintln!(
                            "sandfork: error: no template {id}; `sandfork template ls` lists them"
                        );
                        failed = true;
                    }
                    Err(e) => {
                        eprintln!("sandfork: error: {e}");
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
    }
}

/// A path the node can open: absolute (the node runs on this machine).
fn absolute(p: &Path) -> Result<String> {
    let abs = std::fs::canonicalize(p).with_context(|| format!("{}", p.display()))?;
    Ok(abs.display().to_string())
}

/// The `POST /templates` body.
fn build_body(args: &BuildArgs) -> Result<Value> {
    let from = if !args.packages.is_empty() {
        json!({ "debian_packages": args.packages })
    } else if let Some(p) = &args.oci_layout {
        json!({ "oci_layout": absolute(p)? })
    } else if let Some(p) = &args.docker_archive {
        json!({ "docker_archive": absolute(p)? })
    } else if let Some(id) = &args.from_sandbox {
        json!({ "sandbox": id })
    } else if let Some(name) = &args.builtin {
        json!({ "builtin": name })
    } else {
        bail!(
            "say what to build from: --packages, --oci-layout, --docker-archive, --from-sandbox or --builtin"
        );
    };
    let mut body = json!({ "name": args.name, "from": from });
    let optional = [
        ("start_cmd", args.start_cmd.clone().map(Value::from)),
        ("ready_cmd", args.ready_cmd.clone().map(Value::from)),
        ("vcpus", args.vcpus.map(Value::from)),
        ("memory_mb", args.memory_mb.map(Value::from)),
    ];
    for (k, v) in optional {
        if let Some(v) = v {
            body[k] = v;
        }
    }
    Ok(body)
}

async fn build(node: &Node, args: BuildArgs) -> Result<ExitCode> {
    let body = build_body(&args)?;
    let started: Value = match node.json("POST", "/templates", Some(&body)).await {
        Err(NodeError::Api { status: 404, .. }) if args.from_sandbox.is_some() => {
            let id = args.from_sandbox.as_deref().unwrap_or_default();
            bail!("no sandbox {id}; `sandfork ls` lists them")
        }
        r => r?,
    };
    let (id, build_id) = (field(&started, "templateID"), field(&started, "buildID"));
    let progress = Spinner::announced(&format!("building {} ({id})", args.name));
    let mut offset = 0usize;
    let status = loop {
        let path = format!(
            "/templates/{}/builds/{}/status?logsOffset={offset}",
            escape(id),
            escape(build_id)
        );
        let status: Value = node.json("GET", &path, None).await?;
        let lines = status.get("logs").and_then(Value::as_array);
        if let Some(lines) = lines.filter(|l| !l.is_empty()) {
            for line in lines {
                progress.log(line.as_str().unwrap_or_default());
            }
            offset += lines.len();
        }
        match field(&status, "status") {
            "building" => {}
            _ => break status,
        }
        tokio::time::sleep(POLL).await;
    };
    let took = progress.elapsed();
    drop(progress);
    match field(&status, "status") {
        "ready" => {
            if args.json {
                output::print_json(&status)?;
            } else {
                eprintln!("built {} in {}", args.name, output::short(took));
                println!("{id}");
            }
            Ok(ExitCode::SUCCESS)
        }
        other => {
            let reason = status
                .pointer("/reason/message")
                .and_then(Value::as_str)
                .unwrap_or(other);
            bail!("the build of {} failed: {reason}", args.name)
        }
    }
}

async fn ls(node: &Node, json: bool) -> Result<ExitCode> {
    let list: Vec<Value> = node.json("GET", "/templates", None).await?;
    if output::wants_json(json) {
        output::print_json(&Value::Array(list))?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|t| {
            let names = t
                .get("names")
                .and_then(Value::as_array)
                .map(|n| {
                    n.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            vec![
                field(t, "templateID").to_owned(),
                names,
                field(t, "kind").to_owned(),
                field(t, "buildStatus").to_owned(),
                format!(
                    "{}/{}M",
                    t.get("cpuCount").and_then(Value::as_u64).unwrap_or(0),
                    t.get("memoryMB").and_then(Value::as_u64).unwrap_or(0)
                ),
                output::relative(field(t, "createdAt")),
            ]
        })
        .collect();
    output::print_table(
        &["ID", "NAMES", "KIND", "STATUS", "CPU/MEM", "CREATED"],
        &rows,
    )?;
    Ok(ExitCode::SUCCESS)
}
