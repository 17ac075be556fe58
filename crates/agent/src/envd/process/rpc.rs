//! Handlers of `process.Process`, the task that supervises each started
//! process, and the loop that follows a process on one response stream.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use envd_proto::json::B64;
use envd_proto::process::{self as pb, Signal};
use envd_proto::{Code, ConnectError};
use nix::sys::signal::kill;
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};

use super::output::{CHUNK, Chunk};
use super::pty::Master;
use super::spawn::{SpawnSpec, build_env, resolve_cwd, spawn};
use super::status::end_event;
use super::table::{Proc, ProcessTable};
use crate::envd::Envd;
use crate::envd::connect::{
    self, ConnectErr, ConnectJson, EnvelopeReader, StreamRequest, StreamSender, Unary, UnaryResult,
};
use crate::envd::user::RequestUser;
use crate::reaper;

/// Keepalive interval without a `Keepalive-Ping-Interval` header.
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);
/// How long output may still drain after the process exited (a background
/// child can hold the pipes open indefinitely).
pub const EOF_GRACE: Duration = Duration::from_secs(1);
/// Bound on a stdin write when the request has no deadline.
pub const STDIN_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Messages queued on one response stream before the follower waits.
const STREAM_QUEUE: usize = 16;

pub fn router() -> Router<Envd> {
    Router::new()
        .route(pb::PATH_START, post(start))
        .route(pb::PATH_CONNECT, post(connect_process))
        .route(pb::PATH_LIST, post(list))
        .route(pb::PATH_SEND_INPUT, post(send_input))
        .route(pb::PATH_STREAM_INPUT, post(stream_input))
        .route(pb::PATH_SEND_SIGNAL, post(send_signal))
        .route(pb::PATH_CLOSE_STDIN, post(close_stdin))
        .route(pb::PATH_UPDATE, post(update))
        .route("/process.Process/{*method}", post(connect::unimplemented))
}

/// `Keepalive-Ping-Interval` in seconds; the default when absent or invalid.
fn keepalive_interval(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map_or(DEFAULT_KEEPALIVE, Duration::from_secs)
}

fn event(e: pb::ProcessEvent) -> pb::StartResponse {
    pb::StartResponse { event: e }
}

async fn start(
    State(envd): State<Envd>,
    RequestUser(user): RequestUser,
    StreamRequest { headers, mut body }: StreamRequest,
) -> Response {
    match start_process(&envd, user, &headers, &mut body).await {
        Ok(resp) => resp,
        Err(e) => connect::stream_error(e),
    }
}

async fn start_process(
    envd: &Envd,
    user: crate::envd::user::User,
    headers: &HeaderMap,
    body: &mut EnvelopeReader,
) -> Result<Response, ConnectError> {
    let lifetime = connect::timeout(headers)?;
    let keepalive = keepalive_interval(headers);
    let req: pb::StartRequest = body.single().await?;
    if req.process.cmd.is_empty() {
        return Err(ConnectError::invalid_argument("process.cmd is empty"));
    }
    let settings = envd.sandbox.settings();
    let cwd = resolve_cwd(
        &user,
        req.process.cwd.as_deref(),
        settings.default_workdir.as_deref(),
    )?;
    let spec = SpawnSpec {
        cmd: req.process.cmd.clone(),
        args: req.process.args.clone(),
        env: build_env(&user, &settings.env_vars, &req.process.envs),
        cwd,
        user,
        stdin: req.stdin.unwrap_or(true),
        pty: req.pty.map(|p| p.size.map_or((0, 0), |s| (s.cols, s.rows))),
    };
    let spawned = spawn(&spec)?;
    // No await between spawn and watch: see `reaper`.
    let status_rx = reaper::watch(spawned.pid);
    let pid = spawned.pid;
    log::info!(
        "started process {pid} ({:?} as {}{})",
        spec.cmd,
        spec.user.name,
        if spec.pty.is_some() { ", pty" } else { "" }
    );

    let fail = |what: &str, e: std::io::Error| {
        let _ = kill(Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        ConnectError::internal(format!("process {pid}: {what}: {e}"))
    };
    let stdin = match spawned.stdin {
        Some(fd) => Some(pipe::Sender::from_owned_fd(fd).map_err(|e| fail("stdin", e))?),
        None => None,
    };
    let pty = match spawned.pty_master {
        Some(fd) => Some(Master::new(fd).map_err(|e| fail("pty", e))?),
        None => None,
    };
    let proc = Arc::new(Proc::new(pid as u32, req.tag, req.process, stdin, pty));
    // Subscribed before any output is read: the Start stream sees all of it.
    let rx = proc.output.subscribe();
    envd.processes.insert(proc.clone());

    let mut readers = Vec::new();
    if let Some(fd) = spawned.stdout {
        readers.push(pump_pipe(fd, proc.clone(), Chunk::Stdout));
    }
    if let Some(fd) = spawned.stderr {
        readers.push(pump_pipe(fd, proc.clone(), Chunk::Stderr));
    }
    if proc.pty.is_some() {
        readers.push(tokio::spawn(pump_pty(proc.clone())));
    }
    tokio::spawn(supervise(
        proc.clone(),
        status_rx,
        readers,
        lifetime,
        envd.processes.clone(),
    ));

    let (tx, resp) = connect::stream_response(STREAM_QUEUE);
    tokio::spawn(follow(proc, rx, tx, keepalive, None));
    Ok(resp)
}

/// Copies a stdout/stderr pipe to the process's streams until EOF.
fn pump_pipe(fd: OwnedFd, proc: Arc<Proc>, wrap: fn(Bytes) -> Chunk) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut rx = match pipe::Receiver::from_owned_fd(fd) {
            Ok(rx) => rx,
            Err(e) => {
                log::error!("process {}: output pipe: {e}", proc.pid);
                return;
            }
        };
        let mut buf = vec![0u8; CHUNK];
        loop {
            match rx.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => {
                    proc.output
                        .publish(wrap(Bytes::copy_from_slice(&buf[..n])))
                        .await
                }
                Err(e) => {
                    log::debug!("process {}: output pipe: {e}", proc.pid);
                    break;
                }
            }
        }
    })
}

