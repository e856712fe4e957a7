//! `kiln alerts`: Prometheus alerting rules generated from a policy's
//! declared SLOs, on the metrics the gateway exports (`server::metrics`).
//!
//! Per tier with a TTFT SLO: multi-window, multi-burn-rate alerts as in the
//! Google SRE workbook (ch. 5): page at burn rate 14.4 over 1h and 5m, page
//! at 6 over 6h and 30m, ticket at 3 over 1d and 2h. The SLI is the share of
//! requests whose first token came within the SLO, refused requests counted
//! as bad; its error ratio per window is a recording rule, so each alert
//! only compares two recorded series. The SLO is read from the TTFT
//! histogram at a bucket bound: the largest bound at or below the SLO (the
//! gateway's buckets are fixed), which is stricter than the SLO when they
//! differ; the rule's annotations then say which bound it uses.
//!
//! Completion-window tiers: predicted and actual deadline misses. Every
//! tier: queue oldest wait above its SLO. Fleet: replicas busy, slots full,
//! an upstream's breaker open, a rollout rolled back.
//!
//! The rules file is built as [`RulesFile`] (Prometheus's rule file
//! format as serde structs) and written by serde_norway, a maintained
//! serde_yaml fork: it quotes and escapes every string that needs it, so
//! hostile tier names cannot break the file.

use crate::graph::{DecisionGraph, Owner, Tier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A Prometheus rules file: `groups:`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RulesFile {
    pub groups: Vec<RuleGroup>,
}

/// One rule group: a name and its rules, evaluated together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleGroup {
    pub name: String,
    pub rules: Vec<Rule>,
}

/// An alerting rule (`alert`) or a recording rule (`record`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
    pub expr: String,
    #[serde(rename = "for", default, skip_serializing_if = "Option::is_none")]
    pub for_: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Why the rules file could not be written (serde_norway refused it).
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("writing the rules as YAML: {0}")]
#[diagnostic(code(kiln::alerts::yaml))]
pub struct YamlError(String);

/// The gateway's `kiln_ttft_seconds` buckets (`server::metrics`; a test in
/// `tests/alerts.rs` checks they agree).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

/// Where the runbooks are (`docs/playbooks.md`).
pub const RUNBOOK: &str = "docs/playbooks.md";

/// The burn-rate alerts: (name suffix, burn rate, long window, short
/// window, `for`, severity). SRE workbook table 5-8.
const BURNS: &[(&str, f64, &str, &str, &str, &str)] = &[
    ("Fast", 14.4, "1h", "5m", "2m", "page"),
    ("Slow", 6.0, "6h", "30m", "15m", "page"),
    ("Budget", 3.0, "1d", "2h", "1h", "ticket"),
];

/// Every window a recording rule is kept for.
const WINDOWS: &[&str] = &["5m", "30m", "1h", "2h", "6h", "1d"];

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum AlertsError {
    #[error("objective {0} is not a share between 0 and 1 (exclusive)")]
    #[diagnostic(
        code(kiln::alerts::objective),
        help("write it as a percentage below 100%, e.g. `--objective 99%` or `99.9%`")
    )]
    Objective(String),
    #[error("selector `{0}` is not a list of label matchers: {1}")]
    #[diagnostic(
        code(kiln::alerts::selector),
        help("write matchers as PromQL does, comma-separated: `--selector 'job=\"kiln\",namespace=\"prod\"'` (operators =, !=, =~, !~; values in double quotes)")
    )]
    Selector(String, String),
}

/// One label matcher of `--selector` (`job="kiln"`): the value is kept as
/// written between the quotes (escapes and all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub label: String,
    pub op: &'static str,
    pub value: String,
}

impl Matcher {
    fn promql(&self) -> String {
        format!("{}{}\"{}\"", self.label, self.op, self.value)
    }
}

