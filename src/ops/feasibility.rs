//! The `infeasible-slo` lint: a tier whose TTFT SLO is below the zero-load
//! time to first token of the prompts it routes, from the cost model. Such
//! prompts can never meet it, however idle the fleet: kiln refuses them as
//! `infeasible` at admission, so the author should know before the policy
//! ships. (It lives above `compile` because it needs the cost model.)

use crate::backend::cost::CostModel;
use crate::diag::{Code, Diagnostic, Diagnostics};
use crate::graph::DecisionGraph;
use crate::sched::replica::Replica;

/// Prompts shorter than this are ordinary chat turns: an SLO that cannot
/// serve one of them on an idle replica is worth a warning.
pub const TYPICAL_PROMPT: u64 = 1024;

/// The longest prompt (tokens) whose zero-load TTFT on `r` is within
/// `limit` µs, or 0 when not even one token is.
fn longest_feasible(r: &Replica, limit: u64) -> u64 {
    if r.idle_first_token_time(1) > limit {
        return 0;
    }
    let (mut lo, mut hi) = (1u64, 2u64);
    while hi < 1 << 24 && r.idle_first_token_time(hi) <= limit {
        lo = hi;
        hi *= 2;
    }
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if r.idle_first_token_time(mid) <= limit {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Warnings for tiers whose TTFT SLO is impossible for typical prompts on
/// the fastest replica their routes reach (as the simulator models it).
pub fn lint(g: &DecisionGraph) -> Diagnostics {
    let mut out = Diagnostics::new();
    let Ok(cost) = CostModel::from_graph(g, None) else {
        return out;
    };
    let plan = crate::backend::deploy::simulated(g, &cost);
    let replicas: Vec<Replica> = plan.replicas.into_iter().map(Replica::new).collect();
    for (t, tier) in g.tiers.iter().enumerate() {
        let Some(ttft) = tier.slo.ttft else { continue };
        let pools = crate::compile::validate::tier_pools(g, t as u16);
        let limit = (ttft * 1000.0) as u64;
        let Some(best) = replicas
            .iter()
            .filter(|r| pools.contains(&r.spec.pool))
            .map(|r| longest_feasible(r, limit))
            .max()
        else {
            continue;
        };
        if best >= TYPICAL_PROMPT {
            continue;
        }
        let (msg, label) = if best == 0 {
            (
                format!(
                    "tier `{}`'s TTFT SLO ({ttft} ms) is below the time any prompt takes to its first token on an idle replica",
                    tier.name
                ),
                "no request can meet this".to_string(),
            )
        } else {
            (
                format!(
                    "tier `{}`'s TTFT SLO ({ttft} ms) is met on an idle replica only by prompts of at most {best} tokens",
                    tier.name
                ),
                "longer prompts are refused as `infeasible`".to_string(),
            )
        };
        out.push(
            Diagnostic::error(Code::InfeasibleSlo, msg)
                .at(tier.span, label)
                .help("raise the tier's `slo { ttft }`, or route it to faster GPUs (the estimate is the cost model's zero-load prefill; calibrate it with `kiln calibrate`)"),
        );
    }
    out
}