/// Copies the pty's output to the process's streams until every slave end is
/// closed.
async fn pump_pty(proc: Arc<Proc>) {
    let Some(master) = proc.pty.as_ref() else {
        return;
    };
    let mut buf = vec![0u8; CHUNK];
    loop {
        match master.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                proc.output
                    .publish(Chunk::Pty(Bytes::copy_from_slice(&buf[..n])))
                    .await
            }
            Err(e) => {
                log::debug!("process {}: pty: {e}", proc.pid);
                break;
            }
        }
    }
}

/// Waits for the exit (killing the process when its lifetime runs out), lets
/// the output drain, then publishes the end and retires the process.
async fn supervise(
    proc: Arc<Proc>,
    mut status_rx: oneshot::Receiver<WaitStatus>,
    readers: Vec<JoinHandle<()>>,
    lifetime: Option<Duration>,
    table: Arc<ProcessTable>,
) {
    let status = match lifetime {
        Some(limit) => {
            tokio::select! {
                biased;
                s = &mut status_rx => s.ok(),
                _ = tokio::time::sleep(limit) => {
                    log::info!("process {}: lifetime of {limit:?} is over; killing it", proc.pid);
                    proc.killed_by_deadline.store(true, Ordering::Relaxed);
                    let _ = kill(Pid::from_raw(proc.pid as i32), nix::sys::signal::SIGKILL);
                    status_rx.await.ok()
                }
            }
        }
        None => status_rx.await.ok(),
    };
    proc.exited.store(true, Ordering::Relaxed);
    let drain_until = Instant::now() + EOF_GRACE;
    for mut r in readers {
        if tokio::time::timeout_at(drain_until, &mut r).await.is_err() {
            // Something (an orphaned grandchild) still holds the output open.
            r.abort();
        }
    }
    let end = end_event(status);
    log::info!("process {} ended: {}", proc.pid, end.status);
    proc.end.send_replace(Some(end));
    proc.output.close();
    proc.stdin.lock().await.take();
    table.mark_exited(proc.pid);
}