/// Parses `job="kiln",namespace="prod"` (braces around it allowed).
pub fn parse_selector(text: &str) -> Result<Vec<Matcher>, AlertsError> {
    let bad = |why: &str| AlertsError::Selector(text.to_string(), why.to_string());
    let t = text.trim();
    let t = t
        .strip_prefix('{')
        .and_then(|x| x.strip_suffix('}'))
        .unwrap_or(t);
    let b: Vec<char> = t.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    let skip = |i: &mut usize| {
        while b.get(*i).is_some_and(|c| c.is_whitespace() || *c == ',') {
            *i += 1;
        }
    };
    loop {
        skip(&mut i);
        if i >= b.len() {
            break;
        }
        let start = i;
        while b
            .get(i)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
        {
            i += 1;
        }
        let label: String = b[start..i].iter().collect();
        if label.is_empty() || label.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(bad("a label name must come first"));
        }
        while b.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        let two: String = b.iter().skip(i).take(2).collect();
        let op = match two.as_str() {
            "=~" => "=~",
            "!~" => "!~",
            "!=" => "!=",
            _ if b.get(i) == Some(&'=') => "=",
            _ => return Err(bad(&format!("`{label}` needs an operator (=, !=, =~, !~)"))),
        };
        i += op.len();
        while b.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        if b.get(i) != Some(&'"') {
            return Err(bad(&format!(
                "the value of `{label}` must be in double quotes"
            )));
        }
        i += 1;
        let vstart = i;
        loop {
            match b.get(i) {
                None => return Err(bad(&format!("the value of `{label}` is not closed"))),
                Some('\\') => i += 2,
                Some('"') => break,
                Some('\n') => return Err(bad("a value cannot hold a line break")),
                Some(_) => i += 1,
            }
        }
        let value: String = b
            .get(vstart..i)
            .map(|v| v.iter().collect())
            .unwrap_or_default();
        i += 1;
        if out.iter().any(|m: &Matcher| m.label == label) {
            return Err(bad(&format!("`{label}` is matched twice")));
        }
        if matches!(label.as_str(), "tier" | "tenant" | "le" | "__name__") {
            return Err(bad(&format!("`{label}` is a label kiln's own rules read")));
        }
        out.push(Matcher { label, op, value });
        while b.get(i).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        match b.get(i) {
            None => break,
            Some(',') => {}
            Some(_) => return Err(bad("matchers are separated by commas")),
        }
    }
    Ok(out)
}

/// `expr` scoped to `matchers`: each of kiln's series (`kiln_…`,
/// `kiln:…`) selected with them, and each aggregation's `by (…)` keeping
/// their labels, so recorded series of two scopes (staging and prod in one
/// Prometheus) stay apart. String literals are left alone.
pub fn scope(expr: &str, matchers: &[Matcher]) -> String {
    if matchers.is_empty() {
        return expr.to_string();
    }
    let sel: Vec<String> = matchers.iter().map(Matcher::promql).collect();
    let sel = sel.join(",");
    let chars: Vec<char> = expr.chars().collect();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut out = String::with_capacity(expr.len() + 64);
    let mut i = 0;
    let mut in_str = false;
    while i < chars.len() {
        let c = chars[i];
        if in_str {
            out.push(c);
            if c == '\\' {
                if let Some(n) = chars.get(i + 1) {
                    out.push(*n);
                }
                i += 2;
                continue;
            }
            if c == '"' {
                in_str = false;
            }
            i += 1;
            continue;
        }
        if c == '"' {
            in_str = true;
            out.push(c);
            i += 1;
            continue;
        }
        let starts = (c.is_ascii_alphabetic() || c == '_' || c == ':')
            && (i == 0 || !chars.get(i - 1).is_some_and(|p| ident(*p) || *p == '$'));
        if !starts {
            out.push(c);
            i += 1;
            continue;
        }
        let s = i;
        while chars.get(i).is_some_and(|c| ident(*c)) {
            i += 1;
        }
        let word: String = chars[s..i].iter().collect();
        out.push_str(&word);
        if word.starts_with("kiln_") || word.starts_with("kiln:") {
            if chars.get(i) == Some(&'{') {
                out.push('{');
                out.push_str(&sel);
                let mut j = i + 1;
                while chars.get(j).is_some_and(|c| c.is_whitespace()) {
                    j += 1;
                }
                if chars.get(j) != Some(&'}') {
                    out.push(',');
                }
                i += 1;
            } else {
                out.push('{');
                out.push_str(&sel);
                out.push('}');
            }
        } else if word == "by" {
            let mut j = i;
            while chars.get(j).is_some_and(|c| c.is_whitespace()) {
                j += 1;
            }
            if chars.get(j) == Some(&'(') {
                if let Some(close) = (j..chars.len()).find(|&k| chars[k] == ')') {
                    let inner: String = chars[j + 1..close].iter().collect();
                    let have: Vec<&str> = inner.split(',').map(str::trim).collect();
                    let mut list = inner.trim().to_string();
                    for m in matchers {
                        if !have.contains(&m.label.as_str()) {
                            if !list.is_empty() {
                                list.push_str(", ");
                            }
                            list.push_str(&m.label);
                        }
                    }
                    let gap: String = chars[i..j].iter().collect();
                    out.push_str(&gap);
                    out.push('(');
                    out.push_str(&list);
                    out.push(')');
                    i = close + 1;
                }
            }
        }
    }
    out
}

