//! The `filesystem.Filesystem` Connect handlers (spec §3.4).

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use envd_proto::filesystem::{
    CreateWatcherRequest, CreateWatcherResponse, Empty, EntryResponse, FilesystemEvent,
    GetWatcherEventsRequest, GetWatcherEventsResponse, ListDirRequest, ListDirResponse,
    MakeDirRequest, MoveRequest, PATH_CREATE_WATCHER, PATH_GET_WATCHER_EVENTS, PATH_LIST_DIR,
    PATH_MAKE_DIR, PATH_MOVE, PATH_REMOVE, PATH_REMOVE_WATCHER, PATH_STAT, PATH_WATCH_DIR,
    RemoveRequest, RemoveWatcherRequest, StatRequest, WatchDirRequest, WatchDirResponse,
};
use envd_proto::{Code, ConnectError};

use super::as_user::{Creds, run_as};
use super::error::FsError;
use super::ops;
use super::watch::DirWatcher;
use crate::envd::Envd;
use crate::envd::connect::{
    ConnectErr, ConnectJson, StreamRequest, StreamSender, Unary, UnaryResult, stream_error,
    stream_response, timeout,
};
use crate::envd::user::{RequestUser, User};

pub fn router() -> Router<Envd> {
    Router::new()
        .route(PATH_STAT, post(stat))
        .route(PATH_MAKE_DIR, post(make_dir))
        .route(PATH_MOVE, post(move_entry))
        .route(PATH_LIST_DIR, post(list_dir))
        .route(PATH_REMOVE, post(remove))
        .route(PATH_WATCH_DIR, post(watch_dir))
        .route(PATH_CREATE_WATCHER, post(create_watcher))
        .route(PATH_GET_WATCHER_EVENTS, post(get_watcher_events))
        .route(PATH_REMOVE_WATCHER, post(remove_watcher))
}

/// Paths that must name something: an empty one would mean the home directory,
/// which nobody removes or moves by accident.
fn required(path: &str, what: &str) -> Result<(), ConnectErr> {
    if path.is_empty() {
        return Err(ConnectErr(ConnectError::invalid_argument(format!(
            "{what} is required"
        ))));
    }
    Ok(())
}

async fn stat(
    RequestUser(user): RequestUser,
    ConnectJson(req): ConnectJson<StatRequest>,
) -> UnaryResult<EntryResponse> {
    let path = user.resolve_path(&req.path);
    let entry = run_as(&Creds::from(&user), move || ops::stat(&path)).await?;
    Ok(Unary(EntryResponse { entry: Some(entry) }))
}

async fn make_dir(
    RequestUser(user): RequestUser,
    ConnectJson(req): ConnectJson<MakeDirRequest>,
) -> UnaryResult<EntryResponse> {
    let path = user.resolve_path(&req.path);
    let entry = run_as(&Creds::from(&user), move || ops::make_dir(&path)).await?;
    Ok(Unary(EntryResponse { entry: Some(entry) }))
}

async fn move_entry(
    RequestUser(user): RequestUser,
    ConnectJson(req): ConnectJson<MoveRequest>,
) -> UnaryResult<EntryResponse> {
    required(&req.source, "source")?;
    required(&req.destination, "destination")?;
    let from = user.resolve_path(&req.source);
    let to = user.resolve_path(&req.destination);
    let entry = run_as(&Creds::from(&user), move || ops::rename(&from, &to)).await?;
    Ok(Unary(EntryResponse { entry: Some(entry) }))
}

async fn list_dir(
    RequestUser(user): RequestUser,
    ConnectJson(req): ConnectJson<ListDirRequest>,
) -> UnaryResult<ListDirResponse> {
    let path = user.resolve_path(&req.path);
    let entries = run_as(&Creds::from(&user), move || ops::list_dir(&path, req.depth)).await?;
    Ok(Unary(ListDirResponse { entries }))
}

async fn remove(
    RequestUser(user): RequestUser,
    ConnectJson(req): ConnectJson<RemoveRequest>,
) -> UnaryResult<Empty> {
    required(&req.path, "path")?;
    let path = user.resolve_path(&req.path);
    run_as(&Creds::from(&user), move || ops::remove(&path)).await?;
    Ok(Unary(Empty {}))
}

async fn new_watcher(user: &User, req: &WatchDirRequest) -> Result<DirWatcher, ConnectError> {
    let path = user.resolve_path(&req.path);
    DirWatcher::new(path, req.recursive, req.include_entry, Creds::from(user))
        .await
        .map_err(ConnectError::from)
}