/// Streams one process's events on one response: start, data and keepalives,
/// then end and end-stream. Returns early (the process keeps running) when the
/// client goes away or the stream's own deadline passes.
async fn follow(
    proc: Arc<Proc>,
    mut rx: mpsc::Receiver<Chunk>,
    tx: StreamSender,
    keepalive: Duration,
    deadline: Option<Duration>,
) {
    let start = pb::ProcessEvent::Start(pb::StartEvent { pid: proc.pid });
    if tx.send(&event(start)).await.is_err() {
        return;
    }
    let mut end_rx = proc.end.subscribe();
    let deadline_at = deadline.map(|d| Instant::now() + d);
    let mut ping_at = Instant::now() + keepalive;
    let mut output_open = true;
    loop {
        tokio::select! {
            biased;
            chunk = rx.recv(), if output_open => match chunk {
                Some(c) => {
                    if tx.send(&data_event(c)).await.is_err() {
                        return;
                    }
                    ping_at = Instant::now() + keepalive;
                }
                None => output_open = false,
            },
            // The watch guard must not live across an await: drop it inside.
            _ = async { end_rx.wait_for(Option::is_some).await.map(|_| ()) } => break,
            _ = sleep_until(ping_at) => {
                let ka = pb::ProcessEvent::Keepalive(pb::KeepAlive {});
                if tx.send(&event(ka)).await.is_err() {
                    return;
                }
                ping_at = Instant::now() + keepalive;
            }
            _ = sleep_until(deadline_at.unwrap_or_else(Instant::now)), if deadline_at.is_some() => {
                tx.end(Some(ConnectError::new(Code::DeadlineExceeded, "stream deadline exceeded"))).await;
                return;
            }
            _ = tx.closed() => return,
        }
    }
    while let Ok(c) = rx.try_recv() {
        if tx.send(&data_event(c)).await.is_err() {
            return;
        }
    }
    let end = proc.end.borrow().clone().unwrap_or_default();
    if tx.send(&event(pb::ProcessEvent::End(end))).await.is_err() {
        return;
    }
    let error = proc.killed_by_deadline.load(Ordering::Relaxed).then(|| {
        ConnectError::new(
            Code::DeadlineExceeded,
            "process lifetime (connect-timeout-ms) exceeded; killed",
        )
    });
    tx.end(error).await;
}

fn data_event(c: Chunk) -> pb::StartResponse {
    let data = match c {
        Chunk::Stdout(b) => pb::DataEvent::Stdout(B64(b)),
        Chunk::Stderr(b) => pb::DataEvent::Stderr(B64(b)),
        Chunk::Pty(b) => pb::DataEvent::Pty(B64(b)),
    };
    event(pb::ProcessEvent::Data(data))
}

async fn connect_process(
    State(envd): State<Envd>,
    StreamRequest { headers, mut body }: StreamRequest,
) -> Response {
    let setup = async {
        let deadline = connect::timeout(&headers)?;
        let req: pb::ConnectRequest = body.single().await?;
        let proc = envd.processes.find_any(&req.process)?;
        Ok::<_, ConnectError>((proc, deadline))
    };
    let (proc, deadline) = match setup.await {
        Ok(x) => x,
        Err(e) => return connect::stream_error(e),
    };
    let rx = if proc.has_exited() {
        // Output is over; a receiver whose sender is gone reads as such.
        mpsc::channel(1).1
    } else {
        proc.output.subscribe()
    };
    let (tx, resp) = connect::stream_response(STREAM_QUEUE);
    tokio::spawn(follow(proc, rx, tx, keepalive_interval(&headers), deadline));
    resp
}

async fn list(
    State(envd): State<Envd>,
    ConnectJson(_): ConnectJson<pb::ListRequest>,
) -> UnaryResult<pb::ListResponse> {
    Ok(Unary(pb::ListResponse {
        processes: envd.processes.list(),
    }))
}

fn precondition(msg: impl Into<String>) -> ConnectError {
    ConnectError::new(Code::FailedPrecondition, msg)
}

/// Writes input to a process: to its pty, or its stdin pipe.
async fn write_input(
    proc: &Proc,
    input: pb::ProcessInput,
    limit: Duration,
) -> Result<(), ConnectError> {
    let write = async {
        match input {
            // Stdin input to a pty process goes to the terminal.
            pb::ProcessInput::Pty(data) | pb::ProcessInput::Stdin(data) if proc.pty.is_some() => {
                let master = proc.pty.as_ref().ok_or_else(|| precondition("no pty"))?;
                master.write_all(&data.0).await.map_err(|e| {
                    ConnectError::internal(format!(
                        "writing to the pty of process {}: {e}",
                        proc.pid
                    ))
                })
            }
            pb::ProcessInput::Pty(_) => {
                Err(precondition(format!("process {} has no pty", proc.pid)))
            }
            pb::ProcessInput::Stdin(data) => {
                let mut stdin = proc.stdin.lock().await;
                let Some(pipe) = stdin.as_mut() else {
                    return Err(precondition(if proc.has_stdin {
                        format!("stdin of process {} is closed", proc.pid)
                    } else {
                        format!("process {} was started without stdin", proc.pid)
                    }));
                };
                pipe.write_all(&data.0).await.map_err(|e| {
                    ConnectError::internal(format!("writing to stdin of process {}: {e}", proc.pid))
                })
            }
        }
    };
    timeout(limit, write).await.unwrap_or_else(|_| {
        Err(ConnectError::new(
            Code::DeadlineExceeded,
            format!("process {} is not reading its input", proc.pid),
        ))
    })
}

fn write_limit(headers: &HeaderMap) -> Duration {
    connect::timeout(headers)
        .ok()
        .flatten()
        .unwrap_or(STDIN_WRITE_TIMEOUT)
}

