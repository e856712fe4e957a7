//! `kiln keys list|add|revoke|rotate --config kiln.toml`: API keys as a
//! managed object. Keys are stored hashed (SHA-256) in `[[keys]]`, with a
//! name, the tenant, an optional description and expiry; a new key is
//! printed once and never stored. The file is edited in place with its
//! comments and layout kept, validated as the gateway would read it, and
//! replaced atomically (a temporary file beside it, then a rename), so a
//! running gateway's file watch never reads half a file; it reloads the
//! keys within a second (or on SIGHUP, or `POST /admin/keys/reload`).

use super::*;
use crate::server::config::{hash_secret, parse_expiry, ServerConfig};
use toml_edit::{value, ArrayOfTables, DocumentMut, Item, Table};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: KeysCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum KeysCommand {
    /// The keys in the file: name, tenant, hash prefix, expiry.
    List {
        #[arg(long, default_value = "kiln.toml")]
        config: PathBuf,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Make a key for a tenant: prints it once, stores its hash.
    Add {
        #[arg(long, default_value = "kiln.toml")]
        config: PathBuf,
        /// The policy tenant the key authenticates as.
        #[arg(long)]
        tenant: String,
        /// The key's name (unique in the file): revoke and rotate find it by it.
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
    /// Remove a key by name: the gateway refuses it once it reloads.
    Revoke {
        #[arg(long, default_value = "kiln.toml")]
        config: PathBuf,
        name: String,
    },
    /// Replace a key by a new one of the same name and tenant; the old one
    /// keeps working for --overlap (renamed NAME-rotated-DATE, with that
    /// expiry), so clients can move over.
    Rotate {
        #[arg(long, default_value = "kiln.toml")]
        config: PathBuf,
        name: String,
        /// How long the old key keeps working (`0s`: not at all).
        #[arg(long, default_value = "24h")]
        overlap: String,
    },
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum KeysError {
    #[error("cannot read or write {path}: {message}")]
    #[diagnostic(
        code(kiln::keys::io),
        help("check the path and that you may write its directory (the file is replaced by a rename)")
    )]
    Io { path: String, message: String },
    #[error("{path} is not TOML kiln can edit: {message}")]
    #[diagnostic(
        code(kiln::keys::syntax),
        help("fix the file (kiln serve --config reports where)")
    )]
    Syntax { path: String, message: String },
    #[error("{0}")]
    #[diagnostic(
        code(kiln::keys::usage),
        help("`kiln keys list` shows the keys by name")
    )]
    Usage(String),
}

fn io(path: &Path, e: impl std::fmt::Display) -> KeysError {
    KeysError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn load(path: &Path) -> Result<DocumentMut, KeysError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    text.parse::<DocumentMut>().map_err(|e| KeysError::Syntax {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// Validates the edited file as the gateway reads it, then replaces the
/// file with it: written beside it, synced, renamed over it (the old
/// file's permissions kept).
fn save(path: &Path, doc: &DocumentMut) -> Result<(), miette::Report> {
    let text = doc.to_string();
    ServerConfig::parse(&path.display().to_string(), &text)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "kiln.toml".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        if let Ok(m) = std::fs::metadata(path) {
            f.set_permissions(m.permissions())?;
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path, e).into());
    }
    Ok(())
}

fn keys_mut(doc: &mut DocumentMut) -> Result<&mut ArrayOfTables, KeysError> {
    let item = doc
        .entry("keys")
        .or_insert(Item::ArrayOfTables(ArrayOfTables::new()));
    item.as_array_of_tables_mut().ok_or_else(|| {
        KeysError::Usage("`keys` in the file is not a list of [[keys]] tables".into())
    })
}

fn find(keys: &ArrayOfTables, name: &str) -> Result<usize, KeysError> {
    let hits: Vec<usize> = keys
        .iter()
        .enumerate()
        .filter(|(_, t)| t.get("name").and_then(|n| n.as_str()) == Some(name))
        .map(|(i, _)| i)
        .collect();
    match hits.as_slice() {
        [i] => Ok(*i),
        [] => Err(KeysError::Usage(format!("no key named `{name}`"))),
        _ => Err(KeysError::Usage(format!(
            "{} keys are named `{name}`: give each its own name in the file",
            hits.len()
        ))),
    }
}

/// A new key: `sk-kiln-` and 32 random bytes in hex, from the OS RNG.
fn new_key() -> Result<String, KeysError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| KeysError::Usage(format!("no randomness: {e}")))?;
    Ok(format!("sk-kiln-{}", hex::encode(b)))
}

fn now_ms() -> i64 {
    crate::clock::unix_ms() as i64
}

/// An RFC 3339 time (UTC) for Unix milliseconds.
fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| {
            t.round(jiff::Unit::Second)
                .map_or_else(|_| t.to_string(), |t| t.to_string())
        })
        .unwrap_or_else(|_| ms.to_string())
}

