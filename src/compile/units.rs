//! Types and units. Every literal has a type; values are normalised to one
//! base unit per type (milliseconds, bytes, percent, per-second rates) so
//! that comparisons and the runtime never convert.

use crate::lang::ast::{Quantity, Value, ValueKind};
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
            Ty::Tenant => "tenant",
            Ty::Tier => "tier",
            Ty::Model => "model",
            Ty::Pool => "pool",
        }
    }

    pub fn is_numeric(self) -> bool {
        matches!(
            self,
            Ty::Count | Ty::Duration | Ty::Size | Ty::Percent | Ty::Rate | Ty::TimeOfDay
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

pub fn quantity(q: &Quantity) -> Result<Typed, UnitError> {
    let mult = match q.multiplier {
        None => 1.0,
        Some('k') | Some('K') => 1e3,
        Some('M') => 1e6,
        Some('G') | Some('B') => 1e9,
        Some(c) => return Err(UnitError(format!("unknown multiplier `{c}`"))),
    };
    let n = q.number * mult;
    let (ty, value) = match q.unit.as_deref() {
        None => (Ty::Count, n),
        Some("ms") => (Ty::Duration, n),
        Some("s") => (Ty::Duration, n * 1e3),
        Some("m") | Some("min") => (Ty::Duration, n * 60e3),
        Some("h") => (Ty::Duration, n * 3600e3),
        Some("d") => (Ty::Duration, n * 86_400e3),
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
    match q.per.as_deref() {
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
                p => return Err(UnitError(format!("unknown period `/{p}`"))),
            };
            Ok(Typed {
                ty: Ty::Rate,
                value: value / secs,
            })
        }
    }
}

/// The type of a literal value, if it is a scalar literal.
pub fn literal(v: &Value) -> Option<Result<Typed, UnitError>> {
    match &v.kind {
        ValueKind::Quantity(q) => Some(quantity(q)),
        ValueKind::TimeOfDay(m) => Some(Ok(Typed {
            ty: Ty::TimeOfDay,
            value: f64::from(*m),
        })),
        _ => None,
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

    fn q(raw: &str, n: f64, m: Option<char>, u: Option<&str>, per: Option<&str>) -> Quantity {
        Quantity {
            raw: raw.into(),
            number: n,
            multiplier: m,
            unit: u.map(Into::into),
            per: per.map(Into::into),
        }
    }

    #[test]
    fn normalises_units() {
        assert_eq!(
            quantity(&q("2s", 2.0, None, Some("s"), None))
                .unwrap()
                .value,
            2000.0
        );
        assert_eq!(
            quantity(&q("30m", 30.0, None, Some("m"), None))
                .unwrap()
                .value,
            1_800_000.0
        );
        assert_eq!(
            quantity(&q("80GB", 80.0, None, Some("GB"), None))
                .unwrap()
                .value,
            80e9
        );
        let r = quantity(&q("2M/min", 2.0, Some('M'), None, Some("min"))).unwrap();
        assert_eq!(r.ty, Ty::Rate);
        assert!((r.value - 2e6 / 60.0).abs() < 1e-6);
        assert_eq!(
            quantity(&q("85%", 85.0, None, Some("%"), None)).unwrap().ty,
            Ty::Percent
        );
    }

    #[test]
    fn rejects_nonsense_combinations() {
        assert!(quantity(&q("2Ms", 2.0, Some('M'), Some("s"), None)).is_err());
        assert!(quantity(&q("5s/min", 5.0, None, Some("s"), Some("min"))).is_err());
    }

    #[test]
    fn shows_values() {
        assert_eq!(show(Ty::Duration, 2500.0), "2.5s");
        assert_eq!(show(Ty::Duration, 1_800_000.0), "30m");
        assert_eq!(show(Ty::Percent, 85.0), "85%");
        assert_eq!(weekday("Tuesday"), Some(1));
    }
}
