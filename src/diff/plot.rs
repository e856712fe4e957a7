//! `--plot FILE.svg`: the TTFT distribution (CDF) of every tier, old policy
//! dashed grey and new solid red, one panel a tier, with the tier's TTFT
//! SLO as a dashed vertical line and both axes labelled with units and
//! ticks, so a reviewer can look rather than read. A tier with no finished
//! request under either policy gets a panel marked "no traffic". Plain,
//! self-contained SVG (no scripts, fonts or links); same inputs, same bytes.

use crate::chart::{self, ChartError, Line, Rgb, Rule};
use crate::replay::Outcome;

const W: u32 = 480;
const H: u32 = 270;

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

fn has_traffic(p: &Panel) -> bool {
    p.old.iter().chain(p.new.iter()).any(|x| x.is_finite())
}

/// Renders one panel per tier with traffic; tiers with no finished request
/// under either policy are named in lines at the bottom ("no traffic").
pub fn svg(panels: &[Panel]) -> Result<String, ChartError> {
    let drawn: Vec<chart::Panel> = panels
        .iter()
        .filter(|p| has_traffic(p))
        .map(panel)
        .collect();
    let idle: Vec<&str> = panels
        .iter()
        .filter(|p| !has_traffic(p))
        .map(|p| p.tier.as_str())
        .collect();
    let mut footer = Vec::new();
    if panels.is_empty() {
        footer.push("no tiers to plot".to_string());
    } else if !idle.is_empty() {
        footer.push(
            "no traffic: no request of these tiers finished under either policy (not drawn)"
                .to_string(),
        );
        // The idle tiers' names, wrapped to the width (~75 characters a line).
        let mut line = String::new();
        for name in idle {
            if !line.is_empty() && line.chars().count() + name.chars().count() >= 75 {
                footer.push(line.clone());
                line.clear();
            }
            if !line.is_empty() {
                line.push_str(", ");
            }
            line.push_str(name);
        }
        footer.push(line);
    }
    chart::xy(W, H, &drawn, &footer)
}

fn panel(p: &Panel) -> chart::Panel {
    let finite = |v: &[f64]| v.iter().copied().filter(|x| x.is_finite()).count();
    let (n_old, n_new) = (finite(&p.old), finite(&p.new));
    let slo = |x: Option<f64>| x.filter(|x| x.is_finite() && *x > 0.0);
    // SLO lines: the new policy's, and the old one's where it differs.
    let mut rules = Vec::new();
    if let Some(n) = slo(p.slo_new) {
        rules.push(Rule {
            at: n,
            vertical: true,
            label: format!("SLO {} ms", chart::short_number(n)),
            color: Rgb(0x1f, 0x77, 0xb4),
        });
    }
    if let Some(o) = slo(p.slo_old).filter(|o| slo(p.slo_new) != Some(*o)) {
        rules.push(Rule {
            at: o,
            vertical: true,
            label: format!("old SLO {} ms", chart::short_number(o)),
            color: Rgb(0x99, 0x99, 0x99),
        });
    }
    let data_max = p
        .old
        .iter()
        .chain(p.new.iter())
        .copied()
        .filter(|x| x.is_finite())
        .fold(0.0_f64, f64::max);
    // The x range holds the data and the SLO lines.
    let top = rules.iter().map(|r| r.at).fold(data_max, f64::max).max(1.0);
    let what = |label: &str, n: usize| {
        if n == 0 {
            format!("{label}: no traffic")
        } else {
            format!("{label}: {n} requests")
        }
    };
    chart::Panel {
        title: format!("tier {}: TTFT distribution", p.tier),
        x_desc: "time to first token (ms)".into(),
        y_desc: "finished requests, TTFT ≤ x (%)".into(),
        x: (0.0, top * 1.05),
        y: (0.0, 1.0),
        x_ticks: chart::short_number,
        y_ticks: chart::percent,
        lines: vec![
            Line {
                label: what("old", n_old),
                points: cdf(&p.old),
                color: Rgb(0x99, 0x99, 0x99),
                dashed: true,
            },
            Line {
                label: what("new", n_new),
                points: cdf(&p.new),
                color: Rgb(0xd6, 0x27, 0x28),
                dashed: false,
            },
        ],
        dots: Vec::new(),
        notes: if rules.is_empty() {
            vec!["no TTFT SLO".into()]
        } else {
            Vec::new()
        },
        rules,
    }
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
        insta::assert_snapshot!("diff_plot", svg(&panels()).unwrap());
    }

    #[test]
    fn axes_slo_and_empty_tiers_are_drawn() {
        let out = svg(&panels()).unwrap();
        assert!(out.contains("time to first token (ms)"));
        assert!(out.contains("TTFT ≤ x (%)"));
        assert!(out.contains("\n100%\n") && out.contains("\n0%\n"));
        assert!(out.contains("SLO 800 ms") && out.contains("old SLO 500 ms"));
        assert!(out.contains("old: 100 requests") && out.contains("new: 100 requests"));
        assert!(out.contains("no traffic"));
        assert_eq!(
            out.matches("tier interactive: TTFT distribution").count(),
            1,
            "the idle tier has no panel"
        );
        assert!(!out.contains("tier &lt;batch&gt; &amp; co: TTFT"));
        assert!(out.contains("&lt;batch&gt; &amp; co"), "names are escaped");
        // self-contained: no scripts, no external references
        for bad in ["<script", "href", "url(", "@import"] {
            assert!(!out.contains(bad), "{bad}");
        }
        assert_eq!(out, svg(&panels()).unwrap(), "deterministic");
    }

    #[test]
    fn hostile_inputs_do_not_break_the_document() {
        let p = Panel {
            tier: "t".into(),
            old: vec![f64::NAN, f64::INFINITY],
            new: vec![5.0],
            slo_old: Some(f64::NAN),
            slo_new: Some(-1.0),
        };
        let out = svg(&[p]).unwrap();
        assert!(!out.contains("NaN") && !out.contains("inf"), "{out}");
        assert!(out.contains("no TTFT SLO"));
        let none = svg(&[]).unwrap();
        assert!(none.contains("no tiers to plot"));
    }
}
