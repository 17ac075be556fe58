//! `sandfork cp SRC DST`: one file to or from a sandbox (`ID:/path` on one
//! side), streamed both ways through envd's `/files`, so size is no limit.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::client::Node;
use crate::client::envd::Sandbox;
use crate::client::http::Body;

const CHUNK: usize = 256 * 1024;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork cp ./data.csv $id:/tmp/data.csv\n  sandfork cp $id:/var/log/app.log .\n  sandfork cp $id:/tmp/out.tar - | tar x\n  tar c src | sandfork cp - $id:/tmp/src.tar\n\nA path in a sandbox is ID:/path; `-` is standard input or output."
)]
pub struct CpArgs {
    src: String,
    dst: String,
    /// The guest user whose permissions apply [default: the sandbox's default user].
    #[arg(long, short)]
    user: Option<String>,
}

/// One side of a copy.
#[derive(Debug, PartialEq, Eq)]
pub enum Place {
    Local(PathBuf),
    Stdio,
    Sandbox { id: String, path: String },
}

/// `ID:/path` names a sandbox's file (ids are lowercase letters and digits);
/// anything else is local.
pub fn place(s: &str) -> Place {
    if s == "-" {
        return Place::Stdio;
    }
    if let Some((id, path)) = s.split_once(':')
        && !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Place::Sandbox {
            id: id.to_owned(),
            path: path.to_owned(),
        };
    }
    Place::Local(PathBuf::from(s))
}

fn base_name(path: &str) -> Option<&str> {
    path.rsplit('/').next().filter(|n| !n.is_empty())
}

/// A reader as a streamed request body.
fn stream_body<R: AsyncRead + Unpin + Send + Sync + 'static>(reader: R) -> Body {
    let chunks = futures_util::stream::unfold(reader, |mut r| async move {
        let mut buf = vec![0u8; CHUNK];
        match r.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Frame::data(Bytes::from(buf))), r))
            }
            Err(e) => Some((Err(e), r)),
        }
    });
    StreamBody::new(chunks).boxed()
}

pub async fn run(args: CpArgs) -> Result<ExitCode> {
    match (place(&args.src), place(&args.dst)) {
        (Place::Sandbox { .. }, Place::Sandbox { .. }) => {
            bail!("both sides are in a sandbox; copy to a local file first")
        }
        (Place::Local(_) | Place::Stdio, Place::Local(_) | Place::Stdio) => {
            bail!("neither side is in a sandbox; write one as ID:/path")
        }
        (from, Place::Sandbox { id, path }) => upload(from, &id, &path, args.user).await,
        (Place::Sandbox { id, path }, to) => download(&id, &path, to, args.user).await,
    }
}

async fn upload(from: Place, id: &str, path: &str, user: Option<String>) -> Result<ExitCode> {
    if path.is_empty() {
        bail!("no path after {id}: (write {id}:/path/in/sandbox)");
    }
    let node = Node::from_config()?;
    let (body, len, name) = match &from {
        Place::Local(local) => {
            let file = tokio::fs::File::open(local)
                .await
                .with_context(|| format!("opening {}", local.display()))?;
            let meta = file.metadata().await?;
            if meta.is_dir() {
                bail!(
                    "{} is a directory; cp copies one file (pack it: `tar c DIR | sandfork cp - {id}:/tmp/dir.tar`)",
                    local.display()
                );
            }
            let name = local.file_name().map(|n| n.to_string_lossy().into_owned());
            (stream_body(file), Some(meta.len()), name)
        }
        _ => (stream_body(tokio::io::stdin()), None, None),
    };
    // A target ending in `/` is a directory: the file keeps its name.
    let target = match (path.ends_with('/'), name) {
        (true, Some(n)) => format!("{path}{n}"),
        (true, None) => bail!("{id}:{path} is a directory; name the file to write from stdin"),
        (false, _) => path.to_owned(),
    };
    let sandbox = Sandbox::open(&node, id, user).await?;
    sandbox.upload(&target, body, len).await?;
    Ok(ExitCode::SUCCESS)
}

async fn download(id: &str, path: &str, to: Place, user: Option<String>) -> Result<ExitCode> {
    if path.is_empty() {
        bail!("no path after {id}: (write {id}:/path/in/sandbox)");
    }
    let node = Node::from_config()?;
    let sandbox = Sandbox::open(&node, id, user).await?;
    let local = match to {
        Place::Local(p) if p.is_dir() => {
            let name = base_name(path).with_context(|| format!("{id}:{path} names no file"))?;
            Some(p.join(name))
        }
        Place::Local(p) => Some(p),
        _ => None,
    };
    let response = sandbox.download(path).await?;
    let mut body = response.into_body();
    let (mut sink, name): (Box<dyn AsyncWrite + Unpin>, PathBuf) = match local {
        Some(p) => {
            let file = tokio::fs::File::create(&p)
                .await
                .with_context(|| format!("creating {}", p.display()))?;
            (Box::new(file), p)
        }
        None => (Box::new(tokio::io::stdout()), PathBuf::from("-")),
    };
    while let Some(frame) = body.frame().await {
        let frame = frame.context("the download was cut off")?;
        if let Ok(data) = frame.into_data() {
            sink.write_all(&data)
                .await
                .with_context(|| format!("writing {}", name.display()))?;
        }
    }
    sink.flush().await?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_sandbox_paths_only_with_an_id_before_the_colon() {
        assert_eq!(
            place("abc123:/tmp/x"),
            Place::Sandbox {
                id: "abc123".into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(place("-"), Place::Stdio);
        assert_eq!(place("./a:b"), Place::Local("./a:b".into()));
        assert_eq!(place("/x:y"), Place::Local("/x:y".into()));
        assert_eq!(place("C:stuff"), Place::Local("C:stuff".into()));
        assert_eq!(place("file.txt"), Place::Local("file.txt".into()));
        assert_eq!(base_name("/a/b.txt"), Some("b.txt"));
        assert_eq!(base_name("/a/"), None);
    }
}
