//! Types, units and quantities: the bottom layer every other one reads.
//!
//! Every literal has a type; values are normalised to one base unit per
//! type (milliseconds, bytes, percent, per-second rates) so comparisons and
//! the runtime never convert. The language ([`crate::lang`]) splits a
//! quantity into its parts and [`quantity`] gives it meaning; the same
//! table reads standalone literals in signal files and test cases
//! ([`parse_literal`]) and durations in `kiln.toml` ([`duration`]), so a
//! unit means one thing everywhere.

pub mod calendar;
pub mod duration;

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ty {
    Count,
    Duration,
    Size,
    Percent,
    /// Something per unit of time: `2M/min`, `600/min`, `36k/day`.
    Rate,
    Str,
    Bool,
    TimeOfDay,
    Weekday,
    /// A calendar date (`2026-12-28`), as days since 1970-01-01.
    Date,
    /// A day of the month, 1–31 (`day in 28..2`).
    DayOfMonth,
    Tenant,
    Tier,
    Model,
    Pool,
}

impl Ty {
    /// How the type is described to a user, with an example literal.
    pub fn describe(self) -> &'static str {
        match self {
            Ty::Count => "a count (like `64` or `8k`)",
            Ty::Duration => "a duration (like `500ms`, `2s`, `30m`, `6h`)",
            Ty::Size => "a size (like `80GB`)",
            Ty::Percent => "a percentage (like `85%`)",
            Ty::Rate => "a rate (like `2M/min` or `100/s`)",
            Ty::Str => "a string (like \"text\")",
            Ty::Bool => "true or false",
            Ty::TimeOfDay => "a time of day (like `09:30`)",
            Ty::Weekday => "a weekday (mon … sun)",
            Ty::Date => "a date (like `2026-12-28`)",
            Ty::DayOfMonth => "a day of the month (1 … 31)",
            Ty::Tenant => "a tenant name",
            Ty::Tier => "a tier name",
            Ty::Model => "a model name",
            Ty::Pool => "a pool name",
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            Ty::Count => "count",
            Ty::Duration => "duration",
            Ty::Size => "size",
            Ty::Percent => "percentage",
            Ty::Rate => "rate",
            Ty::Str => "string",
            Ty::Bool => "boolean",
            Ty::TimeOfDay => "time of day",
            Ty::Weekday => "weekday",
            Ty::Date => "date",
            Ty::DayOfMonth => "day of the month",
            Ty::Tenant => "tenant",
            Ty::Tier => "tier",
            Ty::Model => "model",
            Ty::Pool => "pool",
        }
    }

    pub fn is_numeric(self) -> bool {
        matches!(
            self,
            Ty::Count
                | Ty::Duration
                | Ty::Size
                | Ty::Percent
                | Ty::Rate
                | Ty::TimeOfDay
                | Ty::Date
                | Ty::DayOfMonth
        )
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short())
    }
}

/// A typed quantity in base units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Typed {
    pub ty: Ty,
    /// ms for durations, bytes for sizes, 0–100 for percentages, per second
    /// for rates, minutes after midnight for times.
    pub value: f64,
}

/// Why a quantity literal has no meaning.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitError(pub String);

/// A quantity literal as the grammar splits it: `2M/min` is number 2,
/// multiplier `M`, no unit, per `min`; `raw` is the text, for messages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantityParts<'a> {
    pub raw: &'a str,
    pub number: f64,
    pub multiplier: Option<char>,
    pub unit: Option<&'a str>,
    pub per: Option<&'a str>,
}

/// Normalises a quantity to its type's base unit.
pub fn quantity(q: QuantityParts<'_>) -> Result<Typed, UnitError> {
    let mult = match q.multiplier {
        None => 1.0,
        Some('k') | Some('K') => 1e3,
        Some('M') => 1e6,
        Some('G') | Some('B') => 1e9,
        Some(c) => return Err(UnitError(format!("unknown multiplier `{c}`"))),
    };
    let n = q.number * mult;
    let (ty, value) = match q.unit {
        None => (Ty::Count, n),
        Some(u) if duration_unit_ms(u).is_some() => {
            (Ty::Duration, n * duration_unit_ms(u).unwrap_or(0.0))
        }
        Some("KB") => (Ty::Size, n * 1e3),
        Some("MB") => (Ty::Size, n * 1e6),
        Some("GB") => (Ty::Size, n * 1e9),
        Some("TB") => (Ty::Size, n * 1e12),
        Some("KiB") => (Ty::Size, n * 1024.0),
        Some("MiB") => (Ty::Size, n * 1024.0 * 1024.0),
        Some("GiB") => (Ty::Size, n * 1024.0 * 1024.0 * 1024.0),
        Some("TiB") => (Ty::Size, n * 1024f64.powi(4)),
        Some("%") => (Ty::Percent, n),
        Some(u) => return Err(UnitError(format!("unknown unit `{u}`"))),
    };
    if q.multiplier.is_some() && ty != Ty::Count {
        return Err(UnitError(format!(
            "`{}` combines a multiplier with a unit; write the number in full",
            q.raw
        )));
    }
    match q.per {
        None => Ok(Typed { ty, value }),
        Some(per) => {
            if ty != Ty::Count {
                return Err(UnitError(format!(
                    "`{}`: a rate is a plain number per period, like `2M/min`",
                    q.raw
                )));
            }
            let secs = match per {
                "s" => 1.0,
                "min" => 60.0,
                "h" => 3600.0,
                "d" | "day" => 86_400.0,
                // Months differ in length: a rate per month would read as
                // a different rate each month.
                "month" => {
                    return Err(UnitError(format!(
                        "`{}`: a month has no fixed length, so `/month` is only for a `budget` (write the rate per day, hour, minute or second)",
                        q.raw
                    )))
                }
                p => return Err(UnitError(format!("unknown period `/{p}`"))),
            };
            Ok(Typed {
                ty: Ty::Rate,
                value: value / secs,
            })
        }
    }
}

