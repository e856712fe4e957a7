//! `kiln dashboard`: a Grafana dashboard (JSON, schema 39) for a policy's
//! gateway, on the metrics it exports (`server::metrics`).
//!
//! Per tier of the policy: TTFT p50/p99 and end-to-end p95 against the
//! tier's SLO (a threshold line at it). Then the fleet: queue depth and
//! oldest wait, admitted and refused by reason, what each tenant is served
//! (tokens per second: fair share is over service, and there is no fair
//! share metric), GPU busy ratio, cost per tenant, useful and wasted GPU
//! time, the policy version in force and the rollout (canary and shadow
//! decisions), upstream breakers.
//!
//! Tier names are written into PromQL string literals escaped
//! ([`super::alerts::promql_escape`]). Grafana expands `$name` in queries
//! and has no escape for it; a `$` in a tier name is left as it is.

use super::alerts::{promql_escape, scope, Matcher};
use crate::graph::DecisionGraph;
use serde_json::{json, Value};

const DS: &str = "${datasource}";

fn target(expr: String, legend: &str, ref_id: usize) -> Value {
    // A series that does not exist yet (no refusal, no rollout, no HTTP
    // upstream on a fresh gateway) reads 0, not "No data"; `on()` adds the
    // 0 only when there is no series at all. Latency quantiles are left
    // empty: 0 s would be a lie.
    let expr = if expr.starts_with("histogram_quantile") {
        expr
    } else {
        format!("{expr} or on() vector(0)")
    };
    json!({
        "datasource": { "type": "prometheus", "uid": DS },
        "expr": expr,
        "legendFormat": legend,
        "refId": ref_id_name(ref_id),
    })
}

fn ref_id_name(i: usize) -> String {
    let letters = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (letters[i % 26] as char).to_string()
}

/// A time series panel; `slo`: a red threshold line at that value.
fn timeseries(
    id: &mut u32,
    title: String,
    unit: &str,
    targets: Vec<Value>,
    slo: Option<f64>,
    pos: (u32, u32, u32, u32),
) -> Value {
    *id += 1;
    let mut steps = vec![json!({ "color": "green", "value": null })];
    if let Some(v) = slo {
        steps.push(json!({ "color": "red", "value": v }));
    }
    let mode = if slo.is_some() { "line" } else { "off" };
    json!({
        "id": *id,
        "type": "timeseries",
        "title": title,
        "datasource": { "type": "prometheus", "uid": DS },
        "gridPos": { "x": pos.0, "y": pos.1, "w": pos.2, "h": pos.3 },
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": { "thresholdsStyle": { "mode": mode } },
                "thresholds": { "mode": "absolute", "steps": steps },
            },
            "overrides": [],
        },
        "options": { "legend": { "displayMode": "list", "placement": "bottom" } },
        "targets": targets,
    })
}

/// A panel's description naming who owns what it shows.
fn owner_text(o: &crate::graph::Owner) -> Option<String> {
    let owner = o.owner.as_ref()?;
    Some(match &o.escalation {
        Some(e) => format!("Owner: {owner}; escalation: {e}"),
        None => format!("Owner: {owner}"),
    })
}

fn row(id: &mut u32, title: &str, y: u32) -> Value {
    *id += 1;
    json!({
        "id": *id,
        "type": "row",
        "title": title,
        "collapsed": false,
        "gridPos": { "x": 0, "y": y, "w": 24, "h": 1 },
        "panels": [],
    })
}

fn variable(name: &str, label: &str, query: &str) -> Value {
    json!({
        "name": name,
        "label": label,
        "type": "query",
        "datasource": { "type": "prometheus", "uid": DS },
        "query": { "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery" },
        "definition": query,
        "refresh": 2,
        "includeAll": true,
        "multi": true,
        "allValue": ".*",
        "current": { "selected": true, "text": ["All"], "value": ["$__all"] },
        "sort": 1,
    })
}