/// The rules scoped and linked: every expression through [`scope`], every
/// runbook link under `runbook_base` (a URL the repository's
/// `docs/playbooks.md` is served under).
fn finish(f: &mut RulesFile, o: &Options) {
    for r in f.groups.iter_mut().flat_map(|g| g.rules.iter_mut()) {
        r.expr = scope(&r.expr, &o.selector);
        if let (Some(u), Some(base)) = (r.annotations.get_mut("runbook_url"), &o.runbook_base) {
            *u = format!("{}/{u}", base.trim_end_matches('/'));
        }
    }
}

/// Parses `99%`, `99.9%` or `0.99` into a share in (0, 1).
pub fn parse_objective(s: &str) -> Result<f64, AlertsError> {
    let t = s.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|x| x / 100.0),
        None => t.parse::<f64>(),
    };
    match v {
        Ok(x) if x.is_finite() && x > 0.0 && x < 1.0 => Ok(x),
        _ => Err(AlertsError::Objective(s.to_string())),
    }
}

/// What the rules are generated with.
#[derive(Debug, Clone)]
pub struct Options {
    /// Share of a tier's requests that must meet its SLO, in (0, 1).
    pub objective: f64,
    /// The policy as the operator named it, for annotations.
    pub policy: String,
    /// Label matchers every expression is scoped to (`--selector`).
    pub selector: Vec<Matcher>,
    /// Where `docs/playbooks.md` is served (`--runbook-base`); runbook
    /// links are relative to the repository without it.
    pub runbook_base: Option<String>,
}

/// A PromQL string literal's contents: `\` and `"` escaped, and line
/// breaks, which a selector cannot hold raw.
pub fn promql_escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// Text for an alert's annotations or labels, which Prometheus expands as
/// Go templates: a literal `{{` is written as an action printing it.
pub fn template_escape(v: &str) -> String {
    v.replace("{{", "{{ \"{{\" }}")
}

/// `tier="…"`, escaped.
fn tier_sel(t: &Tier) -> String {
    format!("tier=\"{}\"", promql_escape(&t.name))
}

/// A number as PromQL and Prometheus' `le` label write it (`0.5`, `1`),
/// rounded off float noise.
fn num(x: f64) -> String {
    let r = (x * 1e9).round() / 1e9;
    format!("{r}")
}

/// The bucket bound the SLO is read at: the largest at or below it (the
/// smallest if the SLO is below them all), and whether it is the SLO.
pub fn slo_bucket(slo_s: f64) -> (f64, bool) {
    let mut best = TTFT_BUCKETS[0];
    for &b in TTFT_BUCKETS {
        if b <= slo_s + 1e-12 {
            best = b;
        }
    }
    (best, (best - slo_s).abs() < 1e-12)
}

fn runbook(anchor: &str) -> String {
    format!("{RUNBOOK}#{anchor}")
}

fn ms(x: f64) -> String {
    if x >= 3_600_000.0 && x % 3_600_000.0 == 0.0 {
        format!("{}h", x / 3_600_000.0)
    } else if x >= 60_000.0 && x % 60_000.0 == 0.0 {
        format!("{}m", x / 60_000.0)
    } else if x >= 1000.0 && x % 1000.0 == 0.0 {
        format!("{}s", x / 1000.0)
    } else {
        format!("{}ms", num(x))
    }
}

/// Name of the recorded TTFT error ratio over `w`.
fn ratio_name(w: &str) -> String {
    format!("kiln:tier_ttft_errors:ratio_rate{w}")
}

/// The TTFT error ratio of one tier over window `w`: (first tokens after
/// the bound + refused) / (first tokens + refused). Each side that has no
/// series yet is taken as 0 of the other's labels, so a tier whose every
/// request is refused still has a ratio (of 1).
fn ratio_expr(sel: &str, le: &str, w: &str) -> String {
    let ft = format!("sum by (tier) (rate(kiln_ttft_seconds_count{{{sel}}}[{w}]))");
    let good = format!("sum by (tier) (rate(kiln_ttft_seconds_bucket{{{sel},le=\"{le}\"}}[{w}]))");
    // Refusals are counted in kiln_rejects_total (a refused request never
    // reaches kiln_requests_total).
    let rej = format!("sum by (tier) (rate(kiln_rejects_total{{{sel}}}[{w}]))");
    let ft0 = format!("({ft} or {rej} * 0)");
    let good0 = format!("({good} or {rej} * 0)");
    let rej0 = format!("({rej} or {ft} * 0)");
    format!("({ft0} - {good0} + {rej0}) / ({ft0} + {rej0})")
}

/// A rate as the policy would write it: `500000 tokens a minute`, not
/// `8333.333333333 tokens a second`.
fn rate_words(per_s: f64, what: &str) -> String {
    for (scale, unit) in [(1.0, "a second"), (60.0, "a minute"), (3600.0, "an hour")] {
        let v = per_s * scale;
        if (v - v.round()).abs() < 1e-6 * v.max(1.0) {
            return format!("{} {what} {unit}", num(v.round()));
        }
    }
    format!("{} {what} a second", num(per_s))
}

