//! SVG charts, drawn by plotters on its SVG backend (no fonts loaded, no
//! bitmaps, no scripts or links: plain, self-contained SVG; same input,
//! same bytes). One place for every chart kiln draws: `kiln diff --plot`
//! (TTFT distributions, [`xy`]), `kiln plan --plot` (SLO attainment
//! against GPUs, [`xy`]) and `kiln report --format html` ([`bars`],
//! [`shares`]).
//!
//! What is not data is kept off the data: the legend is a row of its own
//! above the plot area, a horizontal reference line is labelled in the
//! right margin and a vertical one above the plot area, so neither prints
//! over a series. Values that are not finite are dropped before drawing,
//! and an empty or one-point range is widened, so no `NaN` or `inf`
//! reaches the file.

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub use plotters::style::RGBColor as Rgb;

/// Why a chart could not be drawn (the SVG backend refused an element).
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("drawing the chart: {0}")]
#[diagnostic(code(kiln::chart))]
pub struct ChartError(String);

fn fail<E: std::fmt::Display>(e: E) -> ChartError {
    ChartError(e.to_string())
}

const FONT: &str = "sans-serif";
/// Text sizes as plotters takes them (it writes `font-size` as size / 1.24):
/// labels at about 11 px, titles at about 13 px.
const LABEL: f64 = 13.6;
const TITLE: f64 = 16.0;
const GREY: Rgb = Rgb(0x66, 0x66, 0x66);
const LIGHT: Rgb = Rgb(0xee, 0xee, 0xee);

/// A series drawn as a line.
#[derive(Debug, Clone)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub color: Rgb,
    pub dashed: bool,
}

/// A series drawn as dots: filled where the flag is set, hollow where not.
#[derive(Debug, Clone)]
pub struct Dots {
    pub label: String,
    pub points: Vec<(f64, f64, bool)>,
    pub color: Rgb,
}

/// A dashed reference line across the plot area, labelled outside it.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Where: an x value (a vertical line) or a y value (a horizontal one).
    pub at: f64,
    pub vertical: bool,
    pub label: String,
    pub color: Rgb,
}

/// One x-y panel.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    /// The axes' ranges; a range that is empty or not finite is widened.
    pub x: (f64, f64),
    pub y: (f64, f64),
    pub x_ticks: fn(f64) -> String,
    pub y_ticks: fn(f64) -> String,
    pub lines: Vec<Line>,
    pub dots: Vec<Dots>,
    pub rules: Vec<Rule>,
    /// Legend entries without a series (grey text), after the series'.
    pub notes: Vec<String>,
}

/// A range drawable as an axis: finite, low below high.
fn axis((lo, hi): (f64, f64)) -> (f64, f64) {
    let lo = if lo.is_finite() { lo } else { 0.0 };
    let hi = if hi.is_finite() { hi } else { lo + 1.0 };
    if hi > lo {
        (lo, hi)
    } else {
        (lo, lo + 1.0)
    }
}

/// A rough width in pixels of `text` at `size` (plotters' own estimate
/// for an SVG, whose fonts it cannot measure).
fn text_width(text: &str, size: f64) -> i32 {
    (size / 1.24 / 1.24 * 0.7 * text.chars().count() as f64).round() as i32
}

fn style(size: f64, color: &Rgb, pos: Pos) -> TextStyle<'static> {
    let mut t = TextStyle::from((FONT, size).into_font()).pos(pos);
    t.color = color.to_backend_color();
    t
}

const LEFT_MID: Pos = Pos {
    h_pos: HPos::Left,
    v_pos: VPos::Center,
};

/// Legend entries laid out in rows of at most `width` pixels from `x0`:
/// for each, its row and x offset.
fn legend_rows(labels: &[String], width: i32) -> Vec<(usize, i32)> {
    let mut out = Vec::new();
    let (mut row, mut x) = (0, 0);
    for l in labels {
        let w = 28 + text_width(l, LABEL) + 18;
        if x > 0 && x + w > width {
            row += 1;
            x = 0;
        }
        out.push((row, x));
        x += w;
    }
    out
}

