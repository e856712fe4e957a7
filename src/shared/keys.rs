//! API keys managed through the admin API of a fleet: kept in Redis under
//! the fleet's namespace, so a key added or revoked through any replica
//! holds on every replica (each reads them again when the fleet's key
//! epoch moves). Records hold a key's SHA-256, never the key.
//!
//! Layout: `keys:managed` (hash → record), `keys:names` (name → hash, so
//! a name is the fleet's once), `keys:revoked` (hash → record; a key of
//! `kiln.toml` can be revoked too, and a revoked hash never comes back)
//! and `keys:epoch` (moved by every change).

use super::{Store, StoreError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A key the fleet manages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedKey {
    pub name: String,
    pub tenant: String,
    #[serde(default)]
    pub description: Option<String>,
    /// RFC 3339 time or a date, as in `[[keys]]`.
    #[serde(default)]
    pub expires: Option<String>,
    /// Who added it, and when (Unix ms).
    pub by: String,
    pub at_ms: u64,
}

/// A revoked key: who revoked it, when (Unix ms), and what it was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RevokedKey {
    #[serde(default)]
    pub name: Option<String>,
    pub tenant: String,
    pub by: String,
    pub at_ms: u64,
}

/// The fleet's managed and revoked keys, by hash, at an epoch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SharedKeys {
    pub epoch: u64,
    pub managed: BTreeMap<String, SharedKey>,
    pub revoked: BTreeMap<String, RevokedKey>,
}

fn json<T: Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Protocol {
        message: e.to_string(),
    })
}

impl Store {
    fn key_keys(&self) -> [String; 4] {
        [
            self.key(&["keys", "managed"]),
            self.key(&["keys", "names"]),
            self.key(&["keys", "epoch"]),
            self.key(&["keys", "revoked"]),
        ]
    }

    /// The fleet's key epoch (0: no key was ever managed, or Redis lost
    /// them).
    pub async fn keys_epoch(&self) -> Result<u64, StoreError> {
        let mut c = self.conn.clone();
        let k = self.key(&["keys", "epoch"]);
        let e: Option<u64> = self
            .call(async move { redis::cmd("GET").arg(k).query_async(&mut c).await })
            .await?;
        Ok(e.unwrap_or(0))
    }

    /// Every managed and revoked key, read at one epoch (one transaction).
    /// Records that do not parse are skipped (and logged).
    pub async fn keys_read(&self) -> Result<SharedKeys, StoreError> {
        let [managed, _, epoch, revoked] = self.key_keys();
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("GET")
            .arg(epoch)
            .cmd("HGETALL")
            .arg(managed)
            .cmd("HGETALL")
            .arg(revoked);
        let mut c = self.conn.clone();
        type Read = (
            Option<u64>,
            BTreeMap<String, String>,
            BTreeMap<String, String>,
        );
        let (e, m, r): Read = self
            .call(async move { pipe.query_async(&mut c).await })
            .await?;
        fn parse<T: for<'de> Deserialize<'de>>(
            all: BTreeMap<String, String>,
        ) -> BTreeMap<String, T> {
            all.into_iter()
                .filter_map(|(h, rec)| match serde_json::from_str(&rec) {
                    Ok(v) => Some((h, v)),
                    Err(e) => {
                        tracing::warn!(sha256_prefix = %h.chars().take(12).collect::<String>(), error = %e, "a shared key record does not parse: skipped");
                        None
                    }
                })
                .collect()
        }
        Ok(SharedKeys {
            epoch: e.unwrap_or(0),
            managed: parse(m),
            revoked: parse(r),
        })
    }

    /// Adds a managed key under `sha256`; `Ok(None)` where its name is
    /// taken (or the hash was seen before), else the new epoch.
    pub async fn keys_add(&self, sha256: &str, k: &SharedKey) -> Result<Option<u64>, StoreError> {
        let rec = json(k)?;
        let mut inv = self.scripts.keys_add.prepare_invoke();
        for key in self.key_keys() {
            inv.key(key);
        }
        inv.arg(sha256).arg(&k.name).arg(rec);
        let mut c = self.conn.clone();
        let e: u64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok((e > 0).then_some(e))
    }

    /// Revokes `sha256` (`managed_name`: its name where the fleet manages
    /// it); `Ok(None)` where that name no longer names it.
    pub async fn keys_revoke(
        &self,
        sha256: &str,
        managed_name: Option<&str>,
        r: &RevokedKey,
    ) -> Result<Option<u64>, StoreError> {
        let rec = json(r)?;
        let mut inv = self.scripts.keys_revoke.prepare_invoke();
        for key in self.key_keys() {
            inv.key(key);
        }
        inv.arg(sha256).arg(managed_name.unwrap_or("")).arg(rec);
        let mut c = self.conn.clone();
        let e: u64 = self
            .call(async move { inv.invoke_async(&mut c).await })
            .await?;
        Ok((e > 0).then_some(e))
    }

    /// Writes back what this replica last read, where Redis no longer has
    /// it (it restarted empty): records are only added where absent, and
    /// the epoch moves past `seen.epoch`, so every replica reads again.
    pub async fn keys_restore(&self, seen: &SharedKeys) -> Result<u64, StoreError> {
        let mut inv = self.scripts.keys_restore.prepare_invoke();
        for key in self.key_keys() {
            inv.key(key);
        }
        inv.arg(seen.epoch).arg(seen.managed.len());
        for (h, k) in &seen.managed {
            inv.arg(h).arg(&k.name).arg(json(k)?);
        }
        for (h, r) in &seen.revoked {
            inv.arg(h).arg(json(r)?);
        }
        let mut c = self.conn.clone();
        self.call(async move { inv.invoke_async(&mut c).await })
            .await
    }
}
