//! Recorded traffic: the JSONL format the gateway's decision log writes and
//! the simulator replays, and importers for public traces.
//!
//! One [`Record`] a line, version 1 (README: "Recorded traffic"). Reading
//! with [`read`] or [`read_with`] returns the records sorted by arrival
//! time, stably (records with equal `at_ms` keep their order in the file);
//! [`Reader`] streams them in file order. [`write()`] produces the same bytes
//! for the same records: fields in a fixed order, numbers in serde_json's
//! shortest round-tripping form.
//!
//! Importers: [`import::azure`], [`import::mooncake`], [`servegen::import`].

mod error;
pub mod import;
pub mod servegen;
pub mod stats;
pub mod synth;

pub(crate) use error::{At, Kind};
pub use error::{LineSource, MalformedLine, TrafficError};

use crate::graph::Request;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;

/// The format version this kiln reads and writes.
pub const FORMAT_VERSION: u32 = 1;

fn format_version() -> u32 {
    FORMAT_VERSION
}

/// One recorded request: when it arrived, what it asked for, what it
/// produced and, when recorded by the gateway, what was decided and the
/// latency seen.
///
/// The request fields are those of [`Request`], repeated rather than
/// flattened so that unknown fields are rejected (`#[serde(flatten)]` does
/// not combine with `deny_unknown_fields`); [`Record::request`] rebuilds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// Format version; optional on input (default 1), always written.
    #[serde(default = "format_version")]
    pub v: u32,
    /// Arrival time in milliseconds from the start of the trace.
    pub at_ms: f64,
    /// Request id, as the gateway assigned it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    pub model: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub max_tokens: u64,
    /// Tokens the model actually produced.
    #[serde(default)]
    pub output_tokens: u64,
    /// Ids of the 512-token prompt blocks (Mooncake `hash_ids`): requests
    /// sharing leading ids share a prompt prefix.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefix_blocks: Vec<u64>,
    /// Hash or name of the policy version that decided the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
    /// Time spent waiting in the gateway's queue before the request started
    /// on a replica (or was refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_ms: Option<f64>,
    /// Time to first token seen by the gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// End-to-end latency seen by the gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
    /// A batch item's deadline: when its batch's completion window ends,
    /// in milliseconds from the start of the trace (the clock of `at_ms`).
    /// The replay gives the item what is left of it as its own window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<f64>,
    /// The request's content hash (64 hex digits) when it was cacheable
    /// (deterministic: temperature 0 or a seed, one choice): the replay
    /// looks it up in its tier's exact cache as the gateway did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
}

/// The decision the gateway took, as recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// The tenant the request was attributed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Where it was routed (`llama-70b.fp16 on h100`): the model that
    /// served it, which may be a declared substitute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// The model the request asked for, when `route` names a substitute
    /// that served it instead (`served_by`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub substituted_for: Option<String>,
    /// `accept`, `queue`, `degrade`, `reject`, …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<String>,
    /// HTTP status returned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Index of the fallback step taken, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_step: Option<u32>,
    /// Why the request was refused (`quota`, `overload`, `policy`, …), when
    /// it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Why the request did not start on arrival (`priority`, `fairness`,
    /// `saturation`, …), when it waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waited_for: Option<String>,
    /// `hit` when the tier's exact cache answered it (no queue, no GPU),
    /// `miss` when it was cacheable and served fresh.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    /// The replica it started on (its index in the gateway's plan): the
    /// requests that shared its replica are the batch it ran in, which
    /// `kiln calibrate --from-log` reads instead of the pool's average.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<u32>,
}

impl Default for Record {
    fn default() -> Self {
        Record {
            v: FORMAT_VERSION,
            at_ms: 0.0,
            id: None,
            tenant: None,
            api_key: None,
            model: String::new(),
            headers: BTreeMap::new(),
            tags: Vec::new(),
            session: None,
            prompt_tokens: 0,
            max_tokens: 0,
            output_tokens: 0,
            prefix_blocks: Vec::new(),
            policy_version: None,
            decision: None,
            queue_ms: None,
            ttft_ms: None,
            e2e_ms: None,
            deadline_ms: None,
            cache_key: None,
        }
    }
}

