//! `kiln lint`: judgement beyond correctness. Each finding has a stable rule
//! id (see [`Code`]) and can be silenced with `# kiln:allow(<id>)` on the
//! line of the finding or in the comment lines just above it.

use super::Compiled;
use crate::diag::{Code, Diagnostic, Diagnostics};
use crate::lang::comments;
use crate::source::Span;
use std::collections::{HashMap, HashSet};

/// `[limits] default_queue_bound`'s default in `kiln.toml`, as the notes
/// name it (`tests/diagnostics.rs` checks it is the gateway's).
pub const DEFAULT_QUEUE_BOUND_TEXT: &str = "5m";

/// `[governance] min_samples`'s default in `kiln.toml`: below it a
/// rollback condition's traffic signals read as healthy
/// (`tests/diagnostics.rs` checks it is the gateway's).
pub const DEFAULT_MIN_SAMPLES: u64 = 20;

/// What a rollback condition reads while the canary has `n` requests,
/// fewer than `min_samples`: every traffic signal healthy (latencies,
/// rates, counts and occupancy 0, attainment 100%, the pools' hardware
/// figures 0), the request counts `n`, the clock at `minute` of `weekday`
/// (`governance::live` computes the same in the gateway).
fn below_min_samples(
    g: &crate::graph::DecisionGraph,
    n: u64,
    weekday: u8,
    minute: u16,
) -> crate::graph::Signals {
    use crate::graph::signal::TierField;
    let mut s = crate::graph::Signals::idle(g);
    for t in &mut s.tiers {
        t.set(TierField::Requests, n as f64);
    }
    for t in &mut s.tenants {
        t.requests = n as f64;
    }
    s.weekday = weekday;
    s.time_of_day = minute;
    s
}

/// The owner-unresolved lint: with a `require owner` rule, every tier,
/// pool and tenant (and the policy, for changes to what nobody owns:
/// classify, models) should resolve to an owner, else a change to it asks
/// any approver.
fn owner_unresolved(g: &crate::graph::DecisionGraph, at: Span, out: &mut Diagnostics) {
    let mut none: Vec<String> = Vec::new();
    if g.owner.owner.is_none() {
        none.push("the policy".into());
    }
    for (i, t) in g.tiers.iter().enumerate() {
        if g.tier_owner(i as u16).owner.is_none() {
            none.push(format!("tier `{}`", t.name));
        }
    }
    for (i, p) in g.pools.iter().enumerate() {
        if g.pool_owner(i as u16).owner.is_none() {
            none.push(format!("pool `{}`", p.name));
        }
    }
    for (i, t) in g.tenants.iter().enumerate() {
        if g.tenant_owner(i as u32).owner.is_none() {
            none.push(format!("tenant `{}`", t.name));
        }
    }
    if none.is_empty() {
        return;
    }
    let shown = if none.len() > 4 {
        format!("{} and {} more", none[..4].join(", "), none.len() - 4)
    } else {
        none.join(", ")
    };
    out.push(
        Diagnostic::error(
            Code::OwnerUnresolved,
            format!("`require owner` finds no owner for {shown}"),
        )
        .at(at, "a change to those asks any approver instead")
        .help("add `owner \"team\"` to them, or `policy { owner \"platform\" }` for everything that names none"),
    );
}