fn alert(
    name: &str,
    expr: String,
    for_: &str,
    severity: &str,
    annotations: BTreeMap<String, String>,
) -> Rule {
    Rule {
        alert: Some(name.into()),
        expr,
        for_: Some(for_.into()),
        labels: BTreeMap::from([("severity".into(), severity.into())]),
        annotations,
        ..Rule::default()
    }
}

/// A tier's alert: its `tier` label set too, so the same alert of two
/// tiers are two rules (label values are templates: escaped).
/// Its `owner` and `escalation` labels are the tier's owner (else the
/// policy's), so Alertmanager can route the alert to the team that owns it.
fn tier_alert(
    (t, owner): (&Tier, &Owner),
    name: &str,
    expr: String,
    for_: &str,
    severity: &str,
    ann: BTreeMap<String, String>,
) -> Rule {
    let mut a = alert(name, expr, for_, severity, ann);
    a.labels.insert("tier".into(), template_escape(&t.name));
    owner_labels(&mut a, owner);
    a
}

/// `owner` and `escalation` labels, where the policy names them.
fn owner_labels(a: &mut Rule, owner: &Owner) {
    if let Some(o) = &owner.owner {
        a.labels.insert("owner".into(), template_escape(o));
    }
    if let Some(e) = &owner.escalation {
        a.labels.insert("escalation".into(), template_escape(e));
    }
}

/// Labels of an alert by pool (`$labels.pool`): each pool's owner where a
/// pool names its own, chosen by a template on the firing series' pool
/// label, the policy's owner otherwise.
fn pool_owner_labels(a: &mut Rule, g: &DecisionGraph) {
    for (key, pick) in [
        (
            "owner",
            (|o: &Owner| o.owner.clone()) as fn(&Owner) -> Option<String>,
        ),
        ("escalation", |o: &Owner| o.escalation.clone()),
    ] {
        // A pool's own value where it names one (an escalation contact
        // of its own, else the policy's, as `pool_owner` resolves it).
        let own: Vec<(&str, String)> = g
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| pick(&p.owner).is_some())
            .filter_map(|(i, p)| pick(&g.pool_owner(i as u16)).map(|v| (p.name.as_str(), v)))
            .collect();
        let fallback = pick(&g.owner);
        if own.is_empty() {
            if let Some(f) = fallback {
                a.labels.insert(key.into(), template_escape(&f));
            }
            continue;
        }
        let mut t = String::new();
        for (i, (pool, v)) in own.iter().enumerate() {
            let kw = if i == 0 { "if" } else { "else if" };
            t.push_str(&format!(
                "{{{{ {kw} eq $labels.pool \"{}\" }}}}{}",
                go_string(pool),
                template_escape(v)
            ));
        }
        // Prometheus keeps a label template that expands to nothing as it
        // is written: the pools without a value read `none`.
        let f = fallback.unwrap_or_else(|| "none".into());
        t.push_str(&format!("{{{{ else }}}}{}", template_escape(&f)));
        t.push_str("{{ end }}");
        a.labels.insert(key.into(), t);
    }
}

/// A Go template string literal's contents.
fn go_string(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn annotations(summary: String, description: String, anchor: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("summary".into(), summary),
        ("description".into(), description),
        ("runbook_url".into(), runbook(anchor)),
    ])
}

