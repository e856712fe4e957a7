//! Keys added and revoked through the admin API of a fleet (`[state]
//! redis`): written to the fleet's store ([`crate::shared::keys`]) and read
//! back by every replica within [`SYNC_EVERY`], so a key added through one
//! replica authenticates on all of them and a key revoked through one
//! (a managed key or one of `kiln.toml`) is refused by all of them.
//!
//! While Redis is unreachable a replica keeps the keys it last read, so a
//! revocation it has seen keeps holding; a Redis that comes back empty is
//! given back what the replica last read (records only where absent), so a
//! revoked key does not come back to life with a flushed store.

use super::super::fleet::Fleet;
use super::super::App;
use crate::server::config::KeyConfig;
use crate::shared::keys::{RevokedKey, SharedKey, SharedKeys};
use crate::shared::StoreError;
use std::sync::Arc;
use std::time::Duration;

/// How often each replica looks at the fleet's key epoch: the longest a
/// key added or revoked elsewhere takes to hold here.
pub const SYNC_EVERY: Duration = Duration::from_millis(500);

/// A managed key as `[[keys]]` would hold it.
pub fn as_config(sha256: &str, k: &SharedKey) -> KeyConfig {
    KeyConfig {
        sha256: sha256.to_string(),
        tenant: k.tenant.clone(),
        name: Some(k.name.clone()),
        description: k.description.clone(),
        expires: k.expires.clone(),
    }
}

/// Reads the fleet's keys where they changed (or were lost) since this
/// replica last looked; the view stays as it was where Redis does not
/// answer.
pub async fn sync(app: &App, fleet: &Fleet) -> Result<(), StoreError> {
    let seen = app.shared_keys.load_full();
    let epoch = fleet.store.keys_epoch().await?;
    if epoch == seen.epoch {
        return Ok(());
    }
    if epoch < seen.epoch {
        // The store lost what it held (a restart without its append-only
        // file, a flush): give it back, then read what it has now.
        let e = fleet.store.keys_restore(&seen).await?;
        tracing::warn!(
            epoch,
            restored_to = e,
            managed = seen.managed.len(),
            revoked = seen.revoked.len(),
            "the shared store lost the fleet's API keys: restored from this replica's last reading"
        );
    }
    let next = fleet.store.keys_read().await?;
    app.shared_keys.store(Arc::new(next));
    Ok(())
}

/// Follows the fleet's keys until the gateway stops.
pub fn spawn(app: Arc<App>, fleet: Arc<Fleet>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SYNC_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = sync(&app, &fleet).await {
                tracing::debug!(error = %e, "fleet keys not read: the last reading stands");
            }
        }
    })
}

/// Adds a managed key; `Ok(None)`: its name is taken in the fleet.
pub async fn add(
    app: &App,
    fleet: &Fleet,
    sha256: &str,
    k: &SharedKey,
) -> Result<Option<u64>, StoreError> {
    let e = fleet.store.keys_add(sha256, k).await?;
    // This replica holds the change before it answers.
    let _ = sync(app, fleet).await;
    Ok(e)
}

/// Revokes a key by hash; `Ok(None)`: the managed name no longer named it.
pub async fn revoke(
    app: &App,
    fleet: &Fleet,
    sha256: &str,
    managed_name: Option<&str>,
    r: &RevokedKey,
) -> Result<Option<u64>, StoreError> {
    let e = fleet.store.keys_revoke(sha256, managed_name, r).await?;
    let _ = sync(app, fleet).await;
    Ok(e)
}

/// The view a fresh replica starts with (nothing read yet).
pub fn empty() -> SharedKeys {
    SharedKeys::default()
}
