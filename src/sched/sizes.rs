//! The recent distribution of prompt sizes of a (model, variant, tier):
//! admission's size-neutral reference (see `docs/fair-admission.md`).
//!
//! Why: a tenant pushed far back in fair order sits at the edge of its
//! tier's SLO, and if admission weighed each request's own prefill there,
//! its short prompts would pass where its long ones fail. It would then be
//! served more requests than its weight (of fewer tokens each), and its
//! users with long prompts would be refused first. Admission instead prices
//! every prompt up to a high quantile of recent prompts as if it were that
//! size, so a request's place in fair order, not its length, decides.
//!
//! A log-scale histogram with exponential forgetting by count: constant
//! memory, O(buckets) per quantile, pure (no clock).

/// Buckets per doubling of the prompt size.
const PER_OCTAVE: f64 = 8.0;
/// Sizes up to 2^24 tokens; larger ones share the last bucket.
const BUCKETS: usize = 8 * 24 + 1;
/// Each sample weighs this much more than the one before: the sketch
/// remembers about the last 2,000 prompts.
const GROWTH: f64 = 1.0 + 1.0 / 2048.0;
/// Weights are rescaled before they could lose precision.
const RESCALE_AT: f64 = 1e100;

#[derive(Debug, Clone)]
pub(crate) struct Sizes {
    weight: Vec<f64>,
    total: f64,
    next: f64,
    samples: u64,
}

impl Default for Sizes {
    fn default() -> Self {
        Sizes {
            weight: vec![0.0; BUCKETS],
            total: 0.0,
            next: 1.0,
            samples: 0,
        }
    }
}

fn bucket(tokens: u64) -> usize {
    let t = tokens.max(1) as f64;
    ((t.log2() * PER_OCTAVE) as usize).min(BUCKETS - 1)
}

/// The largest size a bucket holds (its upper edge, rounded down).
fn upper(b: usize) -> u64 {
    (2f64.powf((b as f64 + 1.0) / PER_OCTAVE)).floor().max(1.0) as u64
}

impl Sizes {
    pub(crate) fn record(&mut self, tokens: u64) {
        let b = bucket(tokens);
        self.weight[b] += self.next;
        self.total += self.next;
        self.samples += 1;
        self.next *= GROWTH;
        if self.next > RESCALE_AT {
            let k = 1.0 / self.next;
            for w in &mut self.weight {
                *w *= k;
            }
            self.total *= k;
            self.next = 1.0;
        }
    }

    /// The `q` quantile (0..=1) of recent prompt sizes, in tokens (the
    /// upper edge of its bucket, within 9%); `None` until there are
    /// `min_samples` samples.
    pub(crate) fn quantile(&self, q: f64, min_samples: u64) -> Option<u64> {
        if self.samples < min_samples || self.total <= 0.0 {
            return None;
        }
        let want = q.clamp(0.0, 1.0) * self.total;
        let mut acc = 0.0;
        for (b, w) in self.weight.iter().enumerate() {
            acc += w;
            if acc >= want && *w > 0.0 {
                return Some(upper(b));
            }
        }
        self.weight.iter().rposition(|w| *w > 0.0).map(upper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_a_known_spread() {
        let mut s = Sizes::default();
        assert_eq!(s.quantile(0.9, 1), None);
        // Twenty passes over 100 sizes: recent samples weigh a little
        // more (forgetting), so no long run of one size may dominate.
        for _ in 0..20 {
            for i in 1..=100u64 {
                s.record(i * 100);
            }
        }
        let p90 = s.quantile(0.9, 100).unwrap_or(0) as f64;
        assert!((p90 / 9000.0 - 1.0).abs() < 0.15, "p90 {p90}");
        let p50 = s.quantile(0.5, 100).unwrap_or(0) as f64;
        assert!((p50 / 5000.0 - 1.0).abs() < 0.15, "p50 {p50}");
        assert_eq!(s.quantile(0.9, 2001), None);
    }

    #[test]
    fn forgets_old_sizes() {
        let mut s = Sizes::default();
        for _ in 0..20_000 {
            s.record(100_000);
        }
        for _ in 0..20_000 {
            s.record(100);
        }
        let p90 = s.quantile(0.9, 1).unwrap_or(0);
        assert!(p90 < 120, "p90 {p90}");
    }

    #[test]
    fn extreme_sizes_stay_in_range() {
        let mut s = Sizes::default();
        s.record(0);
        s.record(u64::MAX);
        assert!(s.quantile(1.0, 1).is_some());
        assert_eq!(s.quantile(0.0, 1), Some(1));
    }
}
