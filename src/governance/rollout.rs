//! The staged rollout of an approved proposal, as its own `rollout` block
//! declares it: shadow (decide every request in parallel, enforce nothing)
//! → canary stages (the new version decides each stage's traffic: a
//! scope of tenants, tiers and models, a share of it) → enforce (it
//! becomes the active policy) → watch (its rollback conditions stay armed
//! for a while after activation) → done. `canary { … }` is one stage
//! named `canary`.
//!
//! Pure: time is passed in (milliseconds on the gateway's clock), and
//! whether each rollback condition and gate holds is passed in;
//! [`Rollout::tick`] says what to do next. A condition with a hold
//! (`for 5m`) trips once it has held continuously that long; a condition
//! without one trips at once. Conditions are read only during canary
//! stages and watch, and their hold restarts at each stage. A stage ends
//! once its duration is over *and* its gates hold (each for its hold);
//! until then it waits, rollback conditions still armed.

use crate::graph::DecisionGraph;
use serde::{Deserialize, Serialize};

/// What the rollout block asks for, resolved for one graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "PlanWire")]
pub struct Plan {
    /// ms
    pub shadow_ms: Option<f64>,
    /// Canary stages, in order; empty goes from shadow to enforce.
    pub stages: Vec<StagePlan>,
    /// How long rollback conditions stay armed after activation, ms.
    pub watch_ms: f64,
    pub rollbacks: Vec<Condition>,
}

/// A plan as stored: state written before stages holds one `canary`.
#[derive(Deserialize)]
struct PlanWire {
    shadow_ms: Option<f64>,
    #[serde(default)]
    canary: Option<LegacyCanary>,
    #[serde(default)]
    stages: Vec<StagePlan>,
    watch_ms: f64,
    rollbacks: Vec<Condition>,
}

/// The one canary of plans stored before stages.
#[derive(Deserialize)]
struct LegacyCanary {
    share: f64,
    tenants: Vec<String>,
    duration_ms: f64,
}

impl From<PlanWire> for Plan {
    fn from(w: PlanWire) -> Plan {
        let mut stages = w.stages;
        if let (true, Some(c)) = (stages.is_empty(), w.canary) {
            stages.push(StagePlan {
                name: canary_name(),
                share: c.share,
                pinned: c.tenants,
                tenants: Vec::new(),
                tiers: Vec::new(),
                models: Vec::new(),
                duration_ms: c.duration_ms,
                gates: Vec::new(),
            });
        }
        Plan {
            shadow_ms: w.shadow_ms,
            stages,
            watch_ms: w.watch_ms,
            rollbacks: w.rollbacks,
        }
    }
}

fn canary_name() -> String {
    "canary".into()
}

/// One canary stage. The canary version decides a request of a `pinned`
/// tenant, or one in scope (its tenant, the tier the canary version
/// classifies it into and its requested model each in the list, where the
/// list is not empty) that falls in `share`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    #[serde(default = "canary_name")]
    pub name: String,
    /// 0 to 100 (%) of the requests in scope.
    pub share: f64,
    /// Tenants whose every request the stage takes, scope and share aside
    /// (`canary { tenants […] }`).
    #[serde(default)]
    pub pinned: Vec<String>,
    #[serde(default)]
    pub tenants: Vec<String>,
    #[serde(default)]
    pub tiers: Vec<String>,
    #[serde(default)]
    pub models: Vec<String>,
    /// ms
    pub duration_ms: f64,
    /// What must hold before the next stage (read like rollback
    /// conditions, on the stage's own traffic).
    #[serde(default)]
    pub gates: Vec<Condition>,
}

