//! `--plot FILE.svg`: the TTFT distribution (CDF) of every tier, old policy
//! dashed and new solid, one panel a tier, so a reviewer can look rather
//! than read. Plain SVG, no dependencies; same inputs, same bytes.

use crate::replay::Outcome;
use std::fmt::Write as _;

const W: f64 = 420.0;
const H: f64 = 220.0;
const PAD: f64 = 40.0;

fn cdf(mut v: Vec<f64>) -> Vec<(f64, f64)> {
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

/// Renders one panel per `(tier name, old TTFTs, new TTFTs)`.
pub fn svg(panels: &[(String, Vec<f64>, Vec<f64>)]) -> String {
    let height = H * panels.len().max(1) as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="11">"#
    );
    for (i, (name, o, n)) in panels.iter().enumerate() {
        let y0 = H * i as f64;
        let max = o.iter().chain(n.iter()).copied().fold(1.0_f64, f64::max);
        let (x0, x1, yb, yt) = (PAD, W - 10.0, y0 + H - PAD + 10.0, y0 + 20.0);
        let _ = writeln!(
            s,
            r#"<text x="{x0}" y="{}" font-weight="bold">tier {}: TTFT CDF (ms)</text>"#,
            y0 + 14.0,
            escape(name)
        );
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{yb}" x2="{x1}" y2="{yb}" stroke="#888"/><line x1="{x0}" y1="{yt}" x2="{x0}" y2="{yb}" stroke="#888"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{x0}" y="{}">0</text><text x="{x1}" y="{}" text-anchor="end">{max:.0}</text>"#,
            yb + 14.0,
            yb + 14.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">1</text><text x="{}" y="{yb}" text-anchor="end">0</text>"#,
            x0 - 4.0,
            yt + 4.0,
            x0 - 4.0
        );
        let lines = [
            (
                o,
                r##"stroke="#999" stroke-dasharray="5,3""##,
                "old",
                yt + 10.0,
            ),
            (n, r##"stroke="#d62728""##, "new", yt + 24.0),
        ];
        for (data, style, label, ly) in lines {
            let pts: Vec<String> = cdf(data.clone())
                .into_iter()
                .map(|(x, p)| {
                    format!(
                        "{:.1},{:.1}",
                        x0 + (x / max) * (x1 - x0),
                        yb - p * (yb - yt)
                    )
                })
                .collect();
            if !pts.is_empty() {
                let _ = writeln!(
                    s,
                    r#"<polyline fill="none" stroke-width="1.5" {style} points="{}"/>"#,
                    pts.join(" ")
                );
            }
            let _ = writeln!(
                s,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke-width="1.5" {style}/><text x="{}" y="{}">{label}</text>"#,
                x1 - 60.0,
                x1 - 40.0,
                x1 - 36.0,
                ly + 4.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
