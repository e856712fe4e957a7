//! `kiln propose --server URL PATH`: upload a policy as a proposal.

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use crate::governance::view::{render_proposal, ProposalView};
use serde_json::json;
use std::collections::BTreeMap;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The policy: a file, files, or a directory.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    #[command(flatten)]
    pub server: ServerArgs,
    /// Replace the text of this open proposal instead (voids its approvals).
    #[arg(long)]
    pub update: Option<String>,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

/// The files of one policy, by file name, as uploads carry them.
pub fn policy_files(paths: &[PathBuf]) -> Result<BTreeMap<String, String>, i32> {
    let sets = discover(paths).map_err(|e| usage_error(&e))?;
    if sets.len() != 1 {
        return Err(usage_error(
            "name one policy (a file, files, or one directory)",
        ));
    }
    let mut files = BTreeMap::new();
    for f in sets.iter().flat_map(|s| s.files.iter()) {
        let name = f
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
            .unwrap_or_else(|| f.display().to_string());
        let text = std::fs::read_to_string(f)
            .map_err(|e| usage_error(&format!("cannot read {}: {e}", f.display())))?;
        if files.insert(name.clone(), text).is_some() {
            return Err(usage_error(&format!(
                "two files are named {name}: a policy's file names must differ"
            )));
        }
    }
    Ok(files)
}

pub fn run(a: Args) -> i32 {
    let files = match policy_files(&a.paths) {
        Ok(f) => f,
        Err(c) => return c,
    };
    let body = json!({ "files": files });
    let (method, path) = match &a.update {
        Some(id) => (Method::Put, format!("/admin/proposals/{id}")),
        None => (Method::Post, "/admin/proposals".to_string()),
    };
    let (status, v) = match admin_client::call(&a.server, method, &path, Some(&body)) {
        Ok(x) => x,
        Err(c) => return c,
    };
    if !(200..300).contains(&status) {
        if a.format == Format::Json {
            admin_client::print_json(&v);
        }
        return admin_client::report_error(status, &v);
    }
    if a.format == Format::Json {
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    let p: ProposalView = match admin_client::parse(v) {
        Ok(p) => p,
        Err(c) => return c,
    };
    print!("{}", render_proposal(&p));
    EXIT_OK
}
