//! Who a caller of the OpenAI endpoints is: the API key it sends, mapped
//! to a tenant by the config's hashed keys or the policy's declared ones.
//! Apart from the routes so that every surface that needs a tenant
//! (generation, models, files and batches) asks the same question without
//! depending on the request pipeline.

use super::openai::ApiError;
use super::App;
use crate::graph::DecisionGraph;
use axum::http::HeaderMap;

/// The key from `Authorization: Bearer` (or `x-api-key`).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get("authorization").and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        let key = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
            .unwrap_or(v);
        return Some(key.trim()).filter(|k| !k.is_empty());
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
}

/// The tenant a caller is: by a hashed key from the config, or a key the
/// policy declares. `Ok(None)` is an anonymous caller, where allowed.
pub fn authenticate(
    app: &App,
    g: &DecisionGraph,
    headers: &HeaderMap,
) -> Result<Option<String>, ApiError> {
    match bearer(headers) {
        Some(key) => {
            let auth = app.auth.load();
            let h = super::config::hash_secret(key);
            let shared = app.shared_keys.load();
            if let Some(r) = shared.revoked.get(&h) {
                return Err(ApiError::new(
                    401,
                    format!(
                        "the API key {} was revoked by {} at {}: ask for a new one",
                        r.name.as_deref().unwrap_or("(unnamed)"),
                        r.by,
                        super::keys::rfc3339(r.at_ms as i64)
                    ),
                )
                .code("revoked_api_key"));
            }
            let managed;
            let entry = match auth.key_entry_hashed(&h) {
                Some(k) => Some(k),
                None => {
                    managed = shared
                        .managed
                        .get(&h)
                        .map(|m| super::keys::shared::as_config(&h, m));
                    managed.as_ref()
                }
            };
            if let Some(k) = entry {
                let now = crate::clock::unix_ms() as i64;
                if k.expired_at(now) {
                    return Err(ApiError::new(
                        401,
                        format!(
                            "the API key {} expired at {}: ask for a new one",
                            k.label(),
                            k.expires.as_deref().unwrap_or("?")
                        ),
                    )
                    .code("expired_api_key"));
                }
                return Ok(Some(k.tenant.clone()));
            }
            if auth.policy_keys {
                if let Some(t) = g.tenant_for_key(key) {
                    return Ok(g.tenants.get(t as usize).map(|t| t.name.clone()));
                }
            }
            Err(ApiError::new(401, "the API key is not valid").code("invalid_api_key"))
        }
        None if app.config.allow_anonymous => Ok(None),
        None => Err(ApiError::new(
            401,
            "missing API key: send `Authorization: Bearer YOUR-KEY`",
        )
        .code("missing_api_key")),
    }
}