impl Record {
    /// A record of `request` arriving at `at_ms` and producing
    /// `output_tokens`; the recorded-by-gateway fields are empty.
    pub fn new(at_ms: f64, request: Request, output_tokens: u64) -> Self {
        let Request {
            tenant,
            api_key,
            model,
            headers,
            tags,
            session,
            prompt_tokens,
            max_tokens,
        } = request;
        Record {
            at_ms,
            tenant,
            api_key,
            model,
            headers,
            tags,
            session,
            prompt_tokens,
            max_tokens,
            output_tokens,
            ..Record::default()
        }
    }

    /// The request as the policy sees it.
    pub fn request(&self) -> Request {
        Request {
            tenant: self.tenant.clone(),
            api_key: self.api_key.clone(),
            model: self.model.clone(),
            headers: self.headers.clone(),
            tags: self.tags.clone(),
            session: self.session.clone(),
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
        }
    }
}

/// How to read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Skip malformed lines (and count them) instead of failing on the first.
    pub skip_malformed: bool,
}

/// Records read or imported, and the malformed lines skipped on the way.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loaded {
    /// Sorted by `at_ms`, stably.
    pub records: Vec<Record>,
    /// 1-based numbers of the lines skipped as malformed (only ever
    /// non-empty with `skip_malformed`).
    pub skipped: Vec<usize>,
}

/// Reads a traffic file strictly: the first malformed line is an error.
/// The records come back sorted by `at_ms`, stably.
pub fn read(path: impl AsRef<Path>) -> Result<Vec<Record>, TrafficError> {
    read_with(path, ReadOptions::default()).map(|l| l.records)
}

/// Reads a traffic file; with `skip_malformed`, bad lines are skipped and
/// their numbers returned. The records come back sorted by `at_ms`, stably.
pub fn read_with(path: impl AsRef<Path>, opts: ReadOptions) -> Result<Loaded, TrafficError> {
    let mut reader = Reader::open(path.as_ref(), opts)?;
    let mut records = Vec::new();
    for r in reader.by_ref() {
        records.push(r?);
    }
    sort(&mut records);
    Ok(Loaded {
        records,
        skipped: reader.skipped,
    })
}

/// Streams records in file order (not sorted). With `skip_malformed`,
/// malformed lines are skipped and counted in [`Reader::skipped`]; without,
/// each is yielded as an error. After an I/O error the reader ends.
pub struct Reader<R> {
    lines: Lines<R>,
    opts: ReadOptions,
    skipped: Vec<usize>,
    done: bool,
}

impl Reader<BufReader<File>> {
    pub fn open(path: &Path, opts: ReadOptions) -> Result<Self, TrafficError> {
        let f = File::open(path).map_err(|e| TrafficError::io(path, e))?;
        Ok(Reader::new(
            BufReader::new(f),
            &path.display().to_string(),
            opts,
        ))
    }
}

impl<R: BufRead> Reader<R> {
    /// Reads from `reader`; `name` is the file name errors show.
    pub fn new(reader: R, name: &str, opts: ReadOptions) -> Self {
        Reader {
            lines: Lines::new(reader, name),
            opts,
            skipped: Vec::new(),
            done: false,
        }
    }

    /// 1-based numbers of the lines skipped so far.
    pub fn skipped(&self) -> &[usize] {
        &self.skipped
    }
}

impl<R: BufRead> Iterator for Reader<R> {
    type Item = Result<Record, TrafficError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        loop {
            let res = match self.lines.next_line(Kind::Kiln)? {
                Ok((n, text)) => {
                    let at = At {
                        kind: Kind::Kiln,
                        path: &self.lines.path,
                        line: n,
                        text: &text,
                    };
                    parse_line(&at)
                }
                Err(e) => Err(e),
            };
            match res {
                Ok(r) => return Some(Ok(r)),
                Err(e) => match e.line() {
                    Some(n) if self.opts.skip_malformed => self.skipped.push(n),
                    Some(_) => return Some(Err(e)),
                    None => {
                        self.done = true;
                        return Some(Err(e));
                    }
                },
            }
        }
    }
}

