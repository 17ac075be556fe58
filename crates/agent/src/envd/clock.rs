//! The guest clock: `/init` carries the host's time, which a restored snapshot
//! or a fresh VM without RTC sync needs.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::time::TimeSpec;
use nix::time::{ClockId, clock_settime};

/// Parses an RFC 3339 timestamp (`2026-01-02T03:04:05.678Z`, offsets allowed).
/// Times before 1970 are refused: a guest clock never needs them.
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        part.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| part.parse().ok())?
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, min, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut nanos: u32 = 0;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let mut scaled = frac[..digits.min(9)].to_string();
        while scaled.len() < 9 {
            scaled.push('0');
        }
        nanos = scaled.parse().ok()?;
        rest = &frac[digits..];
    }
    let offset_secs = match rest {
        "Z" | "z" => 0,
        // ASCII check first: the slicing below must stay on char boundaries.
        _ if rest.len() == 6 && rest.is_ascii() && rest.as_bytes()[3] == b':' => {
            let sign = match &rest[..1] {
                "+" => 1,
                "-" => -1,
                _ => return None,
            };
            let h: i64 = rest[1..3].parse().ok()?;
            let m: i64 = rest[4..6].parse().ok()?;
            sign * (h * 3600 + m * 60)
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + min * 60 + sec - offset_secs;
    let secs = u64::try_from(secs).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's method).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Sets the realtime clock to `when` (the host's time when it sent `/init`)
/// when the guest's clock is wrong by it.
pub fn set_if_off(when: SystemTime) {
    let Some(off) = correction(SystemTime::now(), when) else {
        return;
    };
    let Ok(since) = when.duration_since(UNIX_EPOCH) else {
        return;
    };
    let ts = TimeSpec::from_duration(since);
    match clock_settime(ClockId::CLOCK_REALTIME, ts) {
        Ok(()) => log::info!("clock set from /init (was off by {off:?})"),
        Err(e) => log::warn!("cannot set the clock: {e}"),
    }
}

/// How far the guest's clock `now` is off, if `when` should replace it.
/// `when` was read before the request left the host, so a guest clock
/// behind it is wrong by at least that much (a restored snapshot's clock is
/// behind by the time it lay paused), and is corrected from a millisecond on;
/// one ahead of it may be right by the request's latency, and is corrected
/// only past a second.
fn correction(now: SystemTime, when: SystemTime) -> Option<Duration> {
    match when.duration_since(now) {
        Ok(behind) => (behind >= BEHIND_TOLERANCE).then_some(behind),
        Err(ahead) => (ahead.duration() >= AHEAD_TOLERANCE).then(|| ahead.duration()),
    }
}

const BEHIND_TOLERANCE: Duration = Duration::from_millis(1);
const AHEAD_TOLERANCE: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: &str) -> Option<(u64, u32)> {
        parse_rfc3339(s).map(|t| {
            let d = t.duration_since(UNIX_EPOCH).unwrap();
            (d.as_secs(), d.subsec_nanos())
        })
    }

    #[test]
    fn parses_utc_offsets_and_fractions() {
        assert_eq!(secs("1970-01-01T00:00:00Z"), Some((0, 0)));
        assert_eq!(secs("2000-03-01T00:00:00Z"), Some((951_868_800, 0)));
        assert_eq!(
            secs("2026-01-01T00:00:00.5Z"),
            Some((1_767_225_600, 500_000_000))
        );
        assert_eq!(
            secs("2026-01-01T02:00:00.123456789123+02:00"),
            Some((1_767_225_600, 123_456_789))
        );
        assert_eq!(secs("2025-12-31T23:00:00-01:00"), Some((1_767_225_600, 0)));
    }

    #[test]
    fn corrects_a_clock_behind_from_a_millisecond_and_one_ahead_past_a_second() {
        let when = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let ms = Duration::from_millis;
        assert_eq!(correction(when, when), None);
        assert_eq!(correction(when - ms(300), when), Some(ms(300)));
        assert_eq!(correction(when - ms(1), when), Some(ms(1)));
        assert_eq!(correction(when - Duration::from_micros(500), when), None);
        assert_eq!(correction(when + ms(900), when), None);
        assert_eq!(correction(when + ms(1500), when), Some(ms(1500)));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "2026-01-01",
            "2026-13-01T00:00:00Z",
            "2026-01-01T00:00:00",
            "2026-01-01T00:00:00.Z",
            "1969-12-31T23:59:59Z",
            "2026-01-01T00:00:00+0200",
            "2026-01-01T0a:00:00Z",
            "２０26-01-01T00:00:00Z",
            "2026-01-01T00:00:00+é:00",
        ] {
            assert_eq!(secs(bad), None, "{bad}");
        }
    }
}
