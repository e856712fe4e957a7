//! Promises that account for the queue: how long a batch takes is the
//! scheduler's estimate for its own items *plus* every accepted batch run
//! ahead of it, on the share of its tier its tenant gets, no faster than
//! the tenant's quotas let it.
//!
//! Batches are planned in groups: one tenant's batches in one tier. A
//! group's share of its tier is its tenant's weight among the tenants with
//! batches there (the scheduler's fair share between them); a group's
//! batches run one after the other in the order [`crate::batch::plan`]
//! gives (earliest deadline first, the newest batch giving way when a
//! window cannot be met), not side by side. The runner sends items in
//! that order; `POST /v1/batches` plans the new batch with the others and
//! says when it finishes (and refuses it, if `[batch] on_predicted_miss =
//! "refuse"`, when its window cannot be met); the runner re-plans as items
//! finish, calibrating each group's pace with what it observes.

use super::openai::Endpoint;
use super::App;
use crate::batch::plan::{self, Job, Planned};
use crate::batch::store::{Store, StoreError};
use crate::batch::{BatchRow, BatchStatus};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The scheduler's estimate for a batch's kind of item.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// Wall seconds until its first item would start.
    pub start_s: f64,
    /// Wall seconds of its tier's free capacity one item takes, never less
    /// than the tenant's quotas allow.
    pub item_s: f64,
    /// Wall seconds one item takes alone on a replica, start to end.
    pub item_latency_s: f64,
    /// The tier its items classify into.
    pub tier: String,
}

impl Estimate {
    /// Wall seconds until `items` such items would be done, alone, at
    /// most `cap` of them at once (a batch's `kiln_max_in_flight`).
    pub fn secs(&self, items: u64, cap: Option<u32>) -> f64 {
        self.start_s + items as f64 * self.item_s_capped(1.0, cap)
    }

    /// Wall seconds of the group's capacity per item when the batch gets
    /// `share` of it, and no less than its cap allows: `cap` items at a
    /// time, each taking its latency.
    pub fn item_s_capped(&self, share: f64, cap: Option<u32>) -> f64 {
        let by_share = self.item_s / share.max(1e-6);
        match cap {
            Some(c) if c > 0 => by_share.max(self.item_latency_s / f64::from(c)),
            _ => by_share,
        }
    }
}

/// What the planner keeps between passes.
#[derive(Default)]
pub struct Plans {
    estimates: Mutex<HashMap<String, (Estimate, Instant)>>,
    /// What each running batch finished lately (the runner's).
    pub pace: Mutex<HashMap<String, Recent>>,
    /// Per group (tier, tenant): observed over estimated time per item,
    /// last seen. A new batch of a group that ran before is planned at
    /// the pace the group showed, not at the bare estimate. The runner
    /// stores it with each batch's prediction (`pace_ratio`), and a
    /// restarted gateway starts from the stored value.
    ratio: Mutex<HashMap<(String, Option<String>), f64>>,
}

/// What a running batch finished in the last [`PACE_WINDOW`]: how many
/// items, and when the first of them finished.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recent {
    pub items: usize,
    pub since: Instant,
}

/// How far back the runner counts a batch's finished items for its
/// group's pace: long against a batch's start and its tail, short against
/// a change of pace. (It replaced one batch's last 10,000 finish times, 3 s
/// at thousands a second; the ratio still moves 7-20% from one batch to
/// the next on a shared 2-core machine, which is the pace's own.)
pub const PACE_WINDOW: Duration = Duration::from_secs(20);

/// Where the plan puts a batch, and the pace it was planned at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placed {
    pub plan: Planned,
    /// The group's observed over estimated time per item the plan used;
    /// `None`: none observed yet (the bare estimate).
    pub pace_ratio: Option<f64>,
}

impl Plans {
    fn cached(&self, id: &str, fresh_for: Duration) -> Option<Estimate> {
        let m = self.estimates.lock().ok()?;
        let (e, at) = m.get(id)?;
        (at.elapsed() < fresh_for).then(|| e.clone())
    }

    fn keep(&self, id: &str, e: &Estimate) {
        if let Ok(mut m) = self.estimates.lock() {
            m.insert(id.to_string(), (e.clone(), Instant::now()));
        }
    }

    /// Forgets batches no longer active.
    pub fn retain(&self, live: &dyn Fn(&str) -> bool) {
        if let Ok(mut m) = self.estimates.lock() {
            m.retain(|k, _| live(k));
        }
        if let Ok(mut m) = self.pace.lock() {
            m.retain(|k, _| live(k));
        }
    }
}