/// Panels stacked top to bottom, each `panel_height` high, then `footer`
/// lines of grey text (`footer_bold` leads the first).
pub fn xy(
    width: u32,
    panel_height: u32,
    panels: &[Panel],
    footer: &[String],
) -> Result<String, ChartError> {
    let footer_h = if footer.is_empty() {
        0
    } else {
        12 + 14 * footer.len() as u32
    };
    let height = (panel_height * panels.len() as u32 + footer_h).max(1);
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(fail)?;
        for (i, p) in panels.iter().enumerate() {
            let top = panel_height * i as u32;
            let area = root.margin(top, height - top - panel_height, 0, 0);
            panel(&root, &area, p, width, top as i32)?;
        }
        let y0 = (panel_height * panels.len() as u32) as i32 + 16;
        for (k, l) in footer.iter().enumerate() {
            root.draw(&Text::new(
                l.clone(),
                (8, y0 + 14 * k as i32),
                style(LABEL, &GREY, LEFT_MID),
            ))
            .map_err(fail)?;
        }
        root.present().map_err(fail)?;
    }
    Ok(buf)
}

fn panel(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    p: &Panel,
    width: u32,
    top: i32,
) -> Result<(), ChartError> {
    let (x0, x1) = axis(p.x);
    let (y0, y1) = axis(p.y);
    // Above the plot: the title, the legend rows, then a row for each
    // vertical rule's label.
    let mut labels: Vec<String> = p.lines.iter().map(|l| l.label.clone()).collect();
    labels.extend(p.dots.iter().map(|d| d.label.clone()));
    labels.extend(p.notes.iter().cloned());
    let rows = legend_rows(&labels, width as i32 - 16);
    let legend_h = rows.last().map_or(0, |(r, _)| 14 * (*r as i32 + 1));
    let vrules: Vec<&Rule> = p
        .rules
        .iter()
        .filter(|r| r.vertical && r.at.is_finite())
        .collect();
    let hrules: Vec<&Rule> = p
        .rules
        .iter()
        .filter(|r| !r.vertical && r.at.is_finite())
        .collect();
    let head = 24 + legend_h + 14 * vrules.len() as i32 + 4;
    // Right of the plot: the horizontal rules' labels.
    let right = hrules
        .iter()
        .map(|r| text_width(&r.label, LABEL) + 10)
        .max()
        .unwrap_or(0)
        .max(16);
    let mut chart = ChartBuilder::on(area)
        .margin_top(head as u32)
        .margin_right(right as u32)
        .margin_left(8)
        .margin_bottom(4)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(fail)?;
    let (xf, yf) = (p.x_ticks, p.y_ticks);
    chart
        .configure_mesh()
        .x_desc(p.x_desc.as_str())
        .y_desc(p.y_desc.as_str())
        .x_labels(6)
        .y_labels(5)
        .x_label_formatter(&|x| xf(*x))
        .y_label_formatter(&|y| yf(*y))
        .label_style((FONT, LABEL))
        .axis_desc_style((FONT, LABEL))
        .light_line_style(WHITE)
        .bold_line_style(LIGHT)
        .axis_style(Rgb(0x88, 0x88, 0x88))
        .draw()
        .map_err(fail)?;
    let clamp = |v: f64, lo: f64, hi: f64| if v.is_finite() { v.clamp(lo, hi) } else { lo };
    let finite = |pts: &[(f64, f64)]| -> Vec<(f64, f64)> {
        pts.iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| (clamp(x, x0, x1), clamp(y, y0, y1)))
            .collect()
    };
    for r in &vrules {
        let x = clamp(r.at, x0, x1);
        chart
            .draw_series(DashedLineSeries::new(
                [(x, y0), (x, y1)],
                6,
                4,
                r.color.stroke_width(1),
            ))
            .map_err(fail)?;
    }
    for r in &hrules {
        let y = clamp(r.at, y0, y1);
        chart
            .draw_series(DashedLineSeries::new(
                [(x0, y), (x1, y)],
                4,
                3,
                r.color.stroke_width(1),
            ))
            .map_err(fail)?;
    }
    for l in &p.lines {
        let pts = finite(&l.points);
        let st = l.color.stroke_width(2);
        if l.dashed {
            chart
                .draw_series(DashedLineSeries::new(pts, 5, 3, st))
                .map_err(fail)?;
        } else {
            chart.draw_series(LineSeries::new(pts, st)).map_err(fail)?;
        }
    }
    for d in &p.dots {
        let pts: Vec<(f64, f64, bool)> = d
            .points
            .iter()
            .filter(|(x, y, _)| x.is_finite() && y.is_finite())
            .map(|&(x, y, f)| (clamp(x, x0, x1), clamp(y, y0, y1), f))
            .collect();
        chart
            .draw_series(pts.into_iter().map(|(x, y, filled)| {
                let st = if filled {
                    d.color.filled()
                } else {
                    d.color.stroke_width(1)
                };
                Circle::new((x, y), 4, st)
            }))
            .map_err(fail)?;
    }
    // Outside the plot area: title, legend, rule labels.
    let (px, py) = chart.plotting_area().get_pixel_range();
    let t = |s: &str, at: (i32, i32), st: TextStyle<'static>| {
        root.draw(&Text::new(s.to_string(), at, st)).map_err(fail)
    };
    t(
        &p.title,
        (8, top + 12),
        TextStyle::from((FONT, TITLE).into_font().style(FontStyle::Bold))
            .color(&BLACK)
            .pos(LEFT_MID),
    )?;
    let mut k = 0;
    let entry = |k: usize| {
        let (row, x) = rows.get(k).copied().unwrap_or((0, 0));
        (8 + x, top + 30 + 14 * row as i32)
    };
    for l in &p.lines {
        let (x, y) = entry(k);
        let st = l.color.stroke_width(2);
        if l.dashed {
            root.draw(&DashedPathElement::new([(x, y), (x + 22, y)], 5, 3, st))
                .map_err(fail)?;
        } else {
            root.draw(&PathElement::new(vec![(x, y), (x + 22, y)], st))
                .map_err(fail)?;
        }
        t(&l.label, (x + 28, y), style(LABEL, &BLACK, LEFT_MID))?;
        k += 1;
    }
    for d in &p.dots {
        let (x, y) = entry(k);
        root.draw(&Circle::new((x + 11, y), 4, d.color.filled()))
            .map_err(fail)?;
        t(&d.label, (x + 28, y), style(LABEL, &BLACK, LEFT_MID))?;
        k += 1;
    }
    for n in &p.notes {
        let (x, y) = entry(k);
        t(n, (x + 28, y), style(LABEL, &GREY, LEFT_MID))?;
        k += 1;
    }
    // Vertical rules: a label each above the plot, one row each, kept
    // inside the picture.
    for (j, r) in vrules.iter().enumerate() {
        let (x, _) = chart.backend_coord(&(clamp(r.at, x0, x1), y1));
        let w = text_width(&r.label, LABEL);
        let x = (x - w / 2).clamp(4, (width as i32 - w - 4).max(4));
        let y = py.start - 8 - 14 * (vrules.len() - 1 - j) as i32;
        t(&r.label, (x, y), style(LABEL, &r.color, LEFT_MID))?;
    }
    // Horizontal rules: labels in the right margin, at least a line apart.
    let mut at: Vec<(i32, &Rule)> = hrules
        .iter()
        .map(|r| (chart.backend_coord(&(x1, clamp(r.at, y0, y1))).1, *r))
        .collect();
    at.sort_by_key(|(y, _)| *y);
    let mut last = i32::MIN;
    for (y, r) in at {
        let y = y.max(last.saturating_add(13));
        last = y;
        t(&r.label, (px.end + 6, y), style(LABEL, &r.color, LEFT_MID))?;
    }
    Ok(())
}

