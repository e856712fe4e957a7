//! `kiln status --server URL`: active version, rollout, open proposals
//! with the approvals they still miss, overrides.

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
    if a.format == Format::Json {
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    match admin_client::parse::<StatusView>(v) {
        Ok(s) => {
            print!("{}", render_status(&s));
            EXIT_OK
        }
        Err(c) => c,
    }
}
