//! The staged rollout of an approved proposal, as its own `rollout` block
//! declares it: shadow (decide every request in parallel, enforce nothing)
//! → canary (the new version decides a share of traffic and named tenants)
//! → enforce (it becomes the active policy) → watch (its rollback
//! conditions stay armed for a while after activation) → done.
//!
//! Pure: time is passed in (milliseconds on the gateway's clock), and
//! whether each rollback condition holds is passed in; [`Rollout::tick`]
//! says what to do next. A condition with a hold (`for 5m`) trips once it
//! has held continuously that long; a condition without one trips at
//! once. Conditions are read only during canary and watch, and their hold
//! restarts at each stage.

use crate::graph::DecisionGraph;
use serde::{Deserialize, Serialize};

/// What the rollout block asks for, resolved for one graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// ms
    pub shadow_ms: Option<f64>,
    pub canary: Option<CanaryPlan>,
    /// How long rollback conditions stay armed after activation, ms.
    pub watch_ms: f64,
    pub rollbacks: Vec<Condition>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanaryPlan {
    /// 0 to 100 (%).
    pub share: f64,
    pub tenants: Vec<String>,
    /// ms
    pub duration_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Condition {
    /// As written: `tier(interactive).ttft_p95 > 2500ms`.
    pub text: String,
    /// ms; `None` trips at once.
    pub hold_ms: Option<f64>,
}

impl Plan {
    /// The plan of a graph's rollout block. A canary without a duration
    /// lasts `default_canary_ms`. No rollout block: straight to enforce.
    pub fn of(g: &DecisionGraph, default_canary_ms: f64, watch_ms: f64) -> Plan {
        let Some(r) = &g.rollout else {
            return Plan {
                shadow_ms: None,
                canary: None,
                watch_ms: 0.0,
                rollbacks: Vec::new(),
            };
        };
        let canary =
            (r.canary_share.is_some() || !r.canary_tenants.is_empty()).then(|| CanaryPlan {
                share: r.canary_share.unwrap_or(0.0),
                tenants: r
                    .canary_tenants
                    .iter()
                    .filter_map(|t| g.tenants.get(*t as usize))
                    .map(|t| t.name.clone())
                    .collect(),
                duration_ms: r.canary_duration.unwrap_or(default_canary_ms),
            });
        let rollbacks: Vec<Condition> = r
            .rollbacks
            .iter()
            .map(|b| Condition {
                text: b.text.clone(),
                hold_ms: b.hold,
            })
            .collect();
        Plan {
            shadow_ms: r.shadow.filter(|s| *s > 0.0),
            canary,
            watch_ms: if rollbacks.is_empty() { 0.0 } else { watch_ms },
            rollbacks,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Shadow,
    Canary,
    /// Active; rollback conditions still armed.
    Watch,
    Done,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Shadow => "shadow",
            Stage::Canary => "canary",
            Stage::Watch => "watch",
            Stage::Done => "done",
        }
    }
}

/// What the server must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Decide every request with the new version too, enforcing nothing.
    Shadow,
    /// End shadow (if any); the new version decides the canary traffic.
    Canary,
    /// Make the new version the active policy (ending shadow and canary).
    Enforce,
    /// The watch after activation is over: the rollout is complete.
    Finish,
    /// Rollback condition `index` tripped: undo what the current stage
    /// did (end the canary, or return to the previous version).
    Rollback {
        index: usize,
        text: String,
        /// The stage it tripped in (canary or watch).
        stage: Stage,
        /// How long it had held, ms.
        held_ms: f64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    pub plan: Plan,
    pub stage: Stage,
    /// When the stage began (ms, gateway clock).
    pub since: f64,
    /// When it ends by itself, if it does.
    pub until: Option<f64>,
    /// Per rollback condition: since when it has held, if it holds.
    pub holding: Vec<Option<f64>>,
}

impl Rollout {
    /// Starts at `now`; the first step is what to do at once.
    pub fn start(plan: Plan, now: f64) -> (Rollout, Step) {
        let n = plan.rollbacks.len();
        let mut r = Rollout {
            plan,
            stage: Stage::Shadow,
            since: now,
            until: None,
            holding: vec![None; n],
        };
        let step = if let Some(s) = r.plan.shadow_ms {
            r.until = Some(now + s);
            Step::Shadow
        } else {
            r.next_after_shadow(now)
        };
        (r, step)
    }

    fn enter(&mut self, stage: Stage, now: f64, until: Option<f64>) {
        self.stage = stage;
        self.since = now;
        self.until = until;
        self.holding.iter_mut().for_each(|h| *h = None);
    }

    fn next_after_shadow(&mut self, now: f64) -> Step {
        match &self.plan.canary {
            Some(c) => {
                let until = now + c.duration_ms;
                self.enter(Stage::Canary, now, Some(until));
                Step::Canary
            }
            None => self.enforce(now),
        }
    }

    fn enforce(&mut self, now: f64) -> Step {
        let until = now + self.plan.watch_ms;
        self.enter(Stage::Watch, now, Some(until));
        Step::Enforce
    }

    /// The rollout ended early (an activation refused, an abort).
    pub fn end(&mut self, now: f64) {
        self.enter(Stage::Done, now, None);
    }

    pub fn done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// Whether rollback conditions are read in the current stage.
    pub fn armed(&self) -> bool {
        matches!(self.stage, Stage::Canary | Stage::Watch) && !self.plan.rollbacks.is_empty()
    }

    /// Time is `now`; `holds[i]` says whether rollback condition `i` holds
    /// (read only while [`Rollout::armed`]; missing entries read false).
    pub fn tick(&mut self, now: f64, holds: &[bool]) -> Option<Step> {
        if self.armed() {
            for (i, (h, c)) in self
                .holding
                .iter_mut()
                .zip(&self.plan.rollbacks)
                .enumerate()
            {
                if holds.get(i).copied().unwrap_or(false) {
                    let since = *h.get_or_insert(now);
                    let held = now - since;
                    if held >= c.hold_ms.unwrap_or(0.0) {
                        let stage = self.stage;
                        let text = c.text.clone();
                        self.enter(Stage::Done, now, None);
                        return Some(Step::Rollback {
                            index: i,
                            text,
                            stage,
                            held_ms: held,
                        });
                    }
                } else {
                    *h = None;
                }
            }
        }
        let due = self.until.is_some_and(|u| now >= u);
        if !due {
            return None;
        }
        match self.stage {
            Stage::Shadow => Some(self.next_after_shadow(now)),
            Stage::Canary => Some(self.enforce(now)),
            Stage::Watch => {
                self.enter(Stage::Done, now, None);
                Some(Step::Finish)
            }
            Stage::Done => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(shadow: Option<f64>, canary: Option<f64>, rollbacks: &[(Option<f64>, &str)]) -> Plan {
        Plan {
            shadow_ms: shadow,
            canary: canary.map(|d| CanaryPlan {
                share: 5.0,
                tenants: vec!["t".into()],
                duration_ms: d,
            }),
            watch_ms: 1000.0,
            rollbacks: rollbacks
                .iter()
                .map(|(h, t)| Condition {
                    text: t.to_string(),
                    hold_ms: *h,
                })
                .collect(),
        }
    }

    #[test]
    fn stages_follow_the_block_in_order_and_time() {
        let (mut r, s) = Rollout::start(plan(Some(100.0), Some(200.0), &[(None, "x")]), 0.0);
        assert_eq!((s, r.stage), (Step::Shadow, Stage::Shadow));
        assert!(!r.armed());
        // Conditions are not read in shadow.
        assert_eq!(r.tick(50.0, &[true]), None);
        assert_eq!(r.tick(100.0, &[false]), Some(Step::Canary));
        assert_eq!((r.stage, r.until), (Stage::Canary, Some(300.0)));
        assert_eq!(r.tick(299.0, &[false]), None);
        assert_eq!(r.tick(300.0, &[false]), Some(Step::Enforce));
        assert_eq!(r.stage, Stage::Watch);
        assert_eq!(r.tick(1300.0, &[false]), Some(Step::Finish));
        assert!(r.done());
        assert_eq!(r.tick(9999.0, &[true]), None);
    }

    #[test]
    fn without_shadow_or_canary_it_enforces_at_once() {
        let (r, s) = Rollout::start(plan(None, Some(10.0), &[]), 5.0);
        assert_eq!((s, r.stage), (Step::Canary, Stage::Canary));
        let (r, s) = Rollout::start(plan(None, None, &[]), 5.0);
        assert_eq!((s, r.stage), (Step::Enforce, Stage::Watch));
    }

    #[test]
    fn a_condition_trips_after_holding_for_its_time() {
        let (mut r, _) = Rollout::start(
            plan(
                None,
                Some(10_000.0),
                &[(Some(300.0), "slow"), (None, "errors")],
            ),
            0.0,
        );
        assert_eq!(r.tick(100.0, &[true, false]), None);
        // It stops holding: the hold restarts.
        assert_eq!(r.tick(200.0, &[false, false]), None);
        assert_eq!(r.tick(300.0, &[true, false]), None);
        assert_eq!(r.tick(599.0, &[true, false]), None);
        let s = r.tick(600.0, &[true, false]).unwrap();
        assert_eq!(
            s,
            Step::Rollback {
                index: 0,
                text: "slow".into(),
                stage: Stage::Canary,
                held_ms: 300.0
            }
        );
        assert!(r.done());
    }

    #[test]
    fn a_condition_without_hold_trips_at_once_after_activation_too() {
        let (mut r, s) = Rollout::start(plan(None, None, &[(Some(50.0), "a"), (None, "b")]), 0.0);
        assert_eq!(s, Step::Enforce);
        match r.tick(10.0, &[false, true]) {
            Some(Step::Rollback {
                index: 1,
                stage: Stage::Watch,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_plan_comes_from_the_graph() {
        // platform.kiln names tenants of the team files: compile all three.
        let files = ["platform.kiln", "team-assistants.kiln", "team-search.kiln"];
        let mut src = crate::source::SourceMap::new();
        for f in files {
            src.add(
                f.to_string(),
                std::fs::read_to_string(format!("policies/split/{f}")).unwrap(),
            );
        }
        let g = crate::compile::compile(src).graph.unwrap();
        let p = Plan::of(&g, 600_000.0, 1_800_000.0);
        assert_eq!(p.shadow_ms, Some(3_600_000.0));
        let c = p.canary.unwrap();
        assert_eq!(c.share, 5.0);
        assert_eq!(c.tenants, vec!["query-rewrite", "assistant-evals"]);
        assert_eq!(c.duration_ms, 7_200_000.0);
        // Five written, and interactive's `error_rate 1%` SLO.
        assert_eq!(p.rollbacks.len(), 6);
        assert_eq!(p.rollbacks[0].hold_ms, Some(300_000.0));
        assert_eq!(p.rollbacks[4].hold_ms, None);
        assert_eq!(
            p.rollbacks[5].text,
            "tier(interactive).error_rate > 1% for 5m (its slo)"
        );
        assert_eq!(p.rollbacks[5].hold_ms, Some(300_000.0));
        assert_eq!(p.watch_ms, 1_800_000.0);
    }
}
