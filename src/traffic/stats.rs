//! Summary of a trace per tenant: count, span, rate, token percentiles.

use super::Record;
use crate::table::{self, Left, Right};
use serde::Serialize;
use std::collections::BTreeMap;

/// Percentiles of a token count (nearest rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
    pub max: u64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `v` (0 for an empty one).
    pub fn of(mut v: Vec<u64>) -> Self {
        v.sort_unstable();
        let at = |q: f64| -> u64 {
            if v.is_empty() {
                return 0;
            }
            let rank = (q * v.len() as f64).ceil() as usize;
            v[rank.clamp(1, v.len()) - 1]
        };
        Percentiles {
            p50: at(0.50),
            p95: at(0.95),
            p99: at(0.99),
            max: v.last().copied().unwrap_or(0),
        }
    }
}

/// One row of the summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// The tenant, else the API key, else `-`; `(all)` for the total.
    pub tenant: String,
    pub count: usize,
    /// From the first to the last arrival, seconds.
    pub duration_s: f64,
    /// Requests per second over this row's own span (its first to its last
    /// arrival); `None` with fewer than two requests, where no rate can be
    /// read off. A tenant active for ten minutes of a day-long trace gets
    /// its rate in those ten minutes.
    pub rate: Option<f64>,
    /// Requests per second over the whole trace's span: the tenant's share
    /// of the trace's load, so the rows add up to `(all)`.
    pub rate_over_trace: f64,
    pub prompt_tokens: Percentiles,
    pub output_tokens: Percentiles,
}

fn summarise(name: String, recs: &[&Record], span_s: f64) -> Stats {
    let first = recs.iter().map(|r| r.at_ms).fold(f64::INFINITY, f64::min);
    let last = recs
        .iter()
        .map(|r| r.at_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if recs.is_empty() {
        0.0
    } else {
        (last - first) / 1000.0
    };
    Stats {
        tenant: name,
        count: recs.len(),
        duration_s,
        rate: (recs.len() >= 2 && duration_s > 0.0).then(|| recs.len() as f64 / duration_s),
        rate_over_trace: if span_s > 0.0 {
            recs.len() as f64 / span_s
        } else {
            0.0
        },
        prompt_tokens: Percentiles::of(recs.iter().map(|r| r.prompt_tokens).collect()),
        output_tokens: Percentiles::of(recs.iter().map(|r| r.output_tokens).collect()),
    }
}

/// One row per tenant (by name), then `(all)`. `rate` is each row's own
/// (over its own span); `rate_over_trace` is over the whole trace, so those
/// add up.
pub fn stats(records: &[Record]) -> Vec<Stats> {
    let mut by: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for r in records {
        let k = r
            .tenant
            .clone()
            .or_else(|| r.api_key.clone())
            .unwrap_or_else(|| "-".into());
        by.entry(k).or_default().push(r);
    }
    let all: Vec<&Record> = records.iter().collect();
    let span_s = summarise("(all)".into(), &all, 0.0).duration_s;
    let mut out: Vec<Stats> = by
        .into_iter()
        .map(|(k, v)| summarise(k, &v, span_s))
        .collect();
    out.push(summarise("(all)".into(), &all, span_s));
    out
}

/// A plain-text table of [`stats`].
pub fn render(rows: &[Stats]) -> String {
    let mut t = table::new(&[
        ("tenant", Left),
        ("requests", Right),
        ("span s", Right),
        ("req/s", Right),
        ("trace req/s", Right),
        ("prompt p50/p95/p99/max", Right),
        ("output p50/p95/p99/max", Right),
    ]);
    let p = |x: &Percentiles| format!("{}/{}/{}/{}", x.p50, x.p95, x.p99, x.max);
    for r in rows {
        t.add_row(vec![
            r.tenant.clone(),
            r.count.to_string(),
            format!("{:.1}", r.duration_s),
            r.rate
                .map_or_else(|| "-".to_string(), |x| format!("{x:.3}")),
            format!("{:.3}", r.rate_over_trace),
            p(&r.prompt_tokens),
            p(&r.output_tokens),
        ]);
    }
    table::render(&t, "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_tenant_rows_and_total() {
        let mk = |at_ms: f64, t: &str, p: u64| Record {
            at_ms,
            tenant: Some(t.into()),
            prompt_tokens: p,
            ..Record::default()
        };
        let recs: Vec<Record> = (0..100)
            .map(|i| mk(i as f64 * 100.0, if i % 4 == 0 { "a" } else { "b" }, i + 1))
            .collect();
        let s = stats(&recs);
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].tenant.as_str(), s[0].count), ("a", 25));
        assert_eq!(s[2].count, 100);
        assert_eq!(
            s[2].prompt_tokens,
            Percentiles {
                p50: 50,
                p95: 95,
                p99: 99,
                max: 100
            }
        );
        assert!((s[2].duration_s - 9.9).abs() < 1e-9);
        assert!((s[0].rate_over_trace + s[1].rate_over_trace - s[2].rate_over_trace).abs() < 1e-9);
        // Tenant a arrives every 400 ms from 0 to 9.6 s: 25 requests over its
        // own 9.6 s, not over the trace's 9.9 s.
        let own = s[0].rate.unwrap_or_default();
        assert!((own - 25.0 / 9.6).abs() < 1e-9, "{own}");
        assert!(render(&s).contains("trace req/s"));
        assert!(render(&s).contains("(all)"));
        assert_eq!(stats(&[]).len(), 1);
    }

    #[test]
    fn a_tenant_active_for_part_of_the_trace_gets_its_own_rate() {
        // One tenant busy for the first 10 s at 10 req/s, another trickling
        // over an hour: the busy one's rate is 10/s, not 100 over an hour.
        let mut recs: Vec<Record> = (0..100)
            .map(|i| Record {
                at_ms: f64::from(i) * 100.0,
                tenant: Some("burst".into()),
                ..Record::default()
            })
            .collect();
        recs.extend((0..=6).map(|i| Record {
            at_ms: f64::from(i) * 600_000.0,
            tenant: Some("slow".into()),
            ..Record::default()
        }));
        recs.push(Record {
            at_ms: 5.0,
            tenant: Some("once".into()),
            ..Record::default()
        });
        let s = stats(&recs);
        let row = |n: &str| s.iter().find(|r| r.tenant == n).cloned();
        let burst = row("burst").unwrap_or_else(|| panic!("burst row"));
        assert!((burst.rate.unwrap_or_default() - 100.0 / 9.9).abs() < 1e-9);
        assert!((burst.rate_over_trace - 100.0 / 3600.0).abs() < 1e-9);
        // One request has no rate of its own.
        assert_eq!(row("once").map(|r| r.rate), Some(None));
        assert!(render(&s)
            .lines()
            .any(|l| l.starts_with("once") && l.contains(" - ")));
    }
}
