//! Reserved shares of shared pools (`tier T { reserve { shared 25% } }`).
//!
//! A reservation is counted in what limits a replica: its batch slots and
//! its KV blocks. On every replica of the pool the tier is owed its share
//! of both (slots rounded up, KV tokens rounded down to whole blocks).
//!
//! - **Lent**: while the tier has no request waiting that the replica could
//!   take, its share is anyone's: other tiers fill the replica as if there
//!   were no reservation, so an idle reservation wastes nothing.
//! - **Reclaimed**: while it has such a request and holds less than its
//!   share there (in the unit that binds the replica at the moment: slots
//!   when a larger part of them is taken than of its KV, else KV), the replica keeps the shortfall for it: work of other
//!   tiers starts only if it leaves the shortfall free ("claims", below),
//!   the reserving tier's request is taken ahead of theirs, and if it still
//!   cannot start for want of room, a borrower (a running sequence of
//!   another tier that is preemptible and not itself inside a reservation
//!   of its own) is preempted through the ordinary requeue path, lowest
//!   priority first. A borrower that is not preemptible is waited out:
//!   since no other tier's work starts into the shortfall, the room comes
//!   back as borrowers finish, within the longest decode among them.
//! - The reserving tier's own sequences inside its share rank above
//!   everything when KV blocks run out (see `make_room`), so what it was
//!   given is not taken back by a higher tier's growing decodes.
//!
//! This is not the "last slots for tenants within their share" rule of
//! `fill` (fairness between tenants of one tier); a reservation is
//! between tiers, and is the policy's.

use super::queue::{Slot, Waiting};
use super::replica::{kv_blocks, Replica, KV_BLOCK_TOKENS};
use super::{Action, Mode, Reason, Scheduler};
use crate::graph::{PoolId, TierId};

/// What a reserving tier lacks of its share on one replica while it has
/// work waiting there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Claim {
    pub tier: TierId,
    pub slots: u32,
    pub kv: u64,
}

/// Sequences and KV tokens (whole blocks) `tier` holds on a replica.
fn held(rep: &Replica, tier: TierId) -> (u32, u64) {
    rep.running
        .iter()
        .filter(|s| s.w.tier == tier)
        .fold((0, 0), |(n, kv), s| {
            (n + 1, kv + s.kv_blocks_held() * u64::from(KV_BLOCK_TOKENS))
        })
}

/// A share (percent) of a replica: batch slots (rounded up, at least
/// one) and KV tokens (whole blocks, rounded down).
fn amount(rep: &Replica, share: f64) -> (u32, u64) {
    let f = (share / 100.0).clamp(0.0, 1.0);
    let slots = (f * f64::from(rep.spec.max_batch)).ceil().max(1.0) as u32;
    let blocks = (f * rep.pool_blocks() as f64).floor() as u64;
    (
        slots.min(rep.spec.max_batch),
        blocks * u64::from(KV_BLOCK_TOKENS),
    )
}

/// Whether `tier` holds less than `share` of replica `rep` in the unit
/// that binds the replica now: batch slots when a larger part of them is
/// taken than of its KV blocks, else KV blocks. (Counted in the other unit,
/// a tier of long prompts would be "satisfied" holding few sequences while
/// slots are what everyone lacks, and the other way round.)
fn short(rep: &Replica, tier: TierId, share: f64) -> bool {
    let (slots, kv) = amount(rep, share);
    let (hs, hk) = held(rep, tier);
    let slot_use = rep.running.len() as f64 / f64::from(rep.spec.max_batch.max(1));
    let kv_use = rep.kv_used() as f64 / rep.pool_tokens().max(1) as f64;
    if slot_use >= kv_use {
        hs < slots
    } else {
        hk < kv
    }
}

