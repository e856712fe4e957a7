//! Routing: which replica of a request's route it is sent to when it is
//! queued. Pure: the scheduler describes each candidate replica (what its
//! prefix cache would save this request, how long the request would wait
//! there), the router chooses, and says how long the request is held for
//! that replica before any other may take it.
//!
//! - `kiln` (the default) scores a replica by the prefill time its cached
//!   prefix saves minus the time the request would queue there (the
//!   precise prefix-cache scorer plus the load scorer of llm-d's inference
//!   scheduler), and holds the request for the winner for twice the wait
//!   it expects there plus the saving (capped at [`MAX_HOLD`], at least
//!   [`MIN_HOLD`]): until the estimate is clearly wrong, no other replica
//!   takes it (stealing sooner is FIFO across replicas, which under
//!   overload serves the requests that have already waited longest);
//!   after that any replica of the route may take it. Tiers without
//!   `prefix_affinity` are not routed under `kiln` (the scheduler does not
//!   ask): they wait in their pool's queue and the first replica with room
//!   takes them.
//! - `round-robin`, `least-loaded` and `random` are the baselines of an
//!   external router: they send the request to one replica's endpoint and
//!   it waits there (a strict pin, no stealing), whatever its tier.
//!
//! Prefix caching itself is on in every mode (as vLLM's automatic prefix
//! caching is): routing only decides where a request goes.
//!
//! Ties are never broken by replica index (that piles work on replica 0):
//! the kiln scorer breaks them by load, then by a rotating choice.

use super::{Micros, MS};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// How requests are sent to replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Routing {
    /// Cached-prefix benefit minus expected queueing, soft pin.
    #[default]
    Kiln,
    /// Replicas in turn, strict pin.
    RoundRobin,
    /// The replica where the request would start soonest, strict pin.
    LeastLoaded,
    /// A seeded random replica, strict pin.
    Random,
}

impl Routing {
    pub fn name(self) -> &'static str {
        match self {
            Routing::Kiln => "kiln",
            Routing::RoundRobin => "round-robin",
            Routing::LeastLoaded => "least-loaded",
            Routing::Random => "random",
        }
    }
}

/// The longest a `kiln` soft pin holds a request for its replica.
pub const MAX_HOLD: Micros = 30_000 * MS;
/// The shortest: what a choice by load alone is held for.
pub const MIN_HOLD: Micros = 100 * MS;

/// A replica that could take the request, as the scheduler sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub replica: usize,
    /// Prefill time this replica's cached prefix of the prompt saves.
    pub saved: Micros,
    /// Expected time before the request could start there.
    pub wait: Micros,
    /// Tokens of work already there or pinned to it (a tie-breaker).
    pub load: u64,
}

/// Where the request goes and how long it is held for that replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub replica: usize,
    /// Held for `replica` this long after arrival; [`Micros::MAX`] is a
    /// strict pin.
    pub hold: Micros,
}

/// The router's state: a rotation counter, a cursor over replica indices
/// for ties, and a seeded random stream.
#[derive(Debug, Clone)]
pub struct Router {
    mode: Routing,
    turn: u64,
    /// Ties go to the first tied replica at or after this index (wrapping),
    /// and it moves past the one chosen: a rotation over replicas.
    cursor: usize,
    rng: ChaCha8Rng,
}

