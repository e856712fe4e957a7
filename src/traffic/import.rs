//! Importers for public traces with one row per request: the Azure LLM
//! inference traces (CSV) and the Mooncake traces (JSONL).

use super::{sort, At, Kind, Lines, Loaded, Record, TrafficError};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// How imported rows become requests; shared by every importer.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapping {
    pub tenant: Option<String>,
    pub api_key: Option<String>,
    pub model: String,
    pub headers: BTreeMap<String, String>,
    pub tags: Vec<String>,
    /// `max_tokens` of every request; `None`: the tokens actually generated.
    pub max_tokens: Option<u64>,
    /// Arrival times are multiplied by this (0.5 = twice the rate).
    pub time_scale: f64,
    /// Keep only the first N requests (by arrival).
    pub limit: Option<usize>,
    pub skip_malformed: bool,
}

impl Mapping {
    /// Requests for `model`, nothing else set, time scale 1.
    pub fn new(model: impl Into<String>) -> Self {
        Mapping {
            tenant: None,
            api_key: None,
            model: model.into(),
            headers: BTreeMap::new(),
            tags: Vec::new(),
            max_tokens: None,
            time_scale: 1.0,
            limit: None,
            skip_malformed: false,
        }
    }

    pub(crate) fn check(&self) -> Result<(), TrafficError> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(TrafficError::Invalid(format!(
                "time scale must be a positive number, found {}",
                self.time_scale
            )));
        }
        Ok(())
    }

    /// A record of this mapping's request.
    pub(crate) fn record(&self, at_ms: f64, prompt_tokens: u64, output_tokens: u64) -> Record {
        Record {
            at_ms,
            tenant: self.tenant.clone(),
            api_key: self.api_key.clone(),
            model: self.model.clone(),
            headers: self.headers.clone(),
            tags: self.tags.clone(),
            prompt_tokens,
            max_tokens: self.max_tokens.unwrap_or(output_tokens),
            output_tokens,
            ..Record::default()
        }
    }

    /// Sorts, applies the time scale and the limit.
    pub(crate) fn finish(&self, mut records: Vec<Record>) -> Vec<Record> {
        sort(&mut records);
        if self.time_scale != 1.0 {
            super::scale_time(&mut records, self.time_scale);
        }
        if let Some(n) = self.limit {
            records.truncate(n);
        }
        records
    }
}

