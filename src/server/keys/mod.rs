//! Keys as a managed object: the API keys (`[[keys]]`) and admin tokens
//! (`[admin]`) of `kiln.toml` are reloaded without a restart, on SIGHUP,
//! when the file changes, and on `POST /admin/keys/reload`. A reload is
//! atomic: the whole file is read and validated (and its keys checked
//! against the active policy) before anything changes; a bad file is
//! refused with its diagnostic and the keys in use stay. A request is
//! authenticated once, when it arrives: one in flight keeps the key it was
//! admitted with. Only keys and admin tokens are reloaded; every other
//! section needs a restart (a reload says when they differ).

pub mod file;
pub mod shared;

pub use file::rfc3339;

use super::config::{hash_secret, ConfigError, KeyConfig, ServerConfig};
use super::App;
use crate::shared::keys::{RevokedKey, SharedKey};
use crate::shared::StoreError;
use serde::{Deserialize, Serialize};
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
/// hex digits of its hash, description and expiry, where it is kept
/// (`file`: `kiln.toml`; `fleet`: the fleet's store) and, for a revoked
/// one, who revoked it and when.
#[derive(Debug, Clone, Serialize)]
pub struct KeyRow {
    pub name: Option<String>,
    pub tenant: String,
    pub sha256_prefix: String,
    pub description: Option<String>,
    pub expires: Option<String>,
    pub expired: bool,
    pub source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked: Option<String>,
}

/// The keys in use, then the revoked ones, for `GET /admin/keys`.
pub fn list(app: &App) -> Vec<KeyRow> {
    let now = crate::clock::unix_ms() as i64;
    let shared = app.shared_keys.load();
    let revoked = |h: &str| {
        shared
            .revoked
            .get(&h.to_ascii_lowercase())
            .map(|r| format!("by {} at {}", r.by, rfc3339(r.at_ms as i64)))
    };
    let mut rows: Vec<KeyRow> = app
        .auth
        .load()
        .keys
        .iter()
        .map(|k| KeyRow {
            revoked: revoked(&k.sha256),
            ..row(k, now, "file")
        })
        .collect();
    rows.extend(
        shared
            .managed
            .iter()
            .map(|(h, m)| row(&shared::as_config(h, m), now, "fleet")),
    );
    rows.extend(
        shared
            .revoked
            .iter()
            .filter(|(h, _)| {
                !app.auth
                    .load()
                    .keys
                    .iter()
                    .any(|k| k.sha256.eq_ignore_ascii_case(h))
            })
            .map(|(h, r)| KeyRow {
                name: r.name.clone(),
                tenant: r.tenant.clone(),
                sha256_prefix: h.chars().take(12).collect(),
                description: None,
                expires: None,
                expired: false,
                source: "fleet",
                revoked: Some(format!("by {} at {}", r.by, rfc3339(r.at_ms as i64))),
            }),
    );
    rows
}

fn row(k: &KeyConfig, now_ms: i64, source: &'static str) -> KeyRow {
    KeyRow {
        name: k.name.clone(),
        tenant: k.tenant.clone(),
        sha256_prefix: k.sha256.chars().take(12).collect(),
        description: k.description.clone(),
        expires: k.expires.clone(),
        expired: k.expired_at(now_ms),
        source,
        revoked: None,
    }
}

/// `POST /admin/keys`: a key to make.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddKey {
    pub name: String,
    pub tenant: String,
    #[serde(default)]
    pub description: Option<String>,
    /// RFC 3339 time or a date (UTC).
    #[serde(default)]
    pub expires: Option<String>,
    /// From now: `90d`, `12h`.
    #[serde(default)]
    pub expires_in: Option<String>,
}

/// A key made: shown once, here.
#[derive(Debug, Clone, Serialize)]
pub struct Added {
    pub key: String,
    pub name: String,
    pub tenant: String,
    pub sha256_prefix: String,
    pub expires: Option<String>,
    /// `file` (this gateway's `kiln.toml`) or `fleet` (every replica).
    pub source: &'static str,
}

/// A key revoked.
#[derive(Debug, Clone, Serialize)]
pub struct RevokedView {
    pub name: String,
    pub tenant: String,
    pub sha256_prefix: String,
    pub source: &'static str,
}

/// Why a key was not added or revoked.
#[derive(Debug, thiserror::Error)]
pub enum KeyOpError {
    #[error("{0}")]
    Invalid(String),
    #[error("no key named `{0}`")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("this gateway was started without a config file and is not in a fleet: there is nowhere to keep a key")]
    Nowhere,
    #[error("the fleet's store did not answer, nothing changed: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    File(#[from] file::KeysError),
}