/// Vertical bars, one per label, on a `width` × `height` picture.
pub fn bars(
    title: &str,
    labels: &[String],
    values: &[u64],
    color: Rgb,
    width: u32,
    height: u32,
) -> Result<String, ChartError> {
    let n = labels.len().min(values.len()).max(1) as u32;
    let max = values.iter().copied().max().unwrap_or(0).max(1);
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(fail)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, TITLE).into_font().style(FontStyle::Bold))
            .margin(6)
            .x_label_area_size(18)
            .y_label_area_size(48)
            .build_cartesian_2d((0..n - 1).into_segmented(), 0..max)
            .map_err(fail)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n as usize + 1)
            .y_labels(4)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .label_style((FONT, LABEL))
            .bold_line_style(LIGHT)
            .light_line_style(WHITE)
            .axis_style(Rgb(0x88, 0x88, 0x88))
            .draw()
            .map_err(fail)?;
        chart
            .draw_series(values.iter().take(n as usize).enumerate().map(|(i, &v)| {
                let i = i as u32;
                let mut r = Rectangle::new(
                    [(SegmentValue::Exact(i), 0), (SegmentValue::Exact(i + 1), v)],
                    color.filled(),
                );
                r.set_margin(0, 0, 1, 1);
                r
            }))
            .map_err(fail)?;
        root.present().map_err(fail)?;
    }
    Ok(buf)
}