/// The rollback-on-few-samples lint: a rollback condition that holds on
/// what a canary with fewer than `min_samples` requests reads would roll a
/// version back before it has been tried (an inverted comparison such as
/// `tier(T).ttft_p95 < 1s`, a floor on `requests`, a clock alone).
fn rollback_on_few_samples(g: &crate::graph::DecisionGraph, out: &mut Diagnostics) {
    use crate::graph::trace::NoTrace;
    let Some(r) = &g.rollout else {
        return;
    };
    let noon = crate::graph::Signals::idle(g);
    for b in &r.rollbacks {
        let at_noon = (0..DEFAULT_MIN_SAMPLES).find(|&n| {
            let s = below_min_samples(g, n, noon.weekday, noon.time_of_day);
            b.cond.eval_signals(&s, &mut NoTrace)
        });
        let when = match at_noon {
            Some(n) => Some((n, None)),
            None => (0..DEFAULT_MIN_SAMPLES).find_map(|n| {
                (0..7u8).find_map(|d| {
                    (0..48u16).map(|h| h * 30).find_map(|m| {
                        let s = below_min_samples(g, n, d, m);
                        b.cond
                            .eval_signals(&s, &mut NoTrace)
                            .then_some((n, Some((d, m))))
                    })
                })
            }),
        };
        let Some((n, clock)) = when else {
            continue;
        };
        let at = clock.map_or_else(String::new, |(d, m)| {
            let day = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
                .get(usize::from(d))
                .copied()
                .unwrap_or("?");
            format!(" on {day} at {:02}:{:02}", m / 60, m % 60)
        });
        out.push(
            Diagnostic::error(
                Code::RollbackOnFewSamples,
                format!(
                    "this rollback condition holds with {n} canary request{}{at}, before the window has `[governance] min_samples` ({DEFAULT_MIN_SAMPLES} unless kiln.toml sets another)",
                    if n == 1 { "" } else { "s" }
                ),
            )
            .at(b.span, "trips on what a barely tried canary reads")
            .help("under `min_samples` every traffic signal reads as healthy (latencies, rates and counts 0, `slo_attainment` 100%) and `requests` reads the count: roll back on a bad value (`tier(T).ttft_p95 > 2s`, `tier(T).error_rate > 5%`, `tier(T).slo_attainment < 95%`), not on a good one or on the clock"),
        );
    }
}

/// The rollback-on-shared-pool lint: during a canary every traffic signal
/// a rollback condition reads is the canary's own (`governance::live`), but
/// `pool(P).utilization` and `pool(P).kv_occupancy` measure the pool's
/// hardware, which the active version's traffic loads too: they cannot be
/// split by who decided a request, so they stay the scheduler's whole-pool
/// figures, and a condition on them can roll a canary back for load it
/// did not cause. Without a canary the rollout only watches the version
/// once it decides all traffic, where the pool's figures are its own.
fn rollback_on_shared_pool(g: &crate::graph::DecisionGraph, out: &mut Diagnostics) {
    use crate::graph::signal::PoolField;
    use crate::graph::Sig;
    let Some(r) = &g.rollout else {
        return;
    };
    if r.canary_share.is_none() && r.canary_tenants.is_empty() && r.stages.is_empty() {
        return;
    }
    // A stage's gates read the stage's own traffic like rollbacks do: a
    // gate on the whole pool's hardware would pass or wait for load the
    // canary did not cause.
    let gates = r.stages.iter().flat_map(|s| s.gates.iter());
    for (b, gate) in r
        .rollbacks
        .iter()
        .map(|b| (b, false))
        .chain(gates.map(|b| (b, true)))
    {
        let mut read: Vec<String> = Vec::new();
        for f in [PoolField::Utilization, PoolField::KvOccupancy] {
            for (i, p) in g.pools.iter().enumerate() {
                let hit = b
                    .cond
                    .any_test(&|t| t.sig == Sig::Pool(i as crate::graph::PoolId, f));
                if hit {
                    read.push(format!("`pool({}).{}`", p.name, f.doc().field));
                }
            }
        }
        if read.is_empty() {
            continue;
        }
        out.push(
            Diagnostic::error(
                Code::RollbackOnSharedPool,
                format!(
                    "during the canary this {} reads {}, the whole pool's hardware, loaded by the active version's traffic too",
                    if gate { "stage gate" } else { "rollback condition" },
                    read.join(" and ")
                ),
            )
            .at(
                b.span,
                if gate {
                    "can hold or pass the stage for load it did not cause"
                } else {
                    "can roll the canary back for load it did not cause"
                },
            )
            .help("every other signal is measured on the canary's own requests; to judge the canary read those (`pool(P).queued`, `pool(P).running`, `tier(T).wait_p95`, `tier(T).ttft_p95`), or keep this and silence it with `# kiln:allow(rollback-on-shared-pool)` if a saturated pool should stop any canary"),
        );
    }
}

