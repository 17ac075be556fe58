//! Which user a request acts as, and that user's account data.
//!
//! /etc/passwd and /etc/group are parsed directly rather than through
//! getpwnam(3): the agent is a static glibc binary, where NSS lookups can load
//! nothing or the wrong thing, and the guest has plain files anyway.

use std::path::{Path, PathBuf};

use axum::extract::FromRequestParts;
use axum::http::HeaderMap;
use axum::http::request::Parts;
use base64::Engine;
use envd_proto::ConnectError;

use super::Envd;
use super::connect::ConnectErr;

/// The user every E2B template has; the default when `/init` named none.
pub const E2B_DEFAULT_USER: &str = "user";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups (primary group included).
    pub groups: Vec<u32>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UserError {
    #[error("invalid username {0:?}")]
    Unknown(String),
    #[error("invalid Authorization header")]
    BadHeader,
}

impl User {
    /// Resolves a request path: `~` and `~/x` and relative paths against the
    /// home directory; absolute paths unchanged. An empty path is the home.
    pub fn resolve_path(&self, path: &str) -> PathBuf {
        if path.is_empty() || path == "~" {
            return self.home.clone();
        }
        if let Some(rest) = path.strip_prefix("~/") {
            return self.home.join(rest);
        }
        let p = Path::new(path);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.home.join(p)
        }
    }

    fn root() -> Self {
        User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
            shell: "/bin/sh".into(),
            groups: vec![0],
        }
    }
}

/// Looks `name` up in the given passwd and group texts.
pub fn lookup_in(passwd: &str, group: &str, name: &str) -> Option<User> {
    let line = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && f[0] == name)?;
    let uid = line[2].parse().ok()?;
    let gid = line[3].parse().ok()?;
    let mut groups = vec![gid];
    for g in group.lines() {
        let f: Vec<&str> = g.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(id) = f[2].parse::<u32>() else {
            continue;
        };
        if f[3].split(',').any(|m| m == name) && !groups.contains(&id) {
            groups.push(id);
        }
    }
    let home = if line[5].is_empty() { "/" } else { line[5] };
    Some(User {
        name: name.to_string(),
        uid,
        gid,
        home: home.into(),
        shell: line[6].to_string(),
        groups,
    })
}

/// Looks `name` up in the system's /etc/passwd and /etc/group. `root` always
/// exists, even in a root filesystem without a passwd file.
pub fn lookup(name: &str) -> Result<User, UserError> {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
    match lookup_in(&passwd, &group, name) {
        Some(u) => Ok(u),
        None if name == "root" => Ok(User::root()),
        None => Err(UserError::Unknown(name.to_string())),
    }
}

