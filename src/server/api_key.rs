//! An API key as `[[keys]]` holds it (its hash, tenant, name, description
//! and expiry) and how its expiry is read: shared by the config file, the
//! keys the fleet manages, and `kiln keys`.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// SHA-256 (hex) of the key.
    pub sha256: String,
    /// The policy tenant this key authenticates as.
    pub tenant: String,
    /// A label for logs (never the key); `kiln keys revoke NAME` and
    /// `rotate NAME` find the key by it.
    #[serde(default)]
    pub name: Option<String>,
    /// What the key is for, for whoever reads the file.
    #[serde(default)]
    pub description: Option<String>,
    /// When the key stops authenticating: an RFC 3339 time
    /// (`2027-01-31T00:00:00Z`) or a date (`2027-01-31`, midnight UTC).
    #[serde(default)]
    pub expires: Option<String>,
}

impl KeyConfig {
    /// When the key expires, in Unix milliseconds (`None`: never, or an
    /// `expires` that does not parse, which `validate` refuses).
    pub fn expires_ms(&self) -> Option<i64> {
        self.expires.as_deref().and_then(|e| parse_expiry(e).ok())
    }

    /// Whether the key has expired at `now_ms` (Unix milliseconds).
    pub fn expired_at(&self, now_ms: i64) -> bool {
        self.expires_ms().is_some_and(|e| now_ms >= e)
    }

    /// The key as messages name it: its name, else its entry's tenant.
    pub fn label(&self) -> String {
        match &self.name {
            Some(n) => format!("`{n}`"),
            None => format!("for tenant `{}`", self.tenant),
        }
    }
}

/// An `expires` value in Unix milliseconds: an RFC 3339 time, or a date
/// (midnight UTC).
pub fn parse_expiry(text: &str) -> Result<i64, String> {
    let t = text.trim();
    if let Ok(ts) = t.parse::<jiff::Timestamp>() {
        return Ok(ts.as_millisecond());
    }
    match t.parse::<jiff::civil::Date>() {
        Ok(d) => format!("{d}T00:00:00Z")
            .parse::<jiff::Timestamp>()
            .map(|ts| ts.as_millisecond())
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}
