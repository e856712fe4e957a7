//! `kiln batches`: list, inspect and cancel a gateway's batches through
//! `/admin/batches` (every tenant's; an admin token where one is set).

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use crate::batch::view::{render_one, render_table};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub action: Option<Action>,
    #[command(flatten)]
    pub server: ServerArgs,
    #[arg(long, value_enum, default_value_t = Format::Human, global = true)]
    pub format: Format,
}

#[derive(clap::Subcommand, Debug)]
pub enum Action {
    /// Batches, newest first, with progress, predicted finish and cost.
    List {
        /// How many (at most 100).
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// The page after this batch id.
        #[arg(long)]
        after: Option<String>,
    },
    /// One batch in full.
    Show { id: String },
    /// Cancel a batch: items not yet run end in its error file.
    Cancel { id: String },
}

fn now() -> i64 {
    crate::batch::now_s()
}

pub fn run(a: Args) -> i32 {
    let (method, path, one) = match &a.action {
        None => (Method::Get, "/admin/batches?limit=20".to_string(), false),
        Some(Action::List { limit, after }) => {
            let mut p = format!("/admin/batches?limit={}", (*limit).clamp(1, 100));
            if let Some(x) = after {
                p.push_str("&after=");
                p.push_str(x);
            }
            (Method::Get, p, false)
        }
        Some(Action::Show { id }) => (Method::Get, format!("/admin/batches/{id}"), true),
        Some(Action::Cancel { id }) => (Method::Post, format!("/admin/batches/{id}/cancel"), true),
    };
    let (status, v) = match admin_client::call(&a.server, method, &path, None) {
        Ok(x) => x,
        Err(c) => return c,
    };
    if status != 200 {
        return admin_client::report_error(status, &v);
    }
    if a.format == Format::Json {
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    if one {
        print!("{}", render_one(&v, now()));
    } else {
        let rows = v["data"].as_array().cloned().unwrap_or_default();
        print!("{}", render_table(&rows, now()));
        if v["has_more"].as_bool() == Some(true) {
            if let Some(last) = v["last_id"].as_str() {
                println!("more: kiln batches list --after {last}");
            }
        }
    }
    EXIT_OK
}