impl Router {
    pub fn new(mode: Routing, seed: u64) -> Router {
        Router {
            mode,
            turn: 0,
            cursor: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    pub fn mode(&self) -> Routing {
        self.mode
    }

    /// The next rotation position among `n` (0 when `n` is 0).
    fn rotate(&mut self, n: usize) -> usize {
        let i = (self.turn % n.max(1) as u64) as usize;
        self.turn = self.turn.wrapping_add(1);
        i
    }

    /// Of tied candidates, the next in rotation over replica indices.
    fn next_tied<'c>(&mut self, tied: &[&'c Candidate]) -> Option<&'c Candidate> {
        let cursor = self.cursor;
        let c = tied
            .iter()
            .min_by_key(|c| (c.replica < cursor, c.replica))
            .copied()?;
        self.cursor = c.replica.wrapping_add(1);
        Some(c)
    }

    /// Chooses among `cands` (in replica order). `None` when there are none.
    pub fn choose(&mut self, cands: &[Candidate]) -> Option<Choice> {
        if cands.is_empty() {
            return None;
        }
        let strict = |c: &Candidate| Choice {
            replica: c.replica,
            hold: Micros::MAX,
        };
        match self.mode {
            Routing::RoundRobin => {
                let i = self.rotate(cands.len());
                cands.get(i).map(strict)
            }
            Routing::Random => {
                let i = self.rng.random_range(0..cands.len());
                cands.get(i).map(strict)
            }
            Routing::LeastLoaded => {
                let best = cands.iter().map(|c| (c.wait, c.load)).min()?;
                let tied: Vec<&Candidate> =
                    cands.iter().filter(|c| (c.wait, c.load) == best).collect();
                self.next_tied(&tied).map(strict)
            }
            Routing::Kiln => {
                let score = |c: &Candidate| i128::from(c.saved) - i128::from(c.wait);
                let top = cands.iter().map(score).max()?;
                let mut tied: Vec<&Candidate> = cands.iter().filter(|c| score(c) == top).collect();
                let least = tied.iter().map(|c| c.load).min().unwrap_or(0);
                tied.retain(|c| c.load == least);
                let c = self.next_tied(&tied)?;
                Some(Choice {
                    replica: c.replica,
                    hold: c
                        .saved
                        .saturating_add(c.wait)
                        .saturating_mul(2)
                        .clamp(MIN_HOLD, MAX_HOLD),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(replica: usize, saved: Micros, wait: Micros, load: u64) -> Candidate {
        Candidate {
            replica,
            saved,
            wait,
            load,
        }
    }

    fn pick(r: &mut Router, c: &[Candidate]) -> usize {
        r.choose(c).map(|c| c.replica).unwrap_or(usize::MAX)
    }

    #[test]
    fn kiln_prefers_the_cached_replica_when_idle() {
        let mut r = Router::new(Routing::Kiln, 0);
        let c = [cand(0, 0, 0, 0), cand(1, 80 * MS, 0, 0), cand(2, 0, 0, 0)];
        for _ in 0..5 {
            let ch = r.choose(&c).unwrap();
            assert_eq!(ch.replica, 1);
            assert_eq!(ch.hold, 160 * MS, "held for twice the saving");
        }
        let big = [cand(0, 100 * 1_000 * MS, 0, 0)];
        assert_eq!(r.choose(&big).unwrap().hold, MAX_HOLD);
    }

    #[test]
    fn kiln_moves_off_a_hot_replica_when_waiting_costs_more_than_it_saves() {
        let mut r = Router::new(Routing::Kiln, 0);
        // The cached replica saves 80 ms but has 300 ms of queue.
        let c = [cand(0, 80 * MS, 300 * MS, 9_000), cand(1, 0, 0, 0)];
        assert_eq!(pick(&mut r, &c), 1);
        // With a shorter queue there, the saving wins.
        let c = [cand(0, 80 * MS, 50 * MS, 9_000), cand(1, 0, 0, 0)];
        assert_eq!(pick(&mut r, &c), 0);
    }

    #[test]
    fn ties_are_broken_by_load_then_rotation_not_by_index() {
        let mut r = Router::new(Routing::Kiln, 0);
        let c = [cand(0, 0, 0, 500), cand(1, 0, 0, 100), cand(2, 0, 0, 100)];
        let picks: Vec<usize> = (0..4).map(|_| pick(&mut r, &c)).collect();
        assert!(!picks.contains(&0), "the loaded one loses: {picks:?}");
        assert!(picks.contains(&1) && picks.contains(&2), "{picks:?}");
        // All equal: every replica is chosen in turn.
        let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        let mut seen: Vec<usize> = (0..3).map(|_| pick(&mut r, &c)).collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2]);
        // Nothing cached: held briefly, then any replica may take it.
        assert_eq!(r.choose(&c).unwrap().hold, MIN_HOLD);
    }

    #[test]
    fn least_loaded_takes_the_shortest_wait_strictly() {
        let mut r = Router::new(Routing::LeastLoaded, 0);
        let c = [cand(0, 90 * MS, 40 * MS, 0), cand(1, 0, 10 * MS, 5)];
        let ch = r.choose(&c).unwrap();
        assert_eq!((ch.replica, ch.hold), (1, Micros::MAX));
        let c = [cand(0, 0, 0, 0), cand(1, 0, 0, 0)];
        let a = pick(&mut r, &c);
        let b = pick(&mut r, &c);
        assert_ne!(a, b, "ties rotate");
    }

    #[test]
    fn round_robin_rotates() {
        let mut r = Router::new(Routing::RoundRobin, 0);
        let c = [cand(3, 0, 0, 0), cand(5, 0, 0, 0), cand(7, 0, 0, 0)];
        let picks: Vec<usize> = (0..6).map(|_| pick(&mut r, &c)).collect();
        assert_eq!(picks, vec![3, 5, 7, 3, 5, 7]);
        assert_eq!(r.choose(&c).unwrap().hold, Micros::MAX);
        assert!(r.choose(&[]).is_none());
    }

    #[test]
    fn random_is_reproducible_for_a_seed_and_differs_across_seeds() {
        let c: Vec<Candidate> = (0..8).map(|i| cand(i, 0, 0, 0)).collect();
        let run = |seed| {
            let mut r = Router::new(Routing::Random, seed);
            (0..64).map(|_| pick(&mut r, &c)).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        let picks = run(1);
        assert!(picks.iter().all(|&p| p < 8));
        let mut distinct = picks.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 4, "{distinct:?}");
        assert_eq!(
            Router::new(Routing::Random, 1).choose(&c).map(|c| c.hold),
            Some(Micros::MAX)
        );
    }
}