/// `Keepalive-Ping-Interval` (seconds) as the client asks, else the SDK's 50 s.
fn keepalive_interval(headers: &HeaderMap) -> Duration {
    let secs = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(50);
    Duration::from_secs(secs.clamp(1, 3600))
}

async fn watch_dir(RequestUser(user): RequestUser, req: StreamRequest) -> Response {
    let StreamRequest { headers, mut body } = req;
    let msg: WatchDirRequest = match body.single().await {
        Ok(m) => m,
        Err(e) => return stream_error(e),
    };
    let deadline = match timeout(&headers) {
        Ok(d) => d.filter(|d| !d.is_zero()),
        Err(e) => return stream_error(e),
    };
    let mut watcher = match new_watcher(&user, &msg).await {
        Ok(w) => w,
        Err(e) => return stream_error(e),
    };
    let every = keepalive_interval(&headers);
    let (tx, response) = stream_response(64);
    // The watcher runs in its own task and hands over whole batches: a batch
    // read from inotify must never be dropped half-way by the select below.
    let (batch_tx, mut batches) = tokio::sync::mpsc::channel(16);
    let producer = tokio::spawn(async move {
        loop {
            let batch = watcher.next().await;
            let last = !matches!(batch, Ok(Some(_)));
            if batch_tx.send(batch).await.is_err() || last {
                break;
            }
        }
    });
    tokio::spawn(async move {
        let outcome = stream_events(&tx, &mut batches, every, deadline).await;
        producer.abort();
        if let Some(outcome) = outcome {
            tx.end(outcome).await;
        }
    });
    response
}

/// Sends `start`, then events and keepalives until the watch ends. Returns the
/// end-stream error (None for success), or None if the client went away.
async fn stream_events(
    tx: &StreamSender,
    batches: &mut tokio::sync::mpsc::Receiver<Result<Option<Vec<FilesystemEvent>>, FsError>>,
    every: Duration,
    deadline: Option<Duration>,
) -> Option<Option<ConnectError>> {
    tx.send(&WatchDirResponse::Start(Empty {})).await.ok()?;
    let expiry = async {
        match deadline {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expiry);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            batch = batches.recv() => match batch {
                Some(Ok(Some(events))) => {
                    for e in events {
                        tx.send(&WatchDirResponse::Filesystem(e)).await.ok()?;
                    }
                }
                Some(Ok(None)) | None => return Some(None),
                Some(Err(e)) => return Some(Some(ConnectError::from(e))),
            },
            _ = ticker.tick() => {
                tx.send(&WatchDirResponse::Keepalive(Empty {})).await.ok()?;
            }
            _ = &mut expiry => {
                return Some(Some(ConnectError::new(
                    Code::DeadlineExceeded,
                    "watch deadline exceeded",
                )));
            }
            _ = tx.closed() => return None,
        }
    }
}

async fn create_watcher(
    State(envd): State<Envd>,
    RequestUser(user): RequestUser,
    ConnectJson(req): ConnectJson<CreateWatcherRequest>,
) -> UnaryResult<CreateWatcherResponse> {
    let watcher = new_watcher(&user, &req).await?;
    let watcher_id = envd.watchers.add(watcher);
    Ok(Unary(CreateWatcherResponse { watcher_id }))
}

async fn get_watcher_events(
    State(envd): State<Envd>,
    ConnectJson(req): ConnectJson<GetWatcherEventsRequest>,
) -> UnaryResult<GetWatcherEventsResponse> {
    match envd.watchers.take(&req.watcher_id) {
        Some(events) => Ok(Unary(GetWatcherEventsResponse { events })),
        None => Err(unknown_watcher(&req.watcher_id)),
    }
}

async fn remove_watcher(
    State(envd): State<Envd>,
    ConnectJson(req): ConnectJson<RemoveWatcherRequest>,
) -> UnaryResult<Empty> {
    if envd.watchers.remove(&req.watcher_id) {
        Ok(Unary(Empty {}))
    } else {
        Err(unknown_watcher(&req.watcher_id))
    }
}

fn unknown_watcher(id: &str) -> ConnectErr {
    ConnectErr(ConnectError::not_found(format!("watcher {id:?} not found")))
}

impl From<FsError> for ConnectErr {
    fn from(e: FsError) -> Self {
        ConnectErr(e.into())
    }
}
