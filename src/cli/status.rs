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
    if a.format == Format::Json {
        let mut v = v;
        v["batches"] = serde_json::Value::Array(batches);
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    match admin_client::parse::<StatusView>(v) {
        Ok(s) => {
            print!("{}", render_status(&s));
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
