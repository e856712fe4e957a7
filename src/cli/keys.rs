//! `kiln keys list|add|revoke|rotate`: API keys as a managed object.
//!
//! With `--config kiln.toml` (the default) the file is edited: keys are
//! stored hashed (SHA-256) in `[[keys]]`, with a name, the tenant, an
//! optional description and expiry; a new key is printed once and never
//! stored. The edit keeps the file's comments and layout, is validated as
//! the gateway reads it and replaces the file atomically
//! ([`crate::server::keys::file`]); a running gateway reloads its keys
//! within a second (or on SIGHUP, or `POST /admin/keys/reload`).
//!
//! With `--server URL` the gateway's admin API does it: in a fleet
//! (`[state] redis`) the key is kept in the fleet's store and holds on
//! every replica within half a second; a single gateway edits its own
//! `kiln.toml`.

use super::admin_client::{self, Method, ServerArgs};
use super::*;
use crate::server::config::ServerConfig;
use crate::server::keys::file::{self, NewKey};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: KeysCommand,
}

/// Where the keys are: a file, or a gateway's admin API.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    #[arg(long, default_value = "kiln.toml", conflicts_with = "server")]
    config: PathBuf,
    /// Through a running gateway's admin API instead of a file (in a
    /// fleet, the fleet's keys); with --token or KILN_ADMIN_TOKEN.
    #[arg(long)]
    server: Option<String>,
    /// Admin bearer token (default: $KILN_ADMIN_TOKEN).
    #[arg(long, requires = "server")]
    token: Option<String>,
}

impl Target {
    fn api(&self) -> Option<ServerArgs> {
        self.server.as_ref().map(|s| ServerArgs {
            server: Some(s.clone()),
            token: self.token.clone(),
        })
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum KeysCommand {
    /// The keys: name, tenant, hash prefix, expiry (and, through a
    /// gateway, where each is kept and which are revoked).
    List {
        #[command(flatten)]
        target: Target,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Make a key for a tenant: prints it once, stores its hash.
    Add {
        #[command(flatten)]
        target: Target,
        /// The policy tenant the key authenticates as.
        #[arg(long)]
        tenant: String,
        /// The key's name (unique): revoke and rotate find it by it.
        #[arg(long)]
        name: String,
        #[arg(long)]
        description: Option<String>,
        /// When it stops working: an RFC 3339 time or a date (UTC).
        #[arg(long, conflicts_with = "expires_in")]
        expires: Option<String>,
        /// When it stops working, from now (`90d`, `12h`).
        #[arg(long)]
        expires_in: Option<String>,
    },
    /// Revoke a key by name: the gateway (every replica of a fleet) refuses it.
    Revoke {
        #[command(flatten)]
        target: Target,
        name: String,
    },
    /// Replace a key by a new one of the same name and tenant; the old one
    /// keeps working for --overlap (renamed NAME-rotated-DATE, with that
    /// expiry), so clients can move over. Edits the file (in a fleet: add
    /// a key under a new name, move the clients, then revoke the old one).
    Rotate {
        #[arg(long, default_value = "kiln.toml")]
        config: PathBuf,
        name: String,
        /// How long the old key keeps working (`0s`: not at all).
        #[arg(long, default_value = "24h")]
        overlap: String,
    },
}

/// A row of the human listing.
struct Row {
    name: String,
    tenant: String,
    sha: String,
    expires: String,
    note: String,
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<24} {:<20} {:<13} {:<26} DESCRIPTION",
        "NAME", "TENANT", "SHA256", "EXPIRES"
    );
    for r in rows {
        println!(
            "{:<24} {:<20} {:<13} {:<26} {}",
            r.name, r.tenant, r.sha, r.expires, r.note
        );
    }
}

fn expires_text(expires: Option<&str>, expired: bool) -> String {
    match (expires, expired) {
        (Some(e), true) => format!("{e} (expired)"),
        (Some(e), false) => e.to_string(),
        (None, _) => "never".into(),
    }
}

pub fn run(a: Args) -> i32 {
    let api = match &a.command {
        KeysCommand::List { target, .. }
        | KeysCommand::Add { target, .. }
        | KeysCommand::Revoke { target, .. } => target.api(),
        KeysCommand::Rotate { .. } => None,
    };
    if let Some(args) = api {
        return through_api(&args, &a.command);
    }
    match exec(a) {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("{e:?}");
            EXIT_USAGE
        }
    }
}

