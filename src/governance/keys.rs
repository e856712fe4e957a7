//! Approvers' keys and signed approvals (ed25519).
//!
//! An approval is a signature over a canonical message that binds the
//! gateway, the proposal (its id and a random nonce the gateway drew for
//! it), the policy's full SHA-256, the approver's name and the validity
//! window, so it cannot be moved onto another gateway, another proposal
//! (even one that later gets the same id), another text, another
//! approver's name, or used after it expires:
//!
//! ```text
//! kiln approval v2
//! gateway 9c0d…(32 hex)
//! proposal p-3
//! nonce 4b1e…(32 hex)
//! hash 3f5c…(64 hex)
//! approver alice
//! issued 1767225600
//! expires 1767229200
//! ```
//!
//! `issued` and `expires` are Unix seconds. The gateway's identity and the
//! nonce are random; the proposal's view (`GET /admin/proposals/ID`)
//! carries both. Keys are hex: a public key is
//! 64 hex digits (32 bytes), a signature 128.
//!
//! A key file (`kiln keygen`) is TOML, kept private (mode 0600):
//! `name = "alice"` and `secret = "…64 hex…"` (the ed25519 seed).

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error, miette::Diagnostic, PartialEq, Eq)]
pub enum KeyError {
    #[error("`{0}` is not an ed25519 public key (64 hex digits)")]
    #[diagnostic(
        code(kiln::keys::public),
        help("paste the line `kiln keygen` printed (or the NAME.pub file it wrote)")
    )]
    Public(String),
    #[error("the key file is not a kiln key: {0}")]
    #[diagnostic(
        code(kiln::keys::secret),
        help("make one with `kiln keygen --out NAME`; the file holds `name` and `secret`")
    )]
    Secret(String),
    #[error("the system's random number generator failed: {0}")]
    #[diagnostic(code(kiln::keys::random))]
    Random(String),
}

/// The signed fields of an approval, as sent to the server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedApproval {
    pub approver: String,
    /// The policy's full SHA-256 (64 hex), as reviewed.
    pub hash: String,
    /// Unix seconds.
    pub issued: u64,
    pub expires: u64,
    /// ed25519 signature over [`message`], 128 hex.
    pub signature: String,
}

/// What an approval is for: a gateway's proposal, under the nonce that
/// gateway drew for it (so a signature never fits a later proposal that
/// gets the same id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    pub gateway: &'a str,
    pub proposal: &'a str,
    pub nonce: &'a str,
}

/// The exact bytes an approval signs.
pub fn message(t: &Target, hash: &str, approver: &str, issued: u64, expires: u64) -> String {
    format!(
        "kiln approval v2\ngateway {}\nproposal {}\nnonce {}\nhash {hash}\napprover {approver}\nissued {issued}\nexpires {expires}\n",
        t.gateway, t.proposal, t.nonce
    )
}

/// 16 random bytes as 32 hex digits: a proposal's nonce, a gateway's
/// identity.
pub fn random_id() -> Result<String, KeyError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| KeyError::Random(e.to_string()))?;
    Ok(hex::encode(b))
}

/// A fresh key from the operating system's random number generator.
pub fn generate() -> Result<SigningKey, KeyError> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| KeyError::Random(e.to_string()))?;
    Ok(SigningKey::from_bytes(&seed))
}

pub fn public_hex(k: &VerifyingKey) -> String {
    hex::encode(k.as_bytes())
}

/// A public key from 64 hex digits (surrounding space ignored).
pub fn parse_public(text: &str) -> Result<VerifyingKey, KeyError> {
    let t = text.trim();
    let bytes: [u8; 32] = hex::decode(t)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| KeyError::Public(t.to_string()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| KeyError::Public(t.to_string()))
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    name: String,
    secret: String,
}

/// The text of a key file.
pub fn key_file(name: &str, k: &SigningKey) -> String {
    format!(
        "# kiln approver key: keep this file private (it signs approvals as {name})\nname = {}\nsecret = \"{}\"\n",
        toml_string(name),
        hex::encode(k.to_bytes())
    )
}

