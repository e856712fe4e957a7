//! Keys kept in `kiln.toml`: adding, revoking and rotating a `[[keys]]`
//! entry by editing the file in place (toml_edit: comments and layout
//! kept), validated as the gateway reads it, and replaced atomically (a
//! temporary file beside it, then a rename), so a running gateway's file
//! watch never reads half a file. `kiln keys` edits a file with these, and
//! a single gateway's `POST /admin/keys` edits the file it started with.
//! A new key is returned once and only its hash is stored.

use crate::server::config::{hash_secret, parse_expiry, ConfigError, ServerConfig};
use std::path::{Path, PathBuf};
use toml_edit::{value, ArrayOfTables, DocumentMut, Item, Table};

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
    #[error(transparent)]
    #[diagnostic(transparent)]
    Invalid(#[from] ConfigError),
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
fn save(path: &Path, doc: &DocumentMut) -> Result<(), KeysError> {
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
        return Err(io(path, e));
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
pub fn new_key() -> Result<String, KeysError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| KeysError::Usage(format!("no randomness: {e}")))?;
    Ok(format!("sk-kiln-{}", hex::encode(b)))
}

fn now_ms() -> i64 {
    crate::clock::unix_ms() as i64
}

/// An RFC 3339 time (UTC) for Unix milliseconds.
pub fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| {
            t.round(jiff::Unit::Second)
                .map_or_else(|_| t.to_string(), |t| t.to_string())
        })
        .unwrap_or_else(|_| ms.to_string())
}

/// The RFC 3339 time `text` (a duration: `90d`, `12h`) from now.
fn after(text: &str) -> Result<String, KeysError> {
    let d = crate::units::duration::parse(text)
        .map_err(|e| KeysError::Usage(format!("`{text}` is not a duration: {e}")))?;
    Ok(rfc3339(
        now_ms().saturating_add(d.as_millis().min(i64::MAX as u128) as i64),
    ))
}

/// A key's expiry from `--expires` (a time or a date, checked) or
/// `--expires-in` (a duration from now); `None`: it never expires.
pub fn expiry(
    expires: Option<&str>,
    expires_in: Option<&str>,
) -> Result<Option<String>, KeysError> {
    match (expires, expires_in) {
        (Some(e), _) => {
            parse_expiry(e).map_err(|why| KeysError::Usage(format!("expires {e}: {why}")))?;
            Ok(Some(e.to_string()))
        }
        (None, Some(d)) => Ok(Some(after(d)?)),
        (None, None) => Ok(None),
    }
}

/// A key to add: who it authenticates and what it says about itself.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub name: String,
    pub tenant: String,
    pub description: Option<String>,
    /// RFC 3339 time or a date, already checked ([`expiry`]).
    pub expires: Option<String>,
}

fn entry(k: &NewKey, sha256: &str) -> Table {
    let mut t = Table::new();
    t.insert("name", value(k.name.as_str()));
    t.insert("tenant", value(k.tenant.as_str()));
    t.insert("sha256", value(sha256));
    if let Some(d) = &k.description {
        t.insert("description", value(d.as_str()));
    }
    if let Some(e) = &k.expires {
        t.insert("expires", value(e.as_str()));
    }
    t
}

/// Adds a key named `k.name` to the file; the new key (shown once).
pub fn add(path: &Path, k: &NewKey) -> Result<String, KeysError> {
    let mut doc = load(path)?;
    let keys = keys_mut(&mut doc)?;
    if find(keys, &k.name).is_ok() {
        return Err(KeysError::Usage(format!(
            "a key named `{}` exists: pick another name, or rotate it",
            k.name
        )));
    }
    let key = new_key()?;
    keys.push(entry(k, &hash_secret(&key)));
    save(path, &doc)?;
    Ok(key)
}

/// Removes the key named `name`; its tenant and hash.
pub fn revoke(path: &Path, name: &str) -> Result<(String, String), KeysError> {
    let mut doc = load(path)?;
    let keys = keys_mut(&mut doc)?;
    let i = find(keys, name)?;
    let s = |k: &str| {
        keys.get(i)
            .and_then(|t| t.get(k))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    let (tenant, sha) = (s("tenant"), s("sha256"));
    keys.remove(i);
    save(path, &doc)?;
    Ok((tenant, sha))
}

/// Replaces the key named `name` by a new one of the same name and
/// tenant; the old one keeps working for `overlap` (renamed
/// NAME-rotated-DATE, with that expiry; `0s`: not at all). The new key
/// and its tenant.
pub fn rotate(path: &Path, name: &str, overlap: &str) -> Result<(String, String), KeysError> {
    let overlap_d = crate::units::duration::parse(overlap)
        .map_err(|e| KeysError::Usage(format!("overlap {overlap}: {e}")))?;
    let mut doc = load(path)?;
    let keys = keys_mut(&mut doc)?;
    let i = find(keys, name)?;
    let next = {
        let Some(old) = keys.get(i) else {
            return Err(KeysError::Usage(format!("no key named `{name}`")));
        };
        let s = |k: &str| old.get(k).and_then(|v| v.as_str()).map(str::to_string);
        NewKey {
            name: name.to_string(),
            tenant: s("tenant").unwrap_or_default(),
            description: s("description"),
            expires: s("expires"),
        }
    };
    let key = new_key()?;
    if overlap_d.is_zero() {
        keys.remove(i);
    } else if let Some(old) = keys.get_mut(i) {
        let until = after(overlap)?;
        let date: String = until.chars().take(10).collect();
        old.insert("name", value(format!("{name}-rotated-{date}")));
        old.insert("expires", value(until));
    }
    keys.push(entry(&next, &hash_secret(&key)));
    save(path, &doc)?;
    Ok((key, next.tenant))
}
