//! The calendar, from jiff: civil dates as days since 1970-01-01 (the
//! `date` signal's number), a policy's time zone, and what the clock reads
//! in it at an instant (time of day, weekday, date, day of the month).
//! Pure: the IANA database is compiled in (jiff's bundled tzdb), so a
//! policy's zone does not depend on the machine.

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::Timestamp;

/// 1970-01-01, day 0 of the `date` signal.
fn epoch() -> Date {
    jiff::civil::date(1970, 1, 1)
}

/// `YYYY-MM-DD` as days since 1970-01-01; `None` for a day no calendar
/// has (`2026-02-30`) or a year outside jiff's range.
pub fn date_days(year: i16, month: i8, day: i8) -> Option<i32> {
    let d = Date::new(year, month, day).ok()?;
    Some(days_of(d))
}

fn days_of(d: Date) -> i32 {
    (d.duration_since(epoch()).as_secs() / 86_400) as i32
}

/// The civil date of a day number, for display (`2026-12-28`).
pub fn show_date(days: i32) -> String {
    epoch()
        .checked_add(jiff::Span::new().days(i64::from(days)))
        .map_or_else(|_| format!("day {days}"), |d| d.to_string())
}

/// Parses `YYYY-MM-DD` (signal files, test cases).
pub fn parse_date(text: &str) -> Option<i32> {
    let b = text.trim().as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let s = std::str::from_utf8(b.get(r)?).ok()?;
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    date_days(
        i16::try_from(num(0..4)?).ok()?,
        i8::try_from(num(5..7)?).ok()?,
        i8::try_from(num(8..10)?).ok()?,
    )
}

/// The calendar month of a day number, counted from year 0 (`year * 12 +
/// month - 1`): two days share a month exactly when these are equal.
pub fn month_index(days: i32) -> i32 {
    epoch()
        .checked_add(jiff::Span::new().days(i64::from(days)))
        .map_or(1970 * 12, |d| {
            i32::from(d.year()) * 12 + i32::from(d.month()) - 1
        })
}

/// The day of the month (1–31) of a day number.
pub fn day_of_month(days: i32) -> u8 {
    epoch()
        .checked_add(jiff::Span::new().days(i64::from(days)))
        .map_or(1, |d| d.day() as u8)
}

/// A policy's time zone: its IANA name and jiff's rules for it.
#[derive(Debug, Clone)]
pub struct Zone {
    pub name: String,
    tz: TimeZone,
}

impl PartialEq for Zone {
    fn eq(&self, other: &Zone) -> bool {
        self.name == other.name
    }
}

/// A zone name the database does not hold.
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownZone;

impl Zone {
    /// An IANA zone (`Europe/Berlin`, `America/New_York`, `UTC`).
    pub fn get(name: &str) -> Result<Zone, UnknownZone> {
        TimeZone::get(name)
            .map(|tz| Zone {
                name: name.to_string(),
                tz,
            })
            .map_err(|_| UnknownZone)
    }

    pub fn utc() -> Zone {
        Zone {
            name: "UTC".into(),
            tz: TimeZone::UTC,
        }
    }
}

/// What a clock in a zone reads at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Civil {
    /// Minutes after midnight.
    pub minute: u16,
    /// 0 = Monday.
    pub weekday: u8,
    /// Days since 1970-01-01.
    pub date: i32,
    /// 1–31.
    pub day: u8,
}

/// The clock in `zone` (UTC without one) at `unix_ms`.
pub fn civil_at(unix_ms: i64, zone: Option<&Zone>) -> Civil {
    let ts = Timestamp::from_millisecond(unix_ms).unwrap_or(Timestamp::UNIX_EPOCH);
    let dt = match zone {
        Some(z) => z.tz.to_datetime(ts),
        None => TimeZone::UTC.to_datetime(ts),
    };
    Civil {
        minute: dt.hour() as u16 * 60 + dt.minute() as u16,
        weekday: dt.weekday().to_monday_zero_offset() as u8,
        date: days_of(dt.date()),
        day: dt.day() as u8,
    }
}

/// The clock `minutes` after a start read on a zoneless clock (a replay's
/// virtual time): the start's date advances with whole days.
pub fn civil_after(start_date: i32, start_minute: u32, start_weekday: u8, minutes: u64) -> Civil {
    let total = u64::from(start_minute) + minutes;
    let days = (total / 1440) as i32;
    let date = start_date.saturating_add(days);
    Civil {
        minute: (total % 1440) as u16,
        weekday: ((u64::from(start_weekday) + total / 1440) % 7) as u8,
        date,
        day: day_of_month(date),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_through_day_numbers() {
        assert_eq!(date_days(1970, 1, 1), Some(0));
        assert_eq!(date_days(2024, 1, 1), Some(19_723));
        assert_eq!(date_days(2026, 2, 30), None);
        assert_eq!(parse_date("2024-02-29"), date_days(2024, 2, 29));
        assert_eq!(parse_date("2023-02-29"), None);
        assert_eq!(parse_date("24-02-29"), None);
        for d in (-1000..40_000).step_by(37) {
            let s = show_date(d);
            assert_eq!(parse_date(&s), Some(d), "{s}");
            assert_eq!(day_of_month(d), s[8..].parse::<u8>().unwrap());
        }
    }

    #[test]
    fn the_clock_reads_the_policys_zone_across_daylight_saving() {
        let berlin = Zone::get("Europe/Berlin").unwrap();
        assert!(Zone::get("Mars/Olympus").is_err());
        // 2026-03-28 23:30 UTC: 00:30 on Sunday the 29th in Berlin (CET).
        let ms = 1_774_740_600_000;
        let c = civil_at(ms, Some(&berlin));
        assert_eq!((c.minute, c.weekday, c.day), (30, 6, 29));
        assert_eq!(c.date, date_days(2026, 3, 29).unwrap());
        let utc = civil_at(ms, None);
        assert_eq!((utc.minute, utc.weekday, utc.day), (23 * 60 + 30, 5, 28));
        // Three hours later the clocks went forward: 04:30 CEST, not 03:30.
        let c = civil_at(ms + 3 * 3_600_000, Some(&berlin));
        assert_eq!(c.minute, 4 * 60 + 30);
    }

    #[test]
    fn a_zoneless_clock_advances_the_date_with_whole_days() {
        let start = date_days(2026, 1, 30).unwrap();
        // Monday 2026-01-26 is weekday 0; the 30th is a Friday (4).
        for m in (0..10_000u64).step_by(97) {
            let c = civil_after(start, 12 * 60, 4, m);
            let days = ((12 * 60 + m) / 1440) as i32;
            assert_eq!(c.date, start + days);
            assert_eq!(c.weekday as i32, (4 + days) % 7);
            assert_eq!(u64::from(c.minute), (12 * 60 + m) % 1440);
        }
        assert_eq!(civil_after(start, 23 * 60, 4, 3 * 1440).day, 2);
    }
}