/// Milliseconds in one of a policy's duration units (`ms`, `s`, `m`,
/// `min`, `h`, `d`): the one table policies and `kiln.toml` share.
pub fn duration_unit_ms(unit: &str) -> Option<f64> {
    Some(match unit {
        "ms" => 1.0,
        "s" => 1e3,
        "m" | "min" => 60e3,
        "h" => 3600e3,
        "d" => 86_400e3,
        _ => return None,
    })
}

/// Parses a standalone literal (`"85%"`, `"2s"`, `"80GB"`, `"2M/min"`,
/// `"09:30"`), as it would be written in a policy, for signals and test
/// files that carry kiln literals inside JSON or TOML strings. `None` when
/// the text is not one quantity or time of day.
pub fn parse_literal(text: &str) -> Option<Result<Typed, UnitError>> {
    let t = text.trim();
    if let Some(minutes) = time_of_day(t) {
        return Some(Ok(Typed {
            ty: Ty::TimeOfDay,
            value: f64::from(minutes),
        }));
    }
    if let Some(days) = calendar::parse_date(t) {
        return Some(Ok(Typed {
            ty: Ty::Date,
            value: f64::from(days),
        }));
    }
    let parts = split_quantity(t)?;
    Some(quantity(parts))
}

/// `HH:MM` as minutes after midnight (the grammar's `time_of_day`);
/// `None` past `23:59`.
pub fn time_of_day(t: &str) -> Option<u32> {
    let b = t.as_bytes();
    if b.len() != 5
        || b[2] != b':'
        || !b
            .iter()
            .enumerate()
            .all(|(i, c)| i == 2 || c.is_ascii_digit())
    {
        return None;
    }
    let h = u32::from(b[0] - b'0') * 10 + u32::from(b[1] - b'0');
    let m = u32::from(b[3] - b'0') * 10 + u32::from(b[4] - b'0');
    // `25:00` or `09:75` is no time of day: never a quiet 01:00 tomorrow.
    (h < 24 && m < 60).then_some(h * 60 + m)
}

const UNITS: [&str; 15] = [
    "ms", "min", "GiB", "MiB", "TiB", "KiB", "GB", "MB", "TB", "KB", "s", "m", "h", "d", "%",
];
const PERIODS: [&str; 6] = ["s", "min", "h", "day", "d", "month"];

fn ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// Splits `number multiplier? unit? per?` exactly as the grammar's
/// `quantity` rule does (ordered choices, each followed by no identifier
/// character); `None` unless the whole text is one quantity.
fn split_quantity(t: &str) -> Option<QuantityParts<'_>> {
    let b = t.as_bytes();
    let mut i = b.iter().take_while(|c| c.is_ascii_digit()).count();
    if i == 0 {
        return None;
    }
    if b.get(i) == Some(&b'.') && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i += 1 + b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
    }
    let number: f64 = t.get(..i)?.parse().ok()?;
    let rest = &t[i..];
    // A multiplier is not the first letter of a byte unit (`GB`, `MiB`).
    let multiplier = match rest.as_bytes() {
        [m @ (b'k' | b'K' | b'M' | b'G' | b'B'), next @ ..]
            if !next.starts_with(b"B") && !next.starts_with(b"iB") =>
        {
            Some(char::from(*m))
        }
        _ => None,
    };
    let rest = &rest[usize::from(multiplier.is_some())..];
    let ends_word = |s: &str, n: usize| !s.as_bytes().get(n).copied().is_some_and(ident_char);
    let (unit, rest) = match UNITS.iter().find(|u| rest.starts_with(**u)) {
        Some(u) if ends_word(rest, u.len()) => (Some(*u), &rest[u.len()..]),
        Some(_) => return None,
        None => (None, rest),
    };
    let (per, rest) = match rest.strip_prefix('/') {
        Some(p) => match PERIODS.iter().find(|u| p.starts_with(**u)) {
            Some(u) if ends_word(p, u.len()) => (Some(*u), &p[u.len()..]),
            _ => return None,
        },
        None => (None, rest),
    };
    if !rest.is_empty() {
        return None;
    }
    Some(QuantityParts {
        raw: t,
        number,
        multiplier,
        unit,
        per,
    })
}

