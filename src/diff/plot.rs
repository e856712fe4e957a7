//! `--plot FILE.svg`: the TTFT distribution (CDF) of every tier, old policy
//! dashed grey and new solid red, one panel a tier, with the tier's TTFT
//! SLO as a dashed vertical line and both axes labelled with units and
//! ticks, so a reviewer can look rather than read. A tier with no finished
//! request under either policy gets a panel marked "no traffic". Plain,
//! self-contained SVG (no scripts, fonts or links); same inputs, same bytes.

use crate::replay::Outcome;
use std::fmt::Write as _;

const W: f64 = 480.0;
const H: f64 = 250.0;
/// Plot area margins: left (y ticks and title), right, top (panel title
/// and legend), bottom (x ticks and title).
const LEFT: f64 = 62.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 46.0;

/// One tier's panel.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub tier: String,
    /// TTFTs (ms) of the tier's finished requests under each policy.
    pub old: Vec<f64>,
    pub new: Vec<f64>,
    /// The tier's TTFT SLO (ms) under each policy, if it has one.
    pub slo_old: Option<f64>,
    pub slo_new: Option<f64>,
}

fn cdf(v: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    // At most ~200 points: enough for a smooth curve, small files.
    let step = (v.len() / 200).max(1);
    let mut out: Vec<(f64, f64)> = v
        .iter()
        .enumerate()
        .step_by(step)
        .map(|(i, x)| (*x, (i + 1) as f64 / n))
        .collect();
    if let Some(last) = v.last() {
        out.push((*last, 1.0));
    }
    out
}

/// TTFTs in ms of one tier's finished requests.
pub fn ttfts(outcomes: &[Outcome], tier: Option<u16>) -> Vec<f64> {
    outcomes
        .iter()
        .filter(|o| o.tier.is_some() && o.tier == tier)
        .filter_map(|o| o.first_token.map(|f| (f - o.arrival) as f64 / 1000.0))
        .collect()
}