/// An exception over [`super::decls::MAX_EXCEPTION_DAYS`] days. (Lint
/// has no clock, so one already over is shown by `kiln status`, not here.)
fn long_exceptions(g: &crate::graph::DecisionGraph, out: &mut Diagnostics) {
    let max = super::decls::MAX_EXCEPTION_DAYS;
    for e in &g.exceptions {
        if e.days() > max {
            out.push(
                Diagnostic::error(
                    Code::ExceptionTooLong,
                    format!("exception `{}` lasts {} days", e.name, e.days()),
                )
                .at(e.span, format!("more than {max} days"))
                .help("an exception is a short grant that ends by itself; a grant for longer belongs in the tier or tenant, reviewed as the policy it is. Shorten `dates`, or silence this with `# kiln:allow(exception-too-long)`"),
            );
        }
    }
}

/// Notes for the author, not findings (they never fail `kiln lint` and
/// are not diagnostics): which queue bound applies to each tier whose
/// admission can accept a request without `queue max_wait`. Such a request
/// waits at most the gateway's `[limits] default_queue_bound` (or until
/// its completion window ends, if later), not forever.
pub fn notes(c: &Compiled) -> Vec<String> {
    let Some(g) = &c.graph else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (t, tier) in g.tiers.iter().enumerate() {
        let unbounded = match g.admits.get(t).and_then(Option::as_ref) {
            None => true,
            Some(rs) => rs
                .rules
                .iter()
                .map(|(_, _, o)| o)
                .chain(std::iter::once(&rs.default.1))
                .any(|o| {
                    matches!(
                        o,
                        crate::graph::AdmitOutcome::Accept
                            | crate::graph::AdmitOutcome::Delay { .. }
                            | crate::graph::AdmitOutcome::Degrade { .. }
                    )
                }),
        };
        if !unbounded {
            continue;
        }
        let window = if tier.slo.window.is_some() {
            ", or when their completion window ends if that is later"
        } else {
            ""
        };
        out.push(format!(
            "tier `{}` admits requests without a queue bound: the gateway refuses one still waiting after `[limits] default_queue_bound` ({DEFAULT_QUEUE_BOUND_TEXT} unless kiln.toml sets another{window}) with 503; to choose the tier's own, write `admit {} {{ default => queue max_wait 30s }}`",
            tier.name, tier.name
        ));
    }
    out
}

/// Whether this kiln binary was built with the semantic cache's
/// embedding model (feature `semantic-cache`).
pub const SEMANTIC_CACHE_BUILT: bool = cfg!(feature = "semantic-cache");

/// `kiln check`'s errors for what the policy asks of the binary: a tier's
/// semantic cache on a build without `--features semantic-cache`, which
/// `kiln serve` would refuse at start. `semantic_cache_built` is
/// [`SEMANTIC_CACHE_BUILT`] for the running binary.
pub fn build_features(c: &Compiled, semantic_cache_built: bool) -> Diagnostics {
    let mut out = Diagnostics::new();
    if semantic_cache_built {
        return out;
    }
    for (what, span) in &c.facts.semantic_caches {
        out.push(
            Diagnostic::error(
                Code::FeatureNotBuilt,
                format!("{what} has a semantic cache, which this kiln was built without (build feature `semantic-cache`)"),
            )
            .at(*span, "needs the build feature `semantic-cache`")
            .help("build kiln with `cargo build --release --features semantic-cache` (and set `[cache] embedding_model` in kiln.toml), or use `cache { exact { … } }`, which every build serves"),
        );
    }
    out
}