/// How two values compare in a condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub fn symbol(self) -> &'static str {
        match self {
            CmpOp::Eq => "==",
            CmpOp::Ne => "!=",
            CmpOp::Lt => "<",
            CmpOp::Le => "<=",
            CmpOp::Gt => ">",
            CmpOp::Ge => ">=",
        }
    }
}

pub const WEEKDAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

pub fn weekday(name: &str) -> Option<u8> {
    let lower = name.to_ascii_lowercase();
    WEEKDAYS
        .iter()
        .position(|d| lower.starts_with(d))
        .map(|i| i as u8)
}

/// Human rendering of a base-unit value, for explain traces and diffs.
pub fn show(ty: Ty, v: f64) -> String {
    match ty {
        Ty::Duration => {
            if v >= 3_600_000.0 && v % 3_600_000.0 == 0.0 {
                format!("{}h", v / 3_600_000.0)
            } else if v >= 60_000.0 && v % 60_000.0 == 0.0 {
                format!("{}m", v / 60_000.0)
            } else if v >= 1000.0 {
                format!("{}s", trim(v / 1000.0))
            } else {
                format!("{}ms", trim(v))
            }
        }
        Ty::Size => {
            if v >= 1e9 {
                format!("{}GB", trim(v / 1e9))
            } else {
                format!("{}MB", trim(v / 1e6))
            }
        }
        Ty::Percent => format!("{}%", trim(v)),
        Ty::Rate => {
            let per_min = v * 60.0;
            format!("{}/min", trim(per_min))
        }
        Ty::TimeOfDay => format!("{:02}:{:02}", (v as u32) / 60, (v as u32) % 60),
        Ty::Weekday => WEEKDAYS.get(v as usize).unwrap_or(&"?").to_string(),
        Ty::Date => calendar::show_date(v as i32),
        _ => trim(v),
    }
}

fn trim(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q<'a>(
        raw: &'a str,
        n: f64,
        m: Option<char>,
        u: Option<&'a str>,
        per: Option<&'a str>,
    ) -> QuantityParts<'a> {
        QuantityParts {
            raw,
            number: n,
            multiplier: m,
            unit: u,
            per,
        }
    }

    #[test]
    fn normalises_units() {
        assert_eq!(
            quantity(q("2s", 2.0, None, Some("s"), None)).unwrap().value,
            2000.0
        );
        assert_eq!(
            quantity(q("30m", 30.0, None, Some("m"), None))
                .unwrap()
                .value,
            1_800_000.0
        );
        assert_eq!(
            quantity(q("80GB", 80.0, None, Some("GB"), None))
                .unwrap()
                .value,
            80e9
        );
        let r = quantity(q("2M/min", 2.0, Some('M'), None, Some("min"))).unwrap();
        assert_eq!(r.ty, Ty::Rate);
        assert!((r.value - 2e6 / 60.0).abs() < 1e-6);
        assert_eq!(
            quantity(q("85%", 85.0, None, Some("%"), None)).unwrap().ty,
            Ty::Percent
        );
    }

    #[test]
    fn rejects_nonsense_combinations() {
        assert!(quantity(q("2Ms", 2.0, Some('M'), Some("s"), None)).is_err());
        assert!(quantity(q("5s/min", 5.0, None, Some("s"), Some("min"))).is_err());
    }

    #[test]
    fn parses_standalone_literals_as_the_grammar_does() {
        let v = |s: &str| parse_literal(s).map(|r| r.map(|t| (t.ty, t.value)));
        assert_eq!(v("2s"), Some(Ok((Ty::Duration, 2000.0))));
        assert_eq!(v(" 85% "), Some(Ok((Ty::Percent, 85.0))));
        assert_eq!(v("80GB"), Some(Ok((Ty::Size, 80e9))));
        assert_eq!(v("2GiB"), Some(Ok((Ty::Size, 2.0 * 1024f64.powi(3)))));
        assert_eq!(v("8k"), Some(Ok((Ty::Count, 8000.0))));
        assert_eq!(v("70B"), Some(Ok((Ty::Count, 70e9))));
        assert_eq!(v("09:30"), Some(Ok((Ty::TimeOfDay, 570.0))));
        assert_eq!(v("23:59"), Some(Ok((Ty::TimeOfDay, 1439.0))));
        assert_eq!(v("1.5h"), Some(Ok((Ty::Duration, 5_400_000.0))));
        assert!(matches!(v("2M/min"), Some(Ok((Ty::Rate, _)))));
        assert!(matches!(v("2Ms"), Some(Err(_))));
        for bad in [
            "", "s", "2 s", "2sec", "2mo", "1.", "-1", "2/x", "9:30", "2s/min/s", "abc", "25:00",
            "24:00", "09:60", "99:99",
        ] {
            assert!(!matches!(v(bad), Some(Ok(_))), "{bad:?} parsed");
        }
    }

    #[test]
    fn shows_values() {
        assert_eq!(show(Ty::Duration, 2500.0), "2.5s");
        assert_eq!(show(Ty::Duration, 1_800_000.0), "30m");
        assert_eq!(show(Ty::Percent, 85.0), "85%");
        assert_eq!(weekday("Tuesday"), Some(1));
    }
}