/// How long an estimate is used before it is asked for again.
const ESTIMATE_FRESH: Duration = Duration::from_secs(10);

/// Plans `rows` (the active batches, in acceptance order; the last may be
/// a new one, not stored yet, whose estimate is `fresh`). Batches not
/// running (cancelling, finalizing) and those the scheduler cannot
/// estimate are left out. What each batch was promised at submission is
/// read from its row (the store keeps it across restarts), and so is its
/// group's pace ratio when this process has not observed one yet.
pub async fn plan_rows(
    app: &Arc<App>,
    rows: &[BatchRow],
    fresh: Option<(&str, &Estimate)>,
) -> HashMap<String, Placed> {
    let plans = &app.batches.plans;
    let mut ests: Vec<Option<Estimate>> = Vec::with_capacity(rows.len());
    for b in rows {
        if !matches!(b.status, BatchStatus::Validating | BatchStatus::InProgress) {
            ests.push(None);
            continue;
        }
        let e = match fresh {
            Some((id, e)) if id == b.id => Some(e.clone()),
            _ => match plans.cached(&b.id, ESTIMATE_FRESH) {
                Some(e) => Some(e),
                None => {
                    let left = b
                        .counts
                        .total
                        .saturating_sub(b.counts.completed + b.counts.failed);
                    let e = estimate(app, b, left).await;
                    if let Some(e) = &e {
                        plans.keep(&b.id, e);
                    }
                    e
                }
            },
        };
        ests.push(e);
    }
    let pace: HashMap<String, Recent> = plans.pace.lock().map(|m| m.clone()).unwrap_or_default();
    let now_i = Instant::now();
    // Today's weights and priorities: an exception's grant counts.
    let today = crate::graph::DecisionGraph::in_force_at(
        &app.policy.load().graph,
        crate::clock::unix_ms() as i64,
    )
    .1;
    let weight = {
        let g = today.clone();
        move |owner: Option<&str>| -> f64 {
            owner
                .and_then(|o| g.tenant_id(o))
                .and_then(|t| g.tenants.get(t as usize))
                .map(|t| t.weight)
                .filter(|w| w.is_finite() && *w > 0.0)
                .unwrap_or(1.0)
        }
    };
    let priority_of = {
        let g = today;
        move |tier: &str| -> i64 {
            g.tier_id(tier)
                .and_then(|t| g.tiers.get(t as usize))
                .map_or(0, |t| t.priority)
        }
    };
    // The tenants with batches in each tier, and their weights.
    let mut tiers: BTreeMap<&str, BTreeMap<Option<&str>, f64>> = BTreeMap::new();
    for (b, e) in rows.iter().zip(&ests) {
        if let Some(e) = e {
            tiers
                .entry(e.tier.as_str())
                .or_default()
                .insert(b.owner.as_deref(), weight(b.owner.as_deref()));
        }
    }
    let mut groups: BTreeMap<(&str, Option<&str>), Vec<usize>> = BTreeMap::new();
    for (i, (b, e)) in rows.iter().zip(&ests).enumerate() {
        if let Some(e) = e {
            groups
                .entry((e.tier.as_str(), b.owner.as_deref()))
                .or_default()
                .push(i);
        }
    }
    let now = crate::clock::unix_ms() / 1000.0;
    let mut out = HashMap::new();
    for ((tier, owner), members) in groups {
        let sum: f64 = tiers.get(tier).map_or(1.0, |t| t.values().sum());
        let tier_priority = priority_of(tier);
        let share = (weight(owner) / sum.max(f64::MIN_POSITIVE)).clamp(0.0, 1.0);
        let eff = |i: usize| {
            ests[i]
                .as_ref()
                .map_or(0.0, |e| e.item_s_capped(share, rows[i].job().max_in_flight))
        };
        // The group's observed pace calibrates the estimate, within a
        // factor of ten: the wall time its batches took lately over the
        // estimated time of what they finished, all of them together (the
        // plan runs the group as one stream of work; one batch's own pace
        // undercounts the group while the next one already takes what the
        // first leaves).
        let observed = group_ratio(
            members
                .iter()
                .filter_map(|&i| pace.get(&rows[i].id).map(|r| (*r, eff(i)))),
            now_i,
        );
        let gkey = (tier.to_string(), owner.map(str::to_string));
        let k = match observed {
            Some(k) => {
                let k = k.clamp(0.1, 10.0);
                if let Ok(mut m) = plans.ratio.lock() {
                    m.insert(gkey, k);
                }
                Some(k)
            }
            _ => {
                let known = plans.ratio.lock().ok().and_then(|m| m.get(&gkey).copied());
                // After a restart: the ratio the group's batches were
                // last planned at (the store's), the most recent first.
                known.or_else(|| {
                    members
                        .iter()
                        .rev()
                        .filter_map(|&i| rows[i].promise.pace_ratio)
                        .find(|k| k.is_finite() && *k > 0.0)
                        .map(|k| k.clamp(0.1, 10.0))
                })
            }
        };
        let running = observed.is_some()
            || members
                .iter()
                .any(|&i| app.batches.in_flight_of(&rows[i].id) > 0);
        let start = if running {
            0.0
        } else {
            members
                .iter()
                .filter_map(|&i| ests[i].as_ref().map(|e| e.start_s))
                .fold(f64::INFINITY, f64::min)
                .max(0.0)
        };
        let jobs: Vec<Job> = members
            .iter()
            .map(|&i| {
                let b = &rows[i];
                let left = b
                    .counts
                    .total
                    .saturating_sub(b.counts.completed + b.counts.failed);
                Job {
                    deadline: b.expires_at as f64,
                    work: left as f64 * eff(i) * k.unwrap_or(1.0),
                    seq: i as u64,
                    promised: b.promise.on_time,
                    priority: b.job().priority_in(tier_priority),
                }
            })
            .collect();
        let start = if start.is_finite() { now + start } else { now };
        for (&i, p) in members.iter().zip(plan::plan(start, &jobs)) {
            out.insert(
                rows[i].id.clone(),
                Placed {
                    plan: p,
                    pace_ratio: k,
                },
            );
        }
    }
    out
}

