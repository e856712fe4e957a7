//! One replica of a fleet that shares state through Redis
//! (`[state] redis = "redis://…"`): the gateway's side of [`crate::shared`].
//!
//! - **Quotas**: before a request reaches the scheduler, the tenant it
//!   names claims one request, its tokens (prompt plus `max_tokens`,
//!   refunded at the end to what it used), a concurrency lease and its
//!   GPU-seconds budget in one atomic script ([`Fleet::claim`]). The
//!   scheduler then counts it in flight without charging its own buckets.
//!   Leases are renewed by the heartbeat and expire a lease's time after a
//!   replica stops (a `kill -9`).
//! - **Policy version**: an activation here is published with a new epoch
//!   and announced on a channel; every replica applies the newest epoch
//!   (on the announcement, or at the latest on its next poll), and a
//!   request that arrives while an announced epoch is being applied waits
//!   for it, so no replica decides with a version the fleet has left.
//! - **Registry**: each replica's heartbeat says which version it runs
//!   (`kiln status`, `GET /admin/replicas`).
//! - **Redis unreachable**: the operator's `on_unavailable`. `local`:
//!   requests are not claimed, the scheduler enforces 1/N of each limit
//!   (N: the live replicas the registry last counted,
//!   [`crate::sched::Scheduler::set_quota_scale`]) from its share of what
//!   the fleet last had left (the scheduler's buckets mirror the fleet's,
//!   [`crate::shared::budget`]); what it spends is reported when Redis
//!   answers again, under an id it keeps until Redis answers, so a report
//!   whose answer was lost is charged once. A claim whose answer was lost
//!   (timed out after the script ran) is taken back once Redis answers
//!   ([`Store::unclaim`]): its request was decided here, and is charged
//!   once. `refuse`: 503 `shared-state-unavailable`. Either way a
//!   metric (`kiln_shared_state_up`) and one log line at each change, and
//!   the next successful call resumes sharing.