/// Calls `f` on every non-blank line of `path`; malformed lines (an `Err`
/// from `f`) fail the import or, with `skip`, are skipped and counted.
pub(crate) fn each_line(
    path: &Path,
    kind: Kind,
    skip: bool,
    mut f: impl FnMut(&At<'_>) -> Result<(), TrafficError>,
) -> Result<Vec<usize>, TrafficError> {
    let file = File::open(path).map_err(|e| TrafficError::io(path, e))?;
    each_line_in(
        BufReader::new(file),
        &path.display().to_string(),
        kind,
        skip,
        &mut f,
    )
}

fn each_line_in(
    r: impl BufRead,
    name: &str,
    kind: Kind,
    skip: bool,
    f: &mut impl FnMut(&At<'_>) -> Result<(), TrafficError>,
) -> Result<Vec<usize>, TrafficError> {
    let mut lines = Lines::new(r, name);
    let mut skipped = Vec::new();
    while let Some(next) = lines.next_line(kind) {
        let res = next.and_then(|(n, text)| {
            f(&At {
                kind,
                path: name,
                line: n,
                text: &text,
            })
        });
        if let Err(e) = res {
            match e.line() {
                Some(n) if skip => skipped.push(n),
                _ => return Err(e),
            }
        }
    }
    Ok(skipped)
}

/// Byte ranges of the comma-separated fields of a line.
pub(crate) fn fields(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c == ',' {
            out.push((start, &text[start..i]));
            start = i + 1;
        }
    }
    out.push((start, &text[start..]));
    out
}

/// Parses a field as `T`, or an error naming the column.
pub(crate) fn field<T: std::str::FromStr>(
    at: &At<'_>,
    (off, s): (usize, &str),
    name: &str,
    what: &str,
) -> Result<T, TrafficError> {
    s.trim().parse().map_err(|_| {
        at.error(
            off,
            s.len().max(1),
            format!("{name}: expected {what}, found `{s}`"),
            format!("not {what}"),
        )
    })
}

const AZURE_HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens";

/// Imports an Azure LLM inference trace (2023): CSV with the header
/// `TIMESTAMP,ContextTokens,GeneratedTokens` and timestamps like
/// `2023-11-16 18:15:46.6805900` (no zone). Arrival times are relative to
/// the earliest row (the first, in the published files, which are sorted).
/// `prompt_tokens` = ContextTokens, `output_tokens` = GeneratedTokens,
/// `max_tokens` = GeneratedTokens unless the mapping sets it.
pub fn azure(path: impl AsRef<Path>, map: &Mapping) -> Result<Loaded, TrafficError> {
    map.check()?;
    let mut rows: Vec<(i128, u64, u64)> = Vec::new();
    let mut header_seen = false;
    let skipped = each_line(path.as_ref(), Kind::Azure, map.skip_malformed, |at| {
        if !header_seen {
            header_seen = true;
            if at.text.trim().eq_ignore_ascii_case(AZURE_HEADER) {
                return Ok(());
            }
            return Err(at.whole(
                format!("expected the header `{AZURE_HEADER}`"),
                "not the Azure trace header",
            ));
        }
        let f = fields(at.text);
        if f.len() != 3 {
            return Err(at.whole(
                format!("expected 3 comma-separated fields, found {}", f.len()),
                "this row",
            ));
        }
        let ts = parse_timestamp(f[0].1.trim()).ok_or_else(|| {
            at.error(
                f[0].0,
                f[0].1.len().max(1),
                format!(
                    "TIMESTAMP: expected `YYYY-MM-DD HH:MM:SS.fffffff`, found `{}`",
                    f[0].1
                ),
                "not a timestamp",
            )
        })?;
        let ctx = field(at, f[1], "ContextTokens", "a token count")?;
        let gen = field(at, f[2], "GeneratedTokens", "a token count")?;
        rows.push((ts, ctx, gen));
        Ok(())
    })?;
    let t0 = rows.iter().map(|r| r.0).min().unwrap_or(0);
    let records = rows
        .into_iter()
        .map(|(ts, ctx, gen)| map.record((ts - t0) as f64 / 1e6, ctx, gen))
        .collect();
    Ok(Loaded {
        records: map.finish(records),
        skipped,
    })
}

/// `YYYY-MM-DD HH:MM:SS[.f…]` (or with `T`), no zone, read as UTC, to
/// nanoseconds since 1970-01-01 00:00:00. `None` when it is not a valid
/// time. The shape is checked here, because jiff's parser also reads a date
/// alone, an expanded year or an offset, which an Azure trace never holds.
/// The calendar (month lengths, leap years) and the arithmetic are jiff's.
/// A leap second (`:60`) is read as `:59`, as jiff reads it.
pub fn parse_timestamp(s: &str) -> Option<i128> {
    let b = s.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let shape = b.len() >= 19
        && [0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18]
            .into_iter()
            .all(digit)
        && (b[4], b[7], b[13], b[16]) == (b'-', b'-', b':', b':')
        && matches!(b[10], b' ' | b'T');
    // At most nine digits of fraction (nanoseconds), at least one.
    let fraction = b.len() == 19
        || (b.get(19) == Some(&b'.') && (21..=29).contains(&b.len()) && (20..b.len()).all(digit));
    if !shape || !fraction {
        return None;
    }
    let civil: jiff::civil::DateTime = s.parse().ok()?;
    let zoned = civil.to_zoned_datetime(jiff::tz::TimeZone::UTC).ok()?;
    Some(zoned.timestamp().as_nanosecond())
}

#[derive(Deserialize)]
struct MooncakeRow {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Imports a Mooncake trace: one JSON object a line with `timestamp` (ms
/// from the start, kept as is), `input_length`, `output_length` and
/// `hash_ids` (kept as `prefix_blocks`). `max_tokens` = `output_length`
/// unless the mapping sets it.
pub fn mooncake(path: impl AsRef<Path>, map: &Mapping) -> Result<Loaded, TrafficError> {
    map.check()?;
    let mut records = Vec::new();
    let skipped = each_line(path.as_ref(), Kind::Mooncake, map.skip_malformed, |at| {
        let row: MooncakeRow = serde_json::from_str(at.text).map_err(|e| at.json(&e))?;
        if !(row.timestamp.is_finite() && row.timestamp >= 0.0) {
            return Err(at.whole(
                format!("timestamp must not be negative, found {}", row.timestamp),
                "negative timestamp",
            ));
        }
        let mut r = map.record(row.timestamp, row.input_length, row.output_length);
        r.prefix_blocks = row.hash_ids;
        records.push(r);
        Ok(())
    })?;
    Ok(Loaded {
        records: map.finish(records),
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        let a = parse_timestamp("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_timestamp("2023-11-16 18:15:50.9951690").unwrap();
        assert_eq!(b - a, 4_314_579_000);
        assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0));
        // Read as UTC, whatever the machine's zone.
        assert_eq!(
            parse_timestamp("2023-11-16 18:15:46"),
            Some(1_700_158_546_000_000_000)
        );
        assert_eq!(parse_timestamp("1969-12-31 23:59:59.5"), Some(-500_000_000));
        assert_eq!(
            parse_timestamp("1970-01-02T00:00:00.5"),
            Some(86_400_500_000_000)
        );
        // 2024 is a leap year; midnight crossing a month.
        let x = parse_timestamp("2024-02-29 23:59:59.9").unwrap();
        let y = parse_timestamp("2024-03-01 00:00:00.1").unwrap();
        assert_eq!(y - x, 200_000_000);
        for bad in [
            "",
            "2023-11-16",
            "2023-13-16 18:15:46",
            "2023-02-29 18:15:46",
            "2023-11-16 24:00:00",
            "2023-11-16 18:15:46.",
            "2023-11-16 18:15:46.12a",
            "2023-11-16 18:15:46,1",
            "2023-11-16 18:15:46.1234567890",
            "2023-11-16 18:1é:46",
            "+023-11-16 18:15:46",
            "2023-11-16 18:15:46Z",
            "2023-11-16 18:15:46+01:00",
            "2023-11-16 18:15:46.1+01:00",
            "2023-11-16 18:15",
        ] {
            assert_eq!(parse_timestamp(bad), None, "{bad}");
        }
    }

    #[test]
    fn fields_keep_offsets() {
        assert_eq!(
            fields("a,bc,,d"),
            vec![(0, "a"), (2, "bc"), (5, ""), (6, "d")]
        );
    }

    #[test]
    fn azure_rows_in_memory() {
        let mut recs = Vec::new();
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,10,5\nbad\n2023-11-16 18:15:46.5,3,1";
        let skipped = each_line_in(text.as_bytes(), "x.csv", Kind::Azure, true, &mut |at| {
            recs.push(at.line);
            if at.text == "bad" {
                return Err(at.whole("bad", "bad"));
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(recs, vec![1, 2, 3, 4]);
        assert_eq!(skipped, vec![3]);
    }
}
