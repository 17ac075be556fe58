//! `sandfork logs ID [-f]`: the sandbox's console and agent log
//! (`GET /v2/sandboxes/{id}/logs`), followed by polling with a cursor.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::Result;
use serde_json::Value;

use crate::client::{Node, NodeError, check_id};
use crate::output::field;

/// The node's largest page.
const PAGE: usize = 1000;
const POLL: Duration = Duration::from_secs(1);

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  sandfork logs $id\n  sandfork logs -f -t $id\n  sandfork logs $id --json | jq -r .message"
)]
pub struct LogsArgs {
    id: String,
    /// Keep printing new lines until the sandbox ends (Ctrl+C stops).
    #[arg(short, long)]
    follow: bool,
    /// Prefix each line with its time.
    #[arg(short, long)]
    timestamps: bool,
    /// One JSON object per line (the node's log entries).
    #[arg(long)]
    json: bool,
}

fn unix_ms(rfc3339: &str) -> Option<u64> {
    humantime::parse_rfc3339_weak(rfc3339)
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as u64)
}

/// Where the next page starts: entries at `ms` already printed are the
/// first `seen` of the next page (the node's cursor is inclusive).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub ms: u64,
    pub seen: usize,
}

impl Cursor {
    /// The entries of `page` not printed yet, and the cursor after them.
    pub fn advance(self, page: &[Value]) -> (Vec<&Value>, Cursor) {
        let mut next = self;
        let mut fresh = Vec::new();
        let mut skip = self.seen;
        for entry in page {
            let ms = unix_ms(field(entry, "timestamp")).unwrap_or(next.ms);
            if ms == self.ms && skip > 0 {
                skip -= 1;
                continue;
            }
            if ms == next.ms {
                next.seen += 1;
            } else {
                next = Cursor { ms, seen: 1 };
            }
            fresh.push(entry);
        }
        (fresh, next)
    }
}

pub async fn run(args: LogsArgs) -> Result<ExitCode> {
    let node = Node::from_config()?;
    check_id(&args.id)?;
    let mut cursor = Cursor::default();
    loop {
        let path = format!(
            "/v2/sandboxes/{}/logs?cursor={}&limit={PAGE}&direction=forward",
            args.id, cursor.ms
        );
        let answer = match node.sandbox_call(&args.id, "GET", &path, None).await {
            Err(NodeError::NoSandbox(_)) if args.follow && cursor != Cursor::default() => {
                eprintln!("sandfork: sandbox {} is gone", args.id);
                return Ok(ExitCode::SUCCESS);
            }
            r => r?,
        };
        let body: Value = crate::client::parse(&path, &answer.body)?;
        let page = body
            .get("logs")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let (fresh, next) = cursor.advance(&page);
        {
            let mut out = std::io::stdout().lock();
            for entry in &fresh {
                if args.json {
                    writeln!(out, "{entry}")?;
                } else if args.timestamps {
                    writeln!(
                        out,
                        "{}  {}",
                        field(entry, "timestamp"),
                        field(entry, "message")
                    )?;
                } else {
                    writeln!(out, "{}", field(entry, "message"))?;
                }
            }
            out.flush()?;
        }
        cursor = next;
        if page.len() >= PAGE {
            continue;
        }
        if !args.follow {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn e(ts: &str, m: &str) -> Value {
        json!({"timestamp": ts, "message": m})
    }

    #[test]
    fn cursor_skips_what_was_printed_at_its_millisecond() {
        let t1 = "2026-01-01T00:00:00.001Z";
        let t2 = "2026-01-01T00:00:00.002Z";
        let page = [e(t1, "a"), e(t2, "b"), e(t2, "c")];
        let (fresh, c) = Cursor::default().advance(&page);
        assert_eq!(fresh.len(), 3);
        assert_eq!(c.seen, 2);
        assert_eq!(c.ms, unix_ms(t2).unwrap());
        // The next poll starts at t2: b and c again, then a new d at t2.
        let page = [e(t2, "b"), e(t2, "c"), e(t2, "d")];
        let (fresh, c) = c.advance(&page);
        assert_eq!(fresh.len(), 1);
        assert_eq!(fresh[0]["message"], "d");
        assert_eq!(c.seen, 3);
        // Nothing new.
        let (fresh, c2) = c.advance(&page);
        assert!(fresh.is_empty());
        assert_eq!(c2, c);
    }
}