impl Scheduler {
    /// The tiers reserving a share of `pool`, with their shares (percent).
    /// Per pool, the tiers reserving a share of it (built once per graph:
    /// [`Self::pool_reserves`] is read on every fill and every step).
    pub(super) fn reserves_of(g: &crate::graph::DecisionGraph) -> Vec<Vec<(TierId, f64)>> {
        let mut out = vec![Vec::new(); g.pools.len()];
        for (t, tier) in g.tiers.iter().enumerate() {
            for r in &tier.reserve {
                if let Some(v) = out.get_mut(r.pool as usize) {
                    v.push((t as TierId, r.share));
                }
            }
        }
        out
    }

    pub(super) fn pool_reserves(&self, pool: PoolId) -> &[(TierId, f64)] {
        if self.cfg.mode != Mode::Kiln {
            return &[];
        }
        self.reserves
            .get(pool as usize)
            .map_or(&[][..], |v| v.as_slice())
    }

    /// The reserved share of `pool` that `tier` holds, percent (0 if none).
    pub(super) fn reserved_share(&self, tier: TierId, pool: PoolId) -> f64 {
        self.graph.tiers.get(tier as usize).map_or(0.0, |t| {
            t.reserve
                .iter()
                .filter(|r| r.pool == pool)
                .map(|r| r.share)
                .sum()
        })
    }

    /// The claims on replica `r` now: each reserving tier with a request
    /// `slot` may take, short of its share there.
    pub(super) fn claims(&self, r: usize, slot: &Slot) -> Vec<Claim> {
        let Some(rep) = self.replicas.get(r) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &(tier, share) in self.pool_reserves(rep.spec.pool) {
            if !self.queues.tier_waits_for(tier, slot, self.now) {
                continue; // lent: it has nothing waiting here
            }
            if short(rep, tier, share) {
                let (slots, kv) = amount(rep, share);
                let (hs, hk) = held(rep, tier);
                out.push(Claim {
                    tier,
                    slots: slots.saturating_sub(hs),
                    kv: kv.saturating_sub(hk),
                });
            }
        }
        out
    }

    /// Whether starting `w` on replica `r` would leave less free than the
    /// other tiers' claims there need.
    pub(super) fn blocked_by_claims(&self, r: usize, w: &Waiting, claims: &[Claim]) -> bool {
        let Some(rep) = self.replicas.get(r) else {
            return false;
        };
        let (mut slots, mut kv) = (0u64, 0u64);
        for c in claims.iter().filter(|c| c.tier != w.tier) {
            slots += u64::from(c.slots);
            kv += c.kv;
        }
        if slots == 0 && kv == 0 {
            return false;
        }
        let need = if rep.spec.external {
            u64::from(w.prompt_tokens) + u64::from(w.output_tokens)
        } else {
            u64::from(w.prompt_tokens) + u64::from(w.generated)
        };
        let need = kv_blocks(need) * u64::from(KV_BLOCK_TOKENS);
        let free_slots = u64::from(rep.free_seq_slots());
        free_slots < slots + 1 || rep.kv_free() < kv.saturating_add(need)
    }

    /// The request to start on replica `r` in place of `w`, a request of
    /// a tier without a claim there: the highest-priority claimant's next
    /// request, `w` going back to the head of its line; else `w` itself,
    /// unless starting it would leave less free than the claims need
    /// (then it goes back, waiting for the reservation, and `None`).
    pub(super) fn claimant_instead(
        &mut self,
        r: usize,
        mut w: Waiting,
        claims: &[Claim],
        slot: Slot,
    ) -> Option<Waiting> {
        let own = w.tier;
        let mut tiers: Vec<TierId> = claims
            .iter()
            .map(|c| c.tier)
            .filter(|&t| t != own)
            .collect();
        let prio = |t: TierId| self.graph.tiers.get(t as usize).map_or(0, |x| x.priority);
        tiers.sort_by_key(|&t| (std::cmp::Reverse(prio(t)), t));
        let now = self.now;
        let blocked = self.blocked_by_claims(r, &w, claims);
        let mut instead = tiers
            .into_iter()
            .find_map(|t| self.queues.pick_in_tier(t, now, slot));
        // A claimant that can neither start nor reclaim room now does not
        // keep `w` out of room its claim does not need.
        if let (Some(x), false) = (&instead, blocked) {
            let rep = &self.replicas[r];
            let cached = rep.cached_prefix_tokens(&x.prefix_blocks);
            let fits = rep.free_seq_slots() > 0 && rep.can_start(x, cached);
            if !fits && !self.may_reclaim(r, x.tier) {
                if let Some(x) = instead.take() {
                    self.queues.push_front(x);
                }
            }
        }
        if instead.is_none() && !blocked {
            return Some(w);
        }
        if blocked
            && matches!(
                w.waiting_for,
                None | Some(Reason::Saturation | Reason::Priority | Reason::Fairness)
            )
        {
            w.waiting_for = Some(Reason::Reservation);
        }
        self.queues.push_front(w);
        instead
    }

