//! `kiln diff`

use super::*;
use crate::diff::{self, gate, semantic, traffic as dtraffic, DiffReport};
use std::fmt::Write as _;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiffFormat {
    Human,
    Markdown,
    Json,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy before the change (file or directory).
    pub old: PathBuf,
    /// The policy after the change (file or directory).
    pub new: PathBuf,
    /// Recorded traffic to decide and replay under both policies.
    #[arg(long, num_args = 1..)]
    pub traffic: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = DiffFormat::Human)]
    pub format: DiffFormat,
    /// Write the TTFT distribution per tier, old vs new, as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Fail (exit 1) when a condition holds, e.g. `tier:interactive ttft_p95 +10%`.
    #[arg(long = "fail-if")]
    pub fail_if: Vec<String>,
    /// Roofline calibration (TOML) for the replays.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Skip malformed traffic lines (counted) instead of failing.
    #[arg(long)]
    pub skip_malformed: bool,
    /// Seed (the replay is deterministic; recorded in the report).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(a: Args) -> i32 {
    let gates: Vec<gate::Gate> = match a.fail_if.iter().map(|t| gate::parse(t)).collect() {
        Ok(g) => g,
        Err(e) => return usage_error(&e),
    };
    let old = match compile_one(std::slice::from_ref(&a.old)) {
        Ok((_, g)) => Arc::new(g),
        Err(code) => return code,
    };
    let new = match compile_one(std::slice::from_ref(&a.new)) {
        Ok((_, g)) => Arc::new(g),
        Err(code) => return code,
    };
    let sem = semantic::semantic(&old, &new);
    let mut decisions = None;
    let mut impact = None;
    let mut panels = Vec::new();
    if !a.traffic.is_empty() {
        let records = match load_traffic(&a.traffic, a.skip_malformed) {
            Ok(r) => r,
            Err(code) => return code,
        };
        let (co, cn) = match (
            cost_model(&old, a.calibration.as_ref()),
            cost_model(&new, a.calibration.as_ref()),
        ) {
            (Ok(o), Ok(n)) => (o, n),
            (Err(code), _) | (_, Err(code)) => return code,
        };
        let show = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let Some(run) = diff::dry_run(&old, &new, (&co, &cn), &records, |done, total| {
            if show {
                eprint!("\r{}", super::simulate::progress_bar("replay", done, total));
                if done == total {
                    eprintln!();
                }
            }
        }) else {
            return usage_error("a replay failed");
        };
        decisions = Some(run.decisions);
        impact = Some(run.impact);
        panels = run.ttfts;
    }
    let results: Vec<gate::GateResult> = gates
        .iter()
        .map(|g| gate::evaluate(g, decisions.as_ref(), impact.as_ref()))
        .collect();
    let report = DiffReport {
        semantic: sem,
        decisions,
        impact,
        gates: results,
    };
    if let Some(p) = &a.plot {
        if let Err(e) = std::fs::write(p, diff::plot::svg(&panels)) {
            return usage_error(&format!("cannot write {}: {e}", p.display()));
        }
    }
    let out = match a.format {
        DiffFormat::Human => render(&report, &a, false),
        DiffFormat::Markdown => render(&report, &a, true),
        DiffFormat::Json => match serde_json::to_string_pretty(
            &serde_json::json!({ "seed": a.seed, "diff": report }),
        ) {
            Ok(s) => s + "\n",
            Err(e) => return usage_error(&e.to_string()),
        },
    };
    print!("{out}");
    if report.tripped() {
        EXIT_FINDINGS
    } else {
        EXIT_OK
    }
}

fn fmt_num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e12 {
        format!("{}", x as i64)
    } else {
        format!("{x:.2}")
    }
}

fn fmt_delta(d: &dtraffic::MetricDelta) -> String {
    if d.delta == 0.0 {
        return "=".into();
    }
    let sign = if d.delta > 0.0 { "+" } else { "" };
    match d.pct {
        Some(p) => format!("{sign}{} ({sign}{p:.1}%)", fmt_num(d.delta)),
        None => format!("{sign}{}", fmt_num(d.delta)),
    }
}

