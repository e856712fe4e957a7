//! The wait before a request an upstream did not serve goes back to the
//! queue: exponential backoff with jitter, so requests that failed
//! together do not return together, and a flapping replica is not sent a
//! burst at each recovery. The caller bounds it by the request's upstream
//! budget.

use std::time::Duration;

/// The first wait.
pub const RETRY_BASE: Duration = Duration::from_millis(25);
/// The longest wait.
pub const RETRY_MAX: Duration = Duration::from_millis(800);

/// The wait before try `n + 1` of a request (`n` ≥ 1 tries so far):
/// `RETRY_BASE × 2^(n-1)`, at most `RETRY_MAX`, of which a random half
/// ("equal jitter": between half and all of it). The jitter is drawn
/// from `seed` (the request's id) and `n`, so a test can repeat it.
pub fn retry_backoff(n: u32, seed: u64) -> Duration {
    let doublings = n.saturating_sub(1).min(16);
    let full = RETRY_BASE.saturating_mul(1u32 << doublings).min(RETRY_MAX);
    let half = full / 2;
    let unit = (mix(seed ^ u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 11) as f64
        / (1u64 << 53) as f64;
    half + half.mul_f64(unit)
}

/// SplitMix64's finaliser: a well-spread 64-bit hash of `x`.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_its_cap_with_at_least_half_kept() {
        for seed in 0..200u64 {
            let mut prev_full = Duration::ZERO;
            for n in 1..12 {
                let d = retry_backoff(n, seed);
                let full = RETRY_BASE.saturating_mul(1 << (n - 1)).min(RETRY_MAX);
                assert!(d >= full / 2 && d <= full, "n={n} seed={seed}: {d:?}");
                assert!(full >= prev_full);
                prev_full = full;
            }
        }
        assert_eq!(retry_backoff(3, 7), retry_backoff(3, 7));
        assert!(retry_backoff(u32::MAX, 1) <= RETRY_MAX);
    }

    #[test]
    fn requests_that_failed_together_spread_out() {
        let waits: std::collections::BTreeSet<_> =
            (0..100u64).map(|id| retry_backoff(4, id)).collect();
        assert!(waits.len() > 90, "{}", waits.len());
    }
}
