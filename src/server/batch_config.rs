//! `[batch]` in `kiln.toml`: where the Files and Batches store lives and
//! the bounds the batch runner keeps (in flight, attempts and backoff, the
//! failure budget, upload limits). Apart from `config.rs` to keep each file
//! of `server/` readable at a sitting.

use serde::Deserialize;
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSection {
    /// The SQLite database of files, batches and results. `kiln serve`
    /// defaults to `.kiln/batches.db` (beside where it runs); a gateway
    /// started in-process without one keeps a temporary database. A
    /// `postgres://user:password@host:port/db` URL instead: a PostgreSQL
    /// database that every replica of a fleet shares.
    #[serde(default)]
    pub store: Option<PathBuf>,
    /// Batch items handed to the scheduler at once, over all batches: the
    /// gateway holds these (not whole files) in memory. The runner keeps
    /// twice the fleet's batch slots in flight (every slot full and as
    /// many waiting) and never more than this.
    #[serde(default = "default_batch_in_flight")]
    pub max_in_flight: usize,
    /// Per file, as OpenAI's: 50,000 requests, 200 MB.
    #[serde(default = "default_batch_requests")]
    pub max_requests: u64,
    #[serde(default = "default_batch_bytes")]
    pub max_file_bytes: u64,
    /// Tries of one item that an upstream answers with a 5xx (or that
    /// times out) before the item goes to the error file. Refusals by the
    /// gateway itself (429, 503) are not tries: they wait and come back.
    #[serde(default = "default_batch_attempts")]
    pub max_attempts: u32,
    /// The first wait before an item is tried again; each further try
    /// waits twice as long (at most `retry_max`), with deterministic
    /// jitter (from the batch id, line and try) so items that failed
    /// together do not return together.
    #[serde(
        default = "default_batch_retry_base",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub retry_base: std::time::Duration,
    #[serde(
        default = "default_batch_retry_max",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub retry_max: std::time::Duration,
    /// The failure budget: once at least `min_outcomes_for_budget` items
    /// have an outcome and more than this share of them failed, the batch
    /// stops (status `failed`, code `too_many_failures`): its unrun items
    /// go to the error file and what did run stays in the output file.
    /// 1.0 turns the budget off.
    #[serde(default = "default_batch_failed_share")]
    pub max_failed_share: f64,
    #[serde(default = "default_batch_min_outcomes")]
    pub min_outcomes_for_budget: u64,
    /// The most the store's database may grow to, in bytes (SQLite's
    /// `max_page_count`); past it writes fail as on a full disk (uploads
    /// get 507, the runner pauses). None: only the disk limits it.
    #[serde(default)]
    pub max_store_bytes: Option<u64>,
    /// How a tenant's running batches in one tier share its capacity:
    /// `deadline` (one after the other, earliest deadline first, the
    /// newest giving way when a window cannot be met) or `even` (side by
    /// side, the old rule: feasible windows can become joint misses).
    #[serde(default)]
    pub order: BatchOrder,
    /// What `POST /v1/batches` does with a batch whose window the plan
    /// says cannot be met: `accept` it flagged (`kiln.predicted_miss`) or
    /// `refuse` it (400 `completion_window_unmeetable`, with the predicted
    /// finish).
    #[serde(default)]
    pub on_predicted_miss: OnPredictedMiss,
    /// On a shared (PostgreSQL) store: how long a replica's claim on a
    /// batch lasts without renewal (it renews it several times a second
    /// while it runs). A replica that dies hands its batches on after this.
    #[serde(
        default = "default_batch_lease",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub lease: std::time::Duration,
    /// On a PostgreSQL store: the longest one store call may take,
    /// connecting included. A database that is down or stalled is then
    /// answered 503 (file and batch requests, with Retry-After) and
    /// waited out by the runner, instead of holding requests.
    #[serde(
        default = "default_store_timeout",
        deserialize_with = "crate::units::duration::deserialize"
    )]
    pub store_timeout: std::time::Duration,
    /// On a PostgreSQL store with TLS (`?sslmode=require` in the URL, or
    /// `prefer` where these are set): the CA to trust instead of the
    /// platform's roots, and a client certificate and key (PEM) where the
    /// server asks for one.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    #[serde(default)]
    pub client_key: Option<PathBuf>,
}

impl BatchSection {
    /// The client TLS settings for a PostgreSQL store.
    pub fn tls(&self) -> crate::tls::ClientTls {
        crate::tls::ClientTls {
            ca_file: self.ca_file.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
        }
    }

    /// How a PostgreSQL store is reached (timeout, TLS), or why the TLS
    /// files cannot be used.
    pub fn remote(&self) -> Result<crate::batch::store::Remote, crate::tls::TlsError> {
        let tls = self.tls();
        let tls = if tls.is_set() {
            Some(std::sync::Arc::new(tls.client_config(&[])?))
        } else {
            None
        };
        Ok(crate::batch::store::Remote {
            timeout: self.store_timeout,
            tls,
        })
    }
}

fn default_store_timeout() -> std::time::Duration {
    crate::batch::pg::DEFAULT_TIMEOUT
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchOrder {
    #[default]
    Deadline,
    Even,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPredictedMiss {
    #[default]
    Accept,
    Refuse,
}

fn default_batch_lease() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}

fn default_batch_attempts() -> u32 {
    3
}

fn default_batch_retry_base() -> std::time::Duration {
    std::time::Duration::from_secs(1)
}

fn default_batch_retry_max() -> std::time::Duration {
    std::time::Duration::from_secs(60)
}

fn default_batch_failed_share() -> f64 {
    0.5
}

fn default_batch_min_outcomes() -> u64 {
    100
}

fn default_batch_in_flight() -> usize {
    1024
}

fn default_batch_requests() -> u64 {
    crate::batch::MAX_REQUESTS
}

fn default_batch_bytes() -> u64 {
    crate::batch::MAX_FILE_BYTES
}

impl Default for BatchSection {
    fn default() -> Self {
        BatchSection {
            store: None,
            max_in_flight: default_batch_in_flight(),
            max_requests: default_batch_requests(),
            max_file_bytes: default_batch_bytes(),
            max_attempts: default_batch_attempts(),
            retry_base: default_batch_retry_base(),
            retry_max: default_batch_retry_max(),
            max_failed_share: default_batch_failed_share(),
            min_outcomes_for_budget: default_batch_min_outcomes(),
            max_store_bytes: None,
            order: BatchOrder::default(),
            on_predicted_miss: OnPredictedMiss::default(),
            lease: default_batch_lease(),
            store_timeout: default_store_timeout(),
            ca_file: None,
            client_cert: None,
            client_key: None,
        }
    }
}