/// Lints a compiled policy (errors must be absent for the graph checks to
/// run; syntax-level lints need only the AST).
pub fn lint(c: &Compiled) -> Diagnostics {
    let mut out = Diagnostics::new();
    shadowed_rules(c, &mut out);
    absent_header_matches(c, &mut out);
    if let Some(g) = &c.graph {
        // tier-without-slo
        for t in &g.tiers {
            if t.slo.is_empty() {
                out.push(
                    Diagnostic::error(Code::TierWithoutSlo, format!("tier `{}` has no SLO", t.name))
                        .at(t.span, "no slo")
                        .help("add `slo { ttft 500ms }` for interactive work or `slo { window 6h }` for batch work, so admission and alerts can use it"),
                );
            }
        }
        // reserve-on-dedicated-pool
        let reach: Vec<Vec<u16>> = (0..g.tiers.len() as u16)
            .map(|t| super::validate::tier_pools(g, t))
            .collect();
        for (t, tier) in g.tiers.iter().enumerate() {
            for r in &tier.reserve {
                let shared = reach
                    .iter()
                    .enumerate()
                    .any(|(o, pools)| o != t && pools.contains(&r.pool));
                if shared {
                    continue;
                }
                let pool = &g.pools[r.pool as usize];
                out.push(
                    Diagnostic::error(
                        Code::ReserveOnDedicatedPool,
                        format!(
                            "tier `{}` reserves a share of pool `{}`, which no other tier can use",
                            tier.name, pool.name
                        ),
                    )
                    .at(r.span, "the whole pool is this tier's already")
                    .help("a reserve guarantees a share of a pool other tiers share; remove it, or let other tiers route here"),
                );
            }
        }
        // owner-unresolved
        if let Some(&at) = c.facts.owner_rules.first() {
            owner_unresolved(g, at, &mut out);
        }
        // tenant-without-owner
        for t in &g.tenants {
            if t.owner.as_deref().is_none_or(|o| o.trim().is_empty()) {
                out.push(
                    Diagnostic::error(Code::TenantWithoutOwner, format!("tenant `{}` has no owner", t.name))
                        .at(t.span, "no owner")
                        .help("add `owner \"team@example.com\"`: someone must be paged for it and approve its changes"),
                );
            }
        }
        // preempts-higher-priority
        for t in &g.tiers {
            for &p in &t.preempts {
                let victim = &g.tiers[p as usize];
                if victim.priority > t.priority {
                    let span = c
                        .facts
                        .preempt_spans
                        .get(&(t.name.clone(), victim.name.clone()))
                        .copied()
                        .unwrap_or(t.span);
                    out.push(
                        Diagnostic::error(
                            Code::PreemptsHigherPriority,
                            format!(
                                "tier `{}` (priority {}) preempts `{}` (priority {})",
                                t.name, t.priority, victim.name, victim.priority
                            ),
                        )
                        .at(span, "preempts a higher-priority tier")
                        .help("preemption should run from higher to lower priority; swap the priorities or drop this preempt"),
                    );
                }
            }
            if t.preempts.iter().any(|p| !g.tiers[*p as usize].preemptible) {
                for &p in &t.preempts {
                    let victim = &g.tiers[p as usize];
                    if !victim.preemptible {
                        let span = c
                            .facts
                            .preempt_spans
                            .get(&(t.name.clone(), victim.name.clone()))
                            .copied()
                            .unwrap_or(t.span);
                        out.push(
                            Diagnostic::error(
                                Code::PreemptsHigherPriority,
                                format!(
                                    "tier `{}` preempts `{}`, which is not preemptible",
                                    t.name, victim.name
                                ),
                            )
                            .at(
                                span,
                                "only items of batches marked `kiln_preemptible` can be preempted there",
                            )
                            .help(format!(
                                "mark tier `{}` `preemptible`, or remove it from the list (keep it where its batches opt in with metadata `kiln_preemptible: \"true\"`)",
                                victim.name
                            )),
                        );
                    }
                }
            }
        }
        // quota-oversubscribed: promised GPU-seconds beyond the fleet's
        let fleet_gpus: f64 = g.pools.iter().map(|p| f64::from(p.gpus)).sum();
        let mut promised = 0.0;
        for t in &g.tenants {
            if let Some(gs) = t.quota.gpu_seconds {
                let before = promised;
                promised += gs;
                if promised > fleet_gpus && before <= fleet_gpus {
                    out.push(
                        Diagnostic::error(
                            Code::QuotaOversubscribed,
                            format!(
                                "GPU-second quotas promise {:.0} GPU-seconds/day but the pools hold {:.0}",
                                promised * 86_400.0,
                                fleet_gpus * 86_400.0
                            ),
                        )
                        .at(t.span, "this tenant's quota crosses the fleet's capacity")
                        .help("lower the gpu_seconds quotas, add GPUs to the pools, or silence this with kiln:allow(quota-oversubscribed) if overcommit is deliberate"),
                    );
                }
            }
        }
        // tier-not-granted
        for (tenant, tier, span) in &c.facts.classify_pins {
            let (Some(tn), Some(ti)) = (g.tenant_id(tenant), g.tier_id(tier)) else {
                continue;
            };
            let t = &g.tenants[tn as usize];
            if !t.tiers.contains(&ti) {
                let granted: Vec<&str> = t
                    .tiers
                    .iter()
                    .map(|x| g.tiers[*x as usize].name.as_str())
                    .collect();
                out.push(
                    Diagnostic::error(
                        Code::TierNotGranted,
                        format!("classify sends tenant `{tenant}` to tier `{tier}`, which it is not granted"),
                    )
                    .at(*span, "not granted to this tenant")
                    .help(format!(
                        "at run time it lands in `{}` instead; grant the tier in the tenant's `tiers` or change the rule (granted: {})",
                        granted.first().copied().unwrap_or("?"),
                        granted.join(", ")
                    )),
                );
            }
        }
        unused(c, g, &mut out);
        super::dead::dead_rules(g, &mut out);
        unreachable_limits(c, g, &mut out);
        rollback_on_few_samples(g, &mut out);
        rollback_on_shared_pool(g, &mut out);
        long_exceptions(g, &mut out);
    }
    wrapping_times(c, &mut out);
    for (span, what) in &c.facts.redefined {
        out.push(
            Diagnostic::error(Code::SignalRedefined, "this signal's meaning changed")
                .at(*span, "measures something else than it used to")
                .help(format!(
                    "{what}. Check the rule still says what you mean, then silence this with `# kiln:allow(signal-redefined)`"
                )),
        );
    }
    let mut out = suppress(c, out);
    out.sort();
    out
}

