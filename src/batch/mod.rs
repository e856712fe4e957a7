//! Batches: the OpenAI Files and Batches API on a durable store.
//!
//! A client uploads a JSONL file of requests (`POST /v1/files`,
//! `purpose=batch`); every line is validated as it streams in
//! (`server::batch_lines`)
//! and stored in the embedded database ([`store`]), or nothing is. A batch
//! (`POST /v1/batches`) names the file and a completion window the policy
//! allows; the runner (`server::batch_runner`) then feeds its items, a bounded number at a
//! time, into the same request path as online traffic: each item is
//! classified, admitted, routed and queued by the decision graph and the
//! scheduler, carries the header `x-kiln-batch` and the tag `batch` (so
//! classify rules can send batches to a tier), and has what is left of its
//! batch's window as its deadline (earliest deadline first within its
//! tier). Each result is written once, so a crash at any moment loses no
//! item and duplicates none: items in flight at the crash run again after
//! the restart.

pub mod backend;
pub mod job;
pub mod pg;
pub mod pg_tls;
pub mod plan;
pub mod store;
pub mod view;

use serde_json::{json, Value};

/// OpenAI's per-file limits.
pub const MAX_REQUESTS: u64 = 50_000;
pub const MAX_FILE_BYTES: u64 = 200 * 1024 * 1024;

/// The OpenAI batch lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchStatus {
    Validating,
    InProgress,
    Finalizing,
    Completed,
    Failed,
    Expired,
    Cancelling,
    Cancelled,
}

impl BatchStatus {
    pub fn name(self) -> &'static str {
        match self {
            BatchStatus::Validating => "validating",
            BatchStatus::InProgress => "in_progress",
            BatchStatus::Finalizing => "finalizing",
            BatchStatus::Completed => "completed",
            BatchStatus::Failed => "failed",
            BatchStatus::Expired => "expired",
            BatchStatus::Cancelling => "cancelling",
            BatchStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<BatchStatus> {
        Some(match s {
            "validating" => BatchStatus::Validating,
            "in_progress" => BatchStatus::InProgress,
            "finalizing" => BatchStatus::Finalizing,
            "completed" => BatchStatus::Completed,
            "failed" => BatchStatus::Failed,
            "expired" => BatchStatus::Expired,
            "cancelling" => BatchStatus::Cancelling,
            "cancelled" => BatchStatus::Cancelled,
            _ => return None,
        })
    }

    /// The timestamp column a move to this status sets.
    pub fn stamp_column(self) -> &'static str {
        match self {
            BatchStatus::Validating => "created_at",
            BatchStatus::InProgress => "in_progress_at",
            BatchStatus::Finalizing => "finalizing_at",
            BatchStatus::Completed => "completed_at",
            BatchStatus::Failed => "failed_at",
            BatchStatus::Expired => "expired_at",
            BatchStatus::Cancelling => "cancelling_at",
            BatchStatus::Cancelled => "cancelled_at",
        }
    }

    /// No more work will happen.
    pub fn terminal(self) -> bool {
        matches!(
            self,
            BatchStatus::Completed
                | BatchStatus::Failed
                | BatchStatus::Expired
                | BatchStatus::Cancelled
        )
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCounts {
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
}

/// A stored file.
#[derive(Debug, Clone, PartialEq)]
pub struct FileRow {
    pub id: String,
    /// The tenant that uploaded it (`None`: an anonymous caller).
    pub owner: Option<String>,
    pub purpose: String,
    pub filename: String,
    pub bytes: u64,
    pub created_at: i64,
    pub lines: u64,
    /// The one endpoint every line calls (input files).
    pub endpoint: Option<String>,
    /// Output and error files: the batch whose results they are.
    pub batch_id: Option<String>,
    /// Output (true) or error (false) file of `batch_id`.
    pub ok: Option<bool>,
}

impl FileRow {
    /// A batch input file of `lines` lines (tests build rows from it).
    pub fn example(id: &str, lines: u64) -> FileRow {
        FileRow {
            id: id.into(),
            owner: Some("t".into()),
            purpose: "batch".into(),
            filename: "f.jsonl".into(),
            bytes: 10,
            created_at: 1,
            lines,
            endpoint: Some("/v1/chat/completions".into()),
            batch_id: None,
            ok: None,
        }
    }

    /// OpenAI's file object.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": null,
            "expires_at": null,
        })
    }
}

