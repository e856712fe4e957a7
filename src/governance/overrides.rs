//! Incident controls: time-boxed overrides that pause or throttle a tier or
//! a tenant at the gateway's admission, and end by themselves.
//!
//! * pause: every request of the tier (or tenant) is refused with 503,
//!   reason `paused`, and a Retry-After until the override ends;
//! * throttle to P%: P% of the tier's (or tenant's) requests are admitted,
//!   spread evenly (a credit of P/100 accrues per request and one is spent
//!   per admitted request); the rest are refused with 429, reason
//!   `throttled`.
//!
//! Requests already queued or running are not touched. Pure: time is
//! passed in (ms on the gateway's clock).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Tier,
    Tenant,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Scope::Tier => "tier",
            Scope::Tenant => "tenant",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "tier" => Some(Scope::Tier),
            "tenant" => Some(Scope::Tenant),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "lowercase")]
pub enum Action {
    Pause,
    /// Admit this share (0 to 100 %) of requests.
    Throttle {
        percent: f64,
    },
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Pause => "pause",
            Action::Throttle { .. } => "throttle",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Override {
    pub id: u64,
    pub scope: Scope,
    pub name: String,
    #[serde(flatten)]
    pub action: Action,
    /// ms, gateway clock.
    pub since_ms: f64,
    pub until_ms: f64,
    pub by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Requests refused so far.
    #[serde(default)]
    pub refused: u64,
    #[serde(skip)]
    credit: f64,
}

/// A request an override refuses.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub id: u64,
    pub action: Action,
    /// 503 for a pause, 429 for a throttle.
    pub status: u16,
    /// `paused` or `throttled`.
    pub code: &'static str,
    /// Seconds (gateway clock) until the override ends (pause), or a
    /// second (throttle).
    pub retry_after_ms: f64,
    pub message: String,
}

/// What an operator asks for: an action on a tier or tenant, for how
/// long, by whom and why.
#[derive(Debug, Clone)]
pub struct NewOverride<'a> {
    pub scope: Scope,
    pub name: &'a str,
    pub action: Action,
    pub for_ms: f64,
    pub by: &'a str,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Overrides {
    list: Vec<Override>,
    next: u64,
}

impl Overrides {
    /// Adds an override lasting `for_ms` from `now`. A new override on the
    /// same target replaces the old one (which is returned).
    pub fn add(&mut self, now: f64, req: NewOverride<'_>) -> (Override, Option<Override>) {
        let NewOverride {
            scope,
            name,
            action,
            for_ms,
            by,
            reason,
        } = req;
        let replaced = self
            .list
            .iter()
            .position(|o| o.scope == scope && o.name == name)
            .map(|i| self.list.remove(i));
        self.next += 1;
        let o = Override {
            id: self.next,
            scope,
            name: name.to_string(),
            action,
            since_ms: now,
            until_ms: now + for_ms.max(0.0),
            by: by.to_string(),
            reason,
            refused: 0,
            // The first request passes, unless nothing may (a 0% throttle).
            credit: match action {
                Action::Throttle { percent } if percent <= 0.0 => 0.0,
                _ => 1.0,
            },
        };
        self.list.push(o.clone());
        (o, replaced)
    }

    /// Ends the overrides on a target early; returns them.
    pub fn lift(&mut self, scope: Scope, name: &str) -> Vec<Override> {
        let (gone, keep) = std::mem::take(&mut self.list)
            .into_iter()
            .partition(|o| o.scope == scope && o.name == name);
        self.list = keep;
        gone
    }

    /// Removes and returns the overrides that ended by `now`.
    pub fn expire(&mut self, now: f64) -> Vec<Override> {
        let (gone, keep) = std::mem::take(&mut self.list)
            .into_iter()
            .partition(|o| o.until_ms <= now);
        self.list = keep;
        gone
    }