/// The dashboard for a policy; `policy` is its name as the operator gave
/// it, for the title.
pub fn dashboard(g: &DecisionGraph, policy: &str) -> Value {
    let mut id = 0u32;
    let mut panels = Vec::new();
    let mut y = 0u32;
    panels.push(row(&mut id, "SLOs per tier", y));
    y += 1;
    for t in &g.tiers {
        let sel = format!("tier=\"{}\"", promql_escape(&t.name));
        let q = |p: &str, m: &str| {
            format!("histogram_quantile({p}, sum by (le) (rate({m}_bucket{{{sel}}}[$__rate_interval])))")
        };
        let ttft = timeseries(
            &mut id,
            format!("{}: time to first token", t.name),
            "s",
            vec![
                target(q("0.5", "kiln_ttft_seconds"), "p50", 0),
                target(q("0.99", "kiln_ttft_seconds"), "p99", 1),
            ],
            t.slo.ttft.map(|v| v / 1000.0),
            (0, y, 12, 8),
        );
        let e2e = timeseries(
            &mut id,
            format!("{}: end-to-end latency", t.name),
            "s",
            vec![
                target(q("0.5", "kiln_e2e_seconds"), "p50", 0),
                target(q("0.95", "kiln_e2e_seconds"), "p95", 1),
            ],
            t.slo.e2e_p95.or(t.slo.window).map(|v| v / 1000.0),
            (12, y, 12, 8),
        );
        let mut ttft = ttft;
        let mut e2e = e2e;
        if let Some(d) = g
            .tier_id(&t.name)
            .and_then(|i| owner_text(&g.tier_owner(i)))
        {
            ttft["description"] = Value::String(d.clone());
            e2e["description"] = Value::String(d);
        }
        panels.push(ttft);
        panels.push(e2e);
        y += 8;
    }
    let tt = "tier=~\"$tier\",tenant=~\"$tenant\"";
    panels.push(row(&mut id, "Queues and admission", y));
    y += 1;
    panels.push(timeseries(
        &mut id,
        "Queue depth".into(),
        "short",
        vec![target(
            format!("sum by (tier, tenant) (kiln_queue_depth{{{tt}}})"),
            "{{tier}} / {{tenant}}",
            0,
        )],
        None,
        (0, y, 12, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "Oldest queued request's wait".into(),
        "s",
        vec![target(
            format!("max by (tier, tenant) (kiln_queue_oldest_wait_seconds{{{tt}}})"),
            "{{tier}} / {{tenant}}",
            0,
        )],
        None,
        (12, y, 12, 8),
    ));
    y += 8;
    panels.push(timeseries(
        &mut id,
        "Requests finished, by outcome".into(),
        "reqps",
        vec![target(
            format!("sum by (tier, outcome) (rate(kiln_requests_total{{{tt}}}[$__rate_interval]))"),
            "{{tier}} {{outcome}}",
            0,
        )],
        None,
        (0, y, 12, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "Refused, by reason".into(),
        "reqps",
        vec![target(
            format!(
                "sum by (tier, reason, status) (rate(kiln_rejects_total{{{tt}}}[$__rate_interval]))"
            ),
            "{{tier}} {{reason}} ({{status}})",
            0,
        )],
        None,
        (12, y, 12, 8),
    ));
    y += 8;
    // What retries add to the queues: a refusal that comes back as a
    // retry is pressure the refusal did not remove.
    panels.push(timeseries(
        &mut id,
        "Retries, by reason".into(),
        "reqps",
        vec![target(
            format!("sum by (tier, reason) (rate(kiln_retries_total{{{tt}}}[$__rate_interval]))"),
            "{{tier}} {{reason}}",
            0,
        )],
        None,
        (0, y, 12, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "Client retries' share of requests".into(),
        "percentunit",
        vec![target(
            format!(
                "sum by (tenant) (rate(kiln_retries_total{{{tt},reason=\"client\"}}[$__rate_interval])) / sum by (tenant) (rate(kiln_requests_total{{{tt}}}[$__rate_interval]))"
            ),
            "{{tenant}}",
            0,
        )],
        None,
        (12, y, 12, 8),
    ));
    y += 8;
    panels.push(row(&mut id, "Service, GPUs and cost", y));
    y += 1;
    panels.push(timeseries(
        &mut id,
        "Served per tenant (tokens/s: what fair share divides)".into(),
        "short",
        vec![target(
            format!("sum by (tenant, kind) (rate(kiln_tokens_total{{{tt}}}[$__rate_interval]))"),
            "{{tenant}} {{kind}}",
            0,
        )],
        None,
        (0, y, 12, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "GPU busy ratio".into(),
        "percentunit",
        vec![target(
            "avg by (pool, model, variant) (kiln_replica_busy_ratio)".into(),
            "{{pool}} / {{model}}.{{variant}}",
            0,
        )],
        None,
        (12, y, 12, 8),
    ));
    y += 8;
    panels.push(timeseries(
        &mut id,
        "Cost per tenant (USD/hour)".into(),
        "currencyUSD",
        vec![target(
            format!("sum by (tenant) (rate(kiln_cost_usd_total{{{tt}}}[$__rate_interval])) * 3600"),
            "{{tenant}}",
            0,
        )],
        None,
        (0, y, 12, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "Batch slots in use".into(),
        "short",
        vec![
            target(
                "sum by (pool, model, variant) (kiln_replica_slots_used)".into(),
                "{{pool}} / {{model}}.{{variant}} used",
                0,
            ),
            target(
                "sum by (pool, model, variant) (kiln_replica_slots)".into(),
                "{{pool}} / {{model}}.{{variant}} slots",
                1,
            ),
        ],
        None,
        (12, y, 12, 8),
    ));
    y += 8;
    // Useful against wasted: GPU time spent on answers nobody received
    // (recompute after a preemption, abandoned and failed answers, work
    // preempted and refused) is capacity bought for nothing.
    panels.push(timeseries(
        &mut id,
        "GPU time: useful and wasted, by reason (GPU-seconds per second)".into(),
        "short",
        vec![
            target(
                format!(
                    "sum by (pool) (rate(kiln_gpu_seconds_total{{{tt}}}[$__rate_interval])) - sum by (pool) (rate(kiln_gpu_seconds_wasted_total{{{tt}}}[$__rate_interval]))"
                ),
                "{{pool}} useful",
                0,
            ),
            target(
                format!(
                    "sum by (pool, reason) (rate(kiln_gpu_seconds_wasted_total{{{tt}}}[$__rate_interval]))"
                ),
                "{{pool}} wasted: {{reason}}",
                1,
            ),
        ],
        None,
        (0, y, 24, 8),
    ));
    y += 8;
    // Money budgets: summed over replicas (each exports its share), the
    // share of each tenant's and tier's budget spent this period.
    if g.tenants.iter().any(|t| t.budget.is_some()) || g.tiers.iter().any(|t| t.budget.is_some()) {
        panels.push(timeseries(
            &mut id,
            "Money budgets: share spent this period".into(),
            "percentunit",
            vec![target(
                "sum by (scope, name, period) (kiln_budget_spent) / sum by (scope, name, period) (kiln_budget_limit)".into(),
                "{{scope}} {{name}} ({{period}})",
                0,
            )],
            Some(0.8),
            (0, y, 24, 8),
        ));
        y += 8;
    }
    panels.push(row(&mut id, "Policy and rollout", y));
    y += 1;
    panels.push(timeseries(
        &mut id,
        "Policy version in force".into(),
        "short",
        vec![target(
            "max by (version) (kiln_policy_info)".into(),
            "{{version}}",
            0,
        )],
        None,
        (0, y, 8, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "Rollout: canary and shadow decisions, stages begun".into(),
        "reqps",
        vec![
            target(
                "sum by (version) (rate(kiln_canary_requests_total[$__rate_interval]))".into(),
                "canary {{version}}",
                0,
            ),
            target(
                "sum by (version, result) (rate(kiln_shadow_decisions_total[$__rate_interval]))"
                    .into(),
                "shadow {{version}} {{result}}",
                1,
            ),
            target(
                "sum by (trigger) (increase(kiln_rollbacks_total[$__rate_interval]))".into(),
                "rollback {{trigger}}",
                2,
            ),
            target(
                "sum by (version, stage) (increase(kiln_rollout_stages_total[$__rate_interval]))"
                    .into(),
                "stage {{stage}} began ({{version}})",
                3,
            ),
        ],
        None,
        (8, y, 8, 8),
    ));
    panels.push(timeseries(
        &mut id,
        "Upstream breakers open".into(),
        "short",
        vec![target(
            "max by (pool, upstream) (kiln_upstream_breaker_open)".into(),
            "{{pool}} / {{upstream}}",
            0,
        )],
        None,
        (16, y, 8, 8),
    ));
    let mut out = json!({
        "title": format!("kiln: {policy}"),
        "uid": null,
        "tags": ["kiln"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": true,
        "refresh": "30s",
        "time": { "from": "now-6h", "to": "now" },
        "annotations": { "list": [] },
        "templating": { "list": [
            {
                "name": "datasource",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "refresh": 1,
                "current": {},
            },
            variable("tier", "Tier", "label_values(kiln_requests_total, tier)"),
            variable("tenant", "Tenant", "label_values(kiln_requests_total{tier=~\"$tier\"}, tenant)"),
        ]},
        "panels": panels,
    });
    if let Some(d) = owner_text(&g.owner) {
        out["description"] = Value::String(d);
    }
    out
}

/// [`dashboard`] scoped to `matchers` (`--selector`): every query
/// through [`scope`], each `=` matcher a custom variable whose default is
/// its value (the queries read `label="$label"`).
pub fn scoped(g: &DecisionGraph, policy: &str, matchers: &[Matcher]) -> Value {
    let mut d = dashboard(g, policy);
    if matchers.is_empty() {
        return d;
    }
    let in_queries: Vec<Matcher> = matchers
        .iter()
        .map(|m| match m.op {
            "=" => Matcher {
                value: format!("${}", m.label),
                ..m.clone()
            },
            _ => m.clone(),
        })
        .collect();
    rescope(&mut d, &in_queries);
    let vars: Vec<Value> = matchers
        .iter()
        .filter(|m| m.op == "=")
        .map(|m| {
            json!({
                "name": m.label,
                "label": m.label,
                "type": "custom",
                "query": m.value,
                "current": { "selected": true, "text": m.value, "value": m.value },
                "options": [{ "selected": true, "text": m.value, "value": m.value }],
                "hide": 0,
            })
        })
        .collect();
    if let Some(list) = d["templating"]["list"].as_array_mut() {
        // After the data source, before the tier and tenant variables
        // whose queries read them.
        let at = 1.min(list.len());
        for (i, v) in vars.into_iter().enumerate() {
            list.insert(at + i, v);
        }
    }
    d
}

fn rescope(v: &mut Value, m: &[Matcher]) {
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match (k.as_str(), x) {
                    ("expr" | "definition" | "query", Value::String(e)) => *e = scope(e, m),
                    (_, x) => rescope(x, m),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rescope(x, m)),
        _ => {}
    }
}

/// Every PromQL expression of a dashboard (panel targets and variables).
pub fn exprs(d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    collect(d, &mut out);
    out
}

fn collect(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                    _ => collect(x, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
        _ => {}
    }
}

/// The `kiln_` metric names an expression uses, histogram suffixes
/// (`_bucket`, `_sum`, `_count`) taken off: identifiers scanned by hand.
pub fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut cur = String::new();
    let mut in_str = false;
    let mut prev = '\0';
    for c in expr.chars().chain(std::iter::once(' ')) {
        if in_str {
            if c == '"' && prev != '\\' {
                in_str = false;
            }
            prev = if prev == '\\' && c == '\\' { '\0' } else { c };
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            cur.push(c);
        } else {
            if cur.starts_with("kiln_") {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| cur.strip_suffix(s))
                    .unwrap_or(&cur);
                names.push(base.to_string());
            }
            cur.clear();
            if c == '"' {
                in_str = true;
                prev = '\0';
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_scanned_outside_strings() {
        assert_eq!(
            metric_names(
                "sum(rate(kiln_ttft_seconds_bucket{tier=\"kiln_fake \\\" kiln_x\",le=\"1\"}[5m])) / kiln:tier_ttft_errors:ratio_rate5m + kiln_requests_total"
            ),
            vec!["kiln_requests_total", "kiln_ttft_seconds"]
        );
    }
}
