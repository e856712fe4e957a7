//! `kiln approve --server URL ID --key KEYFILE`: sign a proposal's hash.

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use crate::governance::keys;
use crate::governance::view::{render_proposal, ProposalView};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The proposal id (`kiln status` lists them).
    pub id: String,
    /// The approver's key file (`kiln keygen`).
    #[arg(long)]
    pub key: PathBuf,
    /// The policy hash you reviewed (64 hex). Without it, the proposal's
    /// current hash is fetched and shown before signing.
    #[arg(long)]
    pub hash: Option<String>,
    /// How long the approval stays valid (a kiln duration).
    #[arg(long, default_value = "1h")]
    pub valid_for: String,
    #[command(flatten)]
    pub server: ServerArgs,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

pub fn run(a: Args) -> i32 {
    let text = match std::fs::read_to_string(&a.key) {
        Ok(t) => t,
        Err(e) => return usage_error(&format!("cannot read {}: {e}", a.key.display())),
    };
    let (name, key) = match keys::parse_key_file(&text) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_USAGE;
        }
    };
    let Some(valid_ms) =
        crate::governance::parse_duration_ms(&a.valid_for).filter(|d| *d >= 1000.0)
    else {
        return usage_error("--valid-for must be a duration of a second or more (30m, 1h)");
    };
    // The proposal's view carries what the signature binds besides the
    // hash: the gateway's identity and the proposal's nonce.
    let (status, v) = match admin_client::call(
        &a.server,
        Method::Get,
        &format!("/admin/proposals/{}", a.id),
        None,
    ) {
        Ok(x) => x,
        Err(c) => return c,
    };
    if status != 200 {
        return admin_client::report_error(status, &v);
    }
    let p: ProposalView = match admin_client::parse(v) {
        Ok(p) => p,
        Err(c) => return c,
    };
    let hash = match &a.hash {
        Some(h) => h.trim().to_ascii_lowercase(),
        None => {
            eprintln!(
                "approving {} by {} as {name}: {} (hash {})",
                p.id, p.proposer, p.version, p.hash
            );
            p.hash.clone()
        }
    };
    let issued = crate::clock::unix_s();
    let expires = issued + (valid_ms / 1000.0) as u64;
    let target = keys::Target {
        gateway: &p.gateway,
        proposal: &a.id,
        nonce: &p.nonce,
    };
    let signed = keys::sign(&key, &target, &hash, &name, issued, expires);
    let body = match serde_json::to_value(&signed) {
        Ok(v) => v,
        Err(e) => return usage_error(&e.to_string()),
    };
    let (status, v) = match admin_client::call(
        &a.server,
        Method::Post,
        &format!("/admin/proposals/{}/approvals", a.id),
        Some(&body),
    ) {
        Ok(x) => x,
        Err(c) => return c,
    };
    if status != 200 {
        if a.format == Format::Json {
            admin_client::print_json(&v);
        }
        return admin_client::report_error(status, &v);
    }
    if a.format == Format::Json {
        admin_client::print_json(&v);
        return EXIT_OK;
    }
    match admin_client::parse::<ProposalView>(v) {
        Ok(p) => {
            print!("{}", render_proposal(&p));
            EXIT_OK
        }
        Err(c) => c,
    }
}