/// Parses and checks one line of the kiln format.
fn parse_line(at: &At<'_>) -> Result<Record, TrafficError> {
    let r: Record = serde_json::from_str(at.text).map_err(|e| at.json(&e))?;
    if r.v != FORMAT_VERSION {
        return Err(at.whole(
            format!(
                "unsupported traffic format version {} (this kiln reads version {FORMAT_VERSION})",
                r.v
            ),
            "this version",
        ));
    }
    if r.at_ms.is_nan() || r.at_ms < 0.0 {
        return Err(at.whole(
            format!("at_ms must not be negative, found {}", r.at_ms),
            "negative arrival time",
        ));
    }
    if let Some(d) = r.deadline_ms {
        if !d.is_finite() || d < 0.0 {
            return Err(at.whole(
                format!("deadline_ms must not be negative, found {d}"),
                "negative deadline",
            ));
        }
    }
    for (name, v) in [
        ("queue_ms", r.queue_ms),
        ("ttft_ms", r.ttft_ms),
        ("e2e_ms", r.e2e_ms),
    ] {
        if let Some(v) = v {
            if v.is_nan() || v < 0.0 {
                return Err(at.whole(
                    format!("{name} must not be negative, found {v}"),
                    "negative latency",
                ));
            }
        }
    }
    Ok(r)
}

/// Writes records, one JSON object a line, in the given order. The same
/// records always give the same bytes. A non-finite time (which JSON cannot
/// hold) is an `InvalidInput` error.
pub fn write<W: Write>(mut w: W, records: &[Record]) -> io::Result<()> {
    for r in records {
        write_record(&mut w, r)?;
    }
    w.flush()
}

/// Writes one record and its newline.
pub fn write_record<W: Write>(w: &mut W, r: &Record) -> io::Result<()> {
    let finite = r.at_ms.is_finite()
        && r.queue_ms.is_none_or(f64::is_finite)
        && r.ttft_ms.is_none_or(f64::is_finite)
        && r.e2e_ms.is_none_or(f64::is_finite)
        && r.deadline_ms.is_none_or(f64::is_finite);
    if !finite {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("record at_ms={} has a non-finite time", r.at_ms),
        ));
    }
    serde_json::to_writer(&mut *w, r)?;
    w.write_all(b"\n")
}

/// Sorts by arrival time, stably: equal times keep their order.
pub fn sort(records: &mut [Record]) {
    records.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
}

/// Multiplies every arrival time by `factor` (0.5 replays at twice the
/// rate). Recorded latencies are outcomes, not arrivals, and are kept.
pub fn scale_time(records: &mut [Record], factor: f64) {
    for r in records {
        r.at_ms *= factor;
    }
}

/// Merges traces by arrival time, stably: records with equal times keep
/// the order of the traces given, then their order within a trace.
/// Decision logs stamp arrivals with wall-clock time (Unix milliseconds);
/// replays want time from the start of the trace. When the first arrival
/// looks like a wall-clock stamp (after 1973), every `at_ms` is shifted so
/// the trace starts at 0 (and every `deadline_ms` with it: the same
/// clock). Returns the shift, if any. Sorted input expected.
pub fn rebase_wall_clock(records: &mut [Record]) -> Option<f64> {
    const WALL_CLOCK_MS: f64 = 1e11;
    let first = records.first()?.at_ms;
    if first < WALL_CLOCK_MS {
        return None;
    }
    let shift = |t: f64| ((t - first) * 1000.0).round() / 1000.0;
    for r in records.iter_mut() {
        r.at_ms = shift(r.at_ms);
        r.deadline_ms = r.deadline_ms.map(shift);
    }
    Some(first)
}