/// The rules file for a policy.
pub fn rules(g: &DecisionGraph, o: &Options) -> RulesFile {
    let policy = template_escape(&o.policy);
    let budget = 1.0 - o.objective;
    let pct = num(o.objective * 100.0);
    let mut recording = Vec::new();
    let mut slo_alerts = Vec::new();
    let mut saturation = Vec::new();
    for t in &g.tiers {
        let owner = g
            .tier_id(&t.name)
            .map_or_else(|| g.owner.clone(), |i| g.tier_owner(i));
        let owner = &owner;
        let sel = tier_sel(t);
        if let Some(ttft) = t.slo.ttft {
            let (bound, exact) = slo_bucket(ttft / 1000.0);
            let le = num(bound);
            for w in WINDOWS {
                recording.push(Rule {
                    record: Some(ratio_name(w)),
                    expr: ratio_expr(&sel, &le, w),
                    labels: BTreeMap::from([("tier".into(), t.name.clone())]),
                    ..Rule::default()
                });
            }
            let read_at = if exact {
                format!("read at the histogram bucket le={le}s")
            } else {
                format!(
                    "read at the histogram bucket le={le}s, the largest bound at or below the SLO (stricter than it)"
                )
            };
            for (suffix, rate, long, short, for_, severity) in BURNS {
                let thr = num(rate * budget);
                let expr = format!(
                    "{long_r}{{{sel}}} > {thr} and {short_r}{{{sel}}} > {thr}",
                    long_r = ratio_name(long),
                    short_r = ratio_name(short),
                );
                slo_alerts.push(tier_alert(
                (t, owner),
                    &format!("KilnTierTTFTBudgetBurn{suffix}"),
                    expr,
                    for_,
                    severity,
                    annotations(
                        format!(
                            "Tier {{{{ $labels.tier }}}} is burning its TTFT error budget {} times too fast",
                            num(*rate)
                        ),
                        format!(
                            "Policy {policy}: tier {{{{ $labels.tier }}}} has a TTFT SLO of {} ({pct}% of requests), {read_at}; refused requests count as misses. Over {long} and {short} more than {} of its requests missed it: {} times its error budget of {}.",
                            ms(ttft),
                            num(rate * budget * 100.0) + "%",
                            num(*rate),
                            num(budget * 100.0) + "%",
                        ),
                        "a-tier-is-missing-its-slo",
                    ),
                ));
            }
            saturation.push(tier_alert(
                (t, owner),
                "KilnTierQueueWaitAboveSLO",
                format!(
                    "max by (tier) (kiln_queue_oldest_wait_seconds{{{sel}}}) > {}",
                    num(ttft / 1000.0)
                ),
                "5m",
                "ticket",
                annotations(
                    "Tier {{ $labels.tier }} has requests waiting longer than its TTFT SLO".into(),
                    format!(
                        "Policy {policy}: the oldest queued request of tier {{{{ $labels.tier }}}} has waited more than its TTFT SLO of {} for 5 minutes: its queue is not draining.",
                        ms(ttft)
                    ),
                    "a-tier-is-missing-its-slo",
                ),
            ));
        }
        if let Some(p95) = t.slo.e2e_p95 {
            slo_alerts.push(tier_alert(
                (t, owner),
                "KilnTierE2EP95AboveSLO",
                format!(
                    "histogram_quantile(0.95, sum by (tier, le) (rate(kiln_e2e_seconds_bucket{{{sel}}}[30m]))) > {}",
                    num(p95 / 1000.0)
                ),
                "30m",
                "ticket",
                annotations(
                    "Tier {{ $labels.tier }} end-to-end p95 is above its SLO".into(),
                    format!(
                        "Policy {policy}: tier {{{{ $labels.tier }}}} has an end-to-end p95 SLO of {}; over the last 30 minutes its p95 was {{{{ $value | humanizeDuration }}}}.",
                        ms(p95)
                    ),
                    "a-tier-is-missing-its-slo",
                ),
            ));
        }
        if let Some(limit) = t.slo.error_rate {
            // Errors: refusals answered with a 5xx, and answers an upstream
            // failed or timed out; over everything that ended (refusals
            // are not in kiln_requests_total).
            let sum =
                |m: &str, extra: &str| format!("sum by (tier) (rate({m}{{{sel}{extra}}}[30m]))");
            let either =
                |a: String, b: String| format!("(({a}) or ({b}) * 0) + (({b}) or ({a}) * 0)");
            let errors = either(
                sum("kiln_rejects_total", ",status=~\"5..\""),
                sum(
                    "kiln_requests_total",
                    ",outcome=~\"upstream_error|timeout\"",
                ),
            );
            let ended = either(
                sum("kiln_rejects_total", ""),
                sum("kiln_requests_total", ""),
            );
            slo_alerts.push(tier_alert(
                (t, owner),
                "KilnTierErrorRateAboveSLO",
                format!("({errors}) / ({ended}) > {}", num(limit / 100.0)),
                "15m",
                "page",
                annotations(
                    "Tier {{ $labels.tier }} errors are above its SLO".into(),
                    format!(
                        "Policy {policy}: tier {{{{ $labels.tier }}}} has an error-rate SLO of {}%; over the last 30 minutes {{{{ $value | humanizePercentage }}}} of its requests ended in a 5xx (refused for capacity or a queue timeout, or failed by an upstream).",
                        num(limit)
                    ),
                    "a-tier-is-missing-its-slo",
                ),
            ));
        }
        if let Some(tp) = t.slo.throughput {
            // Below its objective while work waits: the tier asks for more
            // than it gets (without a queue, less demand is not a miss).
            let waiting = format!("sum by (tier) (kiln_queue_depth{{{sel}}}) > 0");
            for (what, per_s, served) in [
                (
                    "tokens",
                    tp.tokens_per_s,
                    format!("sum by (tier) (rate(kiln_tokens_total{{{sel}}}[15m]))"),
                ),
                (
                    "requests",
                    tp.requests_per_s,
                    format!(
                        "sum by (tier) (rate(kiln_requests_total{{{sel},outcome=\"ok\"}}[15m]))"
                    ),
                ),
            ] {
                let Some(per_s) = per_s else { continue };
                slo_alerts.push(tier_alert(
                    (t, owner),
                    "KilnTierThroughputBelowSLO",
                    format!("({served} < {}) and on (tier) ({waiting})", num(per_s)),
                    "15m",
                    "ticket",
                    annotations(
                        format!("Tier {{{{ $labels.tier }}}} is served fewer {what} a second than its SLO while work waits"),
                        format!(
                            "Policy {policy}: tier {{{{ $labels.tier }}}} has a throughput SLO of {}; for 15 minutes it was served {{{{ $value | humanize }}}} {what} a second with requests waiting in its queues.",
                            rate_words(per_s, what)
                        ),
                        "a-tier-is-missing-its-slo",
                    ),
                ));
            }
        }
        if let Some(window) = t.slo.window {
            slo_alerts.push(tier_alert(
                (t, owner),
                "KilnTierBatchPredictedMiss",
                format!("max by (tier) (kiln_batch_predicted_miss{{{sel}}}) > 0"),
                "10m",
                "ticket",
                annotations(
                    "Tier {{ $labels.tier }} has batches predicted to miss their window".into(),
                    format!(
                        "Policy {policy}: at the present rate some batches of tier {{{{ $labels.tier }}}} (completion window SLO {}) will finish after their window; the prediction has held for 10 minutes.",
                        ms(window)
                    ),
                    "a-tier-is-missing-its-slo",
                ),
            ));
            slo_alerts.push(tier_alert(
                (t, owner),
                "KilnTierDeadlineMisses",
                format!(
                    "((({a}) or ({b}) * 0) + (({b}) or ({a}) * 0)) > 0",
                    a = format!("sum by (tier) (increase(kiln_deadline_misses_total{{{sel}}}[30m]))"),
                    b = format!("sum by (tier) (increase(kiln_batch_deadline_misses_total{{{sel}}}[30m]))"),
                ),
                "0m",
                // A soft deadline's misses are expected under load.
                match t.slo.deadline {
                    crate::graph::Deadline::Hard => "page",
                    crate::graph::Deadline::Soft => "ticket",
                },
                annotations(
                    "Tier {{ $labels.tier }} is missing deadlines".into(),
                    format!(
                        "Policy {policy}: requests or batch items of tier {{{{ $labels.tier }}}} (completion window SLO {}) finished after their deadline, or expired unrun, in the last 30 minutes.",
                        ms(window)
                    ),
                    "a-tier-is-missing-its-slo",
                ),
            ));
        }
    }
    let budgets = budget_alerts(g, &policy);
    let fleet = vec![
        alert(
            "KilnReplicasBusy",
            "max by (pool, model, variant) (kiln_replica_busy_ratio) > 0.9".into(),
            "15m",
            "ticket",
            annotations(
                "Replicas of {{ $labels.pool }}/{{ $labels.model }}.{{ $labels.variant }} are more than 90% busy".into(),
                format!("Policy {policy}: the replicas serving {{{{ $labels.model }}}}.{{{{ $labels.variant }}}} in pool {{{{ $labels.pool }}}} have spent more than 90% of their time running steps for 15 minutes: the pool is at capacity."),
                "a-tier-is-missing-its-slo",
            ),
        ),
        alert(
            "KilnReplicaSlotsFull",
            "sum by (pool, model, variant) (kiln_replica_slots_used) >= sum by (pool, model, variant) (kiln_replica_slots) and sum by (pool, model, variant) (kiln_replica_slots) > 0".into(),
            "15m",
            "ticket",
            annotations(
                "Every batch slot of {{ $labels.pool }}/{{ $labels.model }}.{{ $labels.variant }} is in use".into(),
                format!("Policy {policy}: all batch slots of {{{{ $labels.model }}}}.{{{{ $labels.variant }}}} in pool {{{{ $labels.pool }}}} have been in use for 15 minutes; new work queues."),
                "a-tenant-is-flooding",
            ),
        ),
        alert(
            "KilnUpstreamBreakerOpen",
            "max by (pool, upstream) (kiln_upstream_breaker_open) > 0".into(),
            "2m",
            "page",
            annotations(
                "Upstream {{ $labels.upstream }} in pool {{ $labels.pool }} is refused by its circuit breaker".into(),
                format!("Policy {policy}: the circuit breaker of HTTP upstream {{{{ $labels.upstream }}}} (pool {{{{ $labels.pool }}}}) has been open for 2 minutes: the upstream keeps failing and gets no requests."),
                "an-upstream-is-down",
            ),
        ),
        alert(
            "KilnPolicyRolledBack",
            "sum by (trigger) (increase(kiln_rollbacks_total[10m])) > 0".into(),
            "0m",
            "ticket",
            annotations(
                "A policy rollout was rolled back ({{ $labels.trigger }})".into(),
                format!("Policy {policy}: the gateway rolled a policy version back in the last 10 minutes (trigger {{{{ $labels.trigger }}}}). The previous version serves again; find out what was wrong with the new one before it is proposed again."),
                "a-bad-policy-was-rolled-out",
            ),
        ),
        // A refused reload leaves the keys of the last good file in use: a
        // key revoked or expired in the file since then still works.
        alert(
            "KilnKeysReloadRefused",
            "sum by (instance) (increase(kiln_keys_reloads_total{result=\"error\"}[15m])) > 0".into(),
            "0m",
            "page",
            annotations(
                "A reload of API keys was refused on {{ $labels.instance }}: the keys in use are not the file's".into(),
                format!("Policy {policy}: on {{{{ $labels.instance }}}}, a reload of [[keys]] and admin tokens from kiln.toml (SIGHUP, a change to the file, or POST /admin/keys/reload) was refused in the last 15 minutes. The gateway still serves the keys of the last file it accepted, so a key revoked or expired in the file since then still works until the file is fixed."),
                "a-keys-reload-was-refused",
            ),
        ),
    ];
    let mut fleet = fleet;
    for a in &mut fleet {
        let by_pool = a.expr.contains("by (pool");
        if by_pool {
            pool_owner_labels(a, g);
        } else {
            owner_labels(a, &g.owner);
        }
    }
    let groups = [
        ("kiln-slo-ratios", recording),
        ("kiln-slo-alerts", slo_alerts),
        ("kiln-saturation", saturation),
        ("kiln-budgets", budgets),
    ]
    .into_iter()
    .filter(|(_, rules)| !rules.is_empty())
    .chain([("kiln-fleet", fleet)])
    .map(|(name, rules)| RuleGroup {
        name: name.into(),
        rules,
    })
    .collect();
    let mut out = RulesFile { groups };
    finish(&mut out, o);
    out
}

