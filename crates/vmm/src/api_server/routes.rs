//! The routes of the Firecracker API and the action each one sends to the controller.

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::{get, patch, put};
use tokio::sync::oneshot;
use vmm_api::{
    ActionType, Balloon, BalloonStatsUpdate, BalloonUpdate, BootSource, Drive, ForkParams,
    InstanceActionInfo, MachineConfig, MachineConfigUpdate, NetworkInterface, PartialDrive,
    SnapshotCreateParams, SnapshotLoadParams, ValidationError, Vm, VmState, VmmAction, Vsock,
    validate_resource_id,
};

use super::channel::{ApiRequest, ApiRequestSender};
use super::request_body::parse_body;
use super::response::{bad_request, fault, from_action_error, from_data};

pub fn router(sender: ApiRequestSender) -> Router {
    Router::new()
        .route("/", get(get_instance_info))
        .route(
            "/machine-config",
            get(get_machine_config)
                .put(put_machine_config)
                .patch(patch_machine_config),
        )
        .route("/boot-source", put(put_boot_source))
        .route("/drives/{drive_id}", put(put_drive).patch(patch_drive))
        .route("/vsock", put(put_vsock))
        .route("/network-interfaces/{iface_id}", put(put_network_interface))
        .route("/actions", put(put_action))
        .route("/vm", patch(patch_vm))
        .route("/vm/config", get(get_vm_config))
        .route("/snapshot/create", put(create_snapshot))
        .route("/snapshot/load", put(load_snapshot))
        .route("/fork", put(fork))
        .route("/vcpus", get(get_vcpus))
        .route("/devices", get(get_devices))
        .route(
            "/balloon",
            get(get_balloon).put(put_balloon).patch(patch_balloon),
        )
        .route(
            "/balloon/statistics",
            get(get_balloon_stats).patch(patch_balloon_stats),
        )
        // Firecracker answers both an unknown path and a wrong method with 400.
        .fallback(invalid_method_or_path)
        .method_not_allowed_fallback(invalid_method_or_path)
        .with_state(sender)
}

async fn invalid_method_or_path(method: Method, uri: Uri) -> Response {
    bad_request(format!(
        "Invalid request method and/or path: {method} {}",
        uri.path()
    ))
}

/// Hands an action to the controller and waits for its answer.
async fn dispatch(sender: &ApiRequestSender, action: VmmAction) -> Response {
    let (reply, answer) = oneshot::channel();
    let started = std::time::Instant::now();
    if sender.send(ApiRequest { action, reply }).is_err() {
        return fault(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the VMM controller is not running",
        );
    }
    let answered = answer.await;
    tracing::debug!(
        "API: the controller answered in {} us",
        started.elapsed().as_micros()
    );
    match answered {
        Ok(Ok(data)) => from_data(data),
        Ok(Err(error)) => from_action_error(error),
        Err(_) => fault(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the VMM controller stopped before answering",
        ),
    }
}

/// Parses a body, then dispatches the action built from it.
macro_rules! body_route {
    ($name:ident, $ty:ty, $validate:expr, $action:expr) => {
        async fn $name(
            State(sender): State<ApiRequestSender>,
            headers: HeaderMap,
            body: Body,
        ) -> Response {
            match parse_body::<$ty>(&headers, body, $validate).await {
                Ok(value) => dispatch(&sender, $action(value)).await,
                Err(response) => response,
            }
        }
    };
}

fn no_check<T>(_: &T) -> Result<(), ValidationError> {
    Ok(())
}