pub fn merge(traces: impl IntoIterator<Item = Vec<Record>>) -> Vec<Record> {
    let mut all: Vec<Record> = traces.into_iter().flatten().collect();
    sort(&mut all);
    all
}

/// Non-blank lines of a file, numbered from 1, as UTF-8 text without the
/// line ending (and without a leading byte-order mark).
pub(crate) struct Lines<R> {
    r: R,
    pub(crate) path: String,
    line: usize,
    buf: Vec<u8>,
}

impl<R: BufRead> Lines<R> {
    pub(crate) fn new(r: R, path: &str) -> Self {
        Lines {
            r,
            path: path.to_string(),
            line: 0,
            buf: Vec::new(),
        }
    }

    /// The next non-blank line; `None` at the end. A line that is not UTF-8
    /// is a malformed-line error of `kind`.
    pub(crate) fn next_line(
        &mut self,
        kind: Kind,
    ) -> Option<Result<(usize, String), TrafficError>> {
        loop {
            self.buf.clear();
            match self.r.read_until(b'\n', &mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => {
                    return Some(Err(TrafficError::Io {
                        path: self.path.clone(),
                        source: e,
                    }))
                }
            }
            self.line += 1;
            while matches!(self.buf.last(), Some(b'\n' | b'\r')) {
                self.buf.pop();
            }
            let text = match std::str::from_utf8(&self.buf) {
                Ok(t) => t,
                Err(e) => {
                    let lossy = String::from_utf8_lossy(&self.buf).into_owned();
                    let at = At {
                        kind,
                        path: &self.path,
                        line: self.line,
                        text: &lossy,
                    };
                    return Some(Err(at.error(
                        e.valid_up_to(),
                        1,
                        "line is not valid UTF-8",
                        "invalid byte",
                    )));
                }
            };
            let text = if self.line == 1 {
                text.strip_prefix('\u{feff}').unwrap_or(text)
            } else {
                text
            };
            if text.trim().is_empty() {
                continue;
            }
            return Some(Ok((self.line, text.to_string())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(at_ms: f64, model: &str) -> Record {
        Record {
            at_ms,
            model: model.into(),
            ..Record::default()
        }
    }

    fn read_str(s: &str, skip: bool) -> (Vec<Result<Record, TrafficError>>, Vec<usize>) {
        let mut r = Reader::new(
            s.as_bytes(),
            "t.jsonl",
            ReadOptions {
                skip_malformed: skip,
            },
        );
        let v: Vec<_> = r.by_ref().collect();
        (v, r.skipped().to_vec())
    }

    #[test]
    fn writes_fixed_field_order() {
        let mut r = rec(12.5, "m");
        r.tenant = Some("t".into());
        r.prefix_blocks = vec![1, 2];
        r.decision = Some(Decision {
            tier: Some("interactive".into()),
            status: Some(200),
            ..Decision::default()
        });
        let mut out = Vec::new();
        write(&mut out, &[r]).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"v\":1,\"at_ms\":12.5,\"tenant\":\"t\",\"model\":\"m\",\"prompt_tokens\":0,\"max_tokens\":0,\"output_tokens\":0,\"prefix_blocks\":[1,2],\"decision\":{\"tier\":\"interactive\",\"status\":200}}\n"
        );
    }

    #[test]
    fn version_defaults_to_one_and_others_are_rejected() {
        let (v, _) = read_str(
            "{\"at_ms\":1,\"model\":\"m\"}\n{\"v\":2,\"at_ms\":1,\"model\":\"m\"}",
            false,
        );
        assert_eq!(v[0].as_ref().unwrap().v, 1);
        let e = v[1].as_ref().unwrap_err();
        assert_eq!(e.line(), Some(2));
        assert!(e
            .to_string()
            .contains("unsupported traffic format version 2"));
    }

    #[test]
    fn unknown_fields_and_negative_times_are_malformed() {
        let (v, _) = read_str(
            "{\"at_ms\":1,\"model\":\"m\",\"extra\":1}\n{\"at_ms\":-1,\"model\":\"m\"}\n",
            false,
        );
        assert!(v[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("unknown field `extra`"));
        assert!(v[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("must not be negative"));
    }

    #[test]
    fn skips_blank_lines_crlf_and_counts_malformed() {
        let (v, skipped) = read_str(
            "\u{feff}{\"at_ms\":1,\"model\":\"m\"}\r\n\n   \nnot json\n{\"at_ms\":2,\"model\":\"m\"}",
            true,
        );
        assert_eq!(v.len(), 2);
        assert!(v.iter().all(Result::is_ok));
        assert_eq!(skipped, vec![4]);
    }

    #[test]
    fn invalid_utf8_is_malformed_not_fatal() {
        let mut r = Reader::new(
            &b"{\"at_ms\":1,\"model\":\"\xff\"}\n{\"at_ms\":2,\"model\":\"m\"}\n"[..],
            "t.jsonl",
            ReadOptions {
                skip_malformed: true,
            },
        );
        assert_eq!(r.by_ref().filter(Result::is_ok).count(), 1);
        assert_eq!(r.skipped(), &[1]);
    }

    #[test]
    fn gateway_fields_round_trip_and_are_checked() {
        let mut r = rec(3.0, "m");
        r.queue_ms = Some(1.5);
        r.decision = Some(Decision {
            admission: Some("reject".into()),
            status: Some(429),
            reason: Some("quota".into()),
            waited_for: Some("saturation".into()),
            ..Decision::default()
        });
        let mut out = Vec::new();
        write(&mut out, std::slice::from_ref(&r)).unwrap();
        let line = String::from_utf8(out).unwrap();
        assert!(line.contains("\"queue_ms\":1.5"), "{line}");
        assert!(line.contains("\"reason\":\"quota\",\"waited_for\":\"saturation\""));
        let (v, _) = read_str(&line, false);
        assert_eq!(v[0].as_ref().unwrap(), &r);

        let (v, _) = read_str("{\"at_ms\":1,\"model\":\"m\",\"queue_ms\":-2}", false);
        assert!(v[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("queue_ms must not be negative"));
        let mut r = rec(1.0, "m");
        r.queue_ms = Some(f64::NAN);
        assert!(write(&mut Vec::new(), &[r]).is_err());
    }

    #[test]
    fn wall_clock_logs_are_rebased_and_traces_are_not() {
        let mut log = vec![rec(1_795_976_296_000.0, "a"), rec(1_795_976_296_250.5, "b")];
        assert_eq!(rebase_wall_clock(&mut log), Some(1_795_976_296_000.0));
        assert_eq!((log[0].at_ms, log[1].at_ms), (0.0, 250.5));
        let mut trace = vec![rec(3_600_000.0, "a")];
        assert_eq!(rebase_wall_clock(&mut trace), None);
        assert_eq!(trace[0].at_ms, 3_600_000.0);
    }

    #[test]
    fn merge_is_stable() {
        let a = vec![rec(1.0, "a1"), rec(2.0, "a2")];
        let b = vec![rec(1.0, "b1"), rec(1.5, "b2")];
        let m: Vec<String> = merge([a, b]).into_iter().map(|r| r.model).collect();
        assert_eq!(m, ["a1", "b1", "b2", "a2"]);
    }

    #[test]
    fn non_finite_is_not_written() {
        let mut out = Vec::new();
        assert!(write(&mut out, &[rec(f64::NAN, "m")]).is_err());
        let mut r = rec(1.0, "m");
        r.ttft_ms = Some(f64::INFINITY);
        assert!(write(&mut out, &[r]).is_err());
    }

    #[test]
    fn request_round_trips() {
        let req = Request {
            tenant: Some("t".into()),
            model: "m".into(),
            prompt_tokens: 3,
            max_tokens: 4,
            tags: vec!["x".into()],
            ..Request::default()
        };
        assert_eq!(Record::new(1.0, req.clone(), 2).request(), req);
    }
}
