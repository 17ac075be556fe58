//! `filesystem.Filesystem` messages in proto3 JSON (lowerCamelCase with
//! snake_case accepted, enums as names read from names or numbers, int64 as
//! strings, defaults omitted), and the JSON of envd's plain-HTTP file routes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::json::{i64_string, u32_flex};

/// Connect paths of the service's methods.
pub const SERVICE: &str = "filesystem.Filesystem";
pub const PATH_STAT: &str = "/filesystem.Filesystem/Stat";
pub const PATH_MAKE_DIR: &str = "/filesystem.Filesystem/MakeDir";
pub const PATH_MOVE: &str = "/filesystem.Filesystem/Move";
pub const PATH_LIST_DIR: &str = "/filesystem.Filesystem/ListDir";
pub const PATH_REMOVE: &str = "/filesystem.Filesystem/Remove";
pub const PATH_WATCH_DIR: &str = "/filesystem.Filesystem/WatchDir";
pub const PATH_CREATE_WATCHER: &str = "/filesystem.Filesystem/CreateWatcher";
pub const PATH_GET_WATCHER_EVENTS: &str = "/filesystem.Filesystem/GetWatcherEvents";
pub const PATH_REMOVE_WATCHER: &str = "/filesystem.Filesystem/RemoveWatcher";

crate::proto_enum! {
    /// `filesystem.FileType`.
    pub enum FileType "file type" {
        Unspecified = 0 => "FILE_TYPE_UNSPECIFIED",
        File = 1 => "FILE_TYPE_FILE",
        Directory = 2 => "FILE_TYPE_DIRECTORY",
        Symlink = 3 => "FILE_TYPE_SYMLINK",
    }
}

crate::proto_enum! {
    /// `filesystem.EventType`.
    pub enum EventType "event type" {
        Unspecified = 0 => "EVENT_TYPE_UNSPECIFIED",
        Create = 1 => "EVENT_TYPE_CREATE",
        Write = 2 => "EVENT_TYPE_WRITE",
        Remove = 3 => "EVENT_TYPE_REMOVE",
        Rename = 4 => "EVENT_TYPE_RENAME",
        Chmod = 5 => "EVENT_TYPE_CHMOD",
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// `filesystem.EntryInfo`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EntryInfo {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(rename = "type", skip_serializing_if = "FileType::is_default")]
    pub file_type: FileType,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
    #[serde(with = "i64_string", skip_serializing_if = "is_zero_i64")]
    pub size: i64,
    #[serde(with = "u32_flex", skip_serializing_if = "is_zero_u32")]
    pub mode: u32,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub permissions: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub owner: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// RFC 3339 (`google.protobuf.Timestamp`).
    #[serde(alias = "modified_time", skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<String>,
    #[serde(alias = "symlink_target", skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// User xattrs under `user.e2b.`, prefix stripped.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(alias = "is_symlink", skip_serializing_if = "is_false")]
    pub is_symlink: bool,
}

/// `{"path"}`: StatRequest, MakeDirRequest, RemoveRequest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    pub path: String,
}

pub type StatRequest = PathRequest;
pub type MakeDirRequest = PathRequest;
pub type RemoveRequest = PathRequest;

/// `{"entry"}`: StatResponse, MakeDirResponse, MoveResponse.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EntryResponse {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

pub type StatResponse = EntryResponse;
pub type MakeDirResponse = EntryResponse;
pub type MoveResponse = EntryResponse;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    pub path: String,
    #[serde(with = "u32_flex")]
    pub depth: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ListDirResponse {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<EntryInfo>,
}

/// Empty messages: RemoveResponse, RemoveWatcherResponse.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Empty {}

/// WatchDirRequest and CreateWatcherRequest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatchRequest {
    pub path: String,
    pub recursive: bool,
    #[serde(alias = "include_entry")]
    pub include_entry: bool,
    /// Accepted and ignored: there are no network mounts to refuse here.
    #[serde(alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

pub type WatchDirRequest = WatchRequest;
pub type CreateWatcherRequest = WatchRequest;

/// `filesystem.FilesystemEvent`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FilesystemEvent {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(rename = "type", skip_serializing_if = "EventType::is_default")]
    pub event_type: EventType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<Box<EntryInfo>>,
}