/// Horizontal bars of shares (0 to 1), one row per name, top down, each
/// with its percentage after it.
pub fn shares(
    title: &str,
    rows: &[(String, f64)],
    color: Rgb,
    width: u32,
) -> Result<String, ChartError> {
    let n = rows.len().max(1) as u32;
    let height = 40 + 20 * n;
    let name = |j: u32| -> String {
        // Row 0 at the top: segment n-1. (`0..n - 1` is n segments:
        // plotters' integer ranges hold both ends.)
        let i = n.saturating_sub(1).saturating_sub(j) as usize;
        rows.get(i)
            .map(|(s, _)| s.chars().take(24).collect())
            .unwrap_or_default()
    };
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(fail)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (FONT, TITLE).into_font().style(FontStyle::Bold))
            .margin(6)
            .margin_right(56)
            .y_label_area_size(150)
            .build_cartesian_2d(0f64..1f64, (0..n - 1).into_segmented())
            .map_err(fail)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_labels(n as usize + 1)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(j) => name(*j),
                _ => String::new(),
            })
            .label_style((FONT, LABEL))
            .axis_style(Rgb(0x88, 0x88, 0x88))
            .draw()
            .map_err(fail)?;
        let share = |s: f64| {
            if s.is_finite() {
                s.clamp(0.0, 1.0)
            } else {
                0.0
            }
        };
        for (i, (_, s)) in rows.iter().enumerate() {
            let j = n - 1 - i as u32;
            let s = share(*s);
            let mut r = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(j)),
                    (s, SegmentValue::Exact(j + 1)),
                ],
                color.filled(),
            );
            r.set_margin(2, 2, 0, 0);
            chart.draw_series(std::iter::once(r)).map_err(fail)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{:.1}%", s * 100.0),
                    (s, SegmentValue::CenterOf(j)),
                    style(LABEL, &BLACK, LEFT_MID),
                )))
                .map_err(fail)?;
        }
        root.present().map_err(fail)?;
    }
    Ok(buf)
}

