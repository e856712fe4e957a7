//! Offered load for experiments: Poisson arrivals per tenant at a chosen
//! rate, request sizes drawn from recorded traffic (so prompt and output
//! lengths are real, only the arrival process is chosen). Seeded, so a run
//! is reproducible; each tenant has its own stream, so adding a tenant
//! does not change the others' arrivals.

use super::Record;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};

/// At most this many arrivals are made, whatever the rates asked for.
pub const MAX_ARRIVALS: usize = 10_000_000;

/// One tenant's offered load.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub tenant: String,
    /// Mean arrivals per second (0 or less: none).
    pub rate_per_s: f64,
}

/// Arrivals of every tenant over `duration_s` seconds, merged by time
/// (ties in tenant order), with sizes drawn uniformly from `sizes`. Empty
/// when `sizes` is empty; at most [`MAX_ARRIVALS`] in all.
pub fn poisson(
    sizes: &[Record],
    model: &str,
    loads: &[Load],
    duration_s: f64,
    seed: u64,
) -> Vec<Record> {
    let mut out: Vec<(f64, usize, Record)> = Vec::new();
    if sizes.is_empty() || !duration_s.is_finite() {
        return Vec::new();
    }
    for (i, l) in loads.iter().enumerate() {
        let Ok(gap) = Exp::new(l.rate_per_s) else {
            continue;
        };
        if !(l.rate_per_s > 0.0 && l.rate_per_s.is_finite()) {
            continue;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ (0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(i as u64 + 1)),
        );
        let mut t = 0.0;
        loop {
            t += gap.sample(&mut rng);
            if t >= duration_s || out.len() >= MAX_ARRIVALS {
                break;
            }
            let s = &sizes[rng.random_range(0..sizes.len())];
            out.push((
                t,
                i,
                Record {
                    at_ms: t * 1000.0,
                    tenant: Some(l.tenant.clone()),
                    model: model.to_string(),
                    prompt_tokens: s.prompt_tokens,
                    max_tokens: s.output_tokens.max(1),
                    output_tokens: s.output_tokens.max(1),
                    ..Record::default()
                },
            ));
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    out.into_iter().map(|(_, _, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes() -> Vec<Record> {
        (1..=10)
            .map(|i| Record {
                prompt_tokens: i * 100,
                output_tokens: i,
                ..Record::default()
            })
            .collect()
    }

    #[test]
    fn rates_are_kept_and_runs_reproduce() {
        let loads = vec![
            Load {
                tenant: "a".into(),
                rate_per_s: 10.0,
            },
            Load {
                tenant: "b".into(),
                rate_per_s: 40.0,
            },
        ];
        let r = poisson(&sizes(), "m", &loads, 100.0, 7);
        let n = |t: &str| r.iter().filter(|x| x.tenant.as_deref() == Some(t)).count() as f64;
        assert!((n("a") - 1000.0).abs() < 150.0, "{}", n("a"));
        assert!((n("b") - 4000.0).abs() < 300.0, "{}", n("b"));
        assert!(r.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert_eq!(r, poisson(&sizes(), "m", &loads, 100.0, 7));
        assert_ne!(r, poisson(&sizes(), "m", &loads, 100.0, 8));
        // Adding a tenant leaves the others' arrivals as they were.
        let mut more = loads.clone();
        more.push(Load {
            tenant: "c".into(),
            rate_per_s: 5.0,
        });
        let r2 = poisson(&sizes(), "m", &more, 100.0, 7);
        let only_a = |v: &[Record]| {
            v.iter()
                .filter(|x| x.tenant.as_deref() == Some("a"))
                .map(|x| x.at_ms)
                .collect::<Vec<_>>()
        };
        assert_eq!(only_a(&r), only_a(&r2));
    }

    #[test]
    fn hostile_inputs_give_nothing_rather_than_hang() {
        let bad = [0.0, -1.0, f64::NAN, f64::INFINITY];
        for rate in bad {
            let loads = vec![Load {
                tenant: "a".into(),
                rate_per_s: rate,
            }];
            assert!(poisson(&sizes(), "m", &loads, 10.0, 0).is_empty(), "{rate}");
        }
        let loads = vec![Load {
            tenant: "a".into(),
            rate_per_s: 1.0,
        }];
        assert!(poisson(&[], "m", &loads, 10.0, 0).is_empty());
        assert!(poisson(&sizes(), "m", &loads, f64::INFINITY, 0).is_empty());
    }
}
