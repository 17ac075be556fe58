//! Turning controller answers and errors into HTTP responses.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use vmm_api::{ApiError, VmmActionError, VmmData};

/// `{"fault_message": ...}` with the given status.
pub(super) fn fault(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(ApiError::new(message))).into_response()
}

pub(super) fn bad_request(message: impl Into<String>) -> Response {
    fault(StatusCode::BAD_REQUEST, message)
}

pub(super) fn from_action_error(error: VmmActionError) -> Response {
    let status =
        StatusCode::from_u16(error.status_code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    fault(status, error.message)
}

/// `204 No Content` for `Empty`, as Firecracker answers every successful PUT/PATCH;
/// `200` with the JSON document otherwise.
pub(super) fn from_data(data: VmmData) -> Response {
    match data {
        VmmData::Empty => StatusCode::NO_CONTENT.into_response(),
        VmmData::InstanceInfo(info) => Json(info).into_response(),
        VmmData::MachineConfig(config) => Json(config).into_response(),
        VmmData::VmConfig(config) => Json(config).into_response(),
        VmmData::Fork(info) => Json(info).into_response(),
        VmmData::Vcpus(vcpus) => Json(vcpus).into_response(),
        VmmData::Devices(devices) => Json(devices).into_response(),
        VmmData::Balloon(balloon) => Json(balloon).into_response(),
        VmmData::BalloonStats(stats) => Json(stats).into_response(),
    }
}
