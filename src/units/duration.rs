//! Durations in configuration files: `"30s"`, `"500ms"`, `"1m30s"`,
//! `"1.5h"`, or a plain number of seconds (`30`, `0.25`, `"30"`). Every
//! unit a policy accepts means the same here; config files also take the
//! spelt-out forms (`sec`, `minutes`, `µs`).

use std::time::Duration;

/// Parses a duration; the error says what is wrong in words.
///
/// Units: `ns`, `us`/`µs`, `ms`, `s`/`sec`/`secs`/`second(s)`,
/// `m`/`min`/`mins`/`minute(s)`, `h`/`hr`/`hrs`/`hour(s)`,
/// `d`/`day(s)`. Several parts add up (`"1m 30s"`).
pub fn parse(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty duration; write e.g. \"30s\" or \"500ms\"".into());
    }
    if let Ok(secs) = s.parse::<f64>() {
        return from_secs(secs, text);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_len);
        if num.is_empty() {
            return Err(format!(
                "`{text}` is not a duration: expected a number at `{rest}`"
            ));
        }
        let after = after.trim_start();
        let unit_len = after
            .find(|c: char| !c.is_alphabetic())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale = match super::duration_unit_ms(unit) {
            Some(ms) => ms / 1e3,
            None => match unit {
                "ns" => 1e-9,
                "us" | "µs" => 1e-6,
                "sec" | "secs" | "second" | "seconds" => 1.0,
                "mins" | "minute" | "minutes" => 60.0,
                "hr" | "hrs" | "hour" | "hours" => 3600.0,
                "day" | "days" => 86400.0,
                "" => return Err(format!("`{text}` is not a duration: `{num}` has no unit")),
                other => {
                    return Err(format!(
                        "`{text}` is not a duration: unknown unit `{other}` (use ms, s, m or h)"
                    ))
                }
            },
        };
        let value: f64 = num
            .parse()
            .map_err(|_| format!("`{text}` is not a duration: bad number `{num}`"))?;
        let part = from_secs(value * scale, text)?;
        total = total
            .checked_add(part)
            .ok_or_else(|| format!("`{text}` is too long a duration"))?;
        rest = after.trim_start();
    }
    Ok(total)
}

fn from_secs(secs: f64, text: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(secs)
        .map_err(|_| format!("`{text}` is not a duration: it must be a finite, non-negative time"))
}

/// Formats a duration the way [`parse`] reads it: `200ms`, `2s`, `1.5s`.
pub fn format(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.as_nanos().is_multiple_of(1_000_000) && d < Duration::from_secs(10) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

/// `#[serde(deserialize_with = "duration::deserialize")]`: a string
/// with units, or a number of seconds.
pub fn deserialize<'de, D>(deserializer: D) -> Result<Duration, D::Error>
where
    D: serde::Deserializer<'de>,
{
    deserializer.deserialize_any(Visitor)
}

struct Visitor;

impl serde::de::Visitor<'_> for Visitor {
    type Value = Duration;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a duration such as \"30s\" or \"500ms\", or a number of seconds")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Duration, E> {
        parse(v).map_err(E::custom)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Duration, E> {
        Ok(Duration::from_secs(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Duration, E> {
        u64::try_from(v)
            .map(Duration::from_secs)
            .map_err(|_| E::custom(format!("{v} is not a duration: it is negative")))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Duration, E> {
        from_secs(v, &v.to_string()).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        let ms = Duration::from_millis;
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("500ms"), Ok(ms(500)));
        assert_eq!(parse(" 1m30s "), Ok(Duration::from_secs(90)));
        assert_eq!(parse("1h 2m"), Ok(Duration::from_secs(3720)));
        assert_eq!(parse("1.5s"), Ok(ms(1500)));
        assert_eq!(parse("2 seconds"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("0.25"), Ok(ms(250)));
        for bad in ["", "s", "10x", "5 m s", "-1s", "-3", "1.2.3s", "inf", "NaN"] {
            assert!(parse(bad).is_err(), "{bad:?} must not parse");
        }
        assert_eq!(format(ms(200)), "200ms");
        assert_eq!(format(Duration::from_secs(120)), "120s");
        assert_eq!(format(ms(1500)), "1500ms");
        assert_eq!(format(ms(12_500)), "12.5s");
    }
}