fn unused(c: &Compiled, g: &crate::graph::DecisionGraph, out: &mut Diagnostics) {
    // Tiers reached by classify or a demote.
    let mut reached: HashSet<u16> = HashSet::new();
    reached.insert(g.classify.default.1.tier);
    for (_, _, o) in &g.classify.rules {
        reached.insert(o.tier);
    }
    for ch in g.fallbacks.iter().flatten() {
        for (_, s) in &ch.steps {
            if let crate::graph::Step::Demote(t) = s {
                reached.insert(*t);
            }
        }
    }
    for (i, t) in g.tiers.iter().enumerate() {
        if !reached.contains(&(i as u16)) {
            out.push(
                Diagnostic::error(
                    Code::UnusedDefinition,
                    format!("tier `{}` is never assigned", t.name),
                )
                .at(t.span, "no classify rule or demote leads here")
                .help("send requests to it from classify, or remove it"),
            );
        }
    }
    for (i, p) in g.pools.iter().enumerate() {
        let used = g
            .models
            .iter()
            .any(|m| m.variants.iter().any(|v| v.pools.contains(&(i as u16))));
        if !used {
            out.push(
                Diagnostic::error(
                    Code::UnusedDefinition,
                    format!("pool `{}` hosts no variant", p.name),
                )
                .at(p.span, "no variant lists this pool")
                .help("add it to a variant's `pools`, or remove it"),
            );
        }
    }
    for (i, co) in g.cohorts.iter().enumerate() {
        if !g.tenants.iter().any(|t| t.cohort == Some(i as u16)) {
            out.push(
                Diagnostic::error(
                    Code::UnusedDefinition,
                    format!("cohort `{}` has no member", co.name),
                )
                .at(co.span, "no tenant names this cohort")
                .help("set `cohort NAME` on its tenants, or remove it"),
            );
        }
    }
    for m in &g.models {
        for v in &m.variants {
            if !c
                .facts
                .used_variants
                .contains(&(m.name.clone(), v.name.clone()))
            {
                out.push(
                    Diagnostic::error(
                        Code::UnusedDefinition,
                        format!("variant `{}.{}` is never routed to", m.name, v.name),
                    )
                    .at(v.span, "no route, fallback or degrade names it")
                    .help("route to it, or remove it"),
                );
            }
        }
    }
}

/// `HH:MM` for minutes after midnight.
fn hhmm(m: u32) -> String {
    format!("{:02}:{:02}", m / 60, m % 60)
}

/// `8 h` or `7 h 30 min`.
fn span_of(minutes: u32) -> String {
    match (minutes / 60, minutes % 60) {
        (h, 0) => format!("{h} h"),
        (0, m) => format!("{m} min"),
        (h, m) => format!("{h} h {m} min"),
    }
}