fn api_call(
    args: &ServerArgs,
    method: Method,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<serde_json::Value, i32> {
    let (status, v) = admin_client::call(args, method, path, body)?;
    if status >= 300 {
        return Err(admin_client::report_error(status, &v));
    }
    Ok(v)
}

/// `kiln keys` through a gateway's admin API; the exit code.
fn through_api(args: &ServerArgs, command: &KeysCommand) -> i32 {
    let out = match command {
        KeysCommand::List { format, .. } => {
            api_call(args, Method::Get, "/admin/keys", None).map(|v| match format {
                Format::Json => admin_client::print_json(&v["keys"]),
                Format::Human => {
                    let rows: Vec<Row> = v["keys"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                        .iter()
                        .map(|k| {
                            let s = |f: &str| k[f].as_str().unwrap_or("").to_string();
                            let mut note = format!("[{}] {}", s("source"), s("description"));
                            if let Some(r) = k["revoked"].as_str() {
                                note = format!("REVOKED {r} {note}");
                            }
                            Row {
                                name: k["name"].as_str().unwrap_or("-").to_string(),
                                tenant: s("tenant"),
                                sha: s("sha256_prefix"),
                                expires: expires_text(
                                    k["expires"].as_str(),
                                    k["expired"].as_bool().unwrap_or(false),
                                ),
                                note,
                            }
                        })
                        .collect();
                    print_rows(&rows);
                }
            })
        }
        KeysCommand::Add {
            tenant,
            name,
            description,
            expires,
            expires_in,
            ..
        } => {
            let body = serde_json::json!({
                "name": name, "tenant": tenant, "description": description,
                "expires": expires, "expires_in": expires_in,
            });
            api_call(args, Method::Post, "/admin/keys", Some(&body)).map(|v| {
                let a = &v["added"];
                eprintln!(
                    "added key `{name}` for tenant `{tenant}` ({}; its hash only); it is shown once, here:",
                    match a["source"].as_str() {
                        Some("fleet") => "in the fleet's store: every replica takes it within half a second",
                        _ => "in the gateway's kiln.toml",
                    }
                );
                println!("{}", a["key"].as_str().unwrap_or(""));
            })
        }
        KeysCommand::Revoke { name, .. } => {
            // The name as one path segment, percent-encoded.
            let path = reqwest::Url::parse("http://kiln/admin/keys/")
                .ok()
                .and_then(|mut u| {
                    u.path_segments_mut().ok()?.pop_if_empty().push(name);
                    Some(u.path().to_string())
                })
                .unwrap_or_else(|| format!("/admin/keys/{name}"));
            api_call(args, Method::Delete, &path, None).map(|v| {
                eprintln!(
                    "revoked key `{name}` (tenant `{}`); {}",
                    v["revoked"]["tenant"].as_str().unwrap_or("?"),
                    match v["revoked"]["source"].as_str() {
                        Some("fleet") => "every replica refuses it within half a second",
                        _ => "the gateway refuses it now",
                    }
                );
            })
        }
        KeysCommand::Rotate { .. } => Ok(()),
    };
    match out {
        Ok(()) => EXIT_OK,
        Err(code) => code,
    }
}

fn exec(a: Args) -> Result<(), miette::Report> {
    match a.command {
        KeysCommand::List { target, format } => {
            let cfg = ServerConfig::load(&target.config)?;
            let now = crate::clock::unix_ms() as i64;
            match format {
                Format::Json => {
                    let rows: Vec<_> = cfg
                        .keys
                        .iter()
                        .map(|k| {
                            serde_json::json!({
                                "name": k.name,
                                "tenant": k.tenant,
                                "sha256_prefix": k.sha256.chars().take(12).collect::<String>(),
                                "description": k.description,
                                "expires": k.expires,
                                "expired": k.expired_at(now),
                            })
                        })
                        .collect();
                    println!("{}", serde_json::Value::Array(rows));
                }
                Format::Human => {
                    let rows: Vec<Row> = cfg
                        .keys
                        .iter()
                        .map(|k| Row {
                            name: k.name.clone().unwrap_or_else(|| "-".into()),
                            tenant: k.tenant.clone(),
                            sha: k.sha256.chars().take(12).collect(),
                            expires: expires_text(k.expires.as_deref(), k.expired_at(now)),
                            note: k.description.clone().unwrap_or_default(),
                        })
                        .collect();
                    print_rows(&rows);
                }
            }
            Ok(())
        }
        KeysCommand::Add {
            target,
            tenant,
            name,
            description,
            expires,
            expires_in,
        } => {
            let expires = file::expiry(expires.as_deref(), expires_in.as_deref())?;
            let config = target.config;
            let key = file::add(
                &config,
                &NewKey {
                    name: name.clone(),
                    tenant: tenant.clone(),
                    description,
                    expires,
                },
            )?;
            eprintln!(
                "added key `{name}` for tenant `{tenant}` to {} (its hash only); it is shown once, here:",
                config.display()
            );
            println!("{key}");
            eprintln!("a running gateway reloads its keys within a second (or on SIGHUP)");
            Ok(())
        }
        KeysCommand::Revoke { target, name } => {
            file::revoke(&target.config, &name)?;
            eprintln!(
                "revoked key `{name}` in {}; a running gateway refuses it once it reloads (within a second, or on SIGHUP)",
                target.config.display()
            );
            Ok(())
        }
        KeysCommand::Rotate {
            config,
            name,
            overlap,
        } => {
            let (key, tenant) = file::rotate(&config, &name, &overlap)?;
            eprintln!(
                "rotated key `{name}` (tenant `{tenant}`) in {}; the old key works for {overlap} more. The new key, shown once:",
                config.display()
            );
            println!("{key}");
            Ok(())
        }
    }
}
