//! `kiln diff`: what a policy change does. The semantic diff compares the
//! two compiled graphs; with recorded traffic, every request is decided by
//! both, and both policies are replayed through the simulator on the same
//! traffic, side by side, so a reviewer sees per tier and tenant what the
//! change would do before it ships. Gates turn the report into a CI check.

pub mod gate;
pub mod plot;
pub mod semantic;
pub mod traffic;

use crate::replay::report::Report;
use serde::Serialize;

/// Everything `kiln diff` reports (the JSON schema; see README).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiffReport {
    pub semantic: semantic::SemanticDiff,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions: Option<traffic::DecisionDiff>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub impact: Option<traffic::Impact>,
    pub gates: Vec<gate::GateResult>,
}

impl DiffReport {
    pub fn tripped(&self) -> bool {
        self.gates.iter().any(|g| g.tripped)
    }
}

/// The reports of both replays, for gates that read them.
pub fn reports(r: &DiffReport) -> Option<(&Report, &Report)> {
    r.impact.as_ref().map(|i| (&i.old, &i.new))
}

/// The result of replaying one traffic under two policies.
pub struct DryRun {
    pub decisions: traffic::DecisionDiff,
    pub impact: traffic::Impact,
    /// Per tier: TTFTs (ms) and TTFT SLO under the old and the new policy.
    pub ttfts: Vec<plot::Panel>,
}

/// One replay of the traffic under one policy.
pub fn replay(
    g: &std::sync::Arc<crate::graph::DecisionGraph>,
    cost: &crate::backend::cost::CostModel,
    records: &[crate::traffic::Record],
    label: &str,
    mut progress: impl FnMut(usize, usize),
) -> (Report, Vec<crate::replay::Outcome>) {
    use crate::sched::{Config, Scheduler};
    let cfg = Config {
        cache_on_finish: true,
        ..Config::default()
    };
    let mut sched = Scheduler::new(g.clone(), crate::replay::plan(g, cost), cfg);
    let (outcomes, gap) =
        crate::replay::run_measured(&mut sched, crate::replay::arrivals(records), &mut progress);
    let fleet = crate::replay::fleet(&sched, &outcomes, gap);
    (
        crate::replay::report::build(g, label, "kiln", &outcomes, &fleet),
        outcomes,
    )
}

/// Decides every request under both policies and replays the traffic
/// through both, the two replays side by side on two threads.
pub fn dry_run(
    old: &std::sync::Arc<crate::graph::DecisionGraph>,
    new: &std::sync::Arc<crate::graph::DecisionGraph>,
    costs: (
        &crate::backend::cost::CostModel,
        &crate::backend::cost::CostModel,
    ),
    records: &[crate::traffic::Record],
    progress: impl FnMut(usize, usize) + Send,
) -> Option<DryRun> {
    let cfg = crate::sched::Config::default();
    let decisions = traffic::decisions(
        old,
        new,
        records,
        cfg.start_minute_of_day,
        cfg.start_weekday,
    );
    let (ro, rn) = std::thread::scope(|s| {
        let h = s.spawn(|| replay(old, costs.0, records, "old", |_, _| {}));
        let n = replay(new, costs.1, records, "new", progress);
        (h.join(), n)
    });
    let ro = ro.ok()?;
    let slo = |g: &crate::graph::DecisionGraph, name: &str| {
        g.tier_id(name)
            .and_then(|t| g.tiers.get(t as usize))
            .and_then(|t| t.slo.ttft)
    };
    let mut ttfts = Vec::new();
    for t in &old.tiers {
        ttfts.push(plot::Panel {
            tier: t.name.clone(),
            old: plot::ttfts(&ro.1, old.tier_id(&t.name)),
            new: plot::ttfts(&rn.1, new.tier_id(&t.name)),
            slo_old: slo(old, &t.name),
            slo_new: slo(new, &t.name),
        });
    }
    for t in new.tiers.iter().filter(|t| old.tier_id(&t.name).is_none()) {
        ttfts.push(plot::Panel {
            tier: t.name.clone(),
            old: Vec::new(),
            new: plot::ttfts(&rn.1, new.tier_id(&t.name)),
            slo_old: None,
            slo_new: slo(new, &t.name),
        });
    }
    Some(DryRun {
        decisions,
        impact: traffic::impact(ro.0, rn.0),
        ttfts,
    })
}