async fn send_input(
    State(envd): State<Envd>,
    headers: HeaderMap,
    ConnectJson(req): ConnectJson<pb::SendInputRequest>,
) -> UnaryResult<pb::SendInputResponse> {
    let proc = envd.processes.find_live(&req.process)?;
    if let Some(input) = req.input {
        write_input(&proc, input, write_limit(&headers)).await?;
    }
    Ok(Unary(pb::SendInputResponse {}))
}

async fn stream_input(
    State(envd): State<Envd>,
    StreamRequest { headers, mut body }: StreamRequest,
) -> Response {
    let limit = write_limit(&headers);
    let result = async {
        let first: Option<pb::StreamInputRequest> = body.next_message().await?;
        let Some(pb::StreamInputRequest::Start(start)) = first else {
            return Err(ConnectError::invalid_argument(
                "the first StreamInput message must be start",
            ));
        };
        let proc = envd.processes.find_live(&start.process)?;
        // Each envelope is handled as soon as it arrives.
        while let Some(msg) = body.next_message::<pb::StreamInputRequest>().await? {
            match msg {
                pb::StreamInputRequest::Data(d) => {
                    if let Some(input) = d.input {
                        write_input(&proc, input, limit).await?;
                    }
                }
                pb::StreamInputRequest::Keepalive(_) => {}
                pb::StreamInputRequest::Start(_) => {
                    return Err(ConnectError::invalid_argument("start sent twice"));
                }
            }
        }
        Ok(pb::StreamInputResponse {})
    }
    .await;
    connect::client_stream_response(result)
}

async fn send_signal(
    State(envd): State<Envd>,
    ConnectJson(req): ConnectJson<pb::SendSignalRequest>,
) -> UnaryResult<pb::SendSignalResponse> {
    let sig = match req.signal {
        Signal::Sigkill => nix::sys::signal::SIGKILL,
        Signal::Sigterm => nix::sys::signal::SIGTERM,
        Signal::Unspecified => {
            return Err(ConnectErr(ConnectError::invalid_argument(
                "signal is unspecified",
            )));
        }
    };
    let proc = envd.processes.find_live(&req.process)?;
    match kill(Pid::from_raw(proc.pid as i32), sig) {
        Ok(()) => Ok(Unary(pb::SendSignalResponse {})),
        Err(nix::errno::Errno::ESRCH) => Err(ConnectErr(ConnectError::not_found(format!(
            "process with pid {} not found",
            proc.pid
        )))),
        Err(e) => Err(ConnectErr(ConnectError::internal(format!(
            "signalling process {}: {e}",
            proc.pid
        )))),
    }
}

async fn close_stdin(
    State(envd): State<Envd>,
    ConnectJson(req): ConnectJson<pb::CloseStdinRequest>,
) -> UnaryResult<pb::CloseStdinResponse> {
    let proc = envd.processes.find_live(&req.process)?;
    if proc.pty.is_some() {
        return Err(ConnectErr(precondition(format!(
            "process {} has a pty; send ^D (0x04) as pty input instead",
            proc.pid
        ))));
    }
    if !proc.has_stdin {
        return Err(ConnectErr(precondition(format!(
            "process {} was started without stdin",
            proc.pid
        ))));
    }
    // Dropping the writer closes the pipe: the process reads EOF.
    proc.stdin.lock().await.take();
    Ok(Unary(pb::CloseStdinResponse {}))
}

async fn update(
    State(envd): State<Envd>,
    ConnectJson(req): ConnectJson<pb::UpdateRequest>,
) -> UnaryResult<pb::UpdateResponse> {
    let proc = envd.processes.find_live(&req.process)?;
    if let Some(size) = req.pty.and_then(|p| p.size) {
        let master = proc
            .pty
            .as_ref()
            .ok_or_else(|| ConnectErr(precondition(format!("process {} has no pty", proc.pid))))?;
        master
            .resize(size.cols, size.rows)
            .map_err(|e| ConnectErr(ConnectError::internal(format!("resizing the pty: {e}"))))?;
    }
    Ok(Unary(pb::UpdateResponse {}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalive_header() {
        let mut h = HeaderMap::new();
        assert_eq!(keepalive_interval(&h), DEFAULT_KEEPALIVE);
        h.insert("keepalive-ping-interval", "50".parse().unwrap());
        assert_eq!(keepalive_interval(&h), Duration::from_secs(50));
        for bad in ["0", "-1", "x"] {
            h.insert("keepalive-ping-interval", bad.parse().unwrap());
            assert_eq!(keepalive_interval(&h), DEFAULT_KEEPALIVE, "{bad}");
        }
    }
}