use super::config::{OnUnavailable, StateSection};
use super::App;
use crate::graph::{DecisionGraph, Request};
use crate::sched::budget::{BudgetSync, BudgetView};
use crate::sched::quota::{FleetClaim, Scope};
use crate::shared::budget::{Budget, Spend};
use crate::shared::{
    Claimed, Limits, QuotaClaim, QuotaKey, QuotaKind, QuotaSync, ReplicaInfo, Store, StoreConfig,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a request waits for an announced version to be applied here
/// before it is decided by the version in place.
const VERSION_WAIT: Duration = Duration::from_secs(2);

pub struct Fleet {
    /// Shared with governance, which keeps its records in the same store.
    pub store: Arc<Store>,
    pub on_unavailable: OnUnavailable,
    /// `[state] replicas`: the fewest replicas the fleet runs (an
    /// autoscaler's minimum): the registry's count is never taken below
    /// it, so a replica that counted only itself before Redis went away
    /// (the others not registered yet) does not take the whole quota.
    pub replicas: u32,
    /// The live replicas the registry last counted (this one included).
    live: AtomicU32,
    /// The fleet's last levels of each quota, and what this replica spent
    /// by itself that the fleet has not been told.
    pub budget: Budget,
    /// Policy time per wall time (`[sim] speed`): Redis refills buckets by
    /// its wall clock, so rates are sped up alike.
    speed: f64,
    /// The newest epoch announced, and the one this replica applied.
    pub(super) seen: AtomicU64,
    applied: tokio::sync::watch::Sender<u64>,
    /// Concurrency leases this replica holds: quota → request ids.
    leases: Mutex<BTreeMap<QuotaKey, BTreeSet<String>>>,
    started_ms: u64,
    /// Whether the last heartbeat reached Redis (for the log and gauge).
    was_up: AtomicBool,
    /// A version activated here while Redis was unreachable: announced
    /// as soon as it answers.
    pub(super) unannounced: AtomicBool,
    /// Claims whose answer never came (the call timed out or the
    /// connection dropped, possibly after the script ran): their requests
    /// were decided here and their spending is reported, so each is taken
    /// back from the fleet ([`Store::unclaim`]) once Redis answers.
    unsettled: Mutex<Vec<Unsettled>>,
    /// Claims taken back so far (granted in Redis, answer lost).
    taken_back: AtomicU64,
    /// The graph in force today (its exceptions applied), for the last
    /// policy graph asked about and the day it was made for.
    today: Mutex<Option<Today>>,
}

/// A policy graph, a date, and the graph in force that day.
type Today = (Arc<DecisionGraph>, i32, Arc<DecisionGraph>);

/// A claim whose outcome this replica does not know.
struct Unsettled {
    quotas: Vec<(QuotaKey, Limits)>,
    member: String,
    need: f64,
}

/// At most this many claims of unknown outcome are remembered (each is one
/// request in flight when Redis stopped answering; any beyond are charged
/// twice, as before this was remembered).
const MAX_UNSETTLED: usize = 100_000;

/// What the shared quota said about one request.
pub enum Gate {
    /// Claimed: released when the request ends.
    Claimed(Arc<Claim>),
    /// Nothing to claim (no tenant, or one without limits).
    Free,
    /// Refused by a limit: why (the reason code), the client's message,
    /// and when a retry could pass.
    Refused {
        reason: crate::sched::Reason,
        message: String,
        retry_ms: u64,
    },
    /// Redis did not answer: the gateway applies `on_unavailable`.
    Unavailable,
}

/// One request's claim on the shared quotas that apply to it (its
/// tenant's, its tier's, its model's). Released once: when the scheduler
/// reports how it ended ([`Claim::finish`]), or else when the last holder
/// drops it (charged in full, since what it used is unknown).
pub struct Claim {
    fleet: Arc<Fleet>,
    /// Each quota claimed, its tokens/s, whether it limits GPU-seconds,
    /// and the seconds its buckets hold.
    quotas: Vec<(QuotaKey, f64, bool, f64)>,
    member: String,
    need: f64,
    prompt: f64,
    /// What the scheduler needs to know of it ([`FleetClaim`]).
    scheduled: FleetClaim,
    done: AtomicBool,
}

impl Claim {
    /// What the claim covered beyond the tenant, for the scheduler.
    pub fn fleet_claim(&self) -> Box<FleetClaim> {
        Box::new(self.scheduled.clone())
    }

    /// Whether it was released already (a request served once and sent
    /// again is not claimed twice, nor released twice).
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// The request ended having produced `output` tokens and used
    /// `gpu_seconds`: refunds the tokens it reserved but did not use.
    pub fn finish(&self, output: u32, gpu_seconds: f64) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let used = self.prompt + f64::from(output);
        self.release((self.need - used).max(0.0), gpu_seconds);
    }

    /// The request was refused before it ran: everything is given back.
    pub fn refund(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.release(self.need, 0.0);
        }
    }

    fn release(&self, refund: f64, gpu_seconds: f64) {
        for (q, _, _, _) in &self.quotas {
            self.fleet.forget_lease(q, &self.member);
        }
        let fleet = self.fleet.clone();
        let (quotas, member) = (self.quotas.clone(), self.member.clone());
        // Not awaited by the request: a slow Redis must not hold a response
        // open. An unreachable one lets the lease expire instead.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = fleet
                    .store
                    .release(&quotas, &member, refund, gpu_seconds)
                    .await;
            });
        }
    }
}

impl super::executor::Settle for Claim {
    fn finish(&self, output: u32, gpu_seconds: f64) {
        Claim::finish(self, output, gpu_seconds);
    }

    fn refund(&self) {
        Claim::refund(self);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.release(0.0, 0.0);
        }
    }
}