/// Per tenant or tier with a money `budget`: a ticket at 80% of it spent,
/// a page once it is spent. Each replica exports its share of the budget
/// and what it spent, so the sums over replicas are the fleet's.
fn budget_alerts(g: &DecisionGraph, policy: &str) -> Vec<Rule> {
    let tenants = g.tenants.iter().filter_map(|t| {
        let owner = Owner {
            owner: t.owner.clone(),
            escalation: t.escalation.clone(),
        }
        .or(&g.owner);
        t.budget.map(|b| ("tenant", t.name.as_str(), b, owner))
    });
    let tiers = g.tiers.iter().enumerate().filter_map(|(i, t)| {
        t.budget
            .map(|b| ("tier", t.name.as_str(), b, g.tier_owner(i as u16)))
    });
    let mut out = Vec::new();
    for (scope, name, b, owner) in tenants.chain(tiers) {
        let sel = format!(
            "scope=\"{scope}\",name=\"{}\",period=\"{}\"",
            promql_escape(name),
            b.period.name()
        );
        let share = format!(
            "sum by (scope, name) (kiln_budget_spent{{{sel}}}) / sum by (scope, name) (kiln_budget_limit{{{sel}}})"
        );
        let amount = format!("{} a {}", num(b.amount), b.period.name());
        // The low alert stops where the exhausted one starts.
        for (alert_name, range, severity, words) in [
            ("KilnBudgetLow", ">= 0.8 < 1", "ticket", "has spent 80% of"),
            ("KilnBudgetExhausted", ">= 1", "page", "has spent all of"),
        ] {
            let mut a = alert(
                alert_name,
                format!("({share}) {range}"),
                "0m",
                severity,
                annotations(
                    format!("{scope} {{{{ $labels.name }}}} {words} its budget"),
                    format!(
                        "Policy {policy}: {scope} {{{{ $labels.name }}}} has a budget of {amount}; its GPU time this {} has cost {{{{ $value | humanizePercentage }}}} of it. What happens now is what the policy's rules on `budget.remaining` say.",
                        b.period.name()
                    ),
                    "a-budget-is-running-out",
                ),
            );
            a.labels.insert(scope.into(), template_escape(name));
            owner_labels(&mut a, &owner);
            out.push(a);
        }
    }
    out
}

