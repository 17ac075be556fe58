//! `sandfork cluster`: helpers for running a cluster (its certificates).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;

#[derive(clap::Subcommand)]
pub enum ClusterCommand {
    /// Make a private CA and a key and certificate per part of the cluster
    /// (gateways, nodes, etcd members), for TLS with both sides
    /// authenticated between them (`serve --tls-cert/--tls-key/--tls-ca`).
    /// The CA's key is not kept: another part later needs a new set. Every
    /// file is 0600; nothing is written if any of them exists.
    ///
    /// Example: sandfork cluster certs --out /etc/sandfork/tls --names gw1,n1,n2,etcd/10.0.0.1
    Certs(CertsArgs),
}

#[derive(clap::Args)]
pub struct CertsArgs {
    /// The directory the files go to (made if missing): ca.pem, and
    /// NAME.pem and NAME-key.pem for each name.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The parts, comma-separated: NAME or NAME/ADDR[/ADDR...], the
    /// addresses (IPs or DNS names) the certificate names. Nodes and
    /// gateways need none (their peers check the CA's signature, not
    /// names); etcd members need the addresses their clients use.
    #[arg(long, value_name = "NAMES")]
    names: String,
    /// How long the certificates are valid.
    #[arg(long, default_value_t = 825)]
    days: u32,
}

pub fn run(command: ClusterCommand) -> Result<ExitCode> {
    match command {
        ClusterCommand::Certs(args) => {
            let names = sandfork_tls::parse_names(&args.names)?;
            let written = sandfork_tls::make_certs(&args.out, &names, args.days)?;
            for path in written {
                println!("{}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
