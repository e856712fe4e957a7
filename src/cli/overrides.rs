//! Incident controls: `kiln pause`, `kiln throttle` and `kiln resume` a
//! tier or a tenant, for a while.

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    Tier,
    Tenant,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Tier => "tier",
            Target::Tenant => "tenant",
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct PauseArgs {
    pub scope: Target,
    pub name: String,
    /// How long (a kiln duration: 30m, 1h); it ends by itself.
    #[arg(long = "for")]
    pub duration: String,
    #[arg(long)]
    pub reason: Option<String>,
    #[command(flatten)]
    pub server: ServerArgs,
}

#[derive(clap::Args, Debug)]
pub struct ThrottleArgs {
    pub scope: Target,
    pub name: String,
    /// The share of requests still admitted (`10%`).
    #[arg(long)]
    pub to: String,
    #[arg(long = "for")]
    pub duration: String,
    #[arg(long)]
    pub reason: Option<String>,
    #[command(flatten)]
    pub server: ServerArgs,
}

#[derive(clap::Args, Debug)]
pub struct ResumeArgs {
    pub scope: Target,
    pub name: String,
    #[command(flatten)]
    pub server: ServerArgs,
}

fn send(server: &ServerArgs, body: serde_json::Value) -> i32 {
    let (status, v) =
        match admin_client::call(server, Method::Post, "/admin/overrides", Some(&body)) {
            Ok(x) => x,
            Err(c) => return c,
        };
    if status != 201 {
        return admin_client::report_error(status, &v);
    }
    let o = &v["override"];
    println!(
        "override #{}: {} {} {}{} for {} (by {})",
        o["id"],
        o["action"].as_str().unwrap_or("?"),
        o["scope"].as_str().unwrap_or("?"),
        o["name"].as_str().unwrap_or("?"),
        o["percent"]
            .as_f64()
            .map(|p| format!(" to {p}%"))
            .unwrap_or_default(),
        crate::governance::view::secs(o["remaining_s"].as_f64().unwrap_or(0.0)),
        o["by"].as_str().unwrap_or("?"),
    );
    EXIT_OK
}

fn check_duration(d: &str) -> Result<(), i32> {
    match crate::governance::parse_duration_ms(d) {
        Some(x) if x > 0.0 => Ok(()),
        _ => Err(usage_error(&format!(
            "--for `{d}` is not a positive duration (30m, 1h)"
        ))),
    }
}

pub fn pause(a: PauseArgs) -> i32 {
    if let Err(c) = check_duration(&a.duration) {
        return c;
    }
    send(
        &a.server,
        json!({"scope": a.scope.name(), "name": a.name, "action": "pause", "for": a.duration, "reason": a.reason}),
    )
}

pub fn throttle(a: ThrottleArgs) -> i32 {
    if let Err(c) = check_duration(&a.duration) {
        return c;
    }
    let Some(p) = crate::governance::parse_percent(&a.to).filter(|p| (0.0..=100.0).contains(p))
    else {
        return usage_error("--to must be a percentage from 0% to 100%");
    };
    send(
        &a.server,
        json!({"scope": a.scope.name(), "name": a.name, "action": "throttle", "percent": p, "for": a.duration, "reason": a.reason}),
    )
}

pub fn resume(a: ResumeArgs) -> i32 {
    let path = format!("/admin/overrides/{}/{}", a.scope.name(), a.name);
    let (status, v) = match admin_client::call(&a.server, Method::Delete, &path, None) {
        Ok(x) => x,
        Err(c) => return c,
    };
    if status != 200 {
        return admin_client::report_error(status, &v);
    }
    println!("{} {} resumed", a.scope.name(), a.name);
    EXIT_OK
}
