//! A client for the API over its Unix socket, for sandfork's VMM and real Firecracker
//! alike: the node server, the CLI and the benchmarks drive both through it.
//!
//! One connection per request: the socket is local, a connect costs microseconds, and it
//! keeps the client free of pooling state and of keep-alive races with a VMM that exits.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

use vmm_api::{
    ActionType, ApiError, Balloon, BalloonStats, BalloonStatsUpdate, BalloonUpdate, BootSource,
    Drive, InstanceActionInfo, InstanceInfo, MachineConfig, MachineConfigUpdate, NetworkInterface,
    PartialDrive, SnapshotCreateParams, SnapshotLoadParams, Vm, VmConfig, VmState, Vsock,
    validate_resource_id,
};

/// How often [`VmmClient::wait_for_socket`] retries.
const SOCKET_POLL_INTERVAL: Duration = Duration::from_millis(2);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The VMM answered with an error status; `fault_message` is its explanation (or the
    /// raw body when it was not the usual JSON).
    #[error("VMM API error {status}: {fault_message}")]
    Api { status: u16, fault_message: String },
    #[error("I/O error on API socket {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("HTTP error on API socket: {0}")]
    Http(#[from] hyper::Error),
    /// A success response whose body is not what the route returns.
    #[error("cannot decode API response: {0}")]
    Decode(#[from] serde_json::Error),
    /// The request could not be built (e.g. a drive id that is not a valid path segment).
    #[error("invalid API request: {0}")]
    InvalidRequest(String),
    #[error("API socket {} not accepting connections after {waited:?}", path.display())]
    Timeout { path: PathBuf, waited: Duration },
    #[error("the VMM at {} did not answer {method} {route} within {waited:?}", path.display())]
    NoAnswer {
        path: PathBuf,
        method: Method,
        route: String,
        waited: Duration,
    },
}

/// A response as received, for callers of [`VmmClient::request`].
#[derive(Debug, Clone)]
pub struct RawResponse {
    pub status: u16,
    pub body: Bytes,
}

/// How long one request may take before the client gives up: a VMM that
/// stops answering must not hang its caller.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct VmmClient {
    socket_path: PathBuf,
    request_timeout: Duration,
}

impl VmmClient {
    pub fn new(socket_path: impl Into<PathBuf>) -> Self {
        Self {
            socket_path: socket_path.into(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// The same client with another per-request timeout.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Waits until the socket accepts connections (a freshly spawned VMM creates it a
    /// little after starting). Errors other than "not there yet" end the wait at once.
    pub async fn wait_for_socket(&self, timeout: Duration) -> Result<(), ClientError> {
        let start = Instant::now();
        loop {
            match UnixStream::connect(&self.socket_path).await {
                Ok(_) => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) => {}
                Err(e) => return Err(self.io_error(e)),
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(ClientError::Timeout {
                    path: self.socket_path.clone(),
                    waited,
                });
            }
            tokio::time::sleep(SOCKET_POLL_INTERVAL.min(timeout - waited)).await;
        }
    }

    pub async fn get_instance_info(&self) -> Result<InstanceInfo, ClientError> {
        self.get_json("/").await
    }

    /// What each vCPU thread is doing (sandfork extension), for diagnostics.
    pub async fn get_vcpus(&self) -> Result<Vec<vmm_api::VcpuReport>, ClientError> {
        self.get_json("/vcpus").await
    }

    pub async fn get_devices(&self) -> Result<Vec<vmm_api::DeviceReport>, ClientError> {
        self.get_json("/devices").await
    }

    pub async fn get_machine_config(&self) -> Result<MachineConfig, ClientError> {
        self.get_json("/machine-config").await
    }

    pub async fn get_vm_config(&self) -> Result<VmConfig, ClientError> {
        self.get_json("/vm/config").await
    }

    pub async fn put_machine_config(&self, config: &MachineConfig) -> Result<(), ClientError> {
        self.send_json(Method::PUT, "/machine-config", config).await
    }

    pub async fn patch_machine_config(
        &self,
        update: &MachineConfigUpdate,
    ) -> Result<(), ClientError> {
        self.send_json(Method::PATCH, "/machine-config", update)
            .await
    }

    pub async fn put_boot_source(&self, boot: &BootSource) -> Result<(), ClientError> {
        self.send_json(Method::PUT, "/boot-source", boot).await
    }

    pub async fn put_drive(&self, drive: &Drive) -> Result<(), ClientError> {
        let path = drive_path(&drive.drive_id)?;
        self.send_json(Method::PUT, &path, drive).await
    }

    pub async fn patch_drive(&self, drive: &PartialDrive) -> Result<(), ClientError> {
        let path = drive_path(&drive.drive_id)?;
        self.send_json(Method::PATCH, &path, drive).await
    }

    pub async fn put_vsock(&self, vsock: &Vsock) -> Result<(), ClientError> {
        self.send_json(Method::PUT, "/vsock", vsock).await
    }

    pub async fn put_network_interface(&self, net: &NetworkInterface) -> Result<(), ClientError> {
        validate_resource_id("iface_id", &net.iface_id)
            .map_err(|e| ClientError::InvalidRequest(e.to_string()))?;
        let path = format!("/network-interfaces/{}", net.iface_id);
        self.send_json(Method::PUT, &path, net).await
    }

    /// `PUT /balloon`, before boot.
    pub async fn put_balloon(&self, balloon: &Balloon) -> Result<(), ClientError> {
        self.send_json(Method::PUT, "/balloon", balloon).await
    }

    pub async fn get_balloon(&self) -> Result<Balloon, ClientError> {
        self.get_json("/balloon").await
    }

    /// `PATCH /balloon`: a new target size.
    pub async fn patch_balloon(&self, amount_mib: u32) -> Result<(), ClientError> {
        self.send_json(Method::PATCH, "/balloon", &BalloonUpdate { amount_mib })
            .await
    }

    pub async fn get_balloon_stats(&self) -> Result<BalloonStats, ClientError> {
        self.get_json("/balloon/statistics").await
    }

    pub async fn patch_balloon_stats(&self, interval_s: u16) -> Result<(), ClientError> {
        let update = BalloonStatsUpdate {
            stats_polling_interval_s: interval_s,
        };
        self.send_json(Method::PATCH, "/balloon/statistics", &update)
            .await
    }

    pub async fn instance_start(&self) -> Result<(), ClientError> {
        self.action(ActionType::InstanceStart).await
    }

    pub async fn send_ctrl_alt_del(&self) -> Result<(), ClientError> {
        self.action(ActionType::SendCtrlAltDel).await
    }

    pub async fn flush_metrics(&self) -> Result<(), ClientError> {
        self.action(ActionType::FlushMetrics).await
    }

    pub async fn pause(&self) -> Result<(), ClientError> {
        self.vm_state(VmState::Paused).await
    }

    pub async fn resume(&self) -> Result<(), ClientError> {
        self.vm_state(VmState::Resumed).await
    }

    pub async fn create_snapshot(&self, params: &SnapshotCreateParams) -> Result<(), ClientError> {
        self.send_json(Method::PUT, "/snapshot/create", params)
            .await
    }

    /// `PUT /fork` (sandfork's extension; Firecracker answers 400).
    pub async fn fork(
        &self,
        params: &vmm_api::ForkParams,
    ) -> Result<vmm_api::ForkInfo, ClientError> {
        let body = serde_json::to_vec(params)?;
        let resp = self.checked(Method::PUT, "/fork", Some(body)).await?;
        Ok(serde_json::from_slice(&resp.body)?)
    }

    pub async fn load_snapshot(&self, params: &SnapshotLoadParams) -> Result<(), ClientError> {
        self.send_json(Method::PUT, "/snapshot/load", params).await
    }

    async fn action(&self, action_type: ActionType) -> Result<(), ClientError> {
        self.send_json(
            Method::PUT,
            "/actions",
            &InstanceActionInfo::new(action_type),
        )
        .await
    }

    async fn vm_state(&self, state: VmState) -> Result<(), ClientError> {
        self.send_json(Method::PATCH, "/vm", &Vm { state }).await
    }

    /// `GET path`, decoding a JSON success body; for routes without a typed method.
    pub async fn get_json<R: DeserializeOwned>(&self, path: &str) -> Result<R, ClientError> {
        let resp = self.checked(Method::GET, path, None).await?;
        Ok(serde_json::from_slice(&resp.body)?)
    }

    /// `PUT`/`PATCH path` with a JSON body, expecting success with no data.
    pub async fn send_json<T: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: &T,
    ) -> Result<(), ClientError> {
        let body = serde_json::to_vec(body)?;
        self.checked(method, path, Some(body)).await.map(drop)
    }

    async fn checked(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<RawResponse, ClientError> {
        let resp = self.request(method, path, body).await?;
        if (200..300).contains(&resp.status) {
            return Ok(resp);
        }
        let fault_message = match serde_json::from_slice::<ApiError>(&resp.body) {
            Ok(e) => e.fault_message,
            Err(_) => String::from_utf8_lossy(&resp.body).into_owned(),
        };
        Err(ClientError::Api {
            status: resp.status,
            fault_message,
        })
    }

    /// Sends one request and returns whatever the VMM answered, error statuses included.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<RawResponse, ClientError> {
        let exchange = self.request_once(method.clone(), path, body);
        tokio::time::timeout(self.request_timeout, exchange)
            .await
            .map_err(|_| ClientError::NoAnswer {
                path: self.socket_path.clone(),
                method,
                route: path.to_string(),
                waited: self.request_timeout,
            })?
    }

    async fn request_once(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<RawResponse, ClientError> {
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, "localhost")
            .header(ACCEPT, "application/json");
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::InvalidRequest(e.to_string()))?;

        let stream = UnixStream::connect(&self.socket_path)
            .await
            .map_err(|e| self.io_error(e))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        // The connection future drives the socket; it finishes once `sender` is dropped
        // at the end of the exchange, so both run to completion together.
        let exchange = async move {
            let response = sender.send_request(request).await?;
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<(StatusCode, Bytes), hyper::Error>((status, body))
        };
        let (conn_result, exchange_result) = tokio::join!(conn, exchange);
        let (status, body) = exchange_result?;
        // A complete response was read; a close error after it does not matter.
        drop(conn_result);
        Ok(RawResponse {
            status: status.as_u16(),
            body,
        })
    }

    fn io_error(&self, source: io::Error) -> ClientError {
        ClientError::Io {
            path: self.socket_path.clone(),
            source,
        }
    }
}

fn drive_path(drive_id: &str) -> Result<String, ClientError> {
    validate_resource_id("drive_id", drive_id)
        .map_err(|e| ClientError::InvalidRequest(e.to_string()))?;
    Ok(format!("/drives/{drive_id}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_socket_is_an_io_error_and_wait_times_out() {
        let dir = std::env::temp_dir().join(format!("vmm-api-client-{}", std::process::id()));
        let client = VmmClient::new(dir.join("absent.sock"));
        let err = client.get_instance_info().await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound),
            "{err}"
        );

        let start = Instant::now();
        let err = client
            .wait_for_socket(Duration::from_millis(30))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err}");
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[tokio::test]
    async fn invalid_drive_id_is_refused_before_sending() {
        let client = VmmClient::new("/nonexistent/api.sock");
        let err = client
            .put_drive(&Drive::new("../etc", "/d", false, false))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::InvalidRequest(_)), "{err}");
    }

    #[tokio::test]
    async fn a_vmm_that_never_answers_is_a_timeout() {
        let dir = std::env::temp_dir().join(format!("vmm-api-silent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("silent.sock");
        let _ = std::fs::remove_file(&sock);
        // Accepts connections and reads nothing: a hung VMM.
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let _accepting = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let client = VmmClient::new(&sock).with_request_timeout(Duration::from_millis(200));
        let err = client.get_instance_info().await.unwrap_err();
        assert!(matches!(err, ClientError::NoAnswer { .. }), "{err}");
        assert!(err.to_string().contains("GET /"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