impl Fleet {
    pub fn open(cfg: &StateSection, speed: f64) -> Result<Arc<Fleet>, crate::shared::StoreError> {
        let store = Arc::new(Store::open(&StoreConfig {
            url: cfg.redis.clone(),
            namespace: cfg.namespace.clone(),
            replica: cfg
                .replica
                .clone()
                .unwrap_or_else(crate::shared::default_replica_name),
            lease: cfg.lease,
            tls: crate::tls::ClientTls {
                ca_file: cfg.ca_file.clone(),
                client_cert: cfg.client_cert.clone(),
                client_key: cfg.client_key.clone(),
            },
        })?);
        let (applied, _) = tokio::sync::watch::channel(0);
        Ok(Arc::new(Fleet {
            store,
            on_unavailable: cfg.on_unavailable,
            replicas: cfg.replicas.max(1),
            live: AtomicU32::new(0),
            budget: Budget::new(),
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
            seen: AtomicU64::new(0),
            applied,
            leases: Mutex::new(BTreeMap::new()),
            started_ms: crate::clock::unix_ms() as u64,
            was_up: AtomicBool::new(true),
            unannounced: AtomicBool::new(false),
            unsettled: Mutex::new(Vec::new()),
            taken_back: AtomicU64::new(0),
            today: Mutex::new(None),
        }))
    }

    /// The limits in force today: `graph` with the exceptions that cover
    /// today's date in the policy's zone applied, as each replica's
    /// scheduler applies them, so a quota an exception grants holds over
    /// the fleet too. Made once a day per policy version.
    pub fn graph_today(&self, graph: &Arc<DecisionGraph>) -> Arc<DecisionGraph> {
        if graph.exceptions.is_empty() {
            return graph.clone();
        }
        let now = crate::clock::unix_ms() as i64;
        let date = crate::units::calendar::civil_at(now, graph.timezone.as_ref()).date;
        let Ok(mut today) = self.today.lock() else {
            return DecisionGraph::in_force_at(graph, now).1;
        };
        if let Some((base, day, g)) = today.as_ref() {
            if Arc::ptr_eq(base, graph) && *day == date {
                return g.clone();
            }
        }
        let (date, g) = DecisionGraph::in_force_at(graph, now);
        *today = Some((graph.clone(), date, g.clone()));
        g
    }

    /// The fleet's size: the live replicas the registry last counted, at
    /// least `[state] replicas`.
    pub fn size(&self) -> u32 {
        self.live.load(Ordering::Relaxed).max(self.replicas).max(1)
    }

    /// Whether this replica refuses requests now: Redis is unreachable
    /// and the operator chose `on_unavailable = "refuse"`.
    pub fn refusing(&self) -> bool {
        self.on_unavailable == OnUnavailable::Refuse && !self.store.is_up()
    }

    /// The share of each limit one replica enforces alone.
    pub fn local_scale(&self) -> f64 {
        crate::sched::quota::share_of(self.size())
    }

    /// Limits as Redis enforces them: rates per second of its (wall)
    /// clock, sped up by `[sim] speed`.
    fn limits(&self, q: &crate::graph::Quota) -> Limits {
        Limits {
            requests_per_s: q.requests.unwrap_or(0.0) * self.speed,
            tokens_per_s: q.tokens.unwrap_or(0.0) * self.speed,
            concurrent: q.concurrent.unwrap_or(0),
            // A day of wall time holds `speed` days of policy time.
            gpu_seconds_per_day: q.gpu_seconds.map(|s| s * 86_400.0 * self.speed),
            // A bucket holds a minute of policy time.
            bucket_s: 60.0 / self.speed,
        }
    }

    pub fn applied_epoch(&self) -> u64 {
        *self.applied.borrow()
    }

    pub(super) fn set_applied(&self, epoch: u64) {
        self.applied.send_if_modified(|e| {
            if epoch > *e {
                *e = epoch;
                true
            } else {
                false
            }
        });
        self.seen.fetch_max(epoch, Ordering::AcqRel);
    }

    /// Waits (bounded) while an announced policy epoch is being applied
    /// here, so the request is decided by the fleet's version.
    pub async fn wait_for_version(&self) {
        let seen = self.seen.load(Ordering::Acquire);
        if self.applied_epoch() >= seen {
            return;
        }
        let mut rx = self.applied.subscribe();
        let _ = tokio::time::timeout(VERSION_WAIT, rx.wait_for(|e| *e >= seen)).await;
    }