impl KeyOpError {
    /// The HTTP status and error code it answers with.
    pub fn status(&self) -> (u16, &'static str) {
        match self {
            KeyOpError::Invalid(_) => (400, "invalid_request"),
            KeyOpError::NotFound(_) => (404, "not_found"),
            KeyOpError::Conflict(_) => (409, "conflict"),
            KeyOpError::Nowhere => (409, "no_key_store"),
            KeyOpError::Store(_) => (503, "state_unavailable"),
            KeyOpError::File(_) => (422, "invalid_config"),
        }
    }

    pub fn help(&self) -> &'static str {
        match self {
            KeyOpError::Invalid(_) => "send {\"name\", \"tenant\"} and optionally \"description\", \"expires\" (RFC 3339 or a date) or \"expires_in\" (90d)",
            KeyOpError::NotFound(_) => "GET /admin/keys lists the keys by name",
            KeyOpError::Conflict(_) => "pick another name, or retry (another change landed meanwhile)",
            KeyOpError::Nowhere => "start the gateway with `--config kiln.toml`, or give it `[state] redis` to keep keys in the fleet's store",
            KeyOpError::Store(_) => "retry once Redis answers; the keys in use stay as they are",
            KeyOpError::File(_) => "fix kiln.toml (kiln serve --config reports where); the keys in use stay",
        }
    }
}

/// Records a key change in the audit log (the fleet's chain in a fleet);
/// the change holds either way, a failure to record it is logged.
async fn audit(app: &App, kind: &str, actor: &str, details: serde_json::Value) {
    if let Err(e) = app.gov.audit_event(app, kind, actor, details).await {
        tracing::error!(error = %e, kind, "a key change is in force but not in the audit log");
    }
}

/// A key's name: what messages and `revoke` use, so printable and short.
fn check_name(name: &str) -> Result<(), KeyOpError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(KeyOpError::Invalid(
            "a key's name is 1-64 letters, digits and - _ . @".into(),
        ))
    }
}

fn now_ms() -> u64 {
    crate::clock::unix_ms() as u64
}

/// Makes a key for a tenant of the active policy: kept in the fleet's
/// store where the gateway is one of a fleet (every replica takes it
/// within [`shared::SYNC_EVERY`]), else in the gateway's `kiln.toml`
/// (reloaded at once). Audited.
pub async fn add(app: &App, actor: &str, req: AddKey) -> Result<Added, KeyOpError> {
    check_name(&req.name)?;
    if req.description.as_ref().is_some_and(|d| d.len() > 512) {
        return Err(KeyOpError::Invalid(
            "a description is at most 512 bytes".into(),
        ));
    }
    let known = app
        .policy
        .load()
        .graph
        .tenants
        .iter()
        .any(|t| t.name == req.tenant);
    if !known {
        return Err(KeyOpError::Invalid(format!(
            "`{}` is not a tenant of the active policy",
            req.tenant
        )));
    }
    let expires = file::expiry(req.expires.as_deref(), req.expires_in.as_deref())
        .map_err(|e| KeyOpError::Invalid(e.to_string()))?;
    if app
        .auth
        .load()
        .keys
        .iter()
        .any(|k| k.name.as_deref() == Some(req.name.as_str()))
    {
        return Err(KeyOpError::Conflict(format!(
            "a key named `{}` is in kiln.toml",
            req.name
        )));
    }
    let (key, source) = match &app.fleet {
        Some(fleet) => {
            let key = file::new_key()?;
            let h = hash_secret(&key);
            let rec = SharedKey {
                name: req.name.clone(),
                tenant: req.tenant.clone(),
                description: req.description.clone(),
                expires: expires.clone(),
                by: actor.to_string(),
                at_ms: now_ms(),
            };
            if shared::add(app, fleet, &h, &rec).await?.is_none() {
                return Err(KeyOpError::Conflict(format!(
                    "a key named `{}` is in the fleet",
                    req.name
                )));
            }
            (key, "fleet")
        }
        None => {
            let path = app.config.source.clone().ok_or(KeyOpError::Nowhere)?;
            let k = file::NewKey {
                name: req.name.clone(),
                tenant: req.tenant.clone(),
                description: req.description.clone(),
                expires: expires.clone(),
            };
            let key = tokio::task::spawn_blocking(move || file::add(&path, &k))
                .await
                .map_err(|e| KeyOpError::Conflict(format!("the file edit stopped: {e}")))??;
            reload(app, actor)
                .await
                .map_err(|e| KeyOpError::File(file::KeysError::Invalid(e)))?;
            (key, "file")
        }
    };
    let sha256_prefix: String = hash_secret(&key).chars().take(12).collect();
    audit(
        app,
        "key-added",
        actor,
        json!({
            "name": req.name,
            "tenant": req.tenant,
            "sha256_prefix": sha256_prefix,
            "expires": expires,
            "source": source,
        }),
    )
    .await;
    tracing::info!(name = %req.name, tenant = %req.tenant, source, "API key added");
    Ok(Added {
        key,
        name: req.name,
        tenant: req.tenant,
        sha256_prefix,
        expires,
        source,
    })
}