/// The username of `Authorization: Basic base64(user:password)`, if any (the
/// password is ignored, as envd does).
pub fn basic_username(headers: &HeaderMap) -> Result<Option<String>, UserError> {
    let Some(value) = headers.get(axum::http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let value = value.to_str().map_err(|_| UserError::BadHeader)?.trim();
    let Some((scheme, creds)) = value.split_once(' ') else {
        return Err(UserError::BadHeader);
    };
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(UserError::BadHeader);
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .map_err(|_| UserError::BadHeader)?;
    let text = String::from_utf8(decoded).map_err(|_| UserError::BadHeader)?;
    let name = text.split_once(':').map_or(text.as_str(), |(u, _)| u);
    Ok((!name.is_empty()).then(|| name.to_string()))
}

/// The user a request acts as: the Basic-auth username; else `/init`'s default
/// user; else `user` if it exists; else root.
pub fn resolve(headers: &HeaderMap, default_user: Option<&str>) -> Result<User, UserError> {
    if let Some(name) = basic_username(headers)? {
        return lookup(&name);
    }
    if let Some(name) = default_user {
        return lookup(name);
    }
    lookup(E2B_DEFAULT_USER).or_else(|_| lookup("root"))
}

/// Extractor for Connect handlers: the request's user, or an `unauthenticated`
/// Connect error.
#[derive(Debug, Clone)]
pub struct RequestUser(pub User);

impl FromRequestParts<Envd> for RequestUser {
    type Rejection = ConnectErr;

    async fn from_request_parts(parts: &mut Parts, envd: &Envd) -> Result<Self, ConnectErr> {
        let default = envd.sandbox.settings().default_user;
        resolve(&parts.headers, default.as_deref())
            .map(RequestUser)
            .map_err(|e| ConnectErr(ConnectError::unauthenticated(e.to_string())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        user:x:1000:1000::/home/user:/bin/bash\n\
        broken:x:notanumber:1::/:/bin/sh\n\
        nohome:x:5:5:::/bin/sh\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\nwheel:x:10:root,user\ndocker:x:999:other,user\n\
        bad:x:zz:user\n";

    #[test]
    fn lookup_reads_passwd_and_group_lines() {
        let u = lookup_in(PASSWD, GROUP, "user").unwrap();
        assert_eq!(
            u,
            User {
                name: "user".into(),
                uid: 1000,
                gid: 1000,
                home: "/home/user".into(),
                shell: "/bin/bash".into(),
                groups: vec![1000, 10, 999],
            }
        );
        assert_eq!(
            lookup_in(PASSWD, GROUP, "root").unwrap().groups,
            vec![0, 10]
        );
        assert_eq!(lookup_in(PASSWD, GROUP, "broken"), None);
        assert_eq!(lookup_in(PASSWD, GROUP, "nobody-here"), None);
        assert_eq!(
            lookup_in(PASSWD, GROUP, "nohome").unwrap().home,
            PathBuf::from("/")
        );
    }

    #[test]
    fn system_lookup_finds_root_and_nobody() {
        let root = lookup("root").unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert_eq!(
            lookup("no-such-user-here"),
            Err(UserError::Unknown("no-such-user-here".into()))
        );
        if let Ok(nobody) = lookup("nobody") {
            assert_ne!(nobody.uid, 0);
        }
    }

    #[test]
    fn paths_resolve_against_home() {
        let u = lookup_in(PASSWD, GROUP, "user").unwrap();
        assert_eq!(u.resolve_path("a.txt"), PathBuf::from("/home/user/a.txt"));
        assert_eq!(u.resolve_path("~"), PathBuf::from("/home/user"));
        assert_eq!(u.resolve_path("~/d/e"), PathBuf::from("/home/user/d/e"));
        assert_eq!(u.resolve_path(""), PathBuf::from("/home/user"));
        assert_eq!(u.resolve_path("/tmp/x"), PathBuf::from("/tmp/x"));
    }

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_str(auth).unwrap());
        h
    }

    #[test]
    fn basic_auth_username_only() {
        assert_eq!(basic_username(&HeaderMap::new()), Ok(None));
        assert_eq!(
            basic_username(&headers("Basic cm9vdDo=")),
            Ok(Some("root".into()))
        );
        // Password ignored; lowercase scheme fine.
        let creds = base64::engine::general_purpose::STANDARD.encode("user:secret");
        assert_eq!(
            basic_username(&headers(&format!("basic {creds}"))),
            Ok(Some("user".into()))
        );
        assert_eq!(basic_username(&headers("Basic Og==")), Ok(None));
        assert_eq!(
            basic_username(&headers("Bearer x")),
            Err(UserError::BadHeader)
        );
        assert_eq!(
            basic_username(&headers("Basic !!!")),
            Err(UserError::BadHeader)
        );
    }

    #[test]
    fn resolve_prefers_header_then_default() {
        assert_eq!(
            resolve(&headers("Basic cm9vdDo="), Some("nobody"))
                .unwrap()
                .name,
            "root"
        );
        assert_eq!(
            resolve(&HeaderMap::new(), Some("ghost")),
            Err(UserError::Unknown("ghost".into()))
        );
        // No default: `user` if the machine has one, else root.
        let fallback = resolve(&HeaderMap::new(), None).unwrap();
        let expect = if lookup(E2B_DEFAULT_USER).is_ok() {
            "user"
        } else {
            "root"
        };
        assert_eq!(fallback.name, expect);
    }
}
