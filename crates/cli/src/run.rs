//! `sandfork run [TEMPLATE]`: a new sandbox with an interactive shell on a
//! pseudo-terminal (the terminal session itself is `session::attach`, which
//! `exec -t` uses for an existing sandbox).

use std::process::ExitCode;

use anyhow::Result;
use envd_proto::process::ProcessConfig;

use crate::client::Node;
use crate::client::envd::Sandbox;
use crate::sandboxes::{create_body, create_sandbox, key_value};
use crate::session::{attach, need_terminal};

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork run                 # a shell in a new sandbox from the base template\n  sandfork run mytemplate --rm # removed when the shell exits\n  sandfork exec -t $id -- bash # a shell in an existing sandbox\n\nThe sandbox keeps running after the shell exits unless --rm is given."
)]
pub struct RunArgs {
    /// Template id or name [default: base].
    template: Option<String>,
    /// Kill the sandbox when the shell exits.
    #[arg(long)]
    rm: bool,
    /// Seconds the sandbox may run.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
    #[arg(long, value_name = "KEY=VALUE", value_parser = key_value)]
    metadata: Vec<(String, String)>,
    #[arg(long, short, value_name = "KEY=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// The guest user of the shell [default: the sandbox's default user].
    #[arg(long, short)]
    user: Option<String>,
}

/// The shell: bash when the image has it.
const SHELL: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; else exec /bin/sh -l; fi";

pub async fn run(args: RunArgs) -> Result<ExitCode> {
    need_terminal()?;
    let node = Node::from_config()?;
    let body = create_body(
        args.template.as_deref(),
        args.timeout,
        &args.metadata,
        &args.env,
        false,
    );
    let created = create_sandbox(&node, &body).await?;
    let id = created["sandboxID"].as_str().unwrap_or_default().to_owned();
    if args.rm {
        eprintln!("sandbox {id} (removed when the shell exits)");
    } else {
        eprintln!("sandbox {id} (it keeps running after the shell exits: `sandfork rm {id}`)");
    }
    let result = async {
        let sandbox = Sandbox::open(&node, &id, args.user.clone()).await?;
        attach(
            sandbox,
            ProcessConfig {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), SHELL.into()],
                ..Default::default()
            },
        )
        .await
    }
    .await;
    if args.rm
        && let Err(e) = node
            .sandbox_call(&id, "DELETE", &format!("/sandboxes/{id}"), None)
            .await
    {
        eprintln!("sandfork: error: removing sandbox {id}: {e}");
    }
    result
}