    /// Whether running sequence `s` on replica `r` is a borrower that a
    /// request of `tier` may take its reserved share back from: another
    /// tier's, preemptible, not inside a reservation of its own there,
    /// within its thrash budget and able to come back here.
    fn reclaimable(&self, r: usize, s: &super::replica::Seq, tier: TierId) -> bool {
        let Some(rep) = self.replicas.get(r) else {
            return false;
        };
        if rep.spec.external || s.w.tier == tier || s.w.orphan {
            return false;
        }
        let preemptible = s.w.preemptible(&self.graph);
        let own = self.reserved_share(s.w.tier, rep.spec.pool);
        let inside_own = own > 0.0 && {
            let (slots, kv) = amount(rep, own);
            let (hs, hk) = held(rep, s.w.tier);
            hs <= slots && hk <= kv
        };
        preemptible && !inside_own && self.within_thrash_budget(s) && s.kv <= rep.pool_tokens()
    }

    /// Whether `tier` holds less than its reserved share of replica `r`.
    fn short_of_share(&self, r: usize, tier: TierId) -> bool {
        let Some(rep) = self.replicas.get(r) else {
            return false;
        };
        let share = self.reserved_share(tier, rep.spec.pool);
        if share <= 0.0 {
            return false;
        }
        short(rep, tier, share)
    }

    /// The prefill rank a sequence of `tier` starting on replica `r` gets:
    /// above every tier's while its tier is short of its reserved share
    /// there (what it reserved is served as if the pool were its own, its
    /// prompts included), else its tier's ([`Scheduler::rank_of`]).
    pub(super) fn start_rank(&self, r: usize, tier: TierId) -> i64 {
        if self.cfg.mode == Mode::Kiln && self.short_of_share(r, tier) {
            i64::MAX / 2
        } else {
            self.rank_of(tier)
        }
    }

    /// Whether a request of `tier` could start on replica `r` at once by
    /// reclaiming its share (for wait estimates).
    pub(super) fn may_reclaim(&self, r: usize, tier: TierId) -> bool {
        self.cfg.mode == Mode::Kiln
            && self.short_of_share(r, tier)
            && self
                .replicas
                .get(r)
                .is_some_and(|rep| rep.running.iter().any(|s| self.reclaimable(r, s, tier)))
    }

    /// Reclaims room for `w`, whose tier is short of its reserved share of
    /// replica `r`, by preempting the lowest-priority borrower there (the
    /// one that started last among equals). The borrower keeps its place
    /// at the head of its queue, as any preempted sequence does.
    pub(super) fn try_reclaim(&mut self, r: usize, w: &Waiting) -> bool {
        let most = u64::from(w.prompt_tokens) + u64::from(w.output_tokens);
        let Some(rep) = self.replicas.get(r) else {
            return false;
        };
        if rep.spec.external || most > rep.pool_tokens() || !self.short_of_share(r, w.tier) {
            return false;
        }
        let victim = rep
            .running
            .iter()
            .enumerate()
            .filter(|(_, s)| self.reclaimable(r, s, w.tier))
            .min_by_key(|(_, s)| {
                (
                    self.graph
                        .tiers
                        .get(s.w.tier as usize)
                        .map_or(i64::MIN, |t| t.priority),
                    std::cmp::Reverse(s.started),
                )
            })
            .map(|(i, _)| i);
        let Some(i) = victim else {
            return false;
        };
        let mut seq = self.replicas[r].evict(i);
        self.out.push(Action::Preempted {
            id: seq.w.id,
            replica: r,
            by: w.id,
        });
        seq.w.preemptions += 1;
        seq.w.generated = seq.generated;
        seq.w.gpu_seconds = seq.gpu_seconds;
        seq.w.waiting_for = Some(Reason::Reservation);
        self.queues.push_front(seq.w);
        true
    }