impl StagePlan {
    /// `tiers batch, models llama-8b, 5%`: the stage's traffic for people.
    pub fn scope_text(&self) -> String {
        let mut who = Vec::new();
        let mut list = |what: &str, v: &[String]| {
            if !v.is_empty() {
                who.push(format!("{what} {}", v.join(", ")));
            }
        };
        list("tenants", &self.pinned);
        list("tenants", &self.tenants);
        list("tiers", &self.tiers);
        list("models", &self.models);
        let scoped = !(self.tenants.is_empty() && self.tiers.is_empty() && self.models.is_empty());
        let mut text = who.join(", ");
        if self.share > 0.0 && (self.share < 100.0 || !scoped) {
            let pct = format!("{}%", self.share);
            text = match (text.is_empty(), self.pinned.is_empty()) {
                (true, _) => pct,
                (false, true) => format!("{text}, {pct}"),
                (false, false) => format!("{text} + {pct} of the rest"),
            };
        }
        text
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Condition {
    /// As written: `tier(interactive).ttft_p95 > 2500ms`.
    pub text: String,
    /// ms; `None` trips at once.
    pub hold_ms: Option<f64>,
}

fn conditions(v: &[crate::graph::Rollback]) -> Vec<Condition> {
    v.iter()
        .map(|b| Condition {
            text: b.text.clone(),
            hold_ms: b.hold,
        })
        .collect()
}

impl Plan {
    /// The plan of a graph's rollout block. A stage without a duration
    /// lasts `default_canary_ms`. No rollout block: straight to enforce.
    pub fn of(g: &DecisionGraph, default_canary_ms: f64, watch_ms: f64) -> Plan {
        let Some(r) = &g.rollout else {
            return Plan {
                shadow_ms: None,
                stages: Vec::new(),
                watch_ms: 0.0,
                rollbacks: Vec::new(),
            };
        };
        let tenant_names = |ids: &[crate::graph::TenantId]| -> Vec<String> {
            ids.iter()
                .filter_map(|t| g.tenants.get(*t as usize))
                .map(|t| t.name.clone())
                .collect()
        };
        let mut stages = Vec::new();
        if r.canary_share.is_some() || !r.canary_tenants.is_empty() {
            stages.push(StagePlan {
                name: canary_name(),
                share: r.canary_share.unwrap_or(0.0),
                pinned: tenant_names(&r.canary_tenants),
                tenants: Vec::new(),
                tiers: Vec::new(),
                models: Vec::new(),
                duration_ms: r.canary_duration.unwrap_or(default_canary_ms),
                gates: Vec::new(),
            });
        }
        for s in &r.stages {
            stages.push(StagePlan {
                name: s.name.clone(),
                share: s.share.unwrap_or(100.0),
                pinned: Vec::new(),
                tenants: tenant_names(&s.tenants),
                tiers: s
                    .tiers
                    .iter()
                    .filter_map(|t| g.tiers.get(usize::from(*t)))
                    .map(|t| t.name.clone())
                    .collect(),
                models: s
                    .models
                    .iter()
                    .filter_map(|m| g.models.get(usize::from(*m)))
                    .map(|m| m.name.clone())
                    .collect(),
                duration_ms: s.duration.unwrap_or(default_canary_ms),
                gates: conditions(&s.gates),
            });
        }
        let rollbacks = conditions(&r.rollbacks);
        Plan {
            shadow_ms: r.shadow.filter(|s| *s > 0.0),
            stages,
            watch_ms: if rollbacks.is_empty() { 0.0 } else { watch_ms },
            rollbacks,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Shadow,
    /// One of the plan's canary stages ([`Rollout::index`]).
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
    /// End shadow (if any); the new version decides the traffic of canary
    /// stage `index` (replacing the previous stage's).
    Canary { index: usize },
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
    /// The canary stage in progress (meaningful in [`Stage::Canary`]).
    #[serde(default)]
    pub index: usize,
    /// When the stage began (ms, gateway clock).
    pub since: f64,
    /// When its time is up, if it is ever; a canary stage then also
    /// waits for its gates.
    pub until: Option<f64>,
    /// Per rollback condition: since when it has held, if it holds.
    pub holding: Vec<Option<f64>>,
    /// Per gate of the canary stage: since when it has held, if it holds.
    #[serde(default)]
    pub gate_holding: Vec<Option<f64>>,
}

impl Rollout {
    /// Starts at `now`; the first step is what to do at once.
    pub fn start(plan: Plan, now: f64) -> (Rollout, Step) {
        let n = plan.rollbacks.len();
        let mut r = Rollout {
            plan,
            stage: Stage::Shadow,
            index: 0,
            since: now,
            until: None,
            holding: vec![None; n],
            gate_holding: Vec::new(),
        };
        let step = if let Some(s) = r.plan.shadow_ms {
            r.until = Some(now + s);
            Step::Shadow
        } else {
            r.next_stage(0, now)
        };
        (r, step)
    }

    fn enter(&mut self, stage: Stage, now: f64, until: Option<f64>) {
        self.stage = stage;
        self.since = now;
        self.until = until;
        self.holding.iter_mut().for_each(|h| *h = None);
        let gates = match stage {
            Stage::Canary => self.stage_plan().map_or(0, |s| s.gates.len()),
            _ => 0,
        };
        self.gate_holding = vec![None; gates];
    }

    /// Canary stage `index`, or enforce when there is none.
    fn next_stage(&mut self, index: usize, now: f64) -> Step {
        match self.plan.stages.get(index).map(|c| c.duration_ms) {
            Some(d) => {
                self.index = index;
                self.enter(Stage::Canary, now, Some(now + d));
                Step::Canary { index }
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

    /// The canary stage in progress.
    pub fn stage_plan(&self) -> Option<&StagePlan> {
        (self.stage == Stage::Canary)
            .then(|| self.plan.stages.get(self.index))
            .flatten()
    }

    /// Whether rollback conditions are read in the current stage.
    pub fn armed(&self) -> bool {
        matches!(self.stage, Stage::Canary | Stage::Watch) && !self.plan.rollbacks.is_empty()
    }

    /// Whether live metrics are read now: rollback conditions are armed
    /// or the canary stage has gates.
    pub fn reads(&self) -> bool {
        self.armed() || self.stage_plan().is_some_and(|s| !s.gates.is_empty())
    }

    /// Whether gate `i` of the canary stage has held long enough at `now`.
    fn gate_passes(&self, i: usize, now: f64) -> bool {
        let hold = self
            .stage_plan()
            .and_then(|s| s.gates.get(i))
            .and_then(|g| g.hold_ms)
            .unwrap_or(0.0);
        self.gate_holding
            .get(i)
            .copied()
            .flatten()
            .is_some_and(|since| now - since >= hold)
    }

    /// The gates of the canary stage that do not pass at `now` (indices).
    pub fn waiting(&self, now: f64) -> Vec<usize> {
        (0..self.gate_holding.len())
            .filter(|i| !self.gate_passes(*i, now))
            .collect()
    }

    /// Time is `now`; `holds[i]` says whether rollback condition `i` holds
    /// (read only while [`Rollout::armed`]), `gates[i]` whether gate `i` of
    /// the canary stage holds (a gate short of samples does not); missing
    /// entries read false.
    pub fn tick(&mut self, now: f64, holds: &[bool], gates: &[bool]) -> Option<Step> {
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
        for (i, h) in self.gate_holding.iter_mut().enumerate() {
            if gates.get(i).copied().unwrap_or(false) {
                h.get_or_insert(now);
            } else {
                *h = None;
            }
        }
        let due = self.until.is_some_and(|u| now >= u);
        if !due {
            return None;
        }
        match self.stage {
            Stage::Shadow => Some(self.next_stage(0, now)),
            Stage::Canary if self.waiting(now).is_empty() => {
                Some(self.next_stage(self.index + 1, now))
            }
            Stage::Canary => None,
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
            stages: canary
                .map(|d| stage("canary", d, &[]))
                .into_iter()
                .collect(),
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

    fn stage(name: &str, d: f64, gates: &[(Option<f64>, &str)]) -> StagePlan {
        StagePlan {
            name: name.into(),
            share: 5.0,
            pinned: vec!["t".into()],
            tenants: Vec::new(),
            tiers: Vec::new(),
            models: Vec::new(),
            duration_ms: d,
            gates: gates
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
        assert_eq!(r.tick(50.0, &[true], &[]), None);
        assert_eq!(
            r.tick(100.0, &[false], &[]),
            Some(Step::Canary { index: 0 })
        );
        assert_eq!((r.stage, r.until), (Stage::Canary, Some(300.0)));
        assert_eq!(r.tick(299.0, &[false], &[]), None);
        assert_eq!(r.tick(300.0, &[false], &[]), Some(Step::Enforce));
        assert_eq!(r.stage, Stage::Watch);
        assert_eq!(r.tick(1300.0, &[false], &[]), Some(Step::Finish));
        assert!(r.done());
        assert_eq!(r.tick(9999.0, &[true], &[]), None);
    }

    #[test]
    fn without_shadow_or_canary_it_enforces_at_once() {
        let (r, s) = Rollout::start(plan(None, Some(10.0), &[]), 5.0);
        assert_eq!((s, r.stage), (Step::Canary { index: 0 }, Stage::Canary));
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
        assert_eq!(r.tick(100.0, &[true, false], &[]), None);
        // It stops holding: the hold restarts.
        assert_eq!(r.tick(200.0, &[false, false], &[]), None);
        assert_eq!(r.tick(300.0, &[true, false], &[]), None);
        assert_eq!(r.tick(599.0, &[true, false], &[]), None);
        let s = r.tick(600.0, &[true, false], &[]).unwrap();
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
        match r.tick(10.0, &[false, true], &[]) {
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
        let names: Vec<&str> = p.stages.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["pilot", "batch-8b", "half"]);
        let c = &p.stages[0];
        assert_eq!(c.share, 100.0);
        assert_eq!(c.tenants, vec!["query-rewrite", "assistant-evals"]);
        assert_eq!(c.duration_ms, 7_200_000.0);
        assert_eq!(
            p.stages[1].scope_text(),
            "tiers batch, models llama-8b, 10%"
        );
        assert_eq!(p.stages[2].gates[0].hold_ms, Some(3_600_000.0));
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

    fn staged(rollbacks: &[(Option<f64>, &str)]) -> Plan {
        let mut p = plan(None, None, rollbacks);
        p.stages = vec![
            stage("pilot", 100.0, &[]),
            stage("half", 200.0, &[(Some(50.0), "slo ok"), (None, "enough")]),
            stage("most", 100.0, &[]),
        ];
        p
    }

    #[test]
    fn a_stage_ends_when_its_time_is_up_and_its_gates_hold() {
        let (mut r, s) = Rollout::start(staged(&[]), 0.0);
        assert_eq!((s, r.index), (Step::Canary { index: 0 }, 0));
        // No gates: time alone.
        assert_eq!(r.tick(99.0, &[], &[]), None);
        assert_eq!(r.tick(100.0, &[], &[]), Some(Step::Canary { index: 1 }));
        assert_eq!((r.index, r.until), (1, Some(300.0)));
        assert_eq!(r.stage_plan().map(|s| s.name.as_str()), Some("half"));
        // Gates holding early do not shorten the stage.
        assert_eq!(r.tick(200.0, &[], &[true, true]), None);
        // Time is up, gates hold, but the first has held 50 only from 250.
        assert_eq!(r.tick(250.0, &[], &[false, true]), None);
        assert_eq!(r.tick(300.0, &[], &[true, true]), None);
        assert_eq!(r.waiting(300.0), vec![0]);
        assert_eq!(r.tick(349.0, &[], &[true, true]), None);
        assert_eq!(
            r.tick(350.0, &[], &[true, true]),
            Some(Step::Canary { index: 2 })
        );
        assert!(r.waiting(350.0).is_empty(), "no gates in the last stage");
        assert_eq!(r.tick(450.0, &[], &[]), Some(Step::Enforce));
        assert_eq!(r.stage, Stage::Watch);
    }

    #[test]
    fn a_gate_that_does_not_hold_keeps_the_stage_waiting() {
        let (mut r, _) = Rollout::start(staged(&[]), 0.0);
        r.tick(100.0, &[], &[]);
        r.tick(250.0, &[], &[true, false]);
        // A gate short of samples is passed in as not holding: the stage
        // waits past its time, as long as it takes.
        for t in [300.0, 1_000.0, 100_000.0] {
            assert_eq!(r.tick(t, &[], &[true, false]), None);
            assert_eq!(r.waiting(t), vec![1]);
            assert_eq!(r.index, 1);
        }
        assert_eq!(
            r.tick(100_050.0, &[], &[true, true]),
            Some(Step::Canary { index: 2 })
        );
    }

    #[test]
    fn a_rollback_in_the_second_stage_rolls_back_even_while_waiting_for_gates() {
        let (mut r, _) = Rollout::start(staged(&[(Some(30.0), "slow")]), 0.0);
        assert_eq!(
            r.tick(100.0, &[false], &[]),
            Some(Step::Canary { index: 1 })
        );
        // Waiting for its gates, past its time.
        assert_eq!(r.tick(400.0, &[true], &[false, false]), None);
        match r.tick(430.0, &[true], &[false, false]) {
            Some(Step::Rollback {
                stage: Stage::Canary,
                held_ms,
                ..
            }) => assert_eq!(held_ms, 30.0),
            other => panic!("{other:?}"),
        }
        assert!(r.done());
        assert_eq!(r.index, 1, "the stage it rolled back in stays known");
    }

    #[test]
    fn a_rollout_in_its_second_stage_round_trips_through_json() {
        let (mut r, _) = Rollout::start(staged(&[(None, "x")]), 0.0);
        r.tick(100.0, &[false], &[]);
        r.tick(150.0, &[false], &[true, false]);
        let back: Rollout = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert_eq!(
            (back.index, back.gate_holding.clone()),
            (1, vec![Some(150.0), None])
        );
    }

    #[test]
    fn a_plan_stored_before_stages_loads_its_canary_as_one_stage() {
        // As `kiln` wrote it before stages (state files, published rollouts).
        let old = r#"{"shadow_ms":null,"canary":{"share":5.0,"tenants":["a"],"duration_ms":60000.0},
                      "watch_ms":0.0,"rollbacks":[]}"#;
        let p: Plan = serde_json::from_str(old).unwrap();
        assert_eq!(p.stages.len(), 1);
        let c = &p.stages[0];
        assert_eq!(
            (c.name.as_str(), c.share, c.duration_ms),
            ("canary", 5.0, 60_000.0)
        );
        // Its tenants were taken whole, beside the share: pinned, not scope.
        assert_eq!(
            (c.pinned.clone(), c.tenants.len()),
            (vec!["a".to_string()], 0)
        );
        // A machine stored before stages (no index, no gate holds) loads.
        let m = r#"{"plan":{"shadow_ms":null,"canary":null,"watch_ms":0.0,"rollbacks":[]},
                    "stage":"watch","since":1.0,"until":2.0,"holding":[]}"#;
        let m: Rollout = serde_json::from_str(m).unwrap();
        assert_eq!((m.index, m.gate_holding.len()), (0, 0));
    }

    #[test]
    fn stages_come_from_the_graph_in_order() {
        let src = r#"
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model small { params 1B kv_per_token 32KB variant fp16 { memory 4GB pools [gpu] } }
model big { params 1B kv_per_token 32KB variant fp16 { memory 4GB pools [gpu] } }
tier fast { priority 10 slo { ttft 500ms } }
tier bulk { priority 1 slo { p95 600s } }
tenant bot { owner "o" tiers [fast] }
classify { default => tier fast }
route [fast, bulk] small { default => fp16 }
route [fast, bulk] big { default => fp16 }
rollout {
  stage pilot { tenants [bot] duration 30m }
  stage batch { tiers [bulk] models [small] share 5% duration 1h
                gate when tier(bulk).slo_attainment > 95% for 10m }
  stage half { share 50% }
  rollback when tier(fast).ttft_p95 > 2s for 5m
}
"#;
        let mut m = crate::source::SourceMap::new();
        m.add("p.kiln", src);
        let c = crate::compile::compile(m);
        let g = c.graph.unwrap_or_else(|| panic!("{:?}", c.diagnostics));
        let p = Plan::of(&g, 600_000.0, 60_000.0);
        let names: Vec<&str> = p.stages.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["pilot", "batch", "half"]);
        let (pilot, batch, half) = (&p.stages[0], &p.stages[1], &p.stages[2]);
        assert_eq!(
            (pilot.share, pilot.tenants.clone()),
            (100.0, vec!["bot".to_string()])
        );
        assert_eq!(pilot.duration_ms, 1_800_000.0);
        assert_eq!(
            (batch.tiers.clone(), batch.models.clone()),
            (vec!["bulk".to_string()], vec!["small".to_string()])
        );
        assert_eq!(batch.gates[0].text, "tier(bulk).slo_attainment > 95%");
        assert_eq!(batch.gates[0].hold_ms, Some(600_000.0));
        assert_eq!((half.share, half.duration_ms), (50.0, 600_000.0));
        assert_eq!(batch.scope_text(), "tiers bulk, models small, 5%");
        assert_eq!(pilot.scope_text(), "tenants bot");
    }
}
