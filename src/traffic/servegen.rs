//! ServeGen per-client arrival statistics → requests.
//!
//! A ServeGen directory holds one `chunk-<client>-trace.csv` per client
//! (tenant), no header, one row per window (600 s over 14 days):
//! `window_start_s, rate_req_per_s, cv, distribution, param1, param2`, where
//! `distribution` is `Gamma`, `Weibull` or empty (idle, rate 0).
//!
//! `param1` and `param2` are the shape and the scale (seconds) of the
//! inter-arrival distribution fitted to the window, as scipy names them:
//! for Gamma rows `1/sqrt(param1)` equals the recorded cv and
//! `param1 * param2` equals `1/rate` (to within 3% for 80% of the rows of
//! `language-m-small`), so Gamma(shape = param1, scale = param2). For
//! Weibull rows param1 is the shape k and param2 the scale, but the fitted
//! mean `param2 * Γ(1 + 1/k)` misses `1/rate` by 20% at the median. So
//! kiln keeps the fitted *shape* (the burstiness) and sets the scale so the
//! mean inter-arrival time is exactly `1/rate` (the measured request count):
//! Gamma scale `1/(rate·k)`, Weibull scale `1/(rate·Γ(1+1/k))`. A row with a
//! positive rate but no usable distribution gets Gamma(1/cv², cv²/rate)
//! (Poisson when cv is 0).
//!
//! Arrivals in a window start at the window's start and follow drawn
//! inter-arrival times until the window ends. Each (client, window) has its
//! own random stream (ChaCha8, seeded from `--seed` and the client id, the
//! stream number from the window), so a window's arrivals do not depend on
//! which other windows or clients are generated: `--start`/`--duration`
//! cut the same arrivals out of the same 14 days.
//!
//! Request sizes (prompt, output and max tokens) are sampled uniformly, with
//! replacement, from another kiln trace (`--sizes-from`), with a second
//! stream of the same (client, window). Prefix blocks are not copied: a
//! prefix shared across tenants would be invented.

use super::import::{each_line, field, fields, Mapping};
use super::{At, Kind, Loaded, Record, TrafficError};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Gamma, Weibull};
use std::path::{Path, PathBuf};

/// Which clients to generate.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Clients {
    #[default]
    All,
    /// The N clients with the lowest ids.
    First(usize),
    /// These client ids.
    Ids(Vec<u64>),
}

/// ServeGen generation options (the mapping gives model, headers, …).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub seed: u64,
    /// Seconds from the start of the 14 days.
    pub start_s: f64,
    /// Seconds of traffic to generate from `start_s`.
    pub duration_s: f64,
    pub clients: Clients,
    /// Tenant of client N is `<tenant_prefix>N`.
    pub tenant_prefix: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            seed: 0,
            start_s: 0.0,
            duration_s: 3600.0,
            clients: Clients::All,
            tenant_prefix: "client-".into(),
        }
    }
}

/// One window of one client.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    pub start_s: f64,
    pub rate: f64,
    pub cv: f64,
    pub distribution: String,
    pub param1: Option<f64>,
    pub param2: Option<f64>,
}

/// The default window length, for a client's last row.
const WINDOW_S: f64 = 600.0;