/// The time-range-wraps lint: `time in 20:00..08:00` holds from 20:00 to
/// midnight and from midnight to 08:00, the night. Written for business
/// hours (the outcome delays work until a time inside the range, so work
/// is held to the next day) it is almost always a swapped range.
fn wrapping_times(c: &Compiled, out: &mut Diagnostics) {
    for w in &c.facts.wrapping_times {
        let (from, to) = (hhmm(w.from), hhmm(w.to));
        let covered = span_of(24 * 60 - w.from + w.to);
        let between = span_of(w.from - w.to);
        let inside = |m: u32| m >= w.from || m < w.to;
        let d = match w.delay_until {
            Some((until, span)) if inside(until) => {
                let u = hhmm(until);
                Diagnostic::error(
                    Code::TimeRangeWraps,
                    format!("`{from}..{to}` crosses midnight: it covers {from} to 24:00 and 00:00 to {to} ({covered}), not the hours between"),
                )
                .at(w.span, format!("{from} to {to} the next morning, overnight"))
                .also(span, format!("{u} is inside the range, so work arriving after {from} waits until {u} the next day"))
                .help(format!("for business hours write `time in {to}..{from}` ({between}); if the night is meant, silence this with `# kiln:allow(time-range-wraps)`"))
            }
            _ => Diagnostic::error(
                Code::TimeRangeWraps,
                format!("`{from}..{to}` crosses midnight: it covers {from} to 24:00 and 00:00 to {to} ({covered})"),
            )
            .at(w.span, format!("{from} to {to} the next morning, overnight"))
            .help(format!("the hours between are `{to}..{from}` ({between}); if the night is meant, silence this with `# kiln:allow(time-range-wraps)`")),
        };
        out.push(d);
    }
}

/// Requests the fleet can run at once: per pool, the most replicas of the
/// variant that packs the most sequences there, times its batch.
fn fleet_slots(g: &crate::graph::DecisionGraph) -> u64 {
    (0..g.pools.len())
        .map(|p| {
            let pool = &g.pools[p];
            g.models
                .iter()
                .flat_map(|m| m.variants.iter())
                .filter(|v| v.pools.contains(&(p as u16)))
                .map(|v| u64::from(pool.gpus / v.gpus_per_replica.max(1)) * u64::from(v.max_batch))
                .max()
                .unwrap_or(0)
        })
        .sum()
}

/// Requests one gateway holds in flight with its default limits: client
/// connections (`[limits] max_connections`) plus batch items (`[batch]
/// max_in_flight`), 1,024 each (`tests/diagnostics.rs` checks these are
/// the gateway's).
pub const DEFAULT_GATEWAY_IN_FLIGHT: u64 = 2 * 1024;

/// The unreachable-limit lint: a `concurrent` limit counts requests in
/// flight (running or waiting). One above both what the pools' replicas
/// run at once and what a gateway holds in flight never binds.
fn unreachable_limits(c: &Compiled, g: &crate::graph::DecisionGraph, out: &mut Diagnostics) {
    let slots = fleet_slots(g);
    let bound = slots.max(DEFAULT_GATEWAY_IN_FLIGHT);
    for (what, n, span) in &c.facts.concurrent {
        if *n <= bound {
            continue;
        }
        out.push(
            Diagnostic::error(
                Code::UnreachableLimit,
                format!("{what}'s `concurrent {n}` can never bind"),
            )
            .at(*span, format!("no fleet of these pools reaches {n} in flight"))
            .help(format!(
                "the pools' replicas run at most {slots} requests at once (GPUs per replica and `max_batch` of the variants they host) and a gateway holds at most {DEFAULT_GATEWAY_IN_FLIGHT} in flight with its default limits, so this limit never refuses anything; lower it to what the tenant should hold at most, like `concurrent {}`, or silence this with `# kiln:allow(unreachable-limit)` if many gateways with raised `[limits] max_connections` really hold that many",
                (slots / 4).max(1)
            )),
        );
    }
}

/// Does conjunction `later` imply conjunction `earlier`: every atom of
/// `earlier` is in `later`, or is a numeric comparison that one of
/// `later`'s implies (`estimated_wait > 5s` implies `estimated_wait > 2s`)?
/// Returns the pair of atoms that made it numeric, if any.
fn implies_numerically<'a>(
    c: &Compiled,
    later: &'a [String],
    earlier: &'a [String],
) -> Option<Option<(&'a str, &'a str)>> {
    let mut why = None;
    for a in earlier {
        if later.contains(a) {
            continue;
        }
        let na = c.facts.num_atoms.get(a)?;
        let b = later
            .iter()
            .find(|b| c.facts.num_atoms.get(*b).is_some_and(|nb| nb.implies(na)))?;
        why = Some((b.as_str(), a.as_str()));
    }
    Some(why)
}

