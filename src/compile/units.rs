//! The compiler's view of [`crate::units`]: literals of the AST given their
//! type and base-unit value.

use crate::diag::{Code, Diagnostic};
use crate::lang::ast::{Clock, Quantity, Value, ValueKind};
pub use crate::units::{show, weekday, Ty, Typed, UnitError, WEEKDAYS};

pub fn quantity(q: &Quantity) -> Result<Typed, UnitError> {
    crate::units::quantity(crate::units::QuantityParts {
        raw: &q.raw,
        number: q.number,
        multiplier: q.multiplier,
        unit: q.unit.as_deref(),
        per: q.per.as_deref(),
    })
}

/// The type of a literal value, if it is a scalar literal.
pub fn literal(v: &Value) -> Option<Result<Typed, UnitError>> {
    match &v.kind {
        ValueKind::Quantity(q) => Some(quantity(q)),
        ValueKind::TimeOfDay(c) => Some(match c.minutes() {
            Some(m) => Ok(Typed {
                ty: Ty::TimeOfDay,
                value: f64::from(m),
            }),
            None => Err(UnitError(format!(
                "`{:02}:{:02}` is not a time of day",
                c.hour, c.minute
            ))),
        }),
        ValueKind::Date(d) => Some(
            match crate::units::calendar::date_days(
                i16::try_from(d.year).unwrap_or(i16::MAX),
                i8::try_from(d.month).unwrap_or(i8::MAX),
                i8::try_from(d.day).unwrap_or(i8::MAX),
            ) {
                Some(days) => Ok(Typed {
                    ty: Ty::Date,
                    value: f64::from(days),
                }),
                None => Err(UnitError(format!(
                    "`{:04}-{:02}-{:02}` is not a date",
                    d.year, d.month, d.day
                ))),
            },
        ),
        _ => None,
    }
}

/// The diagnostic for a time of day that does not exist (`25:00`,
/// `09:75`, or `24:00` anywhere but the end of a range); `None` for any
/// other value.
pub fn bad_time(v: &Value) -> Option<Diagnostic> {
    if let ValueKind::Date(d) = &v.kind {
        let shown = format!("{:04}-{:02}-{:02}", d.year, d.month, d.day);
        return Some(
            Diagnostic::error(Code::OutOfRange, format!("`{shown}` is not a date"))
                .at(v.span, "no such day")
                .help("write a day the calendar has, as `YYYY-MM-DD` (months 01 to 12, days as the month has them: `2027-02-28`, not `2027-02-29`)"),
        );
    }
    let ValueKind::TimeOfDay(c) = &v.kind else {
        return None;
    };
    let c: Clock = *c;
    if c.minutes().is_some() {
        return None;
    }
    let shown = format!("{:02}:{:02}", c.hour, c.minute);
    let d = if c.is_end_of_day() {
        Diagnostic::error(
            Code::OutOfRange,
            "`24:00` is only allowed as the end of a range",
        )
        .at(v.span, "not a time of day here")
        .help("`time in 18:00..24:00` means from 18:00 until midnight; for midnight itself write `00:00`")
    } else if c.hour > 23 {
        Diagnostic::error(Code::OutOfRange, format!("`{shown}` is not a time of day"))
            .at(v.span, "hours run from 00 to 23")
            .help("write a 24-hour time from `00:00` to `23:59` (the end of a range may be `24:00`, midnight)")
    } else {
        Diagnostic::error(Code::OutOfRange, format!("`{shown}` is not a time of day"))
            .at(v.span, "minutes run from 00 to 59")
            .help(format!(
                "write a 24-hour time from `00:00` to `23:59`, like `{:02}:00`",
                c.hour
            ))
    };
    Some(d)
}

/// What to write instead of a bare number where a unit is needed
/// (`ttft 500`, `max_wait 2`, `reserve { gpu 25 }`): the number with the
/// likeliest unit. `None` when `v` is not a bare number or `ty` has no unit.
pub fn missing_unit(ty: Ty, v: &Value) -> Option<String> {
    let ValueKind::Quantity(q) = &v.kind else {
        return None;
    };
    if q.unit.is_some() || q.per.is_some() || q.multiplier.is_some() {
        return None;
    }
    let n = &q.raw;
    Some(match ty {
        // Durations written without a unit are most often milliseconds
        // (`ttft 500`) when large, seconds (`max_wait 2`) when small.
        Ty::Duration if q.number >= 50.0 => {
            format!("a duration needs a unit: write `{n}ms` (or `{n}s` for seconds)")
        }
        Ty::Duration => {
            format!("a duration needs a unit: write `{n}s` (or `{n}ms` for milliseconds)")
        }
        Ty::Percent => format!("a percentage needs `%`: write `{n}%`"),
        Ty::Size => format!("a size needs a unit: write `{n}GB` (or `{n}GiB`, `{n}MB`, …)"),
        Ty::Rate => {
            format!("a rate needs a period: write `{n}/s` (or `{n}/min`, `{n}/h`, `{n}/day`)")
        }
        _ => return None,
    })
}