/// A stored batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRow {
    pub id: String,
    pub owner: Option<String>,
    pub input_file_id: String,
    pub endpoint: String,
    pub completion_window: String,
    /// The window in wall seconds (the simulator's speed applied).
    pub window_s: f64,
    pub status: BatchStatus,
    pub created_at: i64,
    pub expires_at: i64,
    pub in_progress_at: Option<i64>,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub failed_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
    pub counts: RequestCounts,
    pub metadata: Option<Value>,
    pub errors: Option<Value>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    /// The tier its items classify into (from its first item).
    pub tier: Option<String>,
    /// Unix seconds the scheduler's estimate says it finishes.
    pub predicted_finish: Option<f64>,
    pub gpu_seconds: f64,
    pub deadline_misses: u64,
    /// What the batch was promised and how the planner last placed it;
    /// stored, so a restart plans on from it instead of afresh.
    pub promise: Promise,
}

/// A batch's promise (made at submission) and its place in the plan (kept
/// up to date by the runner), as the store holds them. A gateway that
/// restarts (even after `kill -9`) reads them back: a batch promised on
/// time keeps its place ahead of newer batches, a flagged one stays
/// behind, and the group's observed pace is not measured again from
/// nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Promise {
    /// Told at submission: on time (`Some(true)`) or flagged
    /// `predicted_miss` (`Some(false)`); `None` for a batch from before
    /// promises were stored (the plan decides it afresh).
    pub on_time: Option<bool>,
    /// Unix seconds it was predicted to finish at submission.
    pub finish: Option<f64>,
    /// Its position in its group's run order at the last plan (0 first).
    pub rank: Option<u64>,
    /// Its group's observed over estimated time per item at the last
    /// plan (the pace calibration; 1 is the bare estimate).
    pub pace_ratio: Option<f64>,
}

impl BatchRow {
    /// A batch in progress with nothing done (tests build rows from it).
    pub fn example(id: &str, file: &str, total: u64) -> BatchRow {
        BatchRow {
            id: id.into(),
            owner: Some("t".into()),
            input_file_id: file.into(),
            endpoint: "/v1/chat/completions".into(),
            completion_window: "24h".into(),
            window_s: 86_400.0,
            status: BatchStatus::InProgress,
            created_at: 1,
            expires_at: 86_401,
            in_progress_at: None,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            counts: RequestCounts {
                total,
                completed: 0,
                failed: 0,
            },
            metadata: None,
            errors: None,
            output_file_id: None,
            error_file_id: None,
            tier: None,
            predicted_finish: None,
            gpu_seconds: 0.0,
            deadline_misses: 0,
            promise: Default::default(),
        }
    }

    /// Its `kiln_*` settings ([`job::JobSettings`]), checked when it was
    /// created; none where its metadata has none.
    pub fn job(&self) -> job::JobSettings {
        job::JobSettings::parse(self.metadata.as_ref()).unwrap_or_default()
    }

    /// Will it finish after its window, by the last estimate?
    pub fn predicted_miss(&self) -> bool {
        !self.status.terminal()
            && self
                .predicted_finish
                .is_some_and(|f| f > self.expires_at as f64)
    }

