//! `sandfork completions SHELL`: the shell's completion script on stdout.

use std::process::ExitCode;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork completions bash > /etc/bash_completion.d/sandfork\n  sandfork completions zsh > \"${fpath[1]}/_sandfork\"\n  sandfork completions fish > ~/.config/fish/completions/sandfork.fish"
)]
pub struct CompletionsArgs {
    shell: clap_complete::Shell,
}

pub fn run(args: CompletionsArgs, mut cli: clap::Command) -> ExitCode {
    clap_complete::generate(args.shell, &mut cli, "sandfork", &mut std::io::stdout());
    ExitCode::SUCCESS
}