/// Human and markdown share one layout; markdown adds table syntax.
fn render(r: &DiffReport, a: &Args, md: bool) -> String {
    let mut s = String::new();
    let h = |s: &mut String, level: usize, t: &str| {
        if md {
            let _ = writeln!(s, "{} {t}\n", "#".repeat(level));
        } else {
            let _ = writeln!(s, "{t}\n{}", "=".repeat(t.chars().count().min(72)));
        }
    };
    h(
        &mut s,
        2,
        &format!("kiln diff: {} → {}", a.old.display(), a.new.display()),
    );
    h(&mut s, 3, "Policy changes");
    if r.semantic.is_empty() {
        s.push_str("No semantic change: the policies compile to the same decisions.\n\n");
    } else if md {
        s.push_str(&semantic::render_markdown(&r.semantic));
        s.push('\n');
    } else {
        s.push_str(&semantic::render_human(&r.semantic));
        s.push('\n');
    }
    if let Some(d) = &r.decisions {
        h(
            &mut s,
            3,
            &format!("Decisions on {} recorded requests", d.requests),
        );
        let kinds: Vec<String> = d.by_kind.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            s,
            "{} of {} requests decided differently{}.\n",
            d.changed,
            d.requests,
            if kinds.is_empty() {
                String::new()
            } else {
                format!(" ({})", kinds.join(", "))
            }
        );
        if !d.transitions.is_empty() {
            if md {
                s.push_str("| change | old | new | requests |\n|---|---|---|---:|\n");
                for t in &d.transitions {
                    let _ = writeln!(s, "| {} | {} | {} | {} |", t.kind, t.old, t.new, t.count);
                }
            } else {
                for t in &d.transitions {
                    let _ = writeln!(
                        s,
                        "  {:<14} {} → {}  ({} requests)",
                        t.kind, t.old, t.new, t.count
                    );
                }
            }
            s.push('\n');
        }
        for x in &d.samples {
            let side = |v: &crate::graph::DecisionView| {
                let rules: Vec<String> = v
                    .rules
                    .iter()
                    .map(|r| format!("{} #{}", r.block, r.index))
                    .collect();
                format!(
                    "tier {}, {}, {} [{}]",
                    v.tier,
                    v.route.as_deref().unwrap_or("no route"),
                    v.admission,
                    rules.join("; ")
                )
            };
            let bullet = if md { "-" } else { " *" };
            let _ = writeln!(
                s,
                "{bullet} request #{} `{}`\n    old: {}\n    new: {}",
                x.index,
                x.request,
                side(&x.old),
                side(&x.new)
            );
        }
        if !d.samples.is_empty() {
            s.push('\n');
        }
    }
    if let Some(i) = &r.impact {
        h(
            &mut s,
            3,
            "Impact (both policies replayed on the same traffic)",
        );
        let show = [
            "ttft_p95_ms",
            "e2e_p95_ms",
            "slo_attainment",
            "goodput_rps",
            "rejected",
            "preemptions",
            "fallbacks",
            "gpu_seconds",
            "cost",
            // per batch
            "completed",
            "deadline_misses",
            "finished_s",
            "deadline_s",
        ];
        let batches = [("batch", &i.batches)];
        let batches = batches.iter().filter(|(_, b)| !b.is_empty());
        for (title, groups) in [("tier", &i.tiers), ("tenant", &i.tenants)]
            .iter()
            .chain(batches)
        {
            if md {
                let _ = writeln!(
                    s,
                    "| {title} | metric | old | new | change |\n|---|---|---:|---:|---:|"
                );
            }
            for g in groups.iter() {
                for m in g
                    .metrics
                    .iter()
                    .filter(|m| show.contains(&m.metric.as_str()))
                {
                    if md {
                        let _ = writeln!(
                            s,
                            "| {} | {} | {} | {} | {} |",
                            g.name,
                            m.metric,
                            fmt_num(m.old),
                            fmt_num(m.new),
                            fmt_delta(m)
                        );
                    } else {
                        let _ = writeln!(
                            s,
                            "  {:<8} {:<16} {:<16} {:>12} → {:<12} {}",
                            title,
                            g.name,
                            m.metric,
                            fmt_num(m.old),
                            fmt_num(m.new),
                            fmt_delta(m)
                        );
                    }
                }
            }
            s.push('\n');
        }
        for m in &i.fleet {
            let _ = writeln!(
                s,
                "{}{}: {} → {} ({})",
                if md { "- " } else { "  " },
                m.metric,
                fmt_num(m.old),
                fmt_num(m.new),
                fmt_delta(m)
            );
        }
        s.push('\n');
    }
    if !r.gates.is_empty() {
        h(&mut s, 3, "Gates");
        for g in &r.gates {
            let mark = if g.tripped { "FAILED" } else { "ok" };
            let _ = writeln!(
                s,
                "{}{mark}: `{}`: {}",
                if md { "- " } else { "  " },
                g.gate,
                g.detail
            );
        }
        s.push('\n');
    }
    s
}
