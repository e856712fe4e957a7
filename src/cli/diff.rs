//! `kiln diff`

use super::*;
use crate::diff::{self, gate, semantic, traffic as dtraffic, DiffReport};
use crate::table::{self, Left, Right};
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
        let bar = super::simulate::Progress::new(
            "replay",
            super::simulate::Progress::stderr_is_terminal(),
            true,
        );
        let Some(run) = diff::dry_run(&old, &new, (&co, &cn), &records, |done, total| {
            bar.set(done, total)
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
        let svg = match diff::plot::svg(&panels) {
            Ok(s) => s,
            Err(e) => return usage_error(&e.to_string()),
        };
        if let Err(e) = std::fs::write(p, svg) {
            return usage_error(&format!("cannot write {}: {e}", p.display()));
        }
    }
    let out = match a.format {
        DiffFormat::Human => render(&report, &a, false),
        DiffFormat::Markdown => render_markdown(&report, &a),
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

/// The metrics the impact tables show, in order.
const SHOWN: [&str; 13] = [
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

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

fn changed(g: &dtraffic::GroupDelta) -> bool {
    g.metrics
        .iter()
        .any(|m| SHOWN.contains(&m.metric.as_str()) && m.delta != 0.0)
}

fn metric<'a>(g: &'a dtraffic::GroupDelta, name: &str) -> Option<&'a dtraffic::MetricDelta> {
    g.metrics.iter().find(|m| m.metric == name)
}

/// The gate verdict, first thing a reviewer reads.
fn verdict(r: &DiffReport) -> String {
    let mut s = String::new();
    if r.gates.is_empty() {
        s.push_str(
            "**Gates: none set** (add `--fail-if` to make this diff a CI check)

",
        );
        return s;
    }
    let tripped = r.gates.iter().filter(|g| g.tripped).count();
    if tripped > 0 {
        let _ = writeln!(
            s,
            "**Gates: FAILED**: {} of {} tripped
",
            tripped,
            r.gates.len()
        );
    } else {
        let _ = writeln!(
            s,
            "**Gates: passed**: all {} held
",
            r.gates.len()
        );
    }
    for g in &r.gates {
        let mark = if g.tripped { "❌ FAILED" } else { "✅ ok" };
        let _ = writeln!(s, "- {mark}: `{}`: {}", g.gate, g.detail);
    }
    s.push('\n');
    s
}

/// One paragraph in plain words: what changes, for which tiers and
/// tenants, and the worst SLO movement.
fn summary(r: &DiffReport) -> String {
    let mut parts: Vec<String> = Vec::new();
    let sem = &r.semantic;
    if sem.changes.is_empty() {
        parts.push("The policies compile to the same decisions.".into());
    } else {
        let mut subjects: Vec<String> = Vec::new();
        for c in &sem.changes {
            let x = format!("`{}`", c.subject);
            if !subjects.contains(&x) {
                subjects.push(x);
            }
        }
        let shown: Vec<String> = subjects.iter().take(4).cloned().collect();
        let more = subjects.len().saturating_sub(shown.len());
        let e = sem.escalations();
        parts.push(format!(
            "This change makes {}{} to {}{}.",
            plural(sem.changes.len(), "policy change", "policy changes"),
            if e > 0 {
                format!(" ({})", plural(e, "escalation", "escalations"))
            } else {
                String::new()
            },
            and_list(&shown),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        ));
    }
    if let Some(d) = &r.decisions {
        let pct = if d.requests > 0 {
            d.changed as f64 * 100.0 / d.requests as f64
        } else {
            0.0
        };
        let kinds: Vec<String> = d.by_kind.iter().map(|(k, v)| format!("{k} {v}")).collect();
        parts.push(format!(
            "Of {} recorded requests, {} ({pct:.1}%) are decided differently{}.",
            d.requests,
            d.changed,
            if kinds.is_empty() {
                String::new()
            } else {
                format!(" ({})", kinds.join(", "))
            }
        ));
    }
    if let Some(i) = &r.impact {
        let names = |gs: &[dtraffic::GroupDelta]| -> Vec<String> {
            gs.iter()
                .filter(|g| changed(g))
                .map(|g| format!("`{}`", g.name))
                .collect()
        };
        let (tiers, tenants) = (names(&i.tiers), names(&i.tenants));
        if tiers.is_empty() && tenants.is_empty() {
            parts.push("Replayed on the same traffic, no tier or tenant moves.".into());
        } else {
            let mut who = Vec::new();
            if !tiers.is_empty() {
                who.push(format!(
                    "{} {}",
                    if tiers.len() == 1 { "tier" } else { "tiers" },
                    and_list(&tiers)
                ));
            }
            if !tenants.is_empty() {
                who.push(format!(
                    "{} {}",
                    if tenants.len() == 1 {
                        "tenant"
                    } else {
                        "tenants"
                    },
                    and_list(&tenants)
                ));
            }
            parts.push(format!(
                "Replayed on the same traffic, it moves {}.",
                and_list(&who)
            ));
            parts.push(worst_slo(&i.tiers));
        }
    }
    let mut s = format!(
        "**Summary.** {}

",
        parts.join(" ")
    );
    if r.impact.is_none() && !r.semantic.is_empty() {
        s.push_str(
            "_No traffic given: pass `--traffic` to replay both policies and see the SLO impact._

",
        );
    }
    s
}

/// The tier whose SLO moves worst: the largest fall in SLO attainment,
/// else the largest relative rise in TTFT p95.
fn worst_slo(tiers: &[dtraffic::GroupDelta]) -> String {
    let fall = tiers
        .iter()
        .filter_map(|g| metric(g, "slo_attainment").map(|m| (g, m)))
        .filter(|(_, m)| m.delta < 0.0)
        .min_by(|a, b| a.1.delta.total_cmp(&b.1.delta));
    let ttft = |g: &dtraffic::GroupDelta| {
        metric(g, "ttft_p95_ms")
            .filter(|m| m.delta != 0.0)
            .map(|m| {
                let change = match m.pct {
                    Some(p) => format!("{p:+.1}%"),
                    None => format!("{:+.0} ms", m.delta),
                };
                format!(
                    "TTFT p95 {} ms → {} ms ({change})",
                    fmt_num(m.old.round()),
                    fmt_num(m.new.round()),
                )
            })
    };
    if let Some((g, m)) = fall {
        let mut s = format!(
            "The worst SLO movement is tier `{}`: SLO attainment {:.1}% → {:.1}% ({:+.1} points)",
            g.name,
            m.old * 100.0,
            m.new * 100.0,
            m.delta * 100.0
        );
        if let Some(t) = ttft(g) {
            s.push_str(&format!(", {t}"));
        }
        s.push('.');
        return s;
    }
    let rise = tiers
        .iter()
        .filter_map(|g| metric(g, "ttft_p95_ms").map(|m| (g, m)))
        .filter(|(_, m)| m.delta > 0.0)
        .max_by(|a, b| {
            let r = |m: &dtraffic::MetricDelta| m.pct.unwrap_or(f64::INFINITY);
            r(a.1).total_cmp(&r(b.1))
        });
    match rise.and_then(|(g, _)| ttft(g).map(|t| (g, t))) {
        Some((g, t)) => format!(
            "No tier's SLO attainment falls; the largest TTFT rise is tier `{}`: {t}.",
            g.name
        ),
        None => "No tier's SLO attainment falls and no TTFT p95 rises.".into(),
    }
}

/// A group's shown metrics, each with the group's name.
fn shown(g: &dtraffic::GroupDelta) -> Vec<(&str, &dtraffic::MetricDelta)> {
    g.metrics
        .iter()
        .filter(|m| SHOWN.contains(&m.metric.as_str()))
        .map(|m| (g.name.as_str(), m))
        .collect()
}

fn md_rows(s: &mut String, title: &str, rows: &[(&str, &dtraffic::MetricDelta)]) {
    let _ = writeln!(
        s,
        "| {title} | metric | old | new | change |\n|---|---|---:|---:|---:|"
    );
    for (name, m) in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} |",
            name,
            m.metric,
            fmt_num(m.old),
            fmt_num(m.new),
            fmt_delta(m)
        );
    }
}