    /// OpenAI's batch object, with kiln's view under `kiln`: tier,
    /// predicted finish and miss, GPU-seconds and their cost at `rate`
    /// (the tenant's `cost_per_gpu_hour`).
    pub fn to_json(&self, rate_per_gpu_hour: Option<f64>) -> Value {
        let done = self.counts.completed + self.counts.failed;
        let job = self.job();
        json!({
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": self.errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.name(),
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.counts.total,
                "completed": self.counts.completed,
                "failed": self.counts.failed,
            },
            "metadata": self.metadata,
            "kiln": {
                "owner": self.owner,
                "tier": self.tier,
                "progress": if self.counts.total > 0 { done as f64 / self.counts.total as f64 } else { 1.0 },
                "predicted_finish_at": self.predicted_finish.map(|f| f.round() as i64),
                "predicted_miss": self.predicted_miss(),
                "deadline_misses": self.deadline_misses,
                "promise": {
                    "on_time": self.promise.on_time,
                    "finish_at": self.promise.finish.map(|f| f.round() as i64),
                    "rank": self.promise.rank,
                    "pace_ratio": self.promise.pace_ratio.map(|k| (k * 1000.0).round() / 1000.0),
                },
                "job": {
                    "priority": job.priority,
                    "preemptible": job.preemptible,
                    "max_in_flight": job.max_in_flight,
                },
                "gpu_seconds": (self.gpu_seconds * 1000.0).round() / 1000.0,
                "cost": rate_per_gpu_hour.map(|r| ((self.gpu_seconds / 3600.0 * r) * 1e6).round() / 1e6),
            },
        })
    }
}

/// An input line waiting to run.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemLine {
    pub line: u64,
    pub custom_id: String,
    /// The line as uploaded (validated).
    pub text: String,
}

/// Unix seconds now.
pub fn now_s() -> i64 {
    (crate::clock::unix_ms() / 1000.0) as i64
}

/// A new random id with OpenAI's shape (`file-…`, `batch_…`).
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 12];
    if getrandom::fill(&mut b).is_err() {
        // No OS randomness: unique per process and time is still unique.
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let t = crate::clock::unix_ms() as u64;
        b[..8].copy_from_slice(&t.to_le_bytes());
        b[8..].copy_from_slice(&(n as u32).to_le_bytes());
    }
    format!("{prefix}{}", hex::encode(b))
}

/// The random part of an id, for ids derived from it.
pub fn short_id(id: &str) -> &str {
    id.rsplit(['_', '-']).next().unwrap_or(id)
}

/// Parses a completion window: `24h`, `90m`, `2d`, `3600s`; seconds.
/// Strict, as OpenAI's enum is: no spaces around it (`"1h "` is refused,
/// not read as `1h`).
pub fn parse_window(s: &str) -> Option<f64> {
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.')?;
    let (n, unit) = s.split_at(split);
    let n: f64 = n.parse().ok()?;
    let mult = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => return None,
    };
    let secs = n * mult;
    (secs.is_finite() && secs > 0.0).then_some(secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse() {
        assert_eq!(parse_window("24h"), Some(86_400.0));
        assert_eq!(parse_window("90m"), Some(5_400.0));
        assert_eq!(parse_window("1.5h"), Some(5_400.0));
        assert_eq!(parse_window("h"), None);
        assert_eq!(parse_window("24"), None);
        assert_eq!(parse_window("0h"), None);
        assert_eq!(parse_window("24w"), None);
        assert_eq!(parse_window("1e999h"), None);
        assert_eq!(parse_window("1h "), None);
        assert_eq!(parse_window(" 24h"), None);
        assert_eq!(parse_window("2 h"), None);
    }

    #[test]
    fn statuses_round_trip() {
        for s in [
            BatchStatus::Validating,
            BatchStatus::InProgress,
            BatchStatus::Finalizing,
            BatchStatus::Completed,
            BatchStatus::Failed,
            BatchStatus::Expired,
            BatchStatus::Cancelling,
            BatchStatus::Cancelled,
        ] {
            assert_eq!(BatchStatus::parse(s.name()), Some(s));
        }
    }

    #[test]
    fn ids_are_distinct() {
        let a = new_id("batch_");
        let b = new_id("batch_");
        assert_ne!(a, b);
        assert!(a.starts_with("batch_") && a.len() == 6 + 24);
        assert_eq!(short_id("batch_abc"), "abc");
    }
}
