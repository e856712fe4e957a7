//! What the gateway's integration tests share: compiling a policy,
//! starting a gateway on 127.0.0.1:0, and a loopback HTTP client.
// Each test binary uses some of these helpers.
#![allow(dead_code)]

pub mod batches;
pub mod postgres;
pub mod redis;
pub mod tls;
pub mod twin;

use kiln::compile::compile_str;
use kiln::server::config::ServerConfig;
use kiln::server::{start, Policy, Running, ServeOptions};
use std::path::PathBuf;
use std::time::Duration;

/// A directory of the test's own, removed (with what it holds) when the
/// value is dropped. `.0` is its path; the tempfile guard does the removal.
pub struct TempDir(pub PathBuf, tempfile::TempDir);

impl TempDir {
    /// A new empty directory under the system's temporary directory, its
    /// name starting with `kiln-TAG-` so a leftover says which test made it.
    pub fn new(tag: &str) -> TempDir {
        let guard = tempfile::Builder::new()
            .prefix(&format!("kiln-{tag}-"))
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot make a temporary directory: {e}"));
        TempDir(guard.path().to_path_buf(), guard)
    }

    /// The path of a decision log inside it.
    pub fn log(&self) -> PathBuf {
        self.0.join("d.jsonl")
    }
}

/// Compiles `text` (as file `name`), failing the test with its errors.
pub fn policy(name: &str, text: &str) -> Policy {
    let c = compile_str(name, text);
    let errs: Vec<String> = c
        .diagnostics
        .items
        .iter()
        .map(|d| d.message.clone())
        .collect();
    let g = c
        .graph
        .unwrap_or_else(|| panic!("policy does not compile: {errs:?}"));
    Policy::new(g, c.sources)
}

/// A gateway on a free loopback port.
pub async fn serve_on_loopback(p: Policy, cfg: ServerConfig) -> Running {
    start(ServeOptions {
        policy: p,
        config: cfg,
        listen: "127.0.0.1:0".into(),
        clock: None,
    })
    .await
    .unwrap()
}

/// A client that never uses a proxy, with a bounded timeout.
pub fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .build()
        .unwrap()
}

/// The gateway's `/metrics` text.
pub async fn scrape(c: &reqwest::Client, base: &str) -> String {
    c.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The sum of `metric`'s series in a scrape whose labels contain every one
/// of `labels` (`reason="client"`).
pub fn metric_sum(scrape: &str, metric: &str, labels: &[&str]) -> f64 {
    scrape
        .lines()
        .filter(|l| {
            l.strip_prefix(metric).is_some_and(|r| r.starts_with('{'))
                && labels.iter().all(|x| l.contains(x))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
