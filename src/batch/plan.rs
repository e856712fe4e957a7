//! The order the batches of one group (a tenant's batches in one tier)
//! run in, and when each finishes: the promise `POST /v1/batches` makes.
//!
//! Splitting a group's capacity evenly between its batches turns windows
//! that are feasible one after the other into joint misses (two batches
//! that each need 40 s of a 72 s window both finish at 80 s). The batches
//! of a group run instead one after the other, earliest deadline first,
//! so that every window that can be met is: the Moore–Hodgson rule, with
//! the batch taken out of the on-time set when a window cannot be met
//! being the one accepted last (a promise already made is not broken by
//! a newer batch). Batches out of the on-time set run after it (earliest
//! deadline first among themselves) and are flagged `predicted_miss`.
//! A batch's `kiln_priority` ([`super::job`]) comes before all that: the
//! group's batches run highest priority first, each priority planned as
//! above from where the one before it ends.
//!
//! Pure: the runner and the create endpoint feed it what they know (work
//! left, deadlines, acceptance order) and read back finish times.

/// One batch of a group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Job {
    /// Unix seconds its window ends.
    pub deadline: f64,
    /// Seconds of the group's capacity its unfinished items need.
    pub work: f64,
    /// Acceptance order (the store's `seq`): later is newer.
    pub seq: u64,
    /// What it was promised at submission, where known: `Some(true)` on
    /// time (it stays in the on-time set: a noisy pace later does not
    /// reorder what was promised), `Some(false)` flagged (it runs after).
    pub promised: Option<bool>,
    /// Its `kiln_priority` (else its tier's): higher runs first.
    pub priority: i64,
}

/// Where a job lands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Planned {
    /// Position in the run order (0: runs first).
    pub rank: usize,
    /// Unix seconds it is predicted to finish.
    pub finish: f64,
    /// It cannot be run inside its window without breaking an older
    /// promise (or at all): it runs after the on-time set.
    pub late: bool,
}

/// Plans one group from `start` (unix seconds the group's first item
/// could start); the answer is in the order of `jobs`. Higher
/// [`Job::priority`] runs first (a batch's `kiln_priority`); each
/// priority is planned from where the one above it ends, so a promise
/// holds against newer batches of its own priority or below.
pub fn plan(start: f64, jobs: &[Job]) -> Vec<Planned> {
    let mut levels: Vec<i64> = jobs.iter().map(|j| j.priority).collect();
    levels.sort_unstable_by(|a, b| b.cmp(a));
    levels.dedup();
    let mut order: Vec<(usize, bool)> = Vec::with_capacity(jobs.len());
    let mut t = start;
    for level in levels {
        let idx: Vec<usize> = (0..jobs.len())
            .filter(|&j| jobs[j].priority == level)
            .collect();
        let (on_time, late) = one_level(t, jobs, idx);
        t += on_time
            .iter()
            .chain(&late)
            .map(|&j| jobs[j].work.max(0.0))
            .sum::<f64>();
        order.extend(on_time.into_iter().map(|j| (j, false)));
        order.extend(late.into_iter().map(|j| (j, true)));
    }
    let mut out = vec![
        Planned {
            rank: 0,
            finish: start,
            late: false,
        };
        jobs.len()
    ];
    let mut t = start;
    for (rank, &(j, late)) in order.iter().enumerate() {
        t += jobs[j].work.max(0.0);
        out[j] = Planned {
            rank,
            finish: t,
            late: late || t > jobs[j].deadline,
        };
    }
    out
}