/// Observed over estimated time for what a group's batches finished
/// lately (`(recent, estimated seconds an item)` each), if that is over
/// a second and 20 items. The first finish counted starts the span and is
/// not counted itself.
pub fn group_ratio(recent: impl Iterator<Item = (Recent, f64)>, now: Instant) -> Option<f64> {
    let (mut items, mut work) = (0usize, 0.0f64);
    let mut first: Option<(Instant, f64)> = None;
    for (r, e) in recent {
        if r.items == 0 || !(e.is_finite() && e > 0.0) {
            continue;
        }
        items += r.items;
        work += r.items as f64 * e;
        if first.is_none_or(|(t, _)| r.since < t) {
            first = Some((r.since, e));
        }
    }
    let (since, e0) = first?;
    let span = now.saturating_duration_since(since).as_secs_f64();
    let work = work - e0;
    (span >= 1.0 && items >= 20 && work > 0.0).then(|| span / work)
}

/// The endpoint of a stored batch.
pub fn endpoint_of(b: &BatchRow) -> Endpoint {
    super::batch_lines::endpoint(&b.endpoint).unwrap_or(Endpoint::Chat)
}

/// Lines of a file sampled for an estimate: evenly spread, at most 64.
pub fn sample_lines(s: &Store, file: &str, lines: u64) -> Result<Vec<String>, StoreError> {
    let n = lines.clamp(1, 64);
    let step = (lines / n).max(1);
    let mut out = Vec::new();
    for i in 0..n {
        if let Some((_, t)) = s.lines(file, i * step, 1)?.into_iter().next() {
            out.push(t);
        }
    }
    Ok(out)
}

/// The scheduler's estimate for the `items` a batch has left, from a
/// sample of its lines.
pub async fn estimate(app: &Arc<App>, b: &BatchRow, items: u64) -> Option<Estimate> {
    let (file, total) = (b.input_file_id.clone(), b.counts.total);
    let sample = app
        .batches
        .store
        .run(move |s| sample_lines(s, &file, total))
        .await
        .ok()?;
    estimate_for_lines(app, &sample, b.owner.as_deref(), endpoint_of(b), items).await
}