/// `1500` → `1.5k`, `250` → `250`, `0.5` → `0.5`.
pub fn short_number(x: f64) -> String {
    if !x.is_finite() {
        return String::new();
    }
    if x.abs() >= 1000.0 {
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

/// `0.25` → `25%`.
pub fn percent(x: f64) -> String {
    if x.is_finite() {
        format!("{:.0}%", x * 100.0)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panel() -> Panel {
        Panel {
            title: "t <&> title".into(),
            x_desc: "x axis (ms)".into(),
            y_desc: "y axis (%)".into(),
            x: (0.0, 100.0),
            y: (0.0, 1.0),
            x_ticks: short_number,
            y_ticks: percent,
            lines: vec![Line {
                label: "series a".into(),
                points: vec![(1.0, 0.1), (50.0, 0.5), (f64::NAN, 0.7), (99.0, 1.0)],
                color: Rgb(0xd6, 0x27, 0x28),
                dashed: false,
            }],
            dots: vec![Dots {
                label: "series b".into(),
                points: vec![(10.0, 0.2, true), (20.0, f64::INFINITY, false)],
                color: Rgb(0x1f, 0x77, 0xb4),
            }],
            rules: vec![
                Rule {
                    at: 40.0,
                    vertical: true,
                    label: "SLO 40 ms".into(),
                    color: Rgb(0x1f, 0x77, 0xb4),
                },
                Rule {
                    at: 0.99,
                    vertical: false,
                    label: "ttft 99%".into(),
                    color: GREY,
                },
            ],
            notes: vec!["a note".into()],
        }
    }

    /// The `<text>` element holding exactly `text` (plotters writes the
    /// text on a line of its own).
    fn text_tag<'a>(out: &'a str, text: &str) -> Option<&'a str> {
        let i = out.find(&format!("\n{text}\n</text>"))?;
        let start = out[..i].rfind("<text")?;
        Some(&out[start..i])
    }

    fn attr(tag: &str, name: &str) -> i32 {
        let v = tag.split(&format!(" {name}=\"")).nth(1).unwrap();
        v[..v.find('"').unwrap()].parse().unwrap()
    }

    #[test]
    fn an_xy_panel_has_its_parts_and_no_nan() {
        let out = xy(480, 260, &[panel()], &["footer line".into()]).unwrap();
        assert!(out.starts_with("<svg") && out.trim_end().ends_with("</svg>"));
        for want in [
            "t &lt;&amp;&gt; title",
            "x axis (ms)",
            "y axis (%)",
            "series a",
            "series b",
            "a note",
            "SLO 40 ms",
            "ttft 99%",
            "footer line",
            "100%",
            "0%",
        ] {
            assert!(text_tag(&out, want).is_some(), "{want} missing");
        }
        assert!(out.contains("<polyline") && out.contains("<circle"));
        for bad in ["NaN", "inf", "<script", "href"] {
            assert!(!out.contains(bad), "{bad}");
        }
        assert_eq!(
            out,
            xy(480, 260, &[panel()], &["footer line".into()]).unwrap()
        );
    }

    #[test]
    fn empty_and_one_point_data_draw_without_nan() {
        let mut p = panel();
        p.lines[0].points = vec![(5.0, 1.0)];
        p.dots.clear();
        p.x = (5.0, 5.0);
        p.y = (f64::NAN, f64::INFINITY);
        for out in [
            xy(480, 260, &[p.clone()], &[]).unwrap(),
            xy(480, 260, &[], &[]).unwrap(),
            bars("b", &[], &[], GREY, 300, 200).unwrap(),
            bars("b", &["x".into()], &[0], GREY, 300, 200).unwrap(),
            shares("s", &[], GREY, 300).unwrap(),
            shares("s", &[("a".into(), f64::NAN)], GREY, 300).unwrap(),
        ] {
            assert!(!out.contains("NaN") && !out.contains("inf"), "{out}");
            assert!(out.trim_end().ends_with("</svg>"));
        }
    }

    /// The legend and the rule labels lie outside the plot area: above it
    /// and right of it, never over the data.
    #[test]
    fn legend_and_rule_labels_are_outside_the_plot_area() {
        let out = xy(480, 260, &[panel()], &[]).unwrap();
        let tag = |t: &str| text_tag(&out, t).unwrap();
        // The 100% tick label is at the top of the plot area, the last x
        // tick at its right end.
        let plot_top = attr(tag("100%"), "y");
        for l in ["series a", "series b", "a note", "SLO 40 ms"] {
            assert!(attr(tag(l), "y") < plot_top - 4, "{l}: {out}");
        }
        let last_x_tick = ["100", "90", "80"]
            .into_iter()
            .filter_map(|t| text_tag(&out, t))
            .map(|t| attr(t, "x"))
            .max()
            .unwrap();
        assert!(attr(tag("ttft 99%"), "x") > last_x_tick, "{out}");
    }

    #[test]
    fn bars_and_shares_draw_a_rect_per_value() {
        let labels: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let out = bars(
            "Requests <by> hour",
            &labels,
            &[3, 0, 5],
            Rgb(1, 2, 3),
            640,
            200,
        )
        .unwrap();
        assert!(text_tag(&out, "Requests &lt;by&gt; hour").is_some());
        assert!(text_tag(&out, "a").is_some() && text_tag(&out, "c").is_some());
        assert_eq!(out.matches("fill=\"#010203\"").count(), 3);
        let out = shares(
            "Share",
            &[("t1".into(), 0.25), ("t2".into(), 0.75)],
            Rgb(1, 2, 3),
            640,
        )
        .unwrap();
        for t in ["25.0%", "75.0%", "t1", "t2"] {
            assert!(text_tag(&out, t).is_some(), "{t}: {out}");
        }
        // t1 is the first row: above t2.
        assert!(
            attr(text_tag(&out, "t1").unwrap(), "y") < attr(text_tag(&out, "t2").unwrap(), "y")
        );
    }
}