    /// Tiers whose sequences on replica `r` are inside their reserved
    /// share (by KV), so none of them is chosen when KV blocks run out.
    pub(super) fn protected_tiers(&self, r: usize) -> Vec<TierId> {
        let Some(rep) = self.replicas.get(r) else {
            return Vec::new();
        };
        self.pool_reserves(rep.spec.pool)
            .iter()
            .copied()
            .filter(|&(t, share)| {
                let (_, kv) = amount(rep, share);
                let (_, hk) = held(rep, t);
                hk <= kv
            })
            .map(|(t, _)| t)
            .collect()
    }

    /// For a wait estimate of a request of `tier` on `replicas`: the mean
    /// share it reserves of them (percent, 0 when none).
    pub(super) fn reserved_of(&self, tier: TierId, replicas: &[usize]) -> f64 {
        if self.cfg.mode != Mode::Kiln || replicas.is_empty() {
            return 0.0;
        }
        let total: f64 = replicas
            .iter()
            .filter_map(|&r| self.replicas.get(r))
            .map(|rep| self.reserved_share(tier, rep.spec.pool))
            .sum();
        total / replicas.len() as f64
    }
}

/// For tests and reports: a replica's share in (slots, KV tokens).
#[cfg(test)]
pub(super) fn share_of(rep: &Replica, share: f64) -> (u32, u64) {
    amount(rep, share)
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::{Action, Event, Reason, Scheduler};
    use crate::graph::DecisionGraph;
    use std::sync::Arc;

    fn policy(bulk: &str, reserve: &str) -> Arc<DecisionGraph> {
        graph(&format!(
            r#"
pool p {{ gpus 1 kind "H100-80GB" memory 80GB }}
model m {{ variant fp16 {{ memory 10GB pools [p] max_batch 4 }} }}
tier bulk {{ priority 50 slo {{ window 1h }} {bulk} }}
tier team {{ priority 10 slo {{ ttft 10s }} {reserve} }}
tenant b {{ owner "o" tiers [bulk] }}
tenant t {{ owner "o" tiers [team] }}
classify {{
  when tenant == t => tier team
  default => tier bulk
}}
route [bulk, team] m {{ default => fp16 }}
"#
        ))
    }

    /// Runs steps until nothing runs or `steps` have passed; every action.
    fn steps(s: &mut Scheduler, n: usize) -> Vec<Action> {
        let mut out = Vec::new();
        for _ in 0..n {
            if !s.replicas[0].busy {
                break;
            }
            let until = s.replicas[0].step_until;
            out.extend(s.handle(until, Event::StepDone { replica: 0 }).to_vec());
        }
        out
    }

    fn started_why(acts: &[Action]) -> Vec<(u64, Option<Reason>)> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Started { id, waited_for, .. } => Some((*id, *waited_for)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_graph_holds_each_reserved_share() {
        let g = policy("preemptible", "reserve { p 50% } fair_share { window 5m }");
        let team = &g.tiers[1];
        assert_eq!(team.reserve.len(), 1);
        assert_eq!((team.reserve[0].pool, team.reserve[0].share), (0, 50.0));
        assert_eq!(team.fair_share_window, Some(300_000.0));
        assert!(g.tiers[0].reserve.is_empty());
        let s = sched(&g);
        assert_eq!(s.pool_reserves(0), &[(1, 50.0)]);
        assert_eq!(super::share_of(&s.replicas[0], 50.0).0, 2);
        assert_eq!(super::share_of(&s.replicas[0], 10.0).0, 1, "rounded up");
    }

    #[test]
    fn an_idle_reservation_is_lent_and_reclaimed_by_preempting_a_borrower() {
        let g = policy("preemptible", "reserve { p 50% }");
        let mut s = sched(&g);
        let mut acts = Vec::new();
        for id in 0..6 {
            acts.extend(arrive(&mut s, 0, arrival(id, "b", "m", 10, 1000)));
        }
        acts.extend(steps(&mut s, 1));
        // Lent: the team has nothing waiting, bulk takes every slot.
        assert_eq!(started(&acts), vec![0, 1, 2, 3]);
        // The team's request reclaims a slot at the next step boundary:
        // a borrower is preempted for it, ahead of the bulk queue.
        let now = s.now();
        arrive(&mut s, now + 1, arrival(10, "t", "m", 10, 5));
        let acts = steps(&mut s, 3);
        let pre: Vec<(u64, u64)> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Preempted { id, by, .. } => Some((*id, *by)),
                _ => None,
            })
            .collect();
        assert_eq!(pre.len(), 1, "{acts:?}");
        assert_eq!(pre[0].1, 10);
        assert_eq!(started(&acts), vec![10]);
        assert!(s.replicas[0].running.iter().any(|x| x.w.id == 10));
        // The borrower waits, for the reservation, and comes back when the
        // team is done.
        let later = steps(&mut s, 2000);
        let back = started_why(&later);
        assert!(
            back.contains(&(pre[0].0, Some(Reason::Reservation))),
            "{back:?}"
        );
    }

    #[test]
    fn a_non_preemptible_borrower_is_waited_out_and_nothing_new_starts_into_the_share() {
        let g = policy("", "reserve { p 50% }");
        let mut s = sched(&g);
        let mut acts = arrive(&mut s, 0, arrival(0, "b", "m", 10, 4));
        for id in 1..8 {
            acts.extend(arrive(&mut s, 0, arrival(id, "b", "m", 10, 1000)));
        }
        acts.extend(steps(&mut s, 1));
        assert_eq!(started(&acts), vec![0, 1, 2, 3]);
        let now = s.now();
        arrive(&mut s, now + 1, arrival(10, "t", "m", 10, 5));
        let acts = steps(&mut s, 30);
        assert!(
            !acts.iter().any(|a| matches!(a, Action::Preempted { .. })),
            "{acts:?}"
        );
        // Request 0 ends after its 4 tokens: its slot goes to the team, not
        // to the bulk work queued before the team's request; bulk gets a
        // slot back only when the team's request is done, having waited
        // for the reservation.
        let at = |f: &dyn Fn(&Action) -> bool| acts.iter().position(f);
        let done0 = at(&|a| matches!(a, Action::Finished { id: 0, .. }));
        let team = at(&|a| matches!(a, Action::Started { id: 10, .. }));
        let done10 = at(&|a| matches!(a, Action::Finished { id: 10, .. }));
        let bulk4 = at(&|a| matches!(a, Action::Started { id: 4, .. }));
        assert!(
            [done0, team, done10, bulk4].iter().all(Option::is_some),
            "{acts:?}"
        );
        assert!(done0 < team && team < done10 && done10 < bulk4, "{acts:?}");
        assert_eq!(
            started_why(&acts),
            vec![
                (10, Some(Reason::Saturation)),
                (4, Some(Reason::Reservation))
            ]
        );
    }

    #[test]
    fn without_a_reserve_the_team_waits_for_the_whole_bulk_queue() {
        let g = policy("preemptible", "");
        let mut s = sched(&g);
        arrive(&mut s, 0, arrival(0, "b", "m", 10, 4));
        for id in 1..8 {
            arrive(&mut s, 0, arrival(id, "b", "m", 10, 1000));
        }
        steps(&mut s, 1);
        let now = s.now();
        arrive(&mut s, now + 1, arrival(10, "t", "m", 10, 5));
        let acts = steps(&mut s, 12);
        assert_eq!(started(&acts), vec![4], "bulk outranks the team");
    }
}
