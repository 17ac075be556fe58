//! `process.Process` messages in proto3 JSON (lowerCamelCase, snake_case
//! accepted, bytes as base64, oneofs as a single key, defaults omitted).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::json::{B64, i32_flex, null_default, u32_flex};

/// Connect paths of the service's methods.
pub const SERVICE: &str = "process.Process";
pub const PATH_LIST: &str = "/process.Process/List";
pub const PATH_START: &str = "/process.Process/Start";
pub const PATH_CONNECT: &str = "/process.Process/Connect";
pub const PATH_UPDATE: &str = "/process.Process/Update";
pub const PATH_SEND_INPUT: &str = "/process.Process/SendInput";
pub const PATH_STREAM_INPUT: &str = "/process.Process/StreamInput";
pub const PATH_SEND_SIGNAL: &str = "/process.Process/SendSignal";
pub const PATH_CLOSE_STDIN: &str = "/process.Process/CloseStdin";

crate::proto_enum! {
    /// The signals `SendSignal` can send.
    pub enum Signal "signal" {
        Unspecified = 0 => "SIGNAL_UNSPECIFIED",
        Sigterm = 15 => "SIGNAL_SIGTERM",
        Sigkill = 9 => "SIGNAL_SIGKILL",
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    #[serde(default, with = "u32_flex")]
    pub cols: u32,
    #[serde(default, with = "u32_flex")]
    pub rows: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pty {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessConfig {
    #[serde(default, deserialize_with = "null_default")]
    pub cmd: String,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub args: Vec<String>,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub envs: BTreeMap<String, String>,
    /// `optional` in the proto: absent and "" differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// Which process a request is about: `{"pid":N}` or `{"tag":"..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessSelector {
    Pid(#[serde(with = "u32_flex")] u32),
    Tag(String),
}

impl std::fmt::Display for ProcessSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessSelector::Pid(pid) => write!(f, "process with pid {pid}"),
            ProcessSelector::Tag(tag) => write!(f, "process with tag {tag}"),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    #[serde(default)]
    pub config: ProcessConfig,
    #[serde(default, with = "u32_flex")]
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListRequest {}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListResponse {
    #[serde(default, deserialize_with = "null_default")]
    pub processes: Vec<ProcessInfo>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartRequest {
    #[serde(default)]
    pub process: ProcessConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Absent means true (legacy behaviour: a stdin pipe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectRequest {
    pub process: ProcessSelector,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateRequest {
    pub process: ProcessSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<Pty>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateResponse {}

/// Input for a process: oneof `stdin` / `pty`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessInput {
    Stdin(B64),
    Pty(B64),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInputRequest {
    pub process: ProcessSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInputResponse {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputStart {
    pub process: ProcessSelector,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputData {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepAlive {}

/// One envelope of a `StreamInput` request: oneof start / data / keepalive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInputRequest {
    Start(StreamInputStart),
    Data(StreamInputData),
    Keepalive(KeepAlive),
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputResponse {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSignalRequest {
    pub process: ProcessSelector,
    #[serde(default)]
    pub signal: Signal,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSignalResponse {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloseStdinRequest {
    pub process: ProcessSelector,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloseStdinResponse {}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartEvent {
    #[serde(default, with = "u32_flex")]
    pub pid: u32,
}

/// Output of a process: oneof stdout / stderr / pty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    Stdout(B64),
    Stderr(B64),
    Pty(B64),
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    /// Always emitted, even when 0: the captured envd exchange does, and
    /// every proto3-JSON parser accepts it.
    #[serde(default, alias = "exit_code", with = "i32_flex")]
    pub exit_code: i32,
    #[serde(default)]
    pub exited: bool,
    #[serde(default, deserialize_with = "null_default")]
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One event of a `Start` or `Connect` stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start(StartEvent),
    Data(DataEvent),
    End(EndEvent),
    Keepalive(KeepAlive),
}

/// A message of a `Start` stream (and of `Connect`, which has the same shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartResponse {
    pub event: ProcessEvent,
}

pub type ConnectResponse = StartResponse;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse<T: for<'de> Deserialize<'de>>(v: serde_json::Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn start_request_as_python_sends_it() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process": {"cmd":"/bin/bash","args":["-l","-c","echo hello"],"envs":{"B":"2"},"cwd":"/tmp"},"stdin":false}"#,
        )
        .unwrap();
        assert_eq!(r.process.cmd, "/bin/bash");
        assert_eq!(r.process.args, ["-l", "-c", "echo hello"]);
        assert_eq!(r.process.envs["B"], "2");
        assert_eq!(r.process.cwd.as_deref(), Some("/tmp"));
        assert_eq!(r.stdin, Some(false));
        assert_eq!(r.pty, None);
        assert_eq!(r.tag, None);

        let pty: StartRequest = parse(json!({
            "process": {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": {"TERM": "xterm-256color"}},
            "pty": {"size": {"cols": 80, "rows": "24"}},
            "tag": "t1",
            "unknownField": 1
        }));
        assert_eq!(
            pty.pty.unwrap().size.unwrap(),
            PtySize { cols: 80, rows: 24 }
        );
        assert_eq!(pty.tag.as_deref(), Some("t1"));
        assert_eq!(pty.stdin, None);
        assert_eq!(pty.process.cwd, None);
    }

    #[test]
    fn events_serialise_as_single_key_oneofs() {
        let cases = [
            (
                ProcessEvent::Start(StartEvent { pid: 4242 }),
                r#"{"event":{"start":{"pid":4242}}}"#,
            ),
            (
                ProcessEvent::Keepalive(KeepAlive {}),
                r#"{"event":{"keepalive":{}}}"#,
            ),
            (
                ProcessEvent::Data(DataEvent::Stdout(B64::from(&b"hello\n"[..]))),
                r#"{"event":{"data":{"stdout":"aGVsbG8K"}}}"#,
            ),
            (
                ProcessEvent::Data(DataEvent::Stderr(B64::from(&b"warn\n"[..]))),
                r#"{"event":{"data":{"stderr":"d2Fybgo="}}}"#,
            ),
            (
                ProcessEvent::Data(DataEvent::Pty(B64::from(&b"$ "[..]))),
                r#"{"event":{"data":{"pty":"JCA="}}}"#,
            ),
            (
                ProcessEvent::End(EndEvent {
                    exit_code: 0,
                    exited: true,
                    status: "exit status 0".into(),
                    error: None,
                }),
                r#"{"event":{"end":{"exitCode":0,"exited":true,"status":"exit status 0"}}}"#,
            ),
            (
                ProcessEvent::End(EndEvent {
                    exit_code: -1,
                    exited: false,
                    status: "signal: killed".into(),
                    error: Some("signal: killed".into()),
                }),
                r#"{"event":{"end":{"exitCode":-1,"exited":false,"status":"signal: killed","error":"signal: killed"}}}"#,
            ),
        ];
        for (event, json) in cases {
            let msg = StartResponse { event };
            assert_eq!(serde_json::to_string(&msg).unwrap(), json);
            assert_eq!(serde_json::from_str::<StartResponse>(json).unwrap(), msg);
        }
        // snake_case input.
        let end: EndEvent = parse(json!({"exit_code": 3}));
        assert_eq!(end.exit_code, 3);
    }

    #[test]
    fn selectors_inputs_and_signals() {
        let c: ConnectRequest = parse(json!({"process": {"pid": 7}}));
        assert_eq!(c.process, ProcessSelector::Pid(7));
        let c: ConnectRequest = parse(json!({"process": {"tag": "x"}}));
        assert_eq!(c.process, ProcessSelector::Tag("x".into()));
        assert!(serde_json::from_value::<ConnectRequest>(json!({"process": {}})).is_err());
        assert!(serde_json::from_value::<ConnectRequest>(json!({})).is_err());
        assert_eq!(ProcessSelector::Pid(1).to_string(), "process with pid 1");

        let s: SendInputRequest = parse(json!({"process": {"pid": 1}, "input": {"stdin": "YQ=="}}));
        assert_eq!(s.input, Some(ProcessInput::Stdin(B64::from(&b"a"[..]))));
        let s: SendInputRequest = parse(json!({"process": {"pid": 1}, "input": {"pty": "Yg=="}}));
        assert_eq!(s.input, Some(ProcessInput::Pty(B64::from(&b"b"[..]))));

        for (sig, want) in [
            (json!("SIGNAL_SIGKILL"), Signal::Sigkill),
            (json!("SIGNAL_SIGTERM"), Signal::Sigterm),
            (json!(9), Signal::Sigkill),
            (json!(15), Signal::Sigterm),
        ] {
            let r: SendSignalRequest = parse(json!({"process": {"pid": 1}, "signal": sig}));
            assert_eq!(r.signal, want);
        }
        let r: SendSignalRequest = parse(json!({"process": {"pid": 1}}));
        assert_eq!(r.signal, Signal::Unspecified);
        assert_eq!(
            serde_json::to_value(SendSignalRequest {
                process: ProcessSelector::Pid(1),
                signal: Signal::Sigkill
            })
            .unwrap(),
            json!({"process": {"pid": 1}, "signal": "SIGNAL_SIGKILL"})
        );
    }

    #[test]
    fn stream_input_envelopes() {
        let start: StreamInputRequest = parse(json!({"start": {"process": {"pid": 4242}}}));
        assert_eq!(
            start,
            StreamInputRequest::Start(StreamInputStart {
                process: ProcessSelector::Pid(4242)
            })
        );
        let data: StreamInputRequest = parse(json!({"data": {"input": {"stdin": "YQ=="}}}));
        assert_eq!(
            data,
            StreamInputRequest::Data(StreamInputData {
                input: Some(ProcessInput::Stdin(B64::from(&b"a"[..])))
            })
        );
        let ka: StreamInputRequest = parse(json!({"keepalive": {}}));
        assert_eq!(ka, StreamInputRequest::Keepalive(KeepAlive {}));
    }

    #[test]
    fn list_response_omits_absent_optionals() {
        let r = ListResponse {
            processes: vec![
                ProcessInfo {
                    config: ProcessConfig {
                        cmd: "sleep".into(),
                        args: vec!["9".into()],
                        envs: BTreeMap::new(),
                        cwd: None,
                    },
                    pid: 10,
                    tag: None,
                },
                ProcessInfo {
                    config: ProcessConfig {
                        cmd: "bash".into(),
                        args: vec![],
                        envs: [("A".to_string(), "1".to_string())].into(),
                        cwd: Some("/tmp".into()),
                    },
                    pid: 11,
                    tag: Some("t".into()),
                },
            ],
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            v,
            json!({"processes": [
                {"config": {"cmd": "sleep", "args": ["9"]}, "pid": 10},
                {"config": {"cmd": "bash", "envs": {"A": "1"}, "cwd": "/tmp"}, "pid": 11, "tag": "t"}
            ]})
        );
        assert_eq!(serde_json::from_value::<ListResponse>(v).unwrap(), r);
        assert_eq!(
            serde_json::from_str::<ListResponse>("{}").unwrap(),
            ListResponse::default()
        );
    }
}