    /// Claims the quotas that apply to `req` for one request needing
    /// `need` tokens, `prompt` of them its prompt: its tenant's (the one it
    /// names), and its tier's and model's as the policy decides them here
    /// (with the live signals a replica has before it queues: if the
    /// scheduler then decides another tier or model, that one is charged
    /// by this replica and reported to the fleet).
    pub async fn claim(
        self: &Arc<Self>,
        graph: &DecisionGraph,
        req: &Request,
        member: &str,
        need: f64,
        prompt: f64,
    ) -> Gate {
        let mut quotas: Vec<QuotaClaim> = Vec::new();
        let mut scheduled = FleetClaim::default();
        let mut tenant_at = None;
        if let Some(t) = req
            .tenant
            .as_deref()
            .and_then(|n| graph.tenant_id(n))
            .and_then(|i| graph.tenants.get(i as usize))
        {
            let limits = self.limits(&t.quota);
            if limits.any() {
                tenant_at = Some(quotas.len());
                quotas.push(self.quota_claim(QuotaKind::Tenant, &t.name, limits));
            }
        }
        let limited = |q: &crate::graph::Quota| self.limits(q).any();
        if graph.tiers.iter().any(|t| limited(&t.quota))
            || graph.models.iter().any(|m| limited(&m.quota))
        {
            let d = graph.decide(req, &crate::graph::Signals::default());
            if let Some(t) = graph.tiers.get(d.tier as usize) {
                let limits = self.limits(&t.quota);
                if limits.any() {
                    scheduled.tier = Some(t.name.clone());
                    quotas.push(self.quota_claim(QuotaKind::Tier, &t.name, limits));
                }
            }
            if let Some(m) = d.target.and_then(|t| graph.models.get(t.model as usize)) {
                let limits = self.limits(&m.quota);
                if limits.any() {
                    scheduled.model = Some(m.name.clone());
                    quotas.push(self.quota_claim(QuotaKind::Model, &m.name, limits));
                }
            }
        }
        if quotas.is_empty() {
            return Gate::Free;
        }
        // Known down: no request waits on a dead store; the heartbeat's
        // next call finds out when it is back.
        if !self.store.is_up() {
            return Gate::Unavailable;
        }
        // Registered before the claim so the heartbeat renews them even if
        // the claim's answer is slow.
        if let Ok(mut l) = self.leases.lock() {
            for q in quotas.iter().filter(|q| q.limits.concurrent > 0) {
                l.entry(q.key.clone())
                    .or_default()
                    .insert(member.to_string());
            }
        }
        let answer = self.store.claim(&quotas, member, need).await;
        let forget = || {
            for q in &quotas {
                self.forget_lease(&q.key, member);
            }
        };
        match answer {
            Ok(Claimed::Granted(levels)) => {
                for (q, l) in quotas.iter().zip(&levels) {
                    self.budget.note(&q.key, *l);
                }
                // The level as this request found it (its own claim given
                // back), as one gateway's policy reads `quota.remaining`
                // before the request's reservation: read after, the
                // request that took the fleet's last token saw 0% and the
                // policy's built-in "quota exhausted" refused it, claimed.
                scheduled.tenant_level = tenant_at.and_then(|i| {
                    let (l, q) = (levels.get(i)?, quotas.get(i)?);
                    Some(found_level(l, &q.limits, need))
                });
                Gate::Claimed(Arc::new(Claim {
                    fleet: self.clone(),
                    quotas: quotas
                        .iter()
                        .map(|q| {
                            (
                                q.key.clone(),
                                q.limits.tokens_per_s,
                                q.limits.gpu_seconds_per_day.is_some(),
                                q.limits.bucket_s,
                            )
                        })
                        .collect(),
                    member: member.to_string(),
                    need,
                    prompt,
                    scheduled,
                    done: AtomicBool::new(false),
                }))
            }
            Ok(Claimed::Refused {
                quota,
                limit,
                retry_ms,
            }) => {
                forget();
                let (reason, message) = refusal(req, quota.as_ref(), &limit);
                Gate::Refused {
                    reason,
                    message,
                    retry_ms,
                }
            }
            Err(_) => {
                forget();
                // The script may have run: if it granted the claim, it is
                // taken back once Redis answers, since this request is now
                // decided (and charged) here.
                if let Ok(mut u) = self.unsettled.lock() {
                    if u.len() < MAX_UNSETTLED {
                        u.push(Unsettled {
                            quotas: quotas.iter().map(|q| (q.key.clone(), q.limits)).collect(),
                            member: member.to_string(),
                            need,
                        });
                    }
                }
                Gate::Unavailable
            }
        }
    }