/// For a pull request comment: the verdict and a summary first, then the
/// tables, with what did not change folded away.
fn render_markdown(r: &DiffReport, a: &Args) -> String {
    let mut s = format!(
        "## kiln diff: {} → {}\n\n",
        a.old.display(),
        a.new.display()
    );
    s.push_str(&verdict(r));
    s.push_str(&summary(r));
    s.push_str("### Policy changes\n\n");
    if r.semantic.is_empty() {
        s.push_str("No semantic change: the policies compile to the same decisions.\n\n");
    } else {
        s.push_str(&semantic::render_markdown(&r.semantic));
        s.push('\n');
    }
    if let Some(d) = &r.decisions {
        let _ = writeln!(s, "### Decisions on {} recorded requests\n", d.requests);
        if d.transitions.is_empty() {
            s.push_str("No request is decided differently.\n\n");
        } else {
            s.push_str("| change | old | new | requests |\n|---|---|---|---:|\n");
            for t in &d.transitions {
                let _ = writeln!(s, "| {} | {} | {} | {} |", t.kind, t.old, t.new, t.count);
            }
            s.push('\n');
        }
        if !d.samples.is_empty() {
            let _ = writeln!(
                s,
                "<details><summary>{}</summary>\n",
                plural(
                    d.samples.len(),
                    "sample request, old and new",
                    "sample requests, old and new"
                )
            );
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
                let _ = writeln!(
                    s,
                    "- request #{} `{}`\n    old: {}\n    new: {}",
                    x.index,
                    x.request,
                    side(&x.old),
                    side(&x.new)
                );
            }
            s.push_str("\n</details>\n\n");
        }
    }
    if let Some(i) = &r.impact {
        s.push_str("### Impact (both policies replayed on the same traffic)\n\n");
        let batches = [("batch", "batches", &i.batches)];
        let batches = batches.iter().filter(|(_, _, b)| !b.is_empty());
        for (title, titles, groups) in [
            ("tier", "tiers", &i.tiers),
            ("tenant", "tenants", &i.tenants),
        ]
        .iter()
        .chain(batches)
        {
            let moved: Vec<_> = groups.iter().filter(|g| changed(g)).collect();
            let still: Vec<_> = groups.iter().filter(|g| !changed(g)).collect();
            if moved.is_empty() {
                let _ = writeln!(s, "No {title} moves.\n");
            } else {
                // Changed groups: their moved metrics first; their
                // unchanged ones are folded with the unchanged groups.
                let rows: Vec<_> = moved
                    .iter()
                    .flat_map(|g| shown(g))
                    .filter(|(_, m)| m.delta != 0.0)
                    .collect();
                md_rows(&mut s, title, &rows);
                s.push('\n');
            }
            let same: Vec<_> = moved
                .iter()
                .flat_map(|g| shown(g))
                .filter(|(_, m)| m.delta == 0.0)
                .chain(still.iter().flat_map(|g| shown(g)))
                .collect();
            if !same.is_empty() {
                let mut label = Vec::new();
                if !still.is_empty() {
                    label.push(format!(
                        "{} unchanged {}",
                        still.len(),
                        if still.len() == 1 { title } else { titles }
                    ));
                }
                let within = same
                    .len()
                    .saturating_sub(still.iter().map(|g| shown(g).len()).sum::<usize>());
                if within > 0 {
                    label.push(plural(
                        within,
                        &format!("unchanged metric of the changed {titles}"),
                        &format!("unchanged metrics of the changed {titles}"),
                    ));
                }
                let _ = writeln!(s, "<details><summary>{}</summary>\n", label.join(", "));
                md_rows(&mut s, title, &same);
                s.push_str("\n</details>\n\n");
            }
        }
        s.push_str("Fleet:\n\n");
        for m in &i.fleet {
            let _ = writeln!(
                s,
                "- {}: {} → {} ({})",
                m.metric,
                fmt_num(m.old),
                fmt_num(m.new),
                fmt_delta(m)
            );
        }
        s.push('\n');
    }
    s
}

/// The human layout (markdown has its own, [`render_markdown`]).
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
                let rows = d
                    .transitions
                    .iter()
                    .map(|t| {
                        vec![
                            t.kind.clone(),
                            format!("{} → {}", t.old, t.new),
                            format!("({} requests)", t.count),
                        ]
                    })
                    .collect();
                s.push_str(&table::render(&table::headless(rows, &[]), "  "));
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
            let mut rows = Vec::new();
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
                        rows.push(vec![
                            title.to_string(),
                            g.name.clone(),
                            m.metric.clone(),
                            fmt_num(m.old),
                            format!("→ {}", fmt_num(m.new)),
                            fmt_delta(m),
                        ]);
                    }
                }
            }
            if !md {
                let aligns = [Left, Left, Left, Right];
                s.push_str(&table::render(&table::headless(rows, &aligns), "  "));
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