fn toml_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// Reads a key file: the approver's name and the key.
pub fn parse_key_file(text: &str) -> Result<(String, SigningKey), KeyError> {
    let f: KeyFile = toml::from_str(text).map_err(|e| KeyError::Secret(e.message().to_string()))?;
    let seed: [u8; 32] = hex::decode(f.secret.trim())
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| KeyError::Secret("`secret` is not 64 hex digits".into()))?;
    if f.name.trim().is_empty() {
        return Err(KeyError::Secret("`name` is empty".into()));
    }
    Ok((f.name, SigningKey::from_bytes(&seed)))
}

/// Signs an approval of `hash` for the proposal `t`.
pub fn sign(
    k: &SigningKey,
    t: &Target,
    hash: &str,
    approver: &str,
    issued: u64,
    expires: u64,
) -> SignedApproval {
    let sig = k.sign(message(t, hash, approver, issued, expires).as_bytes());
    SignedApproval {
        approver: approver.to_string(),
        hash: hash.to_string(),
        issued,
        expires,
        signature: hex::encode(sig.to_bytes()),
    }
}

/// Checks an approval's signature for the proposal `t` under `key`.
pub fn verify(key: &VerifyingKey, t: &Target, a: &SignedApproval) -> bool {
    let Some(bytes) = hex::decode(a.signature.trim())
        .ok()
        .and_then(|b| <[u8; 64]>::try_from(b).ok())
    else {
        return false;
    };
    let sig = Signature::from_bytes(&bytes);
    let msg = message(t, &a.hash, &a.approver, a.issued, a.expires);
    key.verify_strict(msg.as_bytes(), &sig).is_ok() && key.verify(msg.as_bytes(), &sig).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_for_what_it_signed() {
        let k = SigningKey::from_bytes(&[7; 32]);
        let other = SigningKey::from_bytes(&[8; 32]);
        let t = Target {
            gateway: "g1",
            proposal: "p-1",
            nonce: "n1",
        };
        let a = sign(&k, &t, &"a".repeat(64), "alice", 100, 200);
        assert!(verify(&k.verifying_key(), &t, &a));
        // Another proposal, the same id with another nonce (a proposal
        // that got the id again), another gateway, another key, or any
        // field changed: refused.
        for other_t in [
            Target {
                proposal: "p-2",
                ..t
            },
            Target { nonce: "n2", ..t },
            Target { gateway: "g2", ..t },
        ] {
            assert!(!verify(&k.verifying_key(), &other_t, &a));
        }
        assert!(!verify(&other.verifying_key(), &t, &a));
        for f in [
            |a: &mut SignedApproval| a.hash = "b".repeat(64),
            |a: &mut SignedApproval| a.approver = "bob".into(),
            |a: &mut SignedApproval| a.expires += 1,
            |a: &mut SignedApproval| a.issued -= 1,
            |a: &mut SignedApproval| a.signature = "00".into(),
        ] {
            let mut b = a.clone();
            f(&mut b);
            assert!(!verify(&k.verifying_key(), &t, &b));
        }
    }

    #[test]
    fn keys_round_trip_through_their_files() {
        let k = generate().unwrap();
        let (name, back) = parse_key_file(&key_file("al\"ice", &k)).unwrap();
        assert_eq!(name, "al\"ice");
        assert_eq!(back.to_bytes(), k.to_bytes());
        let pubk = parse_public(&format!(" {} \n", public_hex(&k.verifying_key()))).unwrap();
        assert_eq!(pubk, k.verifying_key());
        assert!(parse_public("xyz").is_err());
        assert!(parse_public(&"0".repeat(62)).is_err());
        assert!(parse_key_file("name = \"a\"\nsecret = \"zz\"\n").is_err());
        assert!(parse_key_file("garbage").is_err());
    }
}
