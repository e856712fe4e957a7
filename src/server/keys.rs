//! Keys as a managed object: the API keys (`[[keys]]`) and admin tokens
//! (`[admin]`) of `kiln.toml` are reloaded without a restart, on SIGHUP,
//! when the file changes, and on `POST /admin/keys/reload`. A reload is
//! atomic: the whole file is read and validated (and its keys checked
//! against the active policy) before anything changes; a bad file is
//! refused with its diagnostic and the keys in use stay. A request is
//! authenticated once, when it arrives: one in flight keeps the key it was
//! admitted with. Only keys and admin tokens are reloaded; every other
//! section needs a restart (a reload says when they differ).

use super::config::{ConfigError, KeyConfig, ServerConfig};
use super::App;
use serde::Serialize;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How often the file is looked at for a change (its length, modification
/// time and contents' hash; polling rather than inotify, so a Kubernetes
/// ConfigMap's symlink swap is seen too).
pub const WATCH_EVERY: Duration = Duration::from_secs(1);

/// What a reload changed, by label (never a key or its hash).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Reloaded {
    pub path: String,
    pub keys: usize,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub admin_tokens: usize,
    /// Sections other than keys and admin tokens that differ from those
    /// the gateway started with: they take effect at the next restart.
    pub needs_restart: bool,
}

/// A key as `GET /admin/keys` lists it: its label, tenant, the first 12
/// hex digits of its hash, description and expiry.
#[derive(Debug, Clone, Serialize)]
pub struct KeyRow {
    pub name: Option<String>,
    pub tenant: String,
    pub sha256_prefix: String,
    pub description: Option<String>,
    pub expires: Option<String>,
    pub expired: bool,
}

/// The keys in use, for `GET /admin/keys`.
pub fn list(app: &App) -> Vec<KeyRow> {
    let now = crate::clock::unix_ms() as i64;
    app.auth.load().keys.iter().map(|k| row(k, now)).collect()
}

fn row(k: &KeyConfig, now_ms: i64) -> KeyRow {
    KeyRow {
        name: k.name.clone(),
        tenant: k.tenant.clone(),
        sha256_prefix: k.sha256.chars().take(12).collect(),
        description: k.description.clone(),
        expires: k.expires.clone(),
        expired: k.expired_at(now_ms),
    }
}

/// A key's identity across reloads: its hash and tenant.
fn ident(k: &KeyConfig) -> (String, String) {
    (k.sha256.to_ascii_lowercase(), k.tenant.clone())
}

fn label(k: &KeyConfig) -> String {
    match &k.name {
        Some(n) => format!("{n} ({})", k.tenant),
        None => format!(
            "{}… ({})",
            k.sha256.chars().take(12).collect::<String>(),
            k.tenant
        ),
    }
}

/// Reloads the keys and admin tokens from the file the gateway started
/// with; `actor` is who asked (audited). On an error nothing changes.
pub fn reload(app: &App, actor: &str) -> Result<Reloaded, ConfigError> {
    let Some(path) = app.config.source.clone() else {
        return Err(ConfigError::Invalid {
            message: "this gateway was started without a config file: there are no keys to reload"
                .into(),
            help: Some("start it with `kiln serve --config kiln.toml`".into()),
        });
    };
    let result = reload_from(app, &path, actor);
    app.metrics.keys_reload(result.is_ok());
    match &result {
        Ok(r) => {
            tracing::info!(
                path = %r.path,
                keys = r.keys,
                added = ?r.added,
                removed = ?r.removed,
                admin_tokens = r.admin_tokens,
                "keys reloaded"
            );
            if r.needs_restart {
                tracing::warn!(path = %r.path, "kiln.toml changed outside [[keys]] and [admin]: those changes take effect at the next restart");
            }
        }
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "keys not reloaded: the keys in use stay");
        }
    }
    result
}

fn reload_from(app: &App, path: &Path, actor: &str) -> Result<Reloaded, ConfigError> {
    let mut next = ServerConfig::load(path)?;
    let policy = app.policy.load();
    if let Some(clash) = next.key_clash(&policy.graph) {
        return Err(ConfigError::Invalid {
            message: clash,
            help: Some(
                "a key authenticates one tenant: fix the [[keys]] entry's tenant, or remove the key from the policy's api_keys".into(),
            ),
        });
    }
    // What the gateway runs with apart from keys and admin tokens: the
    // file's other sections are compared, not applied.
    next.policy_keys = app.config.policy_keys;
    next.allow_anonymous = app.config.allow_anonymous;
    let old = app.auth.load();
    let before: Vec<_> = old.keys.iter().map(ident).collect();
    let after: Vec<_> = next.keys.iter().map(ident).collect();
    let added = next
        .keys
        .iter()
        .filter(|k| !before.contains(&ident(k)))
        .map(label)
        .collect();
    let removed = old
        .keys
        .iter()
        .filter(|k| !after.contains(&ident(k)))
        .map(label)
        .collect();
    let r = Reloaded {
        path: path.display().to_string(),
        keys: next.keys.len(),
        added,
        removed,
        admin_tokens: next.admin.token_sha256.len() + next.admin.tokens.len(),
        needs_restart: differs_elsewhere(&app.config, &next),
    };
    let _ = app.gov.audit_event(
        "keys-reloaded",
        actor,
        json!({
            "path": r.path,
            "keys": r.keys,
            "added": r.added,
            "removed": r.removed,
            "admin_tokens": r.admin_tokens,
        }),
    );
    app.auth.store(Arc::new(next));
    Ok(r)
}

/// Whether `next` differs from `started` outside keys and admin tokens
/// (compared as their debug forms: the config holds no floats that print
/// differently for the same value).
fn differs_elsewhere(started: &ServerConfig, next: &ServerConfig) -> bool {
    let strip = |c: &ServerConfig| {
        let mut c = c.clone();
        c.keys.clear();
        c.admin = Default::default();
        c.source = None;
        c.log_format = None;
        format!("{c:?}")
    };
    strip(started) != strip(next)
}

/// The file's fingerprint: length, modification time and the hash of its
/// contents (a ConfigMap swap may keep the time; an editor may keep the
/// length).
fn fingerprint(path: &Path) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Some(format!(
        "{}:{modified}:{}",
        text.len(),
        super::config::hash_secret(&String::from_utf8_lossy(&text))
    ))
}

/// Reloads on SIGHUP and when the file changes, until the gateway stops.
/// Nothing to watch without a config file.
pub fn spawn_watch(app: Arc<App>) -> Option<tokio::task::JoinHandle<()>> {
    let path: PathBuf = app.config.source.clone()?;
    Some(tokio::spawn(async move {
        #[cfg(unix)]
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut seen = fingerprint(&path);
        let mut tick = tokio::time::interval(WATCH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            #[cfg(unix)]
            let signalled = match hup.as_mut() {
                Some(h) => tokio::select! {
                    _ = tick.tick() => false,
                    r = h.recv() => r.is_some(),
                },
                None => {
                    tick.tick().await;
                    false
                }
            };
            #[cfg(not(unix))]
            let signalled = {
                tick.tick().await;
                false
            };
            let now = fingerprint(&path);
            if signalled {
                seen = now;
                let _ = reload(&app, "sighup");
            } else if now.is_some() && now != seen {
                seen = now;
                let _ = reload(&app, "file-watch");
            }
        }
    }))
}