/// Numeric shadowing: rule j can never match when each of its
/// conjunctions implies a conjunction of one earlier rule (by numbers,
/// not only by the same atoms). Rules whose atoms are not numeric are left
/// to the set check above; this one compares only rules with numeric
/// comparisons, so large generated policies of names stay linear.
fn numeric_shadow(
    c: &Compiled,
    block: &super::BlockFacts,
    j: usize,
) -> Option<(usize, String, String)> {
    let d = block.rules.get(j)?.1.as_ref()?;
    if d.is_empty() {
        return None;
    }
    let numeric = |conj: &[String]| conj.iter().any(|a| c.facts.num_atoms.contains_key(a));
    let mut found: Option<(usize, String, String)> = None;
    for conj in d {
        if !numeric(conj) {
            return None;
        }
        let mut hit = None;
        for (i, (_, di)) in block.rules.iter().enumerate().take(j) {
            let Some(di) = di else { continue };
            if let Some(Some((b, a))) = di.iter().find_map(|ci| implies_numerically(c, conj, ci)) {
                hit = Some((i, b.to_string(), a.to_string()));
                break;
            }
        }
        let (i, b, a) = hit?;
        if found.as_ref().is_none_or(|f| i > f.0) {
            found = Some((i, b, a));
        }
    }
    found
}

/// `header("…") != ""` written to mean "the header is set". An absent
/// header is not the empty string, so the rule takes every request without
/// the header too: kiln's own batch tests classified interactive requests
/// as batch this way, and a measurement of interactive latency beside a
/// batch measured batch work.
fn absent_header_matches(c: &Compiled, out: &mut Diagnostics) {
    for block in &c.facts.blocks {
        for (span, d) in &block.rules {
            let Some(d) = d else { continue };
            let Some(atom) = d
                .iter()
                .flatten()
                .find(|a| a.starts_with("header(") && a.ends_with(") != \"\""))
            else {
                continue;
            };
            let batch = if atom.contains("\"x-kiln-batch\"") {
                "for work that came through the Batches API write `when batch`; "
            } else {
                ""
            };
            out.push(
                Diagnostic::error(
                    Code::AbsentHeaderMatches,
                    format!("`{atom}` in `{}` also matches requests without that header", block.name),
                )
                .at(*span, "true when the header is absent")
                .help(format!("an absent header is not \"\", so this rule takes every request that lacks it; {batch}to require the header, compare it with the values it may have (`header(\"x-team\") in [\"search\", \"ads\"]`); if requests without it are meant to match, silence this with `# kiln:allow(absent-header-matches)`")),
            );
        }
    }
}

/// The shadowed-rule check. Rule j is shadowed when an earlier rule i
/// matches whenever j does: every conjunction of j contains all atoms of
/// some conjunction of i. Subset lookups through a hash of atom sets keep
/// this near linear for the 10k-rule policies some teams generate.
fn shadowed_rules(c: &Compiled, out: &mut Diagnostics) {
    for block in &c.facts.blocks {
        let mut seen: HashMap<Vec<&str>, usize> = HashMap::new();
        for (j, (span, d)) in block.rules.iter().enumerate() {
            let Some(d) = d else { continue };
            let mut shadower: Option<usize> = None;
            let mut all_covered = !d.is_empty();
            for conj in d {
                let atoms: Vec<&str> = conj.iter().map(String::as_str).collect();
                let found = subsets_lookup(&atoms, &seen);
                match found {
                    Some(i) => shadower = Some(shadower.map_or(i, |s: usize| s.max(i))),
                    None => {
                        all_covered = false;
                        break;
                    }
                }
            }
            if !all_covered {
                // A rule with numeric comparisons: shadowed by numbers?
                if d.len() <= 8 && block.rules.len() <= 2_000 {
                    if let Some((i, b, a)) = numeric_shadow(c, block, j) {
                        let earlier: Span = block.rules[i].0;
                        out.push(
                            Diagnostic::error(
                                Code::ShadowedRule,
                                format!("rule {} of `{}` can never match", j + 1, block.name),
                            )
                            .at(*span, "shadowed")
                            .also(earlier, format!("rule {} matches first", i + 1))
                            .help(format!("every request with `{b}` also has `{a}`, so rule {} takes it first; put the stricter rule first (rules are tried in order), or delete this one", i + 1)),
                        );
                    }
                }
            }
            if all_covered {
                if let Some(i) = shadower {
                    let earlier: Span = block.rules[i].0;
                    out.push(
                        Diagnostic::error(
                            Code::ShadowedRule,
                            format!("rule {} of `{}` can never match", j + 1, block.name),
                        )
                        .at(*span, "shadowed")
                        .also(earlier, format!("rule {} matches first", i + 1))
                        .help("an earlier rule matches every request this one does; move this rule above it, narrow the earlier rule, or delete this one"),
                    );
                }
            }
            for conj in d {
                let mut key: Vec<&str> = conj.iter().map(String::as_str).collect();
                key.sort_unstable();
                seen.entry(key).or_insert(j);
            }
        }
    }
}

