//! Header parsing for `GET /files`: Accept-Encoding and Range.

/// The body coding of a download.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Identity,
    Gzip,
}

/// Picks a coding from Accept-Encoding: gzip when acceptable, else identity
/// when acceptable (it is unless refused, RFC 9110 §12.5.3), else None (406).
/// A header that names only codings we do not have is refused as envd does.
pub fn choose_coding(header: Option<&str>) -> Option<Coding> {
    let Some(header) = header else {
        return Some(Coding::Identity);
    };
    let mut gzip = None;
    let mut identity = None;
    let mut star = None;
    let mut any = false;
    for item in header.split(',') {
        let mut parts = item.split(';');
        let coding = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        if coding.is_empty() {
            continue;
        }
        any = true;
        let mut q = 1.0f32;
        for p in parts {
            if let Some(v) = p.trim().strip_prefix("q=") {
                q = v.trim().parse().unwrap_or(0.0);
            }
        }
        match coding.as_str() {
            "gzip" | "x-gzip" => gzip = Some(q),
            "identity" => identity = Some(q),
            "*" => star = Some(q),
            _ => {}
        }
    }
    if !any {
        return Some(Coding::Identity);
    }
    if gzip.or(star).is_some_and(|q| q > 0.0) {
        if gzip.is_some() {
            return Some(Coding::Gzip);
        }
        // `*` alone: identity is the cheaper coding it allows.
        return Some(Coding::Identity);
    }
    match identity.or(star) {
        Some(q) if q > 0.0 => Some(Coding::Identity),
        _ => None,
    }
}

/// The outcome of a Range header against a file of `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeRequest {
    /// No usable Range header (absent, malformed, or several ranges): send all.
    Full,
    /// Inclusive byte range within the file.
    Partial { start: u64, end: u64 },
    /// 416.
    Unsatisfiable,
}

/// Parses `bytes=a-b`, `bytes=a-` and `bytes=-n`; a single range only.
pub fn parse_range(header: Option<&str>, size: u64) -> RangeRequest {
    let Some(spec) = header.and_then(|h| h.trim().strip_prefix("bytes=")) else {
        return RangeRequest::Full;
    };
    if spec.contains(',') {
        return RangeRequest::Full;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeRequest::Full;
    };
    let (a, b) = (a.trim(), b.trim());
    let num = |s: &str| -> Option<u64> {
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    if a.is_empty() {
        // Suffix: the last n bytes.
        let Some(n) = num(b) else {
            return RangeRequest::Full;
        };
        if n == 0 || size == 0 {
            return RangeRequest::Unsatisfiable;
        }
        return RangeRequest::Partial {
            start: size.saturating_sub(n),
            end: size - 1,
        };
    }
    let Some(start) = num(a) else {
        return RangeRequest::Full;
    };
    let end = if b.is_empty() {
        u64::MAX
    } else {
        match num(b) {
            Some(e) if e >= start => e,
            _ => return RangeRequest::Full,
        }
    };
    if start >= size {
        return RangeRequest::Unsatisfiable;
    }
    RangeRequest::Partial {
        start,
        end: end.min(size - 1),
    }
}

/// `inline; filename="..."`, with an RFC 8187 `filename*` for names that are
/// not plain ASCII.
pub fn content_disposition(name: &str) -> String {
    let plain: String = name
        .chars()
        .map(|c| {
            if c.is_ascii() && !c.is_ascii_control() && c != '"' && c != '\\' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if plain == name {
        return format!("inline; filename=\"{name}\"");
    }
    let mut encoded = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded += &format!("%{b:02X}");
        }
    }
    format!("inline; filename=\"{plain}\"; filename*=UTF-8''{encoded}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coding_choice() {
        use Coding::*;
        assert_eq!(choose_coding(None), Some(Identity));
        assert_eq!(choose_coding(Some("")), Some(Identity));
        assert_eq!(choose_coding(Some("gzip")), Some(Gzip));
        assert_eq!(choose_coding(Some("gzip, deflate")), Some(Gzip));
        assert_eq!(choose_coding(Some("identity")), Some(Identity));
        assert_eq!(choose_coding(Some("gzip;q=0, identity")), Some(Identity));
        assert_eq!(choose_coding(Some("br, identity;q=0.5")), Some(Identity));
        assert_eq!(choose_coding(Some("*")), Some(Identity));
        assert_eq!(choose_coding(Some("br")), None);
        assert_eq!(choose_coding(Some("zstd, br")), None);
        assert_eq!(choose_coding(Some("identity;q=0")), None);
    }

    #[test]
    fn ranges() {
        use RangeRequest::*;
        assert_eq!(parse_range(None, 10), Full);
        assert_eq!(
            parse_range(Some("bytes=0-3"), 10),
            Partial { start: 0, end: 3 }
        );
        assert_eq!(
            parse_range(Some("bytes=5-"), 10),
            Partial { start: 5, end: 9 }
        );
        assert_eq!(
            parse_range(Some("bytes=5-100"), 10),
            Partial { start: 5, end: 9 }
        );
        assert_eq!(
            parse_range(Some("bytes=-3"), 10),
            Partial { start: 7, end: 9 }
        );
        assert_eq!(
            parse_range(Some("bytes=-30"), 10),
            Partial { start: 0, end: 9 }
        );
        assert_eq!(parse_range(Some("bytes=10-"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-0"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=0-0"), 0), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=3-1"), 10), Full);
        assert_eq!(parse_range(Some("bytes=0-1,4-5"), 10), Full);
        assert_eq!(parse_range(Some("items=0-1"), 10), Full);
        assert_eq!(parse_range(Some("bytes=x-1"), 10), Full);
        assert_eq!(parse_range(Some("bytes=+1-2"), 10), Full);
    }

    #[test]
    fn dispositions() {
        assert_eq!(content_disposition("a.txt"), "inline; filename=\"a.txt\"");
        assert_eq!(
            content_disposition("é \"q\".txt"),
            "inline; filename=\"_ _q_.txt\"; filename*=UTF-8''%C3%A9%20%22q%22.txt"
        );
    }
}
