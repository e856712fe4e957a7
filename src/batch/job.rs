//! What a batch says about itself, in its `metadata` (OpenAI's free-form
//! map of strings), under keys beginning `kiln_`:
//!
//! - `kiln_priority`: a whole number from 0 to its tier's priority. The
//!   batches of one group (a tenant's batches in one tier) run highest
//!   first; the default is the tier's priority, so a batch can step back
//!   behind its siblings, never ahead of its tier. It orders the tenant's
//!   own work only: other tenants' shares do not move.
//! - `kiln_preemptible`: `"true"` marks its items preemptible (idempotent,
//!   safe to recompute) in a tier that is not: a tier that `preempts` this
//!   one may take their slots, and a lender reclaims a share they borrowed
//!   instead of waiting them out. `"false"` is accepted only where the
//!   tier's work is not preemptible anyway: a job may give protection up,
//!   never claim it against its tier.
//! - `kiln_max_in_flight`: at most this many of its items run or wait in
//!   the gateway at once (1 to 10,000), for a job whose downstream cannot
//!   take more; the rest of its group's room goes to its other batches.
//!
//! Any other `kiln_` key is refused: a misspelt setting that did nothing
//! would be worse than an error.

use crate::graph::Tier;
use serde_json::Value;

/// The keys, for the error that lists them.
pub const KEYS: [&str; 3] = ["kiln_priority", "kiln_preemptible", "kiln_max_in_flight"];

/// The largest `kiln_max_in_flight`.
pub const MAX_IN_FLIGHT: u32 = 10_000;

/// A batch's own settings, parsed from its metadata.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobSettings {
    pub priority: Option<i64>,
    pub preemptible: Option<bool>,
    pub max_in_flight: Option<u32>,
}

impl JobSettings {
    /// The settings in `metadata` (`None` or not an object: none), or what
    /// is wrong with them, in words for a 400 answer. Bounds that depend on
    /// the tier are [`Self::check`]'s.
    pub fn parse(metadata: Option<&Value>) -> Result<JobSettings, String> {
        let mut out = JobSettings::default();
        let Some(m) = metadata.and_then(Value::as_object) else {
            return Ok(out);
        };
        for (k, v) in m {
            if !k.starts_with("kiln_") {
                continue;
            }
            let text = v.as_str().unwrap_or_default().trim();
            match k.as_str() {
                "kiln_priority" => {
                    let p = text.parse::<i64>().ok().filter(|p| *p >= 0).ok_or_else(|| {
                        format!("`metadata.kiln_priority` is `{text}`: write a whole number from 0 to the tier's priority")
                    })?;
                    out.priority = Some(p);
                }
                "kiln_preemptible" => {
                    out.preemptible = Some(match text {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(format!(
                            "`metadata.kiln_preemptible` is `{text}`: write \"true\" or \"false\""
                        ))
                        }
                    });
                }
                "kiln_max_in_flight" => {
                    let n = text
                        .parse::<u32>()
                        .ok()
                        .filter(|n| (1..=MAX_IN_FLIGHT).contains(n))
                        .ok_or_else(|| {
                            format!("`metadata.kiln_max_in_flight` is `{text}`: write a whole number from 1 to {MAX_IN_FLIGHT}")
                        })?;
                    out.max_in_flight = Some(n);
                }
                other => {
                    return Err(format!(
                        "`metadata.{other}` is not a kiln setting: the `kiln_` keys are {}",
                        KEYS.join(", ")
                    ))
                }
            }
        }
        Ok(out)
    }

    /// The settings against the tier the batch's items classify into.
    pub fn check(&self, tier: &Tier) -> Result<(), String> {
        if let Some(p) = self.priority {
            if p > tier.priority {
                return Err(format!(
                    "`metadata.kiln_priority` {p} is above tier `{}`'s priority {}: a batch may run behind its tier's other batches, not ahead of its tier (write 0 to {})",
                    tier.name, tier.priority, tier.priority
                ));
            }
        }
        if self.preemptible == Some(false) && tier.preemptible {
            return Err(format!(
                "`metadata.kiln_preemptible` is \"false\" but tier `{}`'s work is preemptible: a batch may mark its items preemptible, never protect them against its tier (leave it out, or ask for a tier that is not preemptible)",
                tier.name
            ));
        }
        Ok(())
    }

    /// Its place among its group's batches: its own priority, else its
    /// tier's.
    pub fn priority_in(&self, tier_priority: i64) -> i64 {
        self.priority.unwrap_or(tier_priority)
    }

    /// Its items are preemptible by its own say, beyond their tier's.
    pub fn opts_into_preemption(&self) -> bool {
        self.preemptible == Some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tier(priority: i64, preemptible: bool) -> Tier {
        let text = format!(
            "pool p {{ gpus 1 kind \"H100-80GB\" memory 80GB }}\n\
             model m {{ variant fp16 {{ memory 10GB pools [p] }} }}\n\
             tier t {{ priority {priority} slo {{ window 1h }} {} }}\n\
             classify {{ default => tier t }}\n\
             route [t] m {{ default => fp16 }}",
            if preemptible { "preemptible" } else { "" }
        );
        let c = crate::compile::compile_str("t.kiln", &text);
        c.graph.expect("compiles").tiers[0].clone()
    }

    #[test]
    fn settings_are_read_and_bounded_by_the_tier() {
        let m = json!({"job": "nightly", "kiln_priority": "20", "kiln_preemptible": "true",
            "kiln_max_in_flight": "8"});
        let s = JobSettings::parse(Some(&m)).unwrap();
        assert_eq!(
            s,
            JobSettings {
                priority: Some(20),
                preemptible: Some(true),
                max_in_flight: Some(8)
            }
        );
        assert!(s.check(&tier(40, false)).is_ok());
        assert_eq!(s.priority_in(40), 20);
        assert!(s.opts_into_preemption());
        // Above the tier: refused, saying the bound.
        let e = s.check(&tier(10, false)).unwrap_err();
        assert!(e.contains("0 to 10"), "{e}");
        // No settings: the tier's.
        let none = JobSettings::parse(Some(&json!({"job": "x"}))).unwrap();
        assert_eq!(none, JobSettings::default());
        assert_eq!(none.priority_in(40), 40);
        assert_eq!(JobSettings::parse(None).unwrap(), JobSettings::default());
    }

    #[test]
    fn protection_cannot_be_claimed_against_the_tier() {
        let no = JobSettings::parse(Some(&json!({"kiln_preemptible": "false"}))).unwrap();
        assert!(no.check(&tier(10, true)).is_err());
        assert!(
            no.check(&tier(10, false)).is_ok(),
            "a no-op where it is not"
        );
        assert!(!no.opts_into_preemption());
    }

    #[test]
    fn a_bad_or_unknown_setting_is_refused_in_words() {
        for (m, says) in [
            (json!({"kiln_priority": "-1"}), "whole number"),
            (json!({"kiln_priority": "high"}), "whole number"),
            (json!({"kiln_preemptible": "yes"}), "\"true\" or \"false\""),
            (json!({"kiln_max_in_flight": "0"}), "1 to 10000"),
            (json!({"kiln_max_in_flight": "10001"}), "1 to 10000"),
            (
                json!({"kiln_prioirty": "5"}),
                "kiln_priority, kiln_preemptible",
            ),
        ] {
            let e = JobSettings::parse(Some(&m)).unwrap_err();
            assert!(e.contains(says), "{m}: {e}");
        }
    }
}