/// `filesystem.WatchDirResponse`: a oneof, so exactly one key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WatchDirResponse {
    Start(Empty),
    Filesystem(FilesystemEvent),
    Keepalive(Empty),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatcherIdMessage {
    #[serde(alias = "watcher_id")]
    pub watcher_id: String,
}

pub type CreateWatcherResponse = WatcherIdMessage;
pub type GetWatcherEventsRequest = WatcherIdMessage;
pub type RemoveWatcherRequest = WatcherIdMessage;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GetWatcherEventsResponse {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<FilesystemEvent>,
}

/// One element of the JSON array `POST /files` answers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WrittenFile {
    pub name: String,
    /// Always `"file"`.
    #[serde(rename = "type")]
    pub file_type: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// `POST /files/compose` request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ComposeRequest {
    pub source_paths: Vec<String>,
    pub destination: String,
    pub username: Option<String>,
}

/// Plain-HTTP error body of envd: `{"code": <http status>, "message"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HttpError {
    pub code: u16,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn entry_info_uses_proto_json_names_and_omits_defaults() {
        let e = EntryInfo {
            name: "a.txt".into(),
            file_type: FileType::File,
            path: "/home/user/a.txt".into(),
            size: 12,
            mode: 0o644,
            permissions: "-rw-r--r--".into(),
            owner: "user".into(),
            group: "user".into(),
            modified_time: Some("2024-01-01T00:00:00Z".into()),
            symlink_target: None,
            metadata: BTreeMap::new(),
            is_symlink: false,
        };
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            json!({"name":"a.txt","type":"FILE_TYPE_FILE","path":"/home/user/a.txt","size":"12",
                   "mode":420,"permissions":"-rw-r--r--","owner":"user","group":"user",
                   "modifiedTime":"2024-01-01T00:00:00Z"})
        );
        assert_eq!(
            serde_json::to_value(EntryInfo::default()).unwrap(),
            json!({})
        );
    }

    #[test]
    fn entry_info_accepts_snake_case_numbers_and_numeric_enums() {
        let e: EntryInfo = serde_json::from_value(json!({
            "type": 3, "size": 7, "modified_time": "x", "symlink_target": "t", "is_symlink": true
        }))
        .unwrap();
        assert_eq!(e.file_type, FileType::Symlink);
        assert_eq!(e.size, 7);
        assert_eq!(e.modified_time.as_deref(), Some("x"));
        assert_eq!(e.symlink_target.as_deref(), Some("t"));
        assert!(e.is_symlink);
        let e: EntryInfo =
            serde_json::from_value(json!({"type":"FILE_TYPE_DIRECTORY","size":"-3"})).unwrap();
        assert_eq!((e.file_type, e.size), (FileType::Directory, -3));
        assert!(serde_json::from_value::<EntryInfo>(json!({"type":"FILE_TYPE_NOPE"})).is_err());
        assert!(serde_json::from_value::<EntryInfo>(json!({"size":"1.5"})).is_err());
    }

    #[test]
    fn watch_messages() {
        assert_eq!(
            serde_json::to_string(&WatchDirResponse::Start(Empty {})).unwrap(),
            r#"{"start":{}}"#
        );
        let ev = WatchDirResponse::Filesystem(FilesystemEvent {
            name: "d/x".into(),
            event_type: EventType::Create,
            entry: None,
        });
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"filesystem":{"name":"d/x","type":"EVENT_TYPE_CREATE"}}"#
        );
        let r: WatchRequest =
            serde_json::from_str(r#"{ "path": "/a", "include_entry": true, "recursive": true }"#)
                .unwrap();
        assert!(r.include_entry && r.recursive && !r.allow_network_mounts);
        let r: WatcherIdMessage = serde_json::from_str(r#"{"watcher_id":"w1"}"#).unwrap();
        assert_eq!(r.watcher_id, "w1");
        assert_eq!(
            serde_json::to_string(&WatcherIdMessage {
                watcher_id: "w".into()
            })
            .unwrap(),
            r#"{"watcherId":"w"}"#
        );
        let ev: FilesystemEvent = serde_json::from_str(r#"{"name":"n","type":4}"#).unwrap();
        assert_eq!(ev.event_type, EventType::Rename);
    }

    #[test]
    fn list_dir_request_defaults() {
        let r: ListDirRequest = serde_json::from_str(r#"{"path":"/"}"#).unwrap();
        assert_eq!(r.depth, 0);
        let r: ListDirRequest = serde_json::from_str("{}").unwrap();
        assert_eq!(r.path, "");
    }
}