/// Is any subset of `atoms` (as a sorted key) a rule seen before?
fn subsets_lookup(atoms: &[&str], seen: &HashMap<Vec<&str>, usize>) -> Option<usize> {
    let mut sorted: Vec<&str> = atoms.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let n = sorted.len();
    if n > 12 {
        return seen.get(&sorted).copied();
    }
    let mut best: Option<usize> = None;
    for mask in 0u32..(1u32 << n) {
        let key: Vec<&str> = (0..n)
            .filter(|b| mask & (1 << b) != 0)
            .map(|b| sorted[b])
            .collect();
        if let Some(&i) = seen.get(&key) {
            best = Some(best.map_or(i, |x: usize| x.min(i)));
        }
    }
    best
}

/// Drops findings silenced by `kiln:allow(<id>)` comments.
fn suppress(c: &Compiled, diags: Diagnostics) -> Diagnostics {
    let mut allowed: HashMap<(u32, usize), Vec<String>> = HashMap::new();
    let mut comment_lines: HashMap<u32, HashSet<usize>> = HashMap::new();
    let mut unknown = Vec::new();
    for (id, f) in c.sources.files() {
        for cm in comments::scan(&f.text) {
            if cm.own_line {
                comment_lines.entry(id.0).or_default().insert(cm.line);
            }
            let ids = comments::allowed_ids(&cm.text);
            for name in &ids {
                if name == "all" || Code::from_name(name).is_some_and(Code::is_lint) {
                    continue;
                }
                let at = cm.text.find(name.as_str()).unwrap_or(0);
                let span = Span::new(id, cm.start + at, cm.start + at + name.len());
                let lints: Vec<&str> = Code::ALL
                    .iter()
                    .filter(|c| c.is_lint() && **c != Code::UnknownLint)
                    .map(|c| c.name())
                    .collect();
                let help = match crate::diag::suggest(name, lints.iter().copied()) {
                    Some(s) => s,
                    None => format!("the lint ids are {}, or `all`", lints.join(", ")),
                };
                unknown.push(
                    Diagnostic::error(Code::UnknownLint, format!("`{name}` is not a lint id"))
                        .at(span, "this silences nothing")
                        .help(help),
                );
            }
            if !ids.is_empty() {
                allowed.entry((id.0, cm.line)).or_default().extend(ids);
            }
        }
    }
    let mut out = Diagnostics::new();
    for d in diags.items {
        let silenced = d.span.and_then(|s| {
            let f = c.sources.get(s.file)?;
            let (line1, _) = f.line_col(s.start as usize);
            let line = line1 - 1;
            let hit = |l: usize| {
                allowed
                    .get(&(s.file.0, l))
                    .is_some_and(|ids| ids.iter().any(|i| i == d.code.name() || i == "all"))
            };
            if hit(line) {
                return Some(());
            }
            // walk up through the comment lines directly above
            let mut l = line;
            let lines = comment_lines.get(&s.file.0);
            while l > 0 && lines.is_some_and(|ls| ls.contains(&(l - 1))) {
                l -= 1;
                if hit(l) {
                    return Some(());
                }
            }
            None
        });
        if silenced.is_none() {
            out.push(d);
        }
    }
    for d in unknown {
        out.push(d);
    }
    out
}
