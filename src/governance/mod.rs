//! Governance: scheduling policy changes go through proposals, signed
//! approvals and a staged rollout with rollback criteria declared before
//! it begins; incidents get time-boxed overrides; and every one of these
//! events lands in a hash-chained audit log.
//!
//! Nothing here knows HTTP: what governance needs from the gateway goes
//! through [`gateway::Gateway`], which the server implements; the admin API
//! over it is [`crate::server::governance`].
//!
//! * [`gov`]: the state a gateway keeps, restored from and persisted to
//!   its state file;
//! * [`runner`]: the rollout runner (one tick: expire overrides, advance
//!   the rollout, start the next approved proposal);
//! * [`actions`]: propose, revise, withdraw, approve, roll back, overrides,
//!   each with a typed error that knows its HTTP status;
//! * [`activation`]: a compiled policy and what activating it answers;
//! * [`approval`]: which approvals a change needs (from the rules of the
//!   policy in force) and whether a signed approval counts;
//! * [`keys`]: ed25519 keys, key files, the signed approval message;
//! * [`proposal`]: a proposal and its states;
//! * [`rollout`]: the shadow → canary → enforce → watch state machine and
//!   its rollback holds;
//! * [`shadow`]: a proposed version deciding beside the active one;
//! * [`live`]: the rolling window of request outcomes that rollback
//!   conditions read;
//! * [`overrides`]: pause and throttle a tier or tenant for a while;
//! * [`audit`]: the append-only, hash-chained JSONL audit log;
//! * [`state`]: proposals and rollback history kept across restarts;
//! * [`shared`]: the same, and the audit chain, kept in the fleet's shared
//!   store, written one step at a time under a lease;
//! * [`view`]: the admin API's answers and their human rendering.

pub mod actions;
pub mod activation;
pub mod approval;
pub mod audit;
pub mod gateway;
pub mod gov;
pub mod keys;
pub mod live;
pub mod overrides;
pub mod proposal;
pub mod rollout;
pub mod runner;
pub mod shadow;
pub mod shared;
pub mod state;
pub mod view;

pub use activation::Policy;

use crate::source::SourceMap;
use sha2::{Digest, Sha256};
use std::sync::{Mutex, MutexGuard};

/// A poisoned lock still guards consistent data here (every critical
/// section leaves it whole), so governance keeps going.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The full SHA-256 (hex) of a policy's text: file names and contents, in
/// order. The gateway's version name is `sha256:` and its first 12 digits.
pub fn policy_hash(sources: &SourceMap) -> String {
    let mut h = Sha256::new();
    for (_, f) in sources.files() {
        h.update(f.name.as_bytes());
        h.update([0]);
        h.update(f.text.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// The version the gateway names a policy by: `sha256:` and the first 12
/// hex digits of [`policy_hash`].
pub fn policy_version(sources: &SourceMap) -> String {
    let d = policy_hash(sources);
    format!("sha256:{}", d.get(..12).unwrap_or(&d))
}

/// A duration as kiln writes it (`30m`, `1h`, `90s`, `500ms`) in ms.
pub fn parse_duration_ms(text: &str) -> Option<f64> {
    match crate::units::parse_literal(text) {
        Some(Ok(t)) if t.ty == crate::units::Ty::Duration && t.value >= 0.0 => Some(t.value),
        _ => None,
    }
}

/// A percentage as kiln writes it (`10%`) in percent.
pub fn parse_percent(text: &str) -> Option<f64> {
    match crate::units::parse_literal(text) {
        Some(Ok(t)) if t.ty == crate::units::Ty::Percent => Some(t.value),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_percentages_parse_in_kiln_units() {
        assert_eq!(parse_duration_ms("30m"), Some(1_800_000.0));
        assert_eq!(parse_duration_ms("1h"), Some(3_600_000.0));
        assert_eq!(parse_duration_ms("250ms"), Some(250.0));
        assert_eq!(parse_duration_ms("10%"), None);
        assert_eq!(parse_duration_ms("soon"), None);
        assert_eq!(parse_percent("10%"), Some(10.0));
        assert_eq!(parse_percent("10"), None);
    }

    #[test]
    fn the_hash_extends_the_gateway_version() {
        let mut s = SourceMap::new();
        s.add("a.kiln", "pool p {}");
        let h = policy_hash(&s);
        assert_eq!(h.len(), 64);
        assert_eq!(policy_version(&s), format!("sha256:{}", &h[..12]));
    }
}
