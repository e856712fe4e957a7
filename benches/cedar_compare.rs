//! kiln vs cedar-policy 4, measured in one run, on the same machine, with
//! interleaved samples so both see the same noise.
//!
//! cargo bench --features cedar-bench --bench cedar_compare
//!
//! Equivalence. kiln's classify block is an ordered first-match list; Cedar
//! policies are unordered and an authorization answers allow/deny with the
//! set of permits that were satisfied. Each kiln classify rule
//! `when tenant == team-17 and header("x-kiln-tier") == "eval" => tier evaluation`
//! becomes one Cedar permit
//! `permit(principal == Tenant::"team-17", action == Action::"classify", resource == Service::"gateway") when { context.tier_header == "eval" };`
//! with policy id `r<index>`. One `is_authorized` call then finds every
//! matching rule; the tier is the one of the lowest-index satisfied permit
//! (kiln's first match), or the classify default when Cedar denies. That
//! lookup is inside the timed loop. Requests, entities (one per tenant, no
//! attributes) and contexts are built once, outside the timed loop, as the
//! kiln `Request`s are. Each request's Cedar tier is checked against kiln's
//! before timing.
//!
//! Cedar does classify only; kiln's `decide` does classify + quota + route +
//! admit. Two kiln figures are therefore given: the full decision, and the
//! same request for a model the policy does not serve, where `decide` stops
//! after classify and the quota check (classify-only, the like-for-like one).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

#[path = "common/mod.rs"]
mod common;

use cedar_policy::{
    Authorizer, Context, Decision, Entities, Entity, EntityUid, Policy, PolicyId, PolicySet,
    Request as CedarRequest, RestrictedExpression,
};
use common::{ClassifyRule, Extra, Generated};
use kiln::graph::{DecisionGraph, Request, Signals};
use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::str::FromStr;
use std::time::Instant;

/// Timed rounds per request and engine; each round is about `ROUND_NS` long.
const ROUNDS: usize = 41;
const ROUND_NS: f64 = 20e6;

fn uid(s: &str) -> EntityUid {
    EntityUid::from_str(s).expect("entity uid")
}

fn cedar_text(r: &ClassifyRule) -> String {
    let cond = match r.extra {
        Extra::Header(v) => format!(" when {{ context.tier_header == \"{v}\" }}"),
        Extra::Tag(t) => format!(" when {{ context.tags.contains(\"{t}\") }}"),
        Extra::None => String::new(),
    };
    format!(
        "permit(principal == Tenant::\"{}\", action == Action::\"classify\", resource == Service::\"gateway\"){cond};",
        common::tenant_name(r.tenant)
    )
}

struct Cedar {
    auth: Authorizer,
    policies: PolicySet,
    entities: Entities,
    /// Policy id → (rule index, tier).
    ids: HashMap<PolicyId, (usize, &'static str)>,
}

impl Cedar {
    fn new(g: &Generated) -> Cedar {
        let mut policies = PolicySet::new();
        let mut ids = HashMap::new();
        for (i, r) in g.classify.iter().enumerate() {
            let id = PolicyId::new(format!("r{i}"));
            let p = Policy::parse(Some(id.clone()), cedar_text(r)).expect("cedar policy parses");
            policies.add(p).expect("unique policy id");
            ids.insert(id, (i, r.tier));
        }
        let entities = Entities::from_entities(
            (0..g.tenants)
                .map(|k| {
                    Entity::new_no_attrs(
                        uid(&format!("Tenant::\"{}\"", common::tenant_name(k))),
                        HashSet::new(),
                    )
                })
                .chain(std::iter::once(Entity::new_no_attrs(
                    uid("Service::\"gateway\""),
                    HashSet::new(),
                ))),
            None,
        )
        .expect("entities");
        Cedar {
            auth: Authorizer::new(),
            policies,
            entities,
            ids,
        }
    }

    /// The Cedar form of a kiln request: absent header is "", tags a set.
    fn request(r: &Request) -> CedarRequest {
        let header = r.header(common::TIER_HEADER).unwrap_or("").to_string();
        let context = Context::from_pairs([
            (
                "tier_header".to_string(),
                RestrictedExpression::new_string(header),
            ),
            (
                "tags".to_string(),
                RestrictedExpression::new_set(
                    r.tags
                        .iter()
                        .map(|t| RestrictedExpression::new_string(t.clone())),
                ),
            ),
        ])
        .expect("context");
        let tenant = r.tenant.as_deref().unwrap_or("anonymous");
        CedarRequest::new(
            uid(&format!("Tenant::\"{tenant}\"")),
            uid("Action::\"classify\""),
            uid("Service::\"gateway\""),
            context,
            None,
        )
        .expect("cedar request")
    }