body_route!(
    put_machine_config,
    MachineConfig,
    MachineConfig::validate,
    VmmAction::PutMachineConfig
);
body_route!(
    patch_machine_config,
    MachineConfigUpdate,
    |u: &MachineConfigUpdate| if u.is_empty() {
        Err(ValidationError::new(
            "PATCH /machine-config needs at least one field to change",
        ))
    } else {
        Ok(())
    },
    VmmAction::PatchMachineConfig
);
body_route!(
    put_boot_source,
    BootSource,
    BootSource::validate,
    VmmAction::PutBootSource
);
body_route!(put_vsock, Vsock, Vsock::validate, VmmAction::PutVsock);
body_route!(
    put_action,
    InstanceActionInfo,
    no_check,
    |a: InstanceActionInfo| match a.action_type {
        ActionType::InstanceStart => VmmAction::InstanceStart,
        ActionType::SendCtrlAltDel => VmmAction::SendCtrlAltDel,
        ActionType::FlushMetrics => VmmAction::FlushMetrics,
    }
);
body_route!(patch_vm, Vm, no_check, |vm: Vm| match vm.state {
    VmState::Paused => VmmAction::Pause,
    VmState::Resumed => VmmAction::Resume,
});
body_route!(
    create_snapshot,
    SnapshotCreateParams,
    SnapshotCreateParams::validate,
    VmmAction::CreateSnapshot
);
body_route!(fork, ForkParams, ForkParams::validate, VmmAction::Fork);
body_route!(
    load_snapshot,
    SnapshotLoadParams,
    SnapshotLoadParams::validate,
    VmmAction::LoadSnapshot
);

body_route!(
    put_balloon,
    Balloon,
    Balloon::validate,
    VmmAction::PutBalloon
);
body_route!(
    patch_balloon,
    BalloonUpdate,
    no_check,
    VmmAction::PatchBalloon
);
body_route!(
    patch_balloon_stats,
    BalloonStatsUpdate,
    no_check,
    VmmAction::PatchBalloonStats
);

async fn get_balloon(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetBalloon).await
}

async fn get_balloon_stats(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetBalloonStats).await
}

async fn get_instance_info(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetInstanceInfo).await
}

async fn get_vcpus(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetVcpus).await
}

async fn get_devices(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetDevices).await
}

async fn get_machine_config(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetMachineConfig).await
}

async fn get_vm_config(State(sender): State<ApiRequestSender>) -> Response {
    dispatch(&sender, VmmAction::GetVmConfig).await
}

async fn put_drive(
    State(sender): State<ApiRequestSender>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path_id = match checked_path_id(path, "drive_id") {
        Ok(id) => id,
        Err(e) => return bad_request(e.message),
    };
    let check = |d: &Drive| {
        same_id("drive_id", &path_id, &d.drive_id)?;
        d.validate()
    };
    match parse_body::<Drive>(&headers, body, check).await {
        Ok(drive) => dispatch(&sender, VmmAction::PutDrive(drive)).await,
        Err(response) => response,
    }
}

async fn patch_drive(
    State(sender): State<ApiRequestSender>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path_id = match checked_path_id(path, "drive_id") {
        Ok(id) => id,
        Err(e) => return bad_request(e.message),
    };
    let check = |d: &PartialDrive| {
        same_id("drive_id", &path_id, &d.drive_id)?;
        d.validate()
    };
    match parse_body::<PartialDrive>(&headers, body, check).await {
        Ok(drive) => dispatch(&sender, VmmAction::PatchDrive(drive)).await,
        Err(response) => response,
    }
}

async fn put_network_interface(
    State(sender): State<ApiRequestSender>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path_id = match checked_path_id(path, "iface_id") {
        Ok(id) => id,
        Err(e) => return bad_request(e.message),
    };
    let check = |n: &NetworkInterface| {
        same_id("iface_id", &path_id, &n.iface_id)?;
        n.validate()
    };
    match parse_body::<NetworkInterface>(&headers, body, check).await {
        Ok(net) => dispatch(&sender, VmmAction::PutNetworkInterface(net)).await,
        Err(response) => response,
    }
}

fn checked_path_id(
    path: Result<Path<String>, PathRejection>,
    field: &str,
) -> Result<String, ValidationError> {
    let Path(id) =
        path.map_err(|e| ValidationError::new(format!("invalid {field} in path: {e}")))?;
    validate_resource_id(field, &id)?;
    Ok(id)
}

fn same_id(field: &str, path_id: &str, body_id: &str) -> Result<(), ValidationError> {
    if path_id == body_id {
        Ok(())
    } else {
        Err(ValidationError::new(format!(
            "the {field} in the path ({path_id:?}) differs from the one in the body ({body_id:?})"
        )))
    }
}