/// One priority's jobs from `start`: the on-time set in run order (earliest
/// deadline first, Moore–Hodgson), then the late ones.
fn one_level(start: f64, jobs: &[Job], mut idx: Vec<usize>) -> (Vec<usize>, Vec<usize>) {
    let by_deadline = |a: &usize, b: &usize| {
        let (x, y) = (&jobs[*a], &jobs[*b]);
        x.deadline.total_cmp(&y.deadline).then(x.seq.cmp(&y.seq))
    };
    idx.sort_by(by_deadline);
    let mut on_time: Vec<usize> = Vec::new();
    let mut late: Vec<usize> = Vec::new();
    let mut t = start;
    for j in idx {
        if jobs[j].promised == Some(false) {
            late.push(j);
            continue;
        }
        on_time.push(j);
        t += jobs[j].work.max(0.0);
        // The prefix before `j` met its windows; while the last one does
        // not, the newest job of the prefix not promised on time goes
        // (each removal only moves the others earlier).
        while on_time.last().is_some_and(|&l| t > jobs[l].deadline) {
            let Some((pos, _)) = on_time
                .iter()
                .enumerate()
                .filter(|(_, &k)| jobs[k].promised != Some(true))
                .max_by_key(|(_, &k)| jobs[k].seq)
            else {
                break;
            };
            let k = on_time.remove(pos);
            t -= jobs[k].work.max(0.0);
            late.push(k);
        }
    }
    late.sort_by(by_deadline);
    (on_time, late)
}