/// The `chunk-<id>-trace.csv` files of `dir`, by client id.
pub fn client_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, TrafficError> {
    let rd = std::fs::read_dir(dir).map_err(|e| TrafficError::io(dir, e))?;
    let mut out = Vec::new();
    for e in rd {
        let p = e.map_err(|e| TrafficError::io(dir, e))?.path();
        let id = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("chunk-"))
            .and_then(|n| n.strip_suffix("-trace.csv"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(id) = id {
            out.push((id, p));
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(TrafficError::Invalid(format!(
            "{}: no ServeGen client traces (chunk-<id>-trace.csv) found",
            dir.display()
        )));
    }
    Ok(out)
}

/// Reads one client's windows.
pub fn read_windows(path: &Path, skip: bool) -> Result<(Vec<Window>, Vec<usize>), TrafficError> {
    let mut out = Vec::new();
    let skipped = each_line(path, Kind::Servegen, skip, |at| {
        out.push(parse_window(at)?);
        Ok(())
    })?;
    Ok((out, skipped))
}

fn parse_window(at: &At<'_>) -> Result<Window, TrafficError> {
    let f = fields(at.text);
    if f.len() != 6 {
        return Err(at.whole(
            format!("expected 6 comma-separated fields, found {}", f.len()),
            "this row",
        ));
    }
    let num = |i: usize, name: &str| -> Result<f64, TrafficError> {
        let v: f64 = field(at, f[i], name, "a number")?;
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(at.error(
                f[i].0,
                f[i].1.len().max(1),
                format!("{name}: expected a non-negative number, found `{}`", f[i].1),
                "out of range",
            ))
        }
    };
    let opt = |i: usize, name: &str| -> Result<Option<f64>, TrafficError> {
        if f[i].1.trim().is_empty() {
            Ok(None)
        } else {
            num(i, name).map(Some)
        }
    };
    let distribution = f[3].1.trim().to_string();
    if !matches!(distribution.as_str(), "" | "Gamma" | "Weibull") {
        return Err(at.error(
            f[3].0,
            f[3].1.len().max(1),
            format!("distribution: expected `Gamma`, `Weibull` or nothing, found `{distribution}`"),
            "unknown distribution",
        ));
    }
    Ok(Window {
        start_s: num(0, "window_start_s")?,
        rate: num(1, "rate_req_per_s")?,
        cv: opt(2, "cv")?.unwrap_or(0.0),
        distribution,
        param1: opt(4, "param1")?,
        param2: opt(5, "param2")?,
    })
}

/// Inter-arrival times of one window, mean `1/rate` (see the module docs).
#[derive(Debug, Clone, Copy)]
pub enum Interarrival {
    Gamma(Gamma<f64>),
    Weibull(Weibull<f64>),
}

impl Interarrival {
    /// `None` when the rate is not positive.
    pub fn for_window(w: &Window) -> Option<Interarrival> {
        let rate = w.rate;
        if !(rate.is_finite() && rate > 0.0) {
            return None;
        }
        let shape = w.param1.filter(|k| k.is_finite() && *k > 0.0);
        let fitted = match (w.distribution.as_str(), shape) {
            ("Gamma", Some(k)) => Gamma::new(k, 1.0 / (rate * k))
                .ok()
                .map(Interarrival::Gamma),
            ("Weibull", Some(k)) => {
                let scale = 1.0 / (rate * libm::tgamma(1.0 + 1.0 / k));
                if scale.is_finite() && scale > 0.0 {
                    Weibull::new(scale, k).ok().map(Interarrival::Weibull)
                } else {
                    None
                }
            }
            _ => None,
        };
        fitted.or_else(|| {
            let k = if w.cv > 0.0 { 1.0 / (w.cv * w.cv) } else { 1.0 };
            Gamma::new(k, 1.0 / (rate * k))
                .ok()
                .map(Interarrival::Gamma)
        })
    }

    pub fn sample(&self, rng: &mut ChaCha8Rng) -> f64 {
        match self {
            Interarrival::Gamma(g) => g.sample(rng),
            Interarrival::Weibull(w) => w.sample(rng),
        }
    }
}

/// SplitMix64 finaliser: decorrelates the seed of each client.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn rng(seed: u64, client: u64, stream: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(mix(seed ^ mix(client)));
    r.set_stream(stream);
    r
}

/// Generates one client's arrivals in `[start_s, start_s + duration_s)`,
/// with sizes drawn from `sizes`; `at_ms` is relative to `start_s` (whole
/// microseconds) and not
/// yet time-scaled.
pub fn generate_client(
    client: u64,
    windows: &[Window],
    opts: &Options,
    map: &Mapping,
    sizes: &[Record],
    out: &mut Vec<Record>,
) {
    let end_s = opts.start_s + opts.duration_s;
    let tenant = format!("{}{client}", opts.tenant_prefix);
    for (i, w) in windows.iter().enumerate() {
        let len = match windows.get(i + 1) {
            Some(n) if n.start_s > w.start_s => n.start_s - w.start_s,
            _ => WINDOW_S,
        };
        let w_end = w.start_s + len;
        if w_end <= opts.start_s || w.start_s >= end_s {
            continue;
        }
        let Some(gap) = Interarrival::for_window(w) else {
            continue;
        };
        let mut arrivals = rng(opts.seed, client, 2 * i as u64);
        let mut sizer = rng(opts.seed, client, 2 * i as u64 + 1);
        // A guard against a degenerate distribution drawing zeros forever.
        let cap = (w.rate * len * 100.0).min(1e9) as u64 + 1000;
        let mut t = w.start_s;
        for _ in 0..cap {
            let g = gap.sample(&mut arrivals);
            if !g.is_finite() {
                break;
            }
            t += g.max(0.0);
            if t >= w_end || t >= end_s {
                break;
            }
            if t < opts.start_s {
                continue;
            }
            let Some(size) = sizes.get(sizer.random_range(0..sizes.len().max(1))) else {
                break;
            };
            // Whole microseconds: enough for arrivals, and short lines.
            let at_ms = ((t - opts.start_s) * 1e6).round() / 1e3;
            let mut r = map.record(at_ms, size.prompt_tokens, size.output_tokens);
            if map.max_tokens.is_none() {
                r.max_tokens = size.max_tokens;
            }
            r.tenant = Some(tenant.clone());
            out.push(r);
        }
    }
}