fn after(text: &str) -> Result<String, KeysError> {
    let d = crate::units::duration::parse(text)
        .map_err(|e| KeysError::Usage(format!("`{text}` is not a duration: {e}")))?;
    Ok(rfc3339(
        now_ms().saturating_add(d.as_millis().min(i64::MAX as u128) as i64),
    ))
}

fn entry(
    name: &str,
    tenant: &str,
    key: &str,
    description: Option<&str>,
    expires: Option<&str>,
) -> Table {
    let mut t = Table::new();
    t.insert("name", value(name));
    t.insert("tenant", value(tenant));
    t.insert("sha256", value(hash_secret(key)));
    if let Some(d) = description {
        t.insert("description", value(d));
    }
    if let Some(e) = expires {
        t.insert("expires", value(e));
    }
    t
}

pub fn run(a: Args) -> i32 {
    match exec(a) {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("{e:?}");
            EXIT_USAGE
        }
    }
}

fn exec(a: Args) -> Result<(), miette::Report> {
    match a.command {
        KeysCommand::List { config, format } => {
            let cfg = ServerConfig::load(&config)?;
            let now = now_ms();
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
            match format {
                Format::Json => println!("{}", serde_json::Value::Array(rows)),
                Format::Human => {
                    println!(
                        "{:<24} {:<20} {:<13} {:<26} DESCRIPTION",
                        "NAME", "TENANT", "SHA256", "EXPIRES"
                    );
                    for k in &cfg.keys {
                        let expires = match (&k.expires, k.expired_at(now)) {
                            (Some(e), true) => format!("{e} (expired)"),
                            (Some(e), false) => e.clone(),
                            (None, _) => "never".into(),
                        };
                        println!(
                            "{:<24} {:<20} {:<13} {:<26} {}",
                            k.name.as_deref().unwrap_or("-"),
                            k.tenant,
                            k.sha256.chars().take(12).collect::<String>(),
                            expires,
                            k.description.as_deref().unwrap_or("")
                        );
                    }
                }
            }
            Ok(())
        }
        KeysCommand::Add {
            config,
            tenant,
            name,
            description,
            expires,
            expires_in,
        } => {
            let expires = match (expires, expires_in) {
                (Some(e), _) => {
                    parse_expiry(&e)
                        .map_err(|why| KeysError::Usage(format!("--expires {e}: {why}")))?;
                    Some(e)
                }
                (None, Some(d)) => Some(after(&d)?),
                (None, None) => None,
            };
            let mut doc = load(&config)?;
            let keys = keys_mut(&mut doc)?;
            if find(keys, &name).is_ok() {
                return Err(KeysError::Usage(format!(
                    "a key named `{name}` exists: pick another name, or `kiln keys rotate {name}`"
                ))
                .into());
            }
            let key = new_key()?;
            keys.push(entry(
                &name,
                &tenant,
                &key,
                description.as_deref(),
                expires.as_deref(),
            ));
            save(&config, &doc)?;
            eprintln!(
                "added key `{name}` for tenant `{tenant}` to {} (its hash only); it is shown once, here:",
                config.display()
            );
            println!("{key}");
            eprintln!("a running gateway reloads its keys within a second (or on SIGHUP)");
            Ok(())
        }
        KeysCommand::Revoke { config, name } => {
            let mut doc = load(&config)?;
            let keys = keys_mut(&mut doc)?;
            let i = find(keys, &name)?;
            keys.remove(i);
            save(&config, &doc)?;
            eprintln!(
                "revoked key `{name}` in {}; a running gateway refuses it once it reloads (within a second, or on SIGHUP)",
                config.display()
            );
            Ok(())
        }
        KeysCommand::Rotate {
            config,
            name,
            overlap,
        } => {
            let overlap_d = crate::units::duration::parse(&overlap)
                .map_err(|e| KeysError::Usage(format!("--overlap {overlap}: {e}")))?;
            let mut doc = load(&config)?;
            let keys = keys_mut(&mut doc)?;
            let i = find(keys, &name)?;
            let (tenant, description, expires) = {
                let Some(old) = keys.get(i) else {
                    return Err(KeysError::Usage(format!("no key named `{name}`")).into());
                };
                let s = |k: &str| old.get(k).and_then(|v| v.as_str()).map(str::to_string);
                (
                    s("tenant").unwrap_or_default(),
                    s("description"),
                    s("expires"),
                )
            };
            let key = new_key()?;
            if overlap_d.is_zero() {
                keys.remove(i);
            } else if let Some(old) = keys.get_mut(i) {
                let until = after(&overlap)?;
                let date: String = until.chars().take(10).collect();
                old.insert("name", value(format!("{name}-rotated-{date}")));
                old.insert("expires", value(until));
            }
            keys.push(entry(
                &name,
                &tenant,
                &key,
                description.as_deref(),
                expires.as_deref(),
            ));
            save(&config, &doc)?;
            eprintln!(
                "rotated key `{name}` (tenant `{tenant}`) in {}; the old key works for {overlap} more. The new key, shown once:",
                config.display()
            );
            println!("{key}");
            Ok(())
        }
    }
}