/// How a group's in-flight items are split between its batches, in plan
/// order: each takes what it still needs (`left`) of what the ones
/// before it left over; `even` splits evenly instead (the old rule, kept
/// for comparison).
pub fn shares(cap: usize, left: &[u64], rank: &[usize], even: bool) -> Vec<usize> {
    let n = left.len();
    if n == 0 {
        return Vec::new();
    }
    if even {
        return vec![(cap / n).max(1); n];
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| rank.get(i).copied().unwrap_or(usize::MAX));
    let mut out = vec![0; n];
    let mut room = cap;
    for i in order {
        let take = usize::try_from(left[i]).unwrap_or(usize::MAX).min(room);
        out[i] = take;
        room -= take;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn job(deadline: f64, work: f64, seq: u64) -> Job {
        Job {
            deadline,
            work,
            seq,
            promised: None,
            priority: 0,
        }
    }

    #[test]
    fn a_promise_holds_the_order_a_noisy_pace_would_change() {
        // Promised on time at submission, then the pace looks slower: the
        // promised batch keeps its place; the unpromised newcomer goes.
        let mut a = job(30.0, 40.0, 0);
        a.promised = Some(true);
        let b = job(100.0, 10.0, 1);
        let p = plan(0.0, &[a, b]);
        assert_eq!((p[0].rank, p[1].rank), (0, 1));
        assert!(p[0].late, "its finish is past its window: it says so");
        assert!(!p[1].late);
        let mut c = job(10.0, 1.0, 2);
        c.promised = Some(false);
        let p = plan(0.0, &[job(100.0, 10.0, 0), c]);
        assert_eq!((p[0].rank, p[1].rank), (0, 1));
    }

    #[test]
    fn feasible_only_in_sequence_all_meet_their_windows() {
        // Three batches of 40 s each, windows 50, 90, 130: an even split
        // finishes all three at 120 s (two misses); in order, none misses.
        let jobs = [job(130.0, 40.0, 0), job(50.0, 40.0, 1), job(90.0, 40.0, 2)];
        let p = plan(0.0, &jobs);
        assert!(p.iter().all(|x| !x.late), "{p:?}");
        assert_eq!(p[1].rank, 0);
        assert_eq!(p[1].finish, 40.0);
        assert_eq!(p[2].finish, 80.0);
        assert_eq!(p[0].finish, 120.0);
    }

    #[test]
    fn the_newest_batch_gives_way_and_is_flagged() {
        // Accepted first: 60 s of work in a 70 s window. A newer one with
        // an earlier deadline would break that promise: it is the late one.
        let jobs = [job(70.0, 60.0, 0), job(30.0, 20.0, 1)];
        let p = plan(0.0, &jobs);
        assert!(!p[0].late && p[1].late, "{p:?}");
        assert_eq!(p[0].finish, 60.0);
        assert_eq!(p[1].finish, 80.0);
    }

    #[test]
    fn a_window_no_order_meets_is_late_alone() {
        let p = plan(10.0, &[job(15.0, 10.0, 0)]);
        assert!(p[0].late);
        assert_eq!(p[0].finish, 20.0);
    }

    #[test]
    fn a_higher_priority_runs_first_even_past_an_older_promise() {
        // The tenant steps its older batch back (kiln_priority below the
        // tier's): the newer one runs first, and the older one is told it
        // will now be late.
        let mut old = job(70.0, 60.0, 0);
        old.promised = Some(true);
        old.priority = 10;
        let mut new = job(100.0, 20.0, 1);
        new.priority = 40;
        let p = plan(0.0, &[old, new]);
        assert_eq!((p[1].rank, p[0].rank), (0, 1));
        assert_eq!((p[1].finish, p[0].finish), (20.0, 80.0));
        assert!(p[0].late && !p[1].late, "{p:?}");
    }

    #[test]
    fn shares_go_in_plan_order() {
        assert_eq!(
            shares(100, &[500, 30, 10], &[2, 0, 1], false),
            vec![60, 30, 10]
        );
        assert_eq!(shares(100, &[500, 300], &[0, 1], false), vec![100, 0]);
        assert_eq!(shares(100, &[500, 300], &[0, 1], true), vec![50, 50]);
    }

    proptest! {
        /// Whatever the mix: on-time jobs meet their windows in the plan,
        /// they run before the late ones, finishes are the cumulative
        /// work, and a newcomer never makes an older on-time job late.
        #[test]
        fn promises_hold(raw in proptest::collection::vec((1.0f64..100.0, 1.0f64..400.0), 1..12)) {
            let jobs: Vec<Job> = raw.iter().enumerate()
                .map(|(i, (w, d))| job(*d, *w, i as u64)).collect();
            let p = plan(0.0, &jobs);
            let total: f64 = jobs.iter().map(|j| j.work).sum();
            let last = p.iter().map(|x| x.finish).fold(0.0, f64::max);
            prop_assert!((last - total).abs() < 1e-6);
            let first_late = p.iter().filter(|x| x.late).map(|x| x.rank).min().unwrap_or(usize::MAX);
            for (j, x) in jobs.iter().zip(&p) {
                if !x.late {
                    prop_assert!(x.finish <= j.deadline + 1e-9);
                    prop_assert!(x.rank < first_late);
                }
            }
            // Adding one more job (the newest) at the same priority keeps
            // every earlier promise.
            let mut more = jobs.clone();
            more.push(job(raw[0].1 / 2.0, raw[0].0, jobs.len() as u64));
            let q = plan(0.0, &more);
            for i in 0..jobs.len() {
                if !p[i].late {
                    prop_assert!(!q[i].late, "job {i} lost its promise: {p:?} -> {q:?}");
                }
            }
        }

        /// With priorities: every job of a higher priority runs before any
        /// of a lower one, finishes are still the cumulative work, and each
        /// level keeps the guarantees above among its own jobs.
        #[test]
        fn priorities_order_the_levels(
            raw in proptest::collection::vec((1.0f64..100.0, 1.0f64..400.0, 0i64..3), 1..12)
        ) {
            let jobs: Vec<Job> = raw.iter().enumerate()
                .map(|(i, (w, d, pr))| Job { priority: *pr, ..job(*d, *w, i as u64) }).collect();
            let p = plan(0.0, &jobs);
            let total: f64 = jobs.iter().map(|j| j.work).sum();
            let last = p.iter().map(|x| x.finish).fold(0.0, f64::max);
            prop_assert!((last - total).abs() < 1e-6);
            let mut ranks: Vec<usize> = p.iter().map(|x| x.rank).collect();
            ranks.sort_unstable();
            prop_assert_eq!(ranks, (0..jobs.len()).collect::<Vec<_>>());
            for (a, x) in jobs.iter().zip(&p) {
                for (b, y) in jobs.iter().zip(&p) {
                    if a.priority > b.priority {
                        prop_assert!(x.rank < y.rank, "{p:?}");
                    }
                }
                if !x.late {
                    prop_assert!(x.finish <= a.deadline + 1e-9);
                }
            }
        }
    }
}