    /// One authorization, then kiln's first-match: the lowest satisfied rule.
    fn classify(&self, req: &CedarRequest) -> &'static str {
        let resp = self.auth.is_authorized(req, &self.policies, &self.entities);
        match resp.decision() {
            Decision::Allow => resp
                .diagnostics()
                .reason()
                .filter_map(|id| self.ids.get(id))
                .min_by_key(|(i, _)| *i)
                .map_or(common::DEFAULT_TIER, |(_, t)| *t),
            Decision::Deny => common::DEFAULT_TIER,
        }
    }
}

/// ns per call of `f`, one figure per round.
fn per_call_ns(iters: u64, f: &mut dyn FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

fn calibrate(f: &mut dyn FnMut()) -> u64 {
    let mut n = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        let e = t.elapsed().as_nanos() as f64;
        if e > ROUND_NS / 10.0 {
            return ((ROUND_NS / (e / n as f64)) as u64).max(1);
        }
        n *= 2;
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Interleaved rounds of each engine; the median ns per call of each.
fn measure(fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let iters: Vec<u64> = fs.iter_mut().map(|f| calibrate(*f)).collect();
    let mut samples = vec![Vec::with_capacity(ROUNDS); fs.len()];
    for _ in 0..ROUNDS {
        for (i, f) in fs.iter_mut().enumerate() {
            samples[i].push(per_call_ns(iters[i], *f));
        }
    }
    samples.into_iter().map(median).collect()
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1000.0 {
        format!("{:.2} µs", ns / 1000.0)
    } else {
        format!("{ns:.0} ns")
    }
}

fn compare(n_rules: usize) {
    let gen = common::policy(n_rules);
    let g: DecisionGraph = common::compile(&gen);
    let signals = Signals::idle(&g);
    let cedar = Cedar::new(&gen);
    println!(
        "\n== kiln policy of {} rules ({} classify incl. default, {} route, {} admit; {} tenants) vs {} Cedar permits",
        gen.total_rules(),
        gen.classify_rules,
        gen.route_rules,
        gen.admit_rules,
        gen.tenants,
        gen.classify.len()
    );
    println!(
        "{:<48} {:>10} {:>14} {:>10} {:>10} {:>12}",
        "request", "kiln", "kiln classify", "cedar", "cedar/kiln", "cedar/classify"
    );
    let mut ratios = Vec::new();
    for (label, req) in common::requests(&gen) {
        let creq = Cedar::request(&req);
        let mut classify_only = req.clone();
        classify_only.model = "not-served".to_string();

        // Equivalence check before timing.
        let kiln_tier = &g.tiers[g.decide(&req, &signals).tier as usize].name;
        let kiln_tier_c = &g.tiers[g.decide(&classify_only, &signals).tier as usize].name;
        let cedar_tier = cedar.classify(&creq);
        assert_eq!(kiln_tier, cedar_tier, "{label}: kiln and cedar disagree");
        assert_eq!(kiln_tier_c, cedar_tier, "{label}: classify-only disagrees");

        let mut k = || {
            black_box(g.decide(black_box(&req), black_box(&signals)).tier);
        };
        let mut kc = || {
            black_box(
                g.decide(black_box(&classify_only), black_box(&signals))
                    .tier,
            );
        };
        let mut c = || {
            black_box(cedar.classify(black_box(&creq)));
        };
        let m = measure(&mut [&mut k, &mut kc, &mut c]);
        let (kn, kcn, cn) = (m[0], m[1], m[2]);
        ratios.push((cn / kn, cn / kcn));
        println!(
            "{:<48} {:>10} {:>14} {:>10} {:>9.1}x {:>11.1}x   (tier {cedar_tier})",
            label,
            fmt_ns(kn),
            fmt_ns(kcn),
            fmt_ns(cn),
            cn / kn,
            cn / kcn
        );
    }
    let geo = |f: fn(&(f64, f64)) -> f64| {
        (ratios.iter().map(|r| f(r).ln()).sum::<f64>() / ratios.len() as f64).exp()
    };
    println!(
        "geometric mean: cedar is {:.1}x kiln's full decision, {:.1}x kiln's classify-only path",
        geo(|r| r.0),
        geo(|r| r.1)
    );
}

fn main() {
    println!(
        "medians of {ROUNDS} interleaved rounds of ~{} ms each, per engine and request",
        ROUND_NS / 1e6
    );
    // The 200-rule policy of benches/decide.rs, and one whose classify
    // block alone has about 200 rules (so about 200 Cedar policies).
    compare(200);
    compare(300);
}