/// Imports a ServeGen directory: arrivals per client for the window of
/// `opts`, sizes sampled from `sizes` (an already imported kiln trace).
pub fn import(
    dir: impl AsRef<Path>,
    map: &Mapping,
    opts: &Options,
    sizes: &[Record],
) -> Result<Loaded, TrafficError> {
    map.check()?;
    if sizes.is_empty() {
        return Err(TrafficError::Invalid(
            "the sizes trace has no records to sample request sizes from".into(),
        ));
    }
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    if !ok(opts.start_s) || !ok(opts.duration_s) {
        return Err(TrafficError::Invalid(
            "--start and --duration must be non-negative numbers of seconds".into(),
        ));
    }
    let mut files = client_files(dir.as_ref())?;
    match &opts.clients {
        Clients::All => {}
        Clients::First(n) => files.truncate(*n),
        Clients::Ids(ids) => {
            if let Some(missing) = ids.iter().find(|id| !files.iter().any(|(f, _)| f == *id)) {
                return Err(TrafficError::Invalid(format!(
                    "{}: no client {missing} (chunk-{missing}-trace.csv)",
                    dir.as_ref().display()
                )));
            }
            files.retain(|(id, _)| ids.contains(id));
        }
    }
    let mut records = Vec::new();
    let mut skipped = Vec::new();
    for (id, path) in &files {
        let (windows, sk) = read_windows(path, map.skip_malformed)?;
        skipped.extend(sk);
        generate_client(*id, &windows, opts, map, sizes, &mut records);
    }
    Ok(Loaded {
        records: map.finish(records),
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(rate: f64, dist: &str, p1: f64) -> Window {
        Window {
            start_s: 0.0,
            rate,
            cv: 1.0,
            distribution: dist.into(),
            param1: Some(p1),
            param2: Some(1.0),
        }
    }

    fn mean_gap(w: &Window) -> f64 {
        let d = Interarrival::for_window(w).unwrap();
        let mut r = rng(1, 2, 3);
        let n = 200_000;
        (0..n).map(|_| d.sample(&mut r)).sum::<f64>() / n as f64
    }

    #[test]
    fn mean_gap_is_one_over_rate() {
        for w in [
            window(4.0, "Gamma", 0.5),
            window(4.0, "Weibull", 0.8),
            window(4.0, "", 0.0),
        ] {
            let m = mean_gap(&w);
            assert!((m - 0.25).abs() < 0.01, "{w:?}: {m}");
        }
        assert!(Interarrival::for_window(&window(0.0, "Gamma", 1.0)).is_none());
    }

    #[test]
    fn parses_rows() {
        let at = |t: &'static str| At {
            kind: Kind::Servegen,
            path: "c.csv",
            line: 1,
            text: t,
        };
        let w = parse_window(&at("600,0,0,,0,0")).unwrap();
        assert_eq!(
            (w.start_s, w.rate, w.distribution.as_str()),
            (600.0, 0.0, "")
        );
        let w = parse_window(&at("1,2.5,1.1,Weibull,0.4,0.01")).unwrap();
        assert_eq!(w.param1, Some(0.4));
        assert!(parse_window(&at("1,2,3,Pareto,1,1")).is_err());
        assert!(parse_window(&at("1,-2,3,Gamma,1,1")).is_err());
        assert!(parse_window(&at("1,2,3")).is_err());
    }

    #[test]
    fn window_arrivals_do_not_depend_on_the_cut() {
        let windows: Vec<Window> = (0..3)
            .map(|i| Window {
                start_s: i as f64 * 600.0,
                ..window(1.0, "Gamma", 0.7)
            })
            .collect();
        let sizes = vec![Record {
            prompt_tokens: 7,
            output_tokens: 3,
            max_tokens: 3,
            ..Record::default()
        }];
        let map = Mapping::new("m");
        let gen = |start_s: f64, duration_s: f64| {
            let mut out = Vec::new();
            let opts = Options {
                start_s,
                duration_s,
                ..Options::default()
            };
            generate_client(5, &windows, &opts, &map, &sizes, &mut out);
            out.iter()
                .map(|r| r.at_ms + start_s * 1000.0)
                .collect::<Vec<_>>()
        };
        let all = gen(0.0, 1800.0);
        let middle = gen(600.0, 600.0);
        assert!(!middle.is_empty());
        let expect: Vec<f64> = all
            .iter()
            .copied()
            .filter(|t| (600_000.0..1_200_000.0).contains(t))
            .collect();
        assert_eq!(middle.len(), expect.len());
        for (a, b) in middle.iter().zip(&expect) {
            assert!((a - b).abs() < 1e-6, "{a} {b}");
        }
    }
}