/// The rules file as YAML, with a header saying where it came from.
pub fn render(g: &DecisionGraph, o: &Options) -> Result<String, YamlError> {
    let yaml = serde_norway::to_string(&rules(g, o)).map_err(|e| YamlError(e.to_string()))?;
    let mut out = String::new();
    out.push_str("# Generated by `kiln alerts` from the policy ");
    // A comment runs to the end of its line: keep the name on it.
    out.push_str(&o.policy.replace(['\n', '\r'], " "));
    out.push_str(". Do not edit; regenerate.\n");
    out.push_str(&format!(
        "# Objective {}% per tier; TTFT SLOs are read at the largest bucket bound of kiln_ttft_seconds at or below them.\n",
        num(o.objective * 100.0)
    ));
    out.push_str(&yaml);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn objective_parses_percent_and_share() {
        assert_eq!(parse_objective("99%").unwrap(), 0.99);
        assert!((parse_objective("99.9%").unwrap() - 0.999).abs() < 1e-12);
        assert_eq!(parse_objective("0.95").unwrap(), 0.95);
        for bad in ["100%", "0", "-1%", "abc", "NaN", "1.5"] {
            assert!(parse_objective(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn slo_falls_on_or_below_a_bucket() {
        assert_eq!(slo_bucket(0.5), (0.5, true));
        assert_eq!(slo_bucket(0.8), (0.5, false));
        assert_eq!(slo_bucket(1.5), (1.0, false));
        assert_eq!(slo_bucket(0.0001), (0.001, false));
        assert_eq!(slo_bucket(1000.0), (60.0, false));
        assert_eq!(num(1.0), "1");
        assert_eq!(num(14.4 * 0.01), "0.144");
    }

    #[test]
    fn selectors_scope_every_series_and_aggregation() {
        let m = parse_selector(r#"job="kiln", namespace=~"prod|stage""#).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            scope(
                r#"sum by (tier) (rate(kiln_ttft_seconds_bucket{tier="a \" kiln_x",le="1"}[5m])) / kiln:tier_ttft_errors:ratio_rate5m > 0 and max(kiln_up{}) or on() vector(0)"#,
                &m
            ),
            r#"sum by (tier, job, namespace) (rate(kiln_ttft_seconds_bucket{job="kiln",namespace=~"prod|stage",tier="a \" kiln_x",le="1"}[5m])) / kiln:tier_ttft_errors:ratio_rate5m{job="kiln",namespace=~"prod|stage"} > 0 and max(kiln_up{job="kiln",namespace=~"prod|stage"}) or on() vector(0)"#
        );
        assert_eq!(
            scope("rate(kiln_x[$__rate_interval])", &[]),
            "rate(kiln_x[$__rate_interval])"
        );
        for bad in [
            "job",
            "job=kiln",
            "job=\"kiln",
            "tier=\"x\"",
            "job=\"a\" ns=\"b\"",
            "job=\"a\",job=\"b\"",
        ] {
            assert!(parse_selector(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_selector("{job=\"kiln\"}").unwrap()[0].value, "kiln");
        assert!(parse_selector("").unwrap().is_empty());
    }

    #[test]
    fn rates_read_as_written() {
        assert_eq!(
            rate_words(500_000.0 / 60.0, "tokens"),
            "500000 tokens a minute"
        );
        assert_eq!(rate_words(20.0, "requests"), "20 requests a second");
        assert_eq!(rate_words(3.0 / 3600.0, "requests"), "3 requests an hour");
    }

    #[test]
    fn escapes() {
        assert_eq!(promql_escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(template_escape("x{{ y }}"), "x{{ \"{{\" }} y }}");
    }

    proptest! {
        /// Any string in a rule (a hostile tier name in its labels and
        /// annotations) reads back from the YAML as it went in.
        #[test]
        fn rules_read_back_from_their_yaml(s in any::<String>()) {
            let f = RulesFile {
                groups: vec![RuleGroup {
                    name: s.clone(),
                    rules: vec![Rule {
                        alert: Some(s.clone()),
                        expr: s.clone(),
                        labels: BTreeMap::from([("tier".into(), s.clone())]),
                        annotations: BTreeMap::from([(s.clone(), s.clone())]),
                        ..Rule::default()
                    }],
                }],
            };
            let text = serde_norway::to_string(&f).unwrap();
            let back: RulesFile = serde_norway::from_str(&text).unwrap();
            prop_assert_eq!(back, f);
        }

        #[test]
        fn promql_escaped_values_have_no_bare_quote(s in any::<String>()) {
            let e = promql_escape(&s);
            let mut chars = e.chars();
            while let Some(c) = chars.next() {
                prop_assert!(c != '"' && c != '\n');
                if c == '\\' {
                    prop_assert!(chars.next().is_some());
                }
            }
        }
    }
}