    /// The overrides in force at `now`.
    pub fn active(&self, now: f64) -> Vec<Override> {
        self.list
            .iter()
            .filter(|o| o.until_ms > now)
            .cloned()
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether an override refuses a request of this tier or tenant (pass
    /// only the one known so far; the other as `None`).
    pub fn check(&mut self, now: f64, scope: Scope, name: Option<&str>) -> Option<Refused> {
        let name = name?;
        let o = self
            .list
            .iter_mut()
            .find(|o| o.scope == scope && o.name == name && o.until_ms > now)?;
        let left = (o.until_ms - now).max(0.0);
        match o.action {
            Action::Pause => {
                o.refused += 1;
                Some(Refused {
                    id: o.id,
                    action: o.action,
                    status: 503,
                    code: "paused",
                    retry_after_ms: left,
                    message: format!(
                        "{} {} is paused by an operator for {} more{}",
                        scope.name(),
                        name,
                        super::view::secs((left / 1000.0).ceil()),
                        o.reason
                            .as_deref()
                            .map(|r| format!(" ({r})"))
                            .unwrap_or_default()
                    ),
                })
            }
            Action::Throttle { percent } => {
                if o.credit >= 1.0 {
                    o.credit -= 1.0;
                    o.credit += percent.clamp(0.0, 100.0) / 100.0;
                    return None;
                }
                o.credit += percent.clamp(0.0, 100.0) / 100.0;
                o.refused += 1;
                Some(Refused {
                    id: o.id,
                    action: o.action,
                    status: 429,
                    code: "throttled",
                    retry_after_ms: 1000.0_f64.min(left.max(1.0)),
                    message: format!(
                        "{} {} is throttled to {percent}% of its requests by an operator{}",
                        scope.name(),
                        name,
                        o.reason
                            .as_deref()
                            .map(|r| format!(" ({r})"))
                            .unwrap_or_default()
                    ),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_refuses_until_it_ends_by_itself() {
        let mut o = Overrides::default();
        let (p, _) = o.add(
            0.0,
            NewOverride {
                scope: Scope::Tier,
                name: "background",
                action: Action::Pause,
                for_ms: 1000.0,
                by: "ops",
                reason: None,
            },
        );
        assert_eq!(p.id, 1);
        let r = o.check(10.0, Scope::Tier, Some("background")).unwrap();
        assert_eq!((r.status, r.code), (503, "paused"));
        assert_eq!(r.retry_after_ms, 990.0);
        assert!(o.check(10.0, Scope::Tier, Some("interactive")).is_none());
        assert!(o.check(10.0, Scope::Tenant, Some("background")).is_none());
        assert!(o.check(10.0, Scope::Tier, None).is_none());
        assert_eq!(o.active(10.0)[0].refused, 1);
        // It ends by itself.
        assert!(o.check(1000.0, Scope::Tier, Some("background")).is_none());
        let gone = o.expire(1000.0);
        assert_eq!(gone.len(), 1);
        assert!(o.is_empty());
    }

    #[test]
    fn a_throttle_admits_its_share_evenly() {
        let mut o = Overrides::default();
        o.add(
            0.0,
            NewOverride {
                scope: Scope::Tenant,
                name: "x",
                action: Action::Throttle { percent: 25.0 },
                for_ms: 60_000.0,
                by: "ops",
                reason: Some("incident 7".into()),
            },
        );
        let admitted: Vec<bool> = (0..12)
            .map(|_| o.check(1.0, Scope::Tenant, Some("x")).is_none())
            .collect();
        assert_eq!(admitted.iter().filter(|a| **a).count(), 3);
        assert!(admitted[0] && !admitted[1] && !admitted[2] && !admitted[3] && admitted[4]);
        assert!(o.check(1.0, Scope::Tenant, Some("x")).is_none());
        let r = o.check(1.0, Scope::Tenant, Some("x")).unwrap();
        assert_eq!((r.status, r.code), (429, "throttled"));
        assert!(r.message.contains("incident 7"));
    }

    #[test]
    fn a_zero_throttle_admits_nothing_not_even_the_first() {
        let mut o = Overrides::default();
        o.add(
            0.0,
            NewOverride {
                scope: Scope::Tier,
                name: "t",
                action: Action::Throttle { percent: 0.0 },
                for_ms: 60_000.0,
                by: "ops",
                reason: None,
            },
        );
        for _ in 0..5 {
            let r = o.check(1.0, Scope::Tier, Some("t")).unwrap();
            assert_eq!((r.status, r.code), (429, "throttled"));
        }
    }

    #[test]
    fn a_new_override_replaces_the_old_and_lift_ends_it() {
        let mut o = Overrides::default();
        o.add(
            0.0,
            NewOverride {
                scope: Scope::Tenant,
                name: "x",
                action: Action::Pause,
                for_ms: 1000.0,
                by: "a",
                reason: None,
            },
        );
        let (_, old) = o.add(
            0.0,
            NewOverride {
                scope: Scope::Tenant,
                name: "x",
                action: Action::Pause,
                for_ms: 5000.0,
                by: "b",
                reason: None,
            },
        );
        assert_eq!(old.map(|x| x.by), Some("a".into()));
        assert_eq!(o.active(0.0).len(), 1);
        assert_eq!(o.lift(Scope::Tenant, "x").len(), 1);
        assert!(o.check(1.0, Scope::Tenant, Some("x")).is_none());
    }
}
