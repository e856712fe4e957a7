//! The audit log: append-only JSONL, one governance event a line, each
//! entry hash-chained to the one before it.
//!
//! An entry is `{seq, at, kind, actor, details, prev_hash, hash}`: `seq`
//! counts from 1, `at` is Unix milliseconds, `prev_hash` is the previous
//! entry's `hash` (64 zeros for the first), and `hash` is the SHA-256 (hex)
//! of the entry's canonical JSON without `hash` (object keys sorted at every
//! level, no whitespace). Editing a line changes its hash; deleting or
//! reordering lines breaks `seq` and `prev_hash`. Removing lines from the
//! end leaves a shorter valid chain: compare the head hash with one kept
//! elsewhere (`kiln audit verify --head`, or `kiln status`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

/// `prev_hash` of the first entry.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub seq: u64,
    /// Unix milliseconds.
    pub at: u64,
    /// `proposal`, `approval`, `activation`, `rollout`, `rollback`, …
    pub kind: String,
    /// Who: an admin token's name, an approver, or `kiln` (automatic).
    pub actor: String,
    pub details: Value,
    pub prev_hash: String,
    pub hash: String,
}

/// JSON with object keys sorted at every level and no whitespace: the bytes
/// an entry's hash covers.
pub fn canonical(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                if let Some(x) = m.get(*k) {
                    write_canonical(x, out);
                }
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The hash of an entry: SHA-256 over its canonical JSON without `hash`.
pub fn entry_hash(v: &Value) -> String {
    let mut v = v.clone();
    if let Value::Object(m) = &mut v {
        m.remove("hash");
    }
    hex::encode(Sha256::digest(canonical(&v).as_bytes()))
}

impl Entry {
    fn body(&self) -> Value {
        serde_json::json!({
            "seq": self.seq,
            "at": self.at,
            "kind": self.kind,
            "actor": self.actor,
            "details": self.details,
            "prev_hash": self.prev_hash,
        })
    }

    /// The line written to the file: canonical JSON, hash included.
    pub fn line(&self) -> String {
        let mut v = self.body();
        if let Value::Object(m) = &mut v {
            m.insert("hash".into(), Value::String(self.hash.clone()));
        }
        canonical(&v)
    }
}

#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum AuditError {
    #[error("cannot read the audit log {path}: {message}")]
    #[diagnostic(
        code(kiln::audit::io),
        help("check the path; `[audit] path` in kiln.toml names the gateway's log")
    )]
    Io { path: String, message: String },
    #[error("{path}:{line}: {what}")]
    #[diagnostic(
        code(kiln::audit::tampered),
        help("the audit log was edited, truncated in the middle, or its lines reordered after they were written; keep the file as evidence and restore it from a copy")
    )]
    Broken {
        path: String,
        /// 1-based line of the first entry that does not verify.
        line: usize,
        what: String,
    },
    #[error("the audit log's head is {found}, not the expected {expected}")]
    #[diagnostic(
        code(kiln::audit::head),
        help("entries were removed from the end (or appended): compare with the head hash `kiln status` shows")
    )]
    Head { expected: String, found: String },
}

/// A verified chain: how many entries and the last hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub entries: u64,
    /// The last entry's hash ([`GENESIS`] for an empty log).
    pub head: String,
}

/// Verifies a chain line by line; the first line that does not verify is
/// named: not an entry, out of sequence (a line deleted or moved), chained
/// to the wrong hash (the same), or hashing differently (edited).
pub fn verify_lines<R: BufRead>(path: &str, r: R) -> Result<Verified, AuditError> {
    let mut prev = GENESIS.to_string();
    let mut seq = 0u64;
    for (i, line) in r.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| AuditError::Io {
            path: path.to_string(),
            message: e.to_string(),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let broken = |what: String| AuditError::Broken {
            path: path.to_string(),
            line: n,
            what,
        };
        let v: Value = serde_json::from_str(&line)
            .map_err(|e| broken(format!("not a JSON entry ({e}): the line was edited")))?;
        let e: Entry = serde_json::from_value(v.clone())
            .map_err(|e| broken(format!("not an audit entry ({e}): the line was edited")))?;
        if e.seq != seq + 1 {
            return Err(broken(format!(
                "entry {} where {} was expected: entries were deleted or reordered",
                e.seq,
                seq + 1
            )));
        }
        if e.prev_hash != prev {
            return Err(broken(format!(
                "chained to {} but the previous entry is {}: entries were deleted, reordered or edited",
                short(&e.prev_hash),
                short(&prev)
            )));
        }
        let h = entry_hash(&v);
        if h != e.hash {
            return Err(broken(format!(
                "entry {} hashes to {} but records {}: the entry was edited",
                e.seq,
                short(&h),
                short(&e.hash)
            )));
        }
        prev = e.hash;
        seq = e.seq;
    }
    Ok(Verified {
        entries: seq,
        head: prev,
    })
}