    /// Takes back every claim whose answer never came and that Redis
    /// granted ([`Store::unclaim`]); those not reached stay for the next
    /// call. False when Redis did not answer.
    async fn settle_unknown(&self) -> bool {
        let list = match self.unsettled.lock() {
            Ok(mut u) if !u.is_empty() => std::mem::take(&mut *u),
            _ => return true,
        };
        let mut left = list.into_iter();
        while let Some(c) = left.next() {
            match self.store.unclaim(&c.quotas, &c.member, c.need).await {
                Ok(true) => {
                    self.taken_back.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {}
                Err(_) => {
                    if let Ok(mut u) = self.unsettled.lock() {
                        u.push(c);
                        u.extend(left);
                    }
                    return false;
                }
            }
        }
        true
    }

    /// Claims Redis granted whose answer never reached this replica, taken
    /// back since it started (each was decided here instead).
    pub fn claims_taken_back(&self) -> u64 {
        self.taken_back.load(Ordering::Relaxed)
    }

    fn quota_claim(&self, kind: QuotaKind, name: &str, limits: Limits) -> QuotaClaim {
        let key = QuotaKey::new(kind, name);
        let seed = self.budget.seed(&key, limits.bucket_s);
        QuotaClaim { key, limits, seed }
    }

    /// Stops renewing `member`'s concurrency lease.
    fn forget_lease(&self, quota: &QuotaKey, member: &str) {
        if let Ok(mut l) = self.leases.lock() {
            if let Some(set) = l.get_mut(quota) {
                set.remove(member);
                if set.is_empty() {
                    l.remove(quota);
                }
            }
        }
    }

    fn lease_snapshot(&self) -> BTreeMap<QuotaKey, Vec<String>> {
        self.leases
            .lock()
            .map(|l| {
                l.iter()
                    .map(|(t, s)| (t.clone(), s.iter().cloned().collect()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The share of each bucket a claim found, from the share it left (`after`)
/// and what it took: one request, `need` tokens.
fn found_level(
    after: &crate::shared::Level,
    limits: &Limits,
    need: f64,
) -> crate::sched::quota::Level {
    let len = crate::shared::bucket_len(limits.bucket_s);
    let back = |share: Option<f64>, rate: f64, took: f64| {
        share.map(|s| {
            let cap = rate * len;
            if cap > 0.0 && took.is_finite() {
                s + took.max(0.0) / cap
            } else {
                s
            }
        })
    };
    crate::sched::quota::Level {
        requests: back(after.requests, limits.requests_per_s, 1.0),
        tokens: back(after.tokens, limits.tokens_per_s, need),
    }
}

/// Why the fleet refused a claim, and what the client is told.
fn refusal(req: &Request, quota: Option<&QuotaKey>, limit: &str) -> (crate::sched::Reason, String) {
    use crate::sched::Reason;
    let tenant = req.tenant.as_deref().unwrap_or("none");
    match (quota.map(|q| (q.kind, q.name.as_str())), limit) {
        (Some((QuotaKind::Tier, name)), _) => (
            Reason::TierQuota,
            format!("tier {name} is over its {limit} quota (counted over every replica)"),
        ),
        (Some((QuotaKind::Model, name)), _) => (
            Reason::ModelQuota,
            format!("model {name} is over its {limit} quota (counted over every replica)"),
        ),
        (_, "concurrency") => (
            Reason::Concurrency,
            format!("tenant {tenant} has as many requests in flight as its quota allows (counted over every replica)"),
        ),
        _ => (
            Reason::Quota,
            format!("tenant {tenant} is over its {limit} quota (counted over every replica)"),
        ),
    }
}

/// Starts the replica's background work: heartbeat (registry, lease
/// renewal, health) and the fair-share and slot exchange. The policy
/// version's sync is [`super::activation::spawn_sync`].
pub fn spawn(app: Arc<App>, fleet: Arc<Fleet>) -> Vec<tokio::task::JoinHandle<()>> {
    let beat = {
        let (app, fleet) = (app.clone(), fleet.clone());
        tokio::spawn(async move { heartbeat(app, fleet).await })
    };
    let share = tokio::spawn(async move { share_sync(app, fleet).await });
    vec![beat, share]
}

/// How often fair-share counters and upstream slots are exchanged: the
/// staleness of a replica's view of the others' service, and the longest a
/// request queued for a shared upstream waits for a slot this replica
/// does not hold yet.
const SHARE_EVERY: Duration = Duration::from_millis(25);

/// Fair share and upstream slots across the fleet: each replica adds the
/// service it charged to the fleet's counters (same decay as its own) and
/// takes back everyone's, so a tenant spreading its requests over replicas
/// is ordered by all it received; and each HTTP upstream's slots are split
/// by who has work for it ([`crate::shared::scripts`]), so the replicas
/// together never send more than its `concurrency`.
async fn share_sync(app: Arc<App>, fleet: Arc<Fleet>) {
    let mut tick = tokio::time::interval(SHARE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Service charged here that Redis has not taken yet (it was down).
    let mut unsent: BTreeMap<(String, u64), Vec<(String, f64)>> = BTreeMap::new();
    let mut ticks = 0u64;
    loop {
        tick.tick().await;
        ticks += 1;
        let Some(view) = app.exec.fleet_view().await else {
            return;
        };
        let g = &view.graph;
        for (scope, spent) in &view.spend {
            if let Some(key) = quota_key(g, *scope) {
                fleet.budget.spent(
                    key,
                    Spend {
                        requests: spent.requests,
                        tokens: spent.tokens,
                        gpu_seconds: spent.gpu_seconds,
                    },
                );
            }
        }
        let tenant_name =
            |t: Option<crate::graph::TenantId>| match t.and_then(|t| g.tenants.get(t as usize)) {
                Some(tn) => tn.name.clone(),
                None => "-".to_string(),
            };
        let queue_name = |key: (u16, u16), tier: crate::graph::TierId| {
            format!(
                "{}.{}",
                g.variant_name(key.0, key.1),
                g.tiers.get(tier as usize).map_or("?", |t| t.name.as_str())
            )
        };
        // Deltas by queue; queues with work waiting are read even without.
        let mut by_queue: BTreeMap<(String, u64), Vec<(String, f64)>> = std::mem::take(&mut unsent);
        let mut ids: BTreeMap<String, ((u16, u16), crate::graph::TierId)> = BTreeMap::new();
        for c in &view.service {
            let q = queue_name(c.key, c.tier);
            ids.insert(q.clone(), (c.key, c.tier));
            let decay = view
                .decays
                .get(c.tier as usize)
                .copied()
                .flatten()
                .unwrap_or(0);
            let e = by_queue.entry((q, decay)).or_default();
            let name = tenant_name(c.tenant);
            match e.iter_mut().find(|(t, _)| *t == name) {
                Some((_, d)) => *d += c.service,
                None => e.push((name, c.service)),
            }
        }
        for (key, tier) in &view.active {
            let q = queue_name(*key, *tier);
            ids.insert(q.clone(), (*key, *tier));
            let decay = view
                .decays
                .get(*tier as usize)
                .copied()
                .flatten()
                .unwrap_or(0);
            by_queue.entry((q, decay)).or_default();
        }
        let mut totals = Vec::new();
        let mut down = !fleet.store.is_up();
        for ((q, decay_us), deltas) in by_queue {
            if down {
                if !deltas.is_empty() {
                    unsent.insert((q, decay_us), deltas);
                }
                continue;
            }
            match fleet.store.share(&q, decay_us / 1000, &deltas).await {
                Ok(all) => {
                    let Some((key, tier)) = ids.get(&q).copied() else {
                        continue;
                    };
                    for (t, service) in all {
                        let tenant = if t == "-" {
                            None
                        } else {
                            match g.tenant_id(&t) {
                                Some(id) => Some(id),
                                None => continue,
                            }
                        };
                        totals.push(crate::sched::queue::ServiceCount {
                            key,
                            tier,
                            tenant,
                            service,
                        });
                    }
                }
                Err(_) => {
                    down = true;
                    if !deltas.is_empty() {
                        unsent.insert((q, decay_us), deltas);
                    }
                }
            }
        }
        // Quotas: what this replica spent by itself goes to the fleet, and
        // the fleet's levels come back (each bucket here mirrors its share).
        let mut quotas = Vec::new();
        if !down && !fleet.settle_unknown().await {
            down = true;
        }
        if !down && (ticks.is_multiple_of(QUOTA_SYNC_TICKS) || fleet.budget.has_unsent()) {
            match sync_quotas(&fleet, g).await {
                Some(q) => quotas = q,
                None => down = true,
            }
        }
        let mut slots = Vec::new();
        for u in &view.upstreams {
            let want = u64::from(u.busy) + u.queued as u64;
            let held = if down {
                None
            } else {
                fleet
                    .store
                    .slots(
                        &u.key,
                        want,
                        u64::from(u.busy),
                        u64::from(u.capacity),
                        &u.tenants,
                        u64::from(u.in_force),
                    )
                    .await
                    .ok()
            };
            let cap = match held {
                Some(n) => n.min(u64::from(u.capacity)) as u32,
                // Redis unreachable: a fixed share, so the fleet together
                // still stays within the upstream's concurrency.
                None => {
                    down = true;
                    u.capacity.div_ceil(fleet.size()).max(1)
                }
            };
            slots.push((u.replica, cap));
        }
        app.exec.send(super::executor::Command::FleetApply {
            graph: view.graph.clone(),
            service: totals,
            slots,
            quotas,
            scale: fleet.local_scale(),
        });
    }
}

/// Every fourth exchange (100 ms), or the next one when spending waits to
/// be reported, quota levels are synced: how stale a replica's picture of
/// the fleet's buckets (its `quota.remaining`, the level it goes on from
/// if Redis becomes unreachable) may get.
const QUOTA_SYNC_TICKS: u64 = 4;

/// The fleet's name of a quota in `g`.
fn quota_key(g: &DecisionGraph, scope: Scope) -> Option<QuotaKey> {
    match scope {
        Scope::Tenant(t) => g
            .tenants
            .get(t as usize)
            .map(|x| QuotaKey::new(QuotaKind::Tenant, &x.name)),
        Scope::Tier(t) => g
            .tiers
            .get(t as usize)
            .map(|x| QuotaKey::new(QuotaKind::Tier, &x.name)),
        Scope::Model(m) => g
            .models
            .get(m as usize)
            .map(|x| QuotaKey::new(QuotaKind::Model, &x.name)),
    }
}

/// Reports what this replica spent by itself and reads every bucketed
/// quota of `g` back; `None` when Redis did not answer (the spending is
/// kept for the next try).
async fn sync_quotas(
    fleet: &Fleet,
    g: &DecisionGraph,
) -> Option<Vec<(Scope, crate::sched::quota::Level)>> {
    let mut scopes: Vec<(Scope, &crate::graph::Quota, QuotaKey)> = Vec::new();
    for (i, t) in g.tenants.iter().enumerate() {
        scopes.push((
            Scope::Tenant(i as crate::graph::TenantId),
            &t.quota,
            QuotaKey::new(QuotaKind::Tenant, &t.name),
        ));
    }
    for (i, t) in g.tiers.iter().enumerate() {
        scopes.push((
            Scope::Tier(i as crate::graph::TierId),
            &t.quota,
            QuotaKey::new(QuotaKind::Tier, &t.name),
        ));
    }
    for (i, m) in g.models.iter().enumerate() {
        scopes.push((
            Scope::Model(i as crate::graph::ModelId),
            &m.quota,
            QuotaKey::new(QuotaKind::Model, &m.name),
        ));
    }
    scopes
        .retain(|(_, q, _)| q.requests.is_some() || q.tokens.is_some() || q.gpu_seconds.is_some());
    // The report is resent whole until Redis answers it, and charged once
    // however often it arrives. Spending of quotas no longer in the
    // policy is dropped.
    let report = fleet.budget.report();
    let items: Vec<QuotaSync> = scopes
        .iter()
        .map(|(_, q, key)| {
            let l = fleet.limits(q);
            let spent = report.spend.get(key).copied().unwrap_or_default();
            QuotaSync {
                key: key.clone(),
                requests_per_s: l.requests_per_s,
                tokens_per_s: l.tokens_per_s,
                spent_requests: spent.requests,
                spent_tokens: spent.tokens,
                spent_gpu_seconds: if l.gpu_seconds_per_day.is_some() {
                    spent.gpu_seconds
                } else {
                    0.0
                },
                seed: fleet.budget.seed(key, l.bucket_s),
                bucket_s: l.bucket_s,
            }
        })
        .collect();
    match fleet.store.sync_quotas(&report.id, &items).await {
        Ok(levels) => {
            fleet.budget.reported(&report.id);
            Some(
                scopes
                    .iter()
                    .zip(levels)
                    .map(|((scope, _, key), l)| {
                        fleet.budget.note(key, l);
                        (
                            *scope,
                            crate::sched::quota::Level {
                                requests: l.requests,
                                tokens: l.tokens,
                            },
                        )
                    })
                    .collect(),
            )
        }
        // Kept for the next try, under the same id.
        Err(_) => None,
    }
}

/// Each money budget's period over the fleet: this replica's spending
/// written, the others' read, so `budget.remaining` reads the fleet's
/// spending against the whole budget on every replica.
async fn sync_budgets(app: &Arc<App>, fleet: &Arc<Fleet>, budgets: &[BudgetView]) {
    let mut out = Vec::with_capacity(budgets.len());
    for b in budgets {
        let key = b.period_key.to_string();
        let parts = [b.scope, b.name.as_str(), b.period, key.as_str()];
        if let Ok((own, others)) = fleet.store.budget(&parts, b.spent).await {
            out.push(BudgetSync {
                scope: b.scope.to_string(),
                name: b.name.clone(),
                period_key: b.period_key,
                own,
                others,
            });
        }
    }
    if !out.is_empty() {
        app.exec.send(super::executor::Command::SyncBudgets(out));
    }
}

async fn heartbeat(app: Arc<App>, fleet: Arc<Fleet>) {
    let every = Duration::from_millis((fleet.store.lease_ms() / 3).max(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let snap = app.exec.snapshot().await;
        let in_flight = snap.as_ref().map_or(0, |s| s.in_flight as u64);
        let info = ReplicaInfo {
            id: fleet.store.replica().to_string(),
            version: app.policy.load().version.to_string(),
            epoch: fleet.applied_epoch(),
            started_unix_ms: fleet.started_ms,
            seen_unix_ms: crate::clock::unix_ms() as u64,
            in_flight,
        };
        let ok = fleet.store.heartbeat(&info).await.is_ok()
            && fleet.store.renew(&fleet.lease_snapshot()).await.is_ok();
        // The fleet's size is the registry's: splits of every quota and
        // upstream while Redis is unreachable follow joins and leaves.
        if ok {
            if let Ok(list) = fleet.store.replicas().await {
                let n = u32::try_from(list.len()).unwrap_or(u32::MAX).max(1);
                fleet.live.store(n, Ordering::Relaxed);
            }
        }
        if ok {
            if let Some(s) = &snap {
                sync_budgets(&app, &fleet, &s.budgets).await;
            }
        }
        app.metrics.shared_state(ok, fleet.store.failures());
        let was = fleet.was_up.swap(ok, Ordering::Relaxed);
        if was != ok {
            match (ok, fleet.on_unavailable) {
                (false, OnUnavailable::Local) => tracing::error!(
                    replica = %fleet.store.replica(),
                    "shared state unreachable: serving with local limits (1/{} of each quota per replica, from the fleet's last levels) until Redis answers",
                    fleet.size()
                ),
                (false, OnUnavailable::Refuse) => tracing::error!(
                    replica = %fleet.store.replica(),
                    "shared state unreachable: refusing requests (503 shared-state-unavailable) until Redis answers"
                ),
                (true, _) => tracing::warn!(
                    replica = %fleet.store.replica(),
                    "shared state reachable again: shared quotas and policy sync resumed"
                ),
            }
        }
    }
}
