//! Batches as `kiln batches` and `kiln status` print them: one row per
//! batch with its progress, predicted finish against its window, and what
//! it cost. Rendered from the batch objects the gateway answers with, so
//! the CLI shows exactly what the API says.

use serde_json::Value;
use std::fmt::Write as _;

/// A duration in seconds as `3h12m`, `4m05s`, `12s`.
pub fn human_secs(s: i64) -> String {
    let (sign, s) = if s < 0 { ("-", -s) } else { ("", s) };
    if s >= 86_400 {
        format!("{sign}{}d{:02}h", s / 86_400, (s % 86_400) / 3600)
    } else if s >= 3600 {
        format!("{sign}{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{sign}{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{sign}{s}s")
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// The table of batches (OpenAI batch objects with their `kiln` block),
/// with times relative to `now` (unix seconds).
pub fn render_table(batches: &[Value], now: i64) -> String {
    if batches.is_empty() {
        return "no batches\n".into();
    }
    let head = [
        "BATCH",
        "TENANT",
        "TIER",
        "STATUS",
        "DONE",
        "FAILED",
        "IN FLIGHT",
        "FINISH",
        "WINDOW LEFT",
        "GPU-S",
        "COST",
    ];
    let mut rows: Vec<[String; 11]> = Vec::new();
    for b in batches {
        let k = &b["kiln"];
        let c = &b["request_counts"];
        let total = c["total"].as_u64().unwrap_or(0);
        let done = c["completed"].as_u64().unwrap_or(0) + c["failed"].as_u64().unwrap_or(0);
        let pct = if total > 0 {
            done as f64 * 100.0 / total as f64
        } else {
            100.0
        };
        let status = b["status"].as_str().unwrap_or("?");
        let terminal = matches!(status, "completed" | "failed" | "expired" | "cancelled");
        let finish = match (terminal, k["predicted_finish_at"].as_i64()) {
            (true, _) => "-".to_string(),
            (false, Some(t)) => {
                let miss = if k["predicted_miss"].as_bool() == Some(true) {
                    " MISS"
                } else {
                    ""
                };
                format!("in {}{miss}", human_secs(t - now))
            }
            (false, None) => "unknown".into(),
        };
        let left = if terminal {
            "-".to_string()
        } else {
            b["expires_at"]
                .as_i64()
                .map_or("-".into(), |e| human_secs(e - now))
        };
        rows.push([
            text(&b["id"]),
            text(&k["owner"]),
            text(&k["tier"]),
            status.to_string(),
            format!("{done}/{total} {pct:.0}%"),
            c["failed"].as_u64().unwrap_or(0).to_string(),
            k["in_flight"]
                .as_u64()
                .map_or("-".into(), |n| n.to_string()),
            finish,
            left,
            k["gpu_seconds"]
                .as_f64()
                .map_or("-".into(), |g| format!("{g:.1}")),
            k["cost"].as_f64().map_or("-".into(), |c| format!("{c:.4}")),
        ]);
    }
    let mut t = crate::table::new(&head.map(|h| (h, crate::table::Left)));
    t.add_rows(rows);
    let mut out = crate::table::render(&t, "");
    let misses: Vec<&str> = batches
        .iter()
        .filter(|b| b["kiln"]["predicted_miss"].as_bool() == Some(true))
        .filter_map(|b| b["id"].as_str())
        .collect();
    if !misses.is_empty() {
        let _ = writeln!(
            out,
            "\n{} batch(es) predicted to miss their completion window at the current load: {}",
            misses.len(),
            misses.join(", ")
        );
        out.push_str("help: give their tier more share (`reserve`), raise its priority, or move interactive load; `kiln diff --traffic` shows the effect first\n");
    }
    out
}

/// One batch in full.
pub fn render_one(b: &Value, now: i64) -> String {
    let mut out = render_table(std::slice::from_ref(b), now);
    let k = &b["kiln"];
    let _ = writeln!(out);
    for (label, key) in [
        ("input file", "input_file_id"),
        ("endpoint", "endpoint"),
        ("window", "completion_window"),
        ("output file", "output_file_id"),
        ("error file", "error_file_id"),
    ] {
        let _ = writeln!(out, "{label:<16}{}", text(&b[key]));
    }
    let _ = writeln!(
        out,
        "{:<16}{}",
        "deadline misses",
        text(&k["deadline_misses"])
    );
    if let Some(m) = b["metadata"].as_object() {
        for (key, v) in m {
            let _ = writeln!(out, "{:<16}{key} = {}", "metadata", text(v));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn batch(id: &str, status: &str, done: u64, finish: Option<i64>, miss: bool) -> Value {
        json!({
            "id": id, "object": "batch", "status": status, "endpoint": "/v1/chat/completions",
            "input_file_id": "file-1", "completion_window": "24h",
            "created_at": 1_000, "expires_at": 1_000 + 86_400,
            "request_counts": {"total": 50_000, "completed": done, "failed": 12},
            "metadata": {"job": "nightly"}, "output_file_id": null, "error_file_id": null,
            "kiln": {"owner": "catalog", "tier": "batch", "predicted_finish_at": finish,
                     "predicted_miss": miss, "gpu_seconds": 5321.25, "cost": 5.912, "in_flight": 512,
                     "deadline_misses": 0}
        })
    }

    #[test]
    fn table_snapshot() {
        let now = 1_000 + 3600;
        let t = render_table(
            &[
                batch("batch_a", "in_progress", 20_000, Some(now + 5_400), false),
                batch("batch_b", "in_progress", 100, Some(now + 90_000), true),
                batch("batch_c", "completed", 49_988, None, false),
            ],
            now,
        );
        insta::assert_snapshot!(t);
    }

    #[test]
    fn one_snapshot() {
        let now = 1_000 + 60;
        insta::assert_snapshot!(render_one(
            &batch("batch_a", "in_progress", 7, Some(now + 75), false),
            now
        ));
    }

    #[test]
    fn durations() {
        assert_eq!(human_secs(5), "5s");
        assert_eq!(human_secs(65), "1m05s");
        assert_eq!(human_secs(3_700), "1h01m");
        assert_eq!(human_secs(90_000), "1d01h");
        assert_eq!(human_secs(-65), "-1m05s");
        assert_eq!(render_table(&[], 0), "no batches\n");
        // Hostile shapes render, never panic.
        let _ = render_table(&[json!(null), json!({"kiln": 3})], 0);
    }
}