/// Revokes the key named `name`: in a fleet, a managed key or one of
/// `kiln.toml` is recorded as revoked in the fleet's store (every replica
/// refuses it within [`shared::SYNC_EVERY`]); a single gateway removes it
/// from its `kiln.toml`. Audited.
pub async fn revoke(app: &App, actor: &str, name: &str) -> Result<RevokedView, KeyOpError> {
    check_name(name)?;
    let (tenant, sha, source) = match &app.fleet {
        Some(fleet) => {
            // Read the fleet's keys first: the name may be one another
            // replica added a moment ago.
            shared::sync(app, fleet).await?;
            let view = app.shared_keys.load_full();
            let managed = view
                .managed
                .iter()
                .find(|(_, m)| m.name == name)
                .map(|(h, m)| (h.clone(), m.tenant.clone()));
            let in_file = app
                .auth
                .load()
                .keys
                .iter()
                .find(|k| k.name.as_deref() == Some(name))
                .map(|k| (k.sha256.to_ascii_lowercase(), k.tenant.clone()));
            let (h, tenant, managed_name) = match (managed, in_file) {
                (Some((h, t)), _) => (h, t, Some(name)),
                (None, Some((h, t))) => (h, t, None),
                (None, None) => return Err(KeyOpError::NotFound(name.to_string())),
            };
            if view.revoked.contains_key(&h) {
                return Err(KeyOpError::Conflict(format!("`{name}` is revoked already")));
            }
            let rec = RevokedKey {
                name: Some(name.to_string()),
                tenant: tenant.clone(),
                by: actor.to_string(),
                at_ms: now_ms(),
            };
            if shared::revoke(app, fleet, &h, managed_name, &rec)
                .await?
                .is_none()
            {
                return Err(KeyOpError::Conflict(format!(
                    "`{name}` changed meanwhile (revoked or replaced through another replica)"
                )));
            }
            (tenant, h, "fleet")
        }
        None => {
            let path = app.config.source.clone().ok_or(KeyOpError::Nowhere)?;
            let n = name.to_string();
            let (tenant, h) = tokio::task::spawn_blocking(move || file::revoke(&path, &n))
                .await
                .map_err(|e| KeyOpError::Conflict(format!("the file edit stopped: {e}")))?
                .map_err(|e| match e {
                    file::KeysError::Usage(m) if m.starts_with("no key named") => {
                        KeyOpError::NotFound(name.to_string())
                    }
                    e => KeyOpError::File(e),
                })?;
            reload(app, actor)
                .await
                .map_err(|e| KeyOpError::File(file::KeysError::Invalid(e)))?;
            (tenant, h, "file")
        }
    };
    let sha256_prefix: String = sha.chars().take(12).collect();
    audit(
        app,
        "key-revoked",
        actor,
        json!({ "name": name, "tenant": tenant, "sha256_prefix": sha256_prefix, "source": source }),
    )
    .await;
    tracing::info!(name, tenant = %tenant, source, "API key revoked");
    Ok(RevokedView {
        name: name.to_string(),
        tenant,
        sha256_prefix,
        source,
    })
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
pub async fn reload(app: &App, actor: &str) -> Result<Reloaded, ConfigError> {
    let Some(path) = app.config.source.clone() else {
        return Err(ConfigError::Invalid {
            message: "this gateway was started without a config file: there are no keys to reload"
                .into(),
            help: Some("start it with `kiln serve --config kiln.toml`".into()),
        });
    };
    let result = reload_from(app, &path);
    if let Ok(r) = &result {
        let details = json!({
            "path": r.path,
            "keys": r.keys,
            "added": r.added,
            "removed": r.removed,
            "admin_tokens": r.admin_tokens,
        });
        if let Err(e) = app
            .gov
            .audit_event(app, "keys-reloaded", actor, details)
            .await
        {
            tracing::error!(error = %e, "the keys reload is in force but not in the audit log");
        }
    }
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

fn reload_from(app: &App, path: &Path) -> Result<Reloaded, ConfigError> {
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
                let _ = reload(&app, "sighup").await;
            } else if now.is_some() && now != seen {
                seen = now;
                let _ = reload(&app, "file-watch").await;
            }
        }
    }))
}