/// The scheduler's drain estimate for `items` requests like these input
/// lines (their mean prompt and `max_tokens`), from `tenant`, in wall
/// seconds; each item no faster than the tenant's request and token
/// quotas allow.
pub async fn estimate_for_lines(
    app: &Arc<App>,
    lines: &[String],
    tenant: Option<&str>,
    endpoint: Endpoint,
    items: u64,
) -> Option<Estimate> {
    let mut first: Option<super::openai::GenerationRequest> = None;
    let (mut prompt, mut max, mut n) = (0u64, 0u64, 0u64);
    for line in lines {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let Some(body) = v.get("body") else { continue };
        let Ok(greq) = super::openai::GenerationRequest::from_value(endpoint, body) else {
            continue;
        };
        prompt += app.tokenizer.prompt(&greq, 0).count;
        max += greq
            .requested_max_tokens()
            .unwrap_or(app.config.limits.default_max_tokens);
        n += 1;
        first.get_or_insert(greq);
    }
    let greq = first?;
    let (prompt, max) = (prompt / n.max(1), (max / n.max(1)).max(1));
    let req = crate::graph::Request {
        tenant: tenant.map(str::to_string),
        model: greq.model.clone(),
        headers: std::collections::BTreeMap::from([(
            crate::graph::BATCH_HEADER.to_string(),
            "estimate".to_string(),
        )]),
        tags: vec!["batch".into()],
        prompt_tokens: prompt,
        max_tokens: max,
        ..Default::default()
    };
    let (graph, f) = app.exec.forecast(req, items).await?;
    let f = f?;
    let tier = graph.tiers.get(f.tier as usize)?.name.clone();
    // The tenant's quotas bound its pace whatever the capacity.
    let quota = tenant
        .and_then(|t| graph.tenant_id(t))
        .and_then(|t| graph.tenants.get(t as usize))
        .map(|t| t.quota);
    let floor = quota.map_or(0.0, |q| quota_floor(&q, prompt + max));
    let speed = app.speed;
    Some(Estimate {
        start_s: f.start_secs / speed,
        item_s: f.item_secs.max(floor) / speed,
        item_latency_s: f.item_latency_secs / speed,
        tier,
    })
}

/// The fewest scheduler seconds one item of `tokens` (prompt and output)
/// takes under a tenant's request and token rates.
pub fn quota_floor(q: &crate::graph::Quota, tokens: u64) -> f64 {
    let by_requests = q.requests.filter(|r| *r > 0.0).map_or(0.0, |r| 1.0 / r);
    let by_tokens = q
        .tokens
        .filter(|r| *r > 0.0)
        .map_or(0.0, |r| tokens as f64 / r);
    by_requests.max(by_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_groups_pace_counts_every_batch_finishing_in_it() {
        let now = Instant::now();
        let ago = |s: f64| now.checked_sub(Duration::from_secs_f64(s)).unwrap();
        let rec = |items: usize, s: f64| Recent {
            items,
            since: ago(s),
        };
        // Two batches sharing the group's capacity over the last 4 s: 300
        // and 100 items of 10 ms estimated each. 4 s for (400 - 1) items
        // of 10 ms: the group runs at 4 / 3.99 of its estimate, where
        // the faster batch alone (300 in 4 s) would read 1.33.
        let r = group_ratio(
            [(rec(300, 4.0), 0.01), (rec(100, 2.0), 0.01)].into_iter(),
            now,
        )
        .unwrap();
        assert!((r - 4.0 / 3.99).abs() < 1e-6, "{r}");
        // Items of another shape are weighed by their own estimate.
        let r = group_ratio(
            [(rec(201, 4.0), 0.01), (rec(100, 3.0), 0.02)].into_iter(),
            now,
        )
        .unwrap();
        assert!((r - 1.0).abs() < 1e-6, "{r}");
        // Too little seen: under a second, or under 20 items, or nothing
        // with an estimate.
        let few = |items, s| group_ratio([(rec(items, s), 0.01)].into_iter(), now);
        assert_eq!(few(500, 0.5), None);
        assert_eq!(few(19, 5.0), None);
        assert_eq!(group_ratio([(rec(500, 5.0), 0.0)].into_iter(), now), None);
        // A stall counts: the same items over a longer span read slower.
        assert!(few(100, 10.0).unwrap() > few(100, 5.0).unwrap());
    }

    #[test]
    fn quotas_bound_the_pace() {
        let mut q = crate::graph::Quota {
            tokens: None,
            requests: None,
            concurrent: None,
            gpu_seconds: None,
        };
        assert_eq!(quota_floor(&q, 100), 0.0);
        q.requests = Some(4.0);
        assert_eq!(quota_floor(&q, 100), 0.25);
        q.tokens = Some(100.0);
        assert_eq!(quota_floor(&q, 100), 1.0);
        assert_eq!(quota_floor(&q, 10), 0.25);
    }
}
