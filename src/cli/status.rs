//! `kiln status --server URL`: active version, rollout, open proposals
//! with the approvals they still miss, overrides, and the batches with
//! their progress and predicted finish.

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use crate::governance::view::{render_status, StatusView};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub server: ServerArgs,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

pub fn run(a: Args) -> i32 {
    let (status, v) = match admin_client::call(&a.server, Method::Get, "/admin/status", None) {
        Ok(x) => x,
        Err(c) => return c,
    };
    if status != 200 {
        return admin_client::report_error(status, &v);
    }
    // Unfinished and recent batches, under the governance state.
    let batches = match admin_client::call(&a.server, Method::Get, "/admin/batches?limit=20", None)
    {
        Ok((200, b)) => b["data"].as_array().cloned().unwrap_or_default(),
        _ => Vec::new(),
    };
    // The fleet's replicas and the version each runs (`[state]`).
    let fleet = match admin_client::call(&a.server, Method::Get, "/admin/replicas", None) {
        Ok((200, f)) => Some(f),
        _ => None,
    };
    if a.format == Format::Json {
        let mut v = v;
        v["batches"] = serde_json::Value::Array(batches);
        if let Some(f) = &fleet {
            v["fleet"] = f.clone();
        }
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    match admin_client::parse::<StatusView>(v) {
        Ok(s) => {
            print!("{}", render_status(&s));
            if let Some(f) = fleet.as_ref().filter(|f| f["shared"] == true) {
                print!("{}", render_fleet(f));
            }
            println!("\nbatches:");
            print!(
                "{}",
                crate::batch::view::render_table(&batches, crate::batch::now_s())
            );
            EXIT_OK
        }
        Err(c) => c,
    }
}

/// The fleet section of `kiln status`: one line per live replica.
pub fn render_fleet(f: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nreplicas (shared state{}; on_unavailable {}):",
        if f["reachable"] == true {
            ""
        } else {
            " UNREACHABLE from this replica"
        },
        f["on_unavailable"].as_str().unwrap_or("?")
    );
    let list = f["replicas"].as_array().cloned().unwrap_or_default();
    let versions: std::collections::BTreeSet<&str> =
        list.iter().filter_map(|r| r["version"].as_str()).collect();
    let rows = list
        .iter()
        .map(|r| {
            vec![
                r["id"].as_str().unwrap_or("?").to_string(),
                r["version"].as_str().unwrap_or("?").to_string(),
                format!("epoch {}", r["epoch"].as_u64().unwrap_or(0)),
                format!("in flight {}", r["in_flight"].as_u64().unwrap_or(0)),
                if r["id"] == f["replica"] {
                    "(this one)".to_string()
                } else {
                    String::new()
                },
            ]
        })
        .collect();
    out.push_str(&crate::table::render(
        &crate::table::headless(rows, &[]),
        "  ",
    ));
    if list.is_empty() {
        out.push_str("  (none seen)\n");
    }
    if versions.len() > 1 {
        let _ = writeln!(
            out,
            "  versions differ across replicas: {} (a replica that cannot run the fleet's version keeps its own; see its log)",
            versions.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::render_fleet;
    use serde_json::json;

    #[test]
    fn the_fleet_section_lists_each_replica_and_says_when_versions_differ() {
        let f = json!({
            "shared": true, "replica": "gw-b", "reachable": true, "on_unavailable": "local",
            "version": "sha256:aaaaaaaaaaaa", "epoch": 7, "fleet_epoch": 7,
            "replicas": [
                {"id": "gw-a", "version": "sha256:aaaaaaaaaaaa", "epoch": 7, "started_unix_ms": 1, "seen_unix_ms": 2, "in_flight": 12},
                {"id": "gw-b", "version": "sha256:aaaaaaaaaaaa", "epoch": 7, "started_unix_ms": 1, "seen_unix_ms": 2, "in_flight": 3},
                {"id": "gw-c", "version": "sha256:bbbbbbbbbbbb", "epoch": 6, "started_unix_ms": 1, "seen_unix_ms": 2, "in_flight": 0}
            ]
        });
        insta::assert_snapshot!(render_fleet(&f));
        let down = json!({"shared": true, "replica": "gw-b", "reachable": false, "on_unavailable": "refuse", "replicas": []});
        insta::assert_snapshot!("unreachable", render_fleet(&down));
    }
}