pub fn verify_file(path: &Path) -> Result<Verified, AuditError> {
    let f = std::fs::File::open(path).map_err(|e| AuditError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    verify_lines(&path.display().to_string(), std::io::BufReader::new(f))
}

fn short(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}

/// The gateway's audit log: the chain's head in memory, every entry
/// appended to the file (when one is configured) and kept in memory (the
/// last [`AuditLog::KEEP`]) for `/admin/audit`.
#[derive(Debug)]
pub struct AuditLog {
    path: Option<PathBuf>,
    seq: u64,
    head: String,
    recent: std::collections::VecDeque<Entry>,
}

impl AuditLog {
    pub const KEEP: usize = 1000;

    /// An audit log kept only in memory (no `[audit] path`).
    pub fn memory() -> AuditLog {
        AuditLog {
            path: None,
            seq: 0,
            head: GENESIS.to_string(),
            recent: std::collections::VecDeque::new(),
        }
    }

    /// Opens (or creates) the file and verifies what it holds: a broken
    /// chain is an error, so nothing is ever appended after a tampered
    /// entry.
    pub fn open(path: &Path) -> Result<AuditLog, AuditError> {
        let v = if path.exists() {
            verify_file(path)?
        } else {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| AuditError::Io {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?;
            Verified {
                entries: 0,
                head: GENESIS.to_string(),
            }
        };
        Ok(AuditLog {
            path: Some(path.to_path_buf()),
            seq: v.entries,
            head: v.head,
            recent: std::collections::VecDeque::new(),
        })
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn head(&self) -> &str {
        &self.head
    }

    pub fn entries(&self) -> u64 {
        self.seq
    }

    pub fn recent(&self) -> impl Iterator<Item = &Entry> {
        self.recent.iter()
    }

    /// Builds the next entry, chained to the head, writes it and moves the
    /// head. A write error is returned (and the head does not move).
    pub fn append(
        &mut self,
        at: u64,
        kind: &str,
        actor: &str,
        details: Value,
    ) -> Result<Entry, AuditError> {
        let mut e = Entry {
            seq: self.seq + 1,
            at,
            kind: kind.to_string(),
            actor: actor.to_string(),
            details,
            prev_hash: self.head.clone(),
            hash: String::new(),
        };
        e.hash = entry_hash(&e.body());
        if let Some(p) = &self.path {
            let io = |err: std::io::Error| AuditError::Io {
                path: p.display().to_string(),
                message: err.to_string(),
            };
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(io)?;
            let mut line = e.line();
            line.push('\n');
            f.write_all(line.as_bytes()).map_err(io)?;
            f.flush().map_err(io)?;
        }
        self.seq = e.seq;
        self.head = e.hash.clone();
        if self.recent.len() >= Self::KEEP {
            self.recent.pop_front();
        }
        self.recent.push_back(e.clone());
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chain(n: usize) -> Vec<String> {
        let mut log = AuditLog::memory();
        (0..n)
            .map(|i| {
                log.append(
                    1000 + i as u64,
                    "proposal",
                    "alice",
                    json!({"id": format!("p-{i}"), "share": 5.5, "list": [1, {"b": 1, "a": 2}]}),
                )
                .unwrap()
                .line()
            })
            .collect()
    }

    fn verify(lines: &[String]) -> Result<Verified, AuditError> {
        verify_lines("audit.jsonl", lines.join("\n").as_bytes())
    }

    fn bad_line(r: Result<Verified, AuditError>) -> usize {
        match r {
            Err(AuditError::Broken { line, .. }) => line,
            other => panic!("expected a broken chain, got {other:?}"),
        }
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_level() {
        let v = json!({"b": [ {"z": 1, "y": null} ], "a": "x\"y", "c": 1.5});
        assert_eq!(
            canonical(&v),
            r#"{"a":"x\"y","b":[{"y":null,"z":1}],"c":1.5}"#
        );
    }

    #[test]
    fn an_intact_chain_verifies_and_names_its_head() {
        let lines = chain(4);
        let v = verify(&lines).unwrap();
        assert_eq!(v.entries, 4);
        let last: Entry = serde_json::from_str(&lines[3]).unwrap();
        assert_eq!(v.head, last.hash);
        assert_eq!(verify(&[]).unwrap().head, GENESIS);
    }

    #[test]
    fn an_edit_is_caught_at_its_line() {
        let mut lines = chain(4);
        lines[2] = lines[2].replace("alice", "mallory");
        assert_eq!(bad_line(verify(&lines)), 3);
        let mut lines = chain(4);
        lines[1] = lines[1].replace("5.5", "55");
        assert_eq!(bad_line(verify(&lines)), 2);
        let mut lines = chain(3);
        lines[0] = "not json".into();
        assert_eq!(bad_line(verify(&lines)), 1);
    }

    #[test]
    fn an_edit_with_a_recomputed_hash_breaks_the_next_link() {
        let mut lines = chain(3);
        let mut v: Value = serde_json::from_str(&lines[1]).unwrap();
        v["actor"] = json!("mallory");
        let h = entry_hash(&v);
        v["hash"] = json!(h);
        lines[1] = canonical(&v);
        assert_eq!(bad_line(verify(&lines)), 3);
    }

    #[test]
    fn deletion_and_reordering_are_caught() {
        let mut lines = chain(4);
        lines.remove(1);
        assert_eq!(bad_line(verify(&lines)), 2);
        let mut lines = chain(4);
        lines.swap(1, 2);
        assert_eq!(bad_line(verify(&lines)), 2);
        let mut lines = chain(4);
        lines.remove(0);
        assert_eq!(bad_line(verify(&lines)), 1);
    }

    #[test]
    fn the_file_log_reopens_on_its_head_and_refuses_a_broken_chain() {
        let dir = std::env::temp_dir().join(format!("kiln-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("audit.jsonl");
        let _ = std::fs::remove_file(&p);
        let mut log = AuditLog::open(&p).unwrap();
        log.append(1, "a", "x", json!({})).unwrap();
        log.append(2, "b", "x", json!({})).unwrap();
        let head = log.head().to_string();
        let mut again = AuditLog::open(&p).unwrap();
        assert_eq!(again.head(), head);
        assert_eq!(again.entries(), 2);
        again.append(3, "c", "y", json!({"n": 1})).unwrap();
        assert_eq!(verify_file(&p).unwrap().entries, 3);
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"y\"", "\"z\"");
        std::fs::write(&p, text).unwrap();
        assert!(matches!(
            AuditLog::open(&p),
            Err(AuditError::Broken { line: 3, .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