/// A round tick step giving about five ticks up to `max` (> 0).
fn tick_step(max: f64) -> f64 {
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let m = raw / mag;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// `1500` → `1.5k`, `250` → `250`, `0.5` → `0.5`.
fn tick_label(x: f64) -> String {
    if x >= 1000.0 {
        let k = x / 1000.0;
        if k.fract() == 0.0 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        }
    } else if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

fn has_traffic(p: &Panel) -> bool {
    p.old.iter().chain(p.new.iter()).any(|x| x.is_finite())
}

/// Height of the closing line that names the tiers without traffic.
const FOOTER: f64 = 26.0;

/// Renders one panel per tier with traffic; tiers with no finished request
/// under either policy are named in one line at the bottom ("no traffic").
pub fn svg(panels: &[Panel]) -> String {
    let drawn: Vec<&Panel> = panels.iter().filter(|p| has_traffic(p)).collect();
    let idle: Vec<String> = panels
        .iter()
        .filter(|p| !has_traffic(p))
        .map(|p| escape(&p.tier))
        .collect();
    // The idle tiers' names, wrapped to the width (~75 characters a line).
    let mut lines: Vec<String> = Vec::new();
    for name in &idle {
        match lines.last_mut() {
            Some(l) if l.chars().count() + name.chars().count() < 75 => {
                l.push_str(", ");
                l.push_str(name);
            }
            _ => lines.push(name.clone()),
        }
    }
    let footer = if panels.is_empty() || !idle.is_empty() {
        FOOTER + 14.0 * lines.len() as f64
    } else {
        0.0
    };
    let height = H * drawn.len() as f64 + footer;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{W}" height="{height}" fill="white"/>"#
    );
    for (i, p) in drawn.iter().enumerate() {
        panel(&mut s, p, H * i as f64);
    }
    let y = H * drawn.len() as f64 + 18.0;
    if panels.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="8" y="{y}" fill="#666">no tiers to plot</text>"##
        );
    } else if !idle.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="8" y="{y}" fill="#666"><tspan font-weight="bold">no traffic</tspan>: no request of these tiers finished under either policy (not drawn)</text>"##
        );
        for (k, l) in lines.iter().enumerate() {
            let _ = writeln!(
                s,
                r##"<text x="16" y="{}" fill="#666">{l}</text>"##,
                y + 14.0 * (k + 1) as f64
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, p: &Panel, y0: f64) {
    let (x0, x1, yb, yt) = (LEFT, W - RIGHT, y0 + H - BOTTOM, y0 + TOP);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-weight="bold">tier {}: TTFT distribution</text>"#,
        8.0,
        y0 + 16.0,
        escape(&p.tier)
    );
    let finite = |v: &[f64]| v.iter().copied().filter(|x| x.is_finite()).count();
    let (n_old, n_new) = (finite(&p.old), finite(&p.new));
    // The frame, always.
    let _ = writeln!(
        s,
        r##"<rect x="{x0}" y="{yt}" width="{}" height="{}" fill="none" stroke="#bbb"/>"##,
        x1 - x0,
        yb - yt
    );
    let slos: Vec<f64> = [p.slo_old, p.slo_new]
        .into_iter()
        .flatten()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    let data_max = p
        .old
        .iter()
        .chain(p.new.iter())
        .copied()
        .filter(|x| x.is_finite())
        .fold(0.0_f64, f64::max);
    // The x range holds the data and the SLO line, rounded up to a tick.
    let top = slos.iter().copied().fold(data_max, f64::max).max(1.0);
    let step = tick_step(top);
    let max = (top / step).ceil() * step;
    let px = |x: f64| x0 + (x / max).clamp(0.0, 1.0) * (x1 - x0);
    let py = |q: f64| yb - q * (yb - yt);
    // x ticks and grid
    let ticks = (max / step).round() as usize;
    for k in 0..=ticks.min(20) {
        let x = k as f64 * step;
        let xp = px(x);
        let _ = writeln!(
            s,
            r##"<line x1="{xp:.1}" y1="{yt}" x2="{xp:.1}" y2="{yb}" stroke="#eee"/><line x1="{xp:.1}" y1="{yb}" x2="{xp:.1}" y2="{}" stroke="#888"/><text x="{xp:.1}" y="{}" text-anchor="middle">{}</text>"##,
            yb + 4.0,
            yb + 15.0,
            tick_label(x)
        );
    }
    // y ticks and grid: 0% to 100% of finished requests
    for k in 0..=4 {
        let q = f64::from(k) / 4.0;
        let yp = py(q);
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{yp:.1}" x2="{x1}" y2="{yp:.1}" stroke="#eee"/><line x1="{}" y1="{yp:.1}" x2="{x0}" y2="{yp:.1}" stroke="#888"/><text x="{}" y="{:.1}" text-anchor="end">{}%</text>"##,
            x0 - 4.0,
            x0 - 6.0,
            yp + 4.0,
            k * 25
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">time to first token (ms)</text>"#,
        (x0 + x1) / 2.0,
        yb + 32.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{:.1}) rotate(-90)" text-anchor="middle">finished requests, TTFT ≤ x (%)</text>"#,
        16.0,
        (yt + yb) / 2.0
    );
    // SLO lines: the new policy's, and the old one's where it differs.
    let mut slo_lines: Vec<(f64, &str, &str)> = Vec::new();
    if let Some(n) = p.slo_new.filter(|x| x.is_finite() && *x > 0.0) {
        slo_lines.push((n, "#1f77b4", "SLO"));
    }
    if let Some(o) = p.slo_old.filter(|x| x.is_finite() && *x > 0.0) {
        if p.slo_new != Some(o) {
            slo_lines.push((o, "#999", "old SLO"));
        }
    }
    for (j, (ms, color, label)) in slo_lines.iter().enumerate() {
        let xp = px(*ms);
        let anchor = if xp > (x0 + x1) / 2.0 { "end" } else { "start" };
        let dx = if anchor == "end" { -3.0 } else { 3.0 };
        let _ = writeln!(
            s,
            r#"<line x1="{xp:.1}" y1="{yt}" x2="{xp:.1}" y2="{yb}" stroke="{color}" stroke-width="1.5" stroke-dasharray="6,4"/><text x="{:.1}" y="{}" text-anchor="{anchor}" fill="{color}">{label} {} ms</text>"#,
            xp + dx,
            yb - 6.0 - 12.0 * j as f64,
            tick_label(*ms)
        );
    }
    let lines = [
        (
            &p.old,
            r##"stroke="#999" stroke-dasharray="5,3""##,
            "old",
            n_old,
        ),
        (&p.new, r##"stroke="#d62728""##, "new", n_new),
    ];
    for (k, (data, style, label, n)) in lines.into_iter().enumerate() {
        let pts: Vec<String> = cdf(data)
            .into_iter()
            .map(|(x, q)| format!("{:.1},{:.1}", px(x), py(q)))
            .collect();
        if !pts.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke-width="1.5" {style} points="{}"/>"#,
                pts.join(" ")
            );
        }
        // legend, above the plot area
        let lx = x0 + 135.0 * k as f64;
        let ly = y0 + 32.0;
        let what = if n == 0 {
            format!("{label}: no traffic")
        } else {
            format!("{label}: {n} requests")
        };
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke-width="1.5" {style}/><text x="{}" y="{}">{what}</text>"#,
            lx + 20.0,
            lx + 24.0,
            ly + 4.0
        );
    }
    let (lx, ly) = (x0 + 270.0, y0 + 32.0);
    if slo_lines.is_empty() {
        let _ = writeln!(
            s,
            r##"<text x="{lx}" y="{}" fill="#666">no TTFT SLO</text>"##,
            ly + 4.0
        );
    } else {
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="#1f77b4" stroke-width="1.5" stroke-dasharray="6,4"/><text x="{}" y="{}">TTFT SLO</text>"##,
            lx + 20.0,
            lx + 24.0,
            ly + 4.0
        );
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panels() -> Vec<Panel> {
        let old: Vec<f64> = (1..=100).map(|i| f64::from(i) * 9.0).collect();
        let new: Vec<f64> = (1..=100).map(|i| f64::from(i) * 12.0).collect();
        vec![
            Panel {
                tier: "interactive".into(),
                old,
                new,
                slo_old: Some(500.0),
                slo_new: Some(800.0),
            },
            Panel {
                tier: "<batch> & co".into(),
                old: Vec::new(),
                new: Vec::new(),
                slo_old: None,
                slo_new: None,
            },
        ]
    }

    #[test]
    fn plot_is_snapshotted() {
        insta::assert_snapshot!("diff_plot", svg(&panels()));
    }

    #[test]
    fn axes_slo_and_empty_tiers_are_drawn() {
        let out = svg(&panels());
        assert!(out.contains("time to first token (ms)"));
        assert!(out.contains("TTFT ≤ x (%)"));
        assert!(out.contains(">100%<") && out.contains(">0%<"));
        assert!(out.contains("SLO 800 ms") && out.contains("old SLO 500 ms"));
        assert!(out.contains("no traffic"));
        assert_eq!(
            out.matches("<polyline").count(),
            2,
            "the idle tier has no panel"
        );
        assert!(out.contains("&lt;batch&gt; &amp; co"), "names are escaped");
        // self-contained: no scripts, no external references
        for bad in ["<script", "href", "url(", "@import"] {
            assert!(!out.contains(bad), "{bad}");
        }
        assert_eq!(out, svg(&panels()), "deterministic");
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(1200.0), 500.0);
        assert_eq!(tick_step(90.0), 20.0);
        assert_eq!(tick_step(1.0), 0.2);
        assert_eq!(tick_label(1500.0), "1.5k");
        assert_eq!(tick_label(2000.0), "2k");
        // hostile inputs do not break the document
        let p = Panel {
            tier: "t".into(),
            old: vec![f64::NAN, f64::INFINITY],
            new: vec![5.0],
            slo_old: Some(f64::NAN),
            slo_new: Some(-1.0),
        };
        let out = svg(&[p]);
        assert!(!out.contains("NaN") && !out.contains("inf"), "{out}");
    }
}
