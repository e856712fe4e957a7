//! `kiln rollback --server URL`: abort the rollout in progress, or return
//! to the previous version (with approvals when the rules in force want
//! them for `rollback`).

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use crate::governance::view::{render_proposal, ProposalView};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Why (recorded in the audit log).
    #[arg(long)]
    pub reason: Option<String>,
    #[command(flatten)]
    pub server: ServerArgs,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

pub fn run(a: Args) -> i32 {
    let body = json!({ "reason": a.reason });
    let (status, v) =
        match admin_client::call(&a.server, Method::Post, "/admin/rollback", Some(&body)) {
            Ok(x) => x,
            Err(c) => return c,
        };
    if !(200..300).contains(&status) {
        return admin_client::report_error(status, &v);
    }
    if a.format == Format::Json {
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    if v["rolled_back"] == json!(true) {
        let r = &v["rollback"];
        match v["aborted"].as_str() {
            Some(id) => println!(
                "rollout of {id} aborted in {}: {} keeps serving",
                v["stage"].as_str().unwrap_or("?"),
                r["to"].as_str().unwrap_or("?")
            ),
            None => println!(
                "rolled back: {} → {}",
                r["from"].as_str().unwrap_or("?"),
                r["to"].as_str().unwrap_or("?")
            ),
        }
        return EXIT_OK;
    }
    match admin_client::parse::<ProposalView>(v["proposal"].clone()) {
        Ok(p) => {
            println!("the rules in force require approval for a rollback:");
            print!("{}", render_proposal(&p));
            EXIT_OK
        }
        Err(c) => c,
    }
}
