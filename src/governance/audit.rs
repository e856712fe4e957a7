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
        help("the log does not hold the head recorded for it (its `.head` file, or `--head`): entries were rewritten with recomputed hashes or removed from the end; keep both files as evidence and restore the log from a copy")
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

/// A last line cut short by an interrupted write: no newline at its end,
/// and not an entry that verifies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Torn {
    /// 1-based line.
    pub line: usize,
    /// Where it starts (the file is good up to here).
    pub offset: u64,
    pub bytes: u64,
    pub what: String,
}

/// What a scan of a chain found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scanned {
    pub verified: Verified,
    /// A torn last line, not counted in `verified`.
    pub torn: Option<Torn>,
    /// The last entry verifies but its newline is missing.
    pub unterminated: bool,
}

/// Scans a chain line by line, calling `visit` with every entry that
/// verifies; the first line that does not verify is named: not an entry,
/// out of sequence (a line deleted or moved), chained to the wrong hash
/// (the same), or hashing differently (edited). A last line without its
/// newline that does not verify is reported as [`Torn`], not as an error.
pub fn scan<R: BufRead>(
    path: &str,
    mut r: R,
    mut visit: impl FnMut(&Entry),
) -> Result<Scanned, AuditError> {
    let mut prev = GENESIS.to_string();
    let mut seq = 0u64;
    let mut offset = 0u64;
    let mut buf = Vec::new();
    let mut n = 0usize;
    let mut unterminated = false;
    loop {
        buf.clear();
        let got = r.read_until(b'\n', &mut buf).map_err(|e| AuditError::Io {
            path: path.to_string(),
            message: e.to_string(),
        })?;
        if got == 0 {
            break;
        }
        n += 1;
        let start = offset;
        offset += got as u64;
        let terminated = buf.last() == Some(&b'\n');
        let checked = check_line(&buf, seq, &prev);
        let e = match checked {
            Ok(None) => continue,
            Ok(Some(e)) => e,
            Err(what) if !terminated => {
                return Ok(Scanned {
                    verified: Verified {
                        entries: seq,
                        head: prev,
                    },
                    torn: Some(Torn {
                        line: n,
                        offset: start,
                        bytes: got as u64,
                        what,
                    }),
                    unterminated: false,
                });
            }
            Err(what) => {
                return Err(AuditError::Broken {
                    path: path.to_string(),
                    line: n,
                    what,
                })
            }
        };
        unterminated = !terminated;
        visit(&e);
        prev = e.hash;
        seq = e.seq;
    }
    Ok(Scanned {
        verified: Verified {
            entries: seq,
            head: prev,
        },
        torn: None,
        unterminated,
    })
}

/// One line against the chain so far: `None` for a blank line, the entry,
/// or what is wrong with it.
fn check_line(bytes: &[u8], seq: u64, prev: &str) -> Result<Option<Entry>, String> {
    let line = std::str::from_utf8(bytes)
        .map_err(|_| "not UTF-8 text: the line was edited".to_string())?;
    if line.trim().is_empty() {
        return Ok(None);
    }
    let v: Value = serde_json::from_str(line)
        .map_err(|e| format!("not a JSON entry ({e}): the line was edited"))?;
    let e: Entry = serde_json::from_value(v.clone())
        .map_err(|e| format!("not an audit entry ({e}): the line was edited"))?;
    if e.seq != seq + 1 {
        return Err(format!(
            "entry {} where {} was expected: entries were deleted or reordered",
            e.seq,
            seq + 1
        ));
    }
    if e.prev_hash != prev {
        return Err(format!(
            "chained to {} but the previous entry is {}: entries were deleted, reordered or edited",
            short(&e.prev_hash),
            short(prev)
        ));
    }
    let h = entry_hash(&v);
    if h != e.hash {
        return Err(format!(
            "entry {} hashes to {} but records {}: the entry was edited",
            e.seq,
            short(&h),
            short(&e.hash)
        ));
    }
    Ok(Some(e))
}

/// Verifies a chain line by line (see [`scan`]); a torn last line is an
/// error here too (the gateway truncates it when it starts).
pub fn verify_lines<R: BufRead>(path: &str, r: R) -> Result<Verified, AuditError> {
    let s = scan(path, r, |_| {})?;
    match s.torn {
        Some(t) => Err(AuditError::Broken {
            path: path.to_string(),
            line: t.line,
            what: format!(
                "a torn last line, cut short by an interrupted write ({}); the gateway truncates it when it starts",
                t.what
            ),
        }),
        None => Ok(s.verified),
    }
}

pub fn verify_file(path: &Path) -> Result<Verified, AuditError> {
    let f = std::fs::File::open(path).map_err(|e| AuditError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    verify_lines(&path.display().to_string(), std::io::BufReader::new(f))
}

/// The head file of an audit log at `audit`: `<audit>.head`, rewritten
/// (atomically) after every append with the number of entries and the
/// head hash, so that a log rewritten with recomputed hashes, or cut
/// short, is caught on restart and by `kiln audit verify`.
pub fn head_path(audit: &Path) -> PathBuf {
    let mut s = audit.as_os_str().to_owned();
    s.push(".head");
    PathBuf::from(s)
}

/// The head an audit log recorded beside itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedHead {
    pub entries: u64,
    pub head: String,
}

/// The head file of the audit log at `audit`, if there is one.
pub fn read_head(audit: &Path) -> Result<Option<RecordedHead>, AuditError> {
    let p = head_path(audit);
    let io = |message: String| AuditError::Io {
        path: p.display().to_string(),
        message,
    };
    match std::fs::read_to_string(&p) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| io(format!("not a head file ({e})"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(e.to_string())),
    }
}

/// Checks a chain against the head recorded for it: the entry at the
/// recorded position must carry the recorded hash (entries appended after
/// it, the head file not yet rewritten, are fine).
pub fn check_head(
    recorded: &RecordedHead,
    verified: &Verified,
    hash_at: Option<&str>,
) -> Result<(), AuditError> {
    if recorded.entries == 0 {
        return Ok(());
    }
    if verified.entries < recorded.entries {
        return Err(AuditError::Head {
            expected: format!("{} (entry {})", recorded.head, recorded.entries),
            found: format!("{} after only {} entries", verified.head, verified.entries),
        });
    }
    match hash_at {
        Some(h) if h == recorded.head => Ok(()),
        found => Err(AuditError::Head {
            expected: format!("{} (entry {})", recorded.head, recorded.entries),
            found: format!(
                "{} at entry {}",
                found.unwrap_or("nothing"),
                recorded.entries
            ),
        }),
    }
}

/// Verifies the file and compares it with its head file, when it has one:
/// what `kiln audit verify` checks without `--head`. Also answers whether
/// a head file was found.
pub fn verify_file_and_head(path: &Path) -> Result<(Verified, bool), AuditError> {
    let recorded = read_head(path)?;
    let f = std::fs::File::open(path).map_err(|e| AuditError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    let want = recorded.as_ref().map(|r| r.entries);
    let mut hash_at = None;
    let v = verify_lines_visiting(path, f, |e| {
        if Some(e.seq) == want {
            hash_at = Some(e.hash.clone());
        }
    })?;
    if let Some(r) = &recorded {
        check_head(r, &v, hash_at.as_deref())?;
    }
    Ok((v, recorded.is_some()))
}

fn verify_lines_visiting(
    path: &Path,
    f: std::fs::File,
    visit: impl FnMut(&Entry),
) -> Result<Verified, AuditError> {
    let name = path.display().to_string();
    let s = scan(&name, std::io::BufReader::new(f), visit)?;
    match s.torn {
        Some(t) => Err(AuditError::Broken {
            path: name,
            line: t.line,
            what: format!(
                "a torn last line, cut short by an interrupted write ({}); the gateway truncates it when it starts",
                t.what
            ),
        }),
        None => Ok(s.verified),
    }
}

/// What the gateway learns from its audit log when it opens it: facts that
/// a lost or replaced state file cannot take away.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Facts {
    /// The gateway's identity, from the first `gateway` entry.
    pub gateway: Option<String>,
    /// The highest `p-N` a `proposal` entry names.
    pub highest_proposal: u64,
    /// The signatures of every accepted approval (`approval` entries).
    pub signatures: std::collections::HashSet<String>,
}

impl Facts {
    /// Adds what `other` knows (entries this log did not read).
    pub fn merge(&mut self, other: Facts) {
        if self.gateway.is_none() {
            self.gateway = other.gateway;
        }
        self.highest_proposal = self.highest_proposal.max(other.highest_proposal);
        self.signatures.extend(other.signatures);
    }

    fn learn(&mut self, e: &Entry) {
        match e.kind.as_str() {
            "gateway" if self.gateway.is_none() => {
                self.gateway = e.details["gateway"].as_str().map(str::to_string);
            }
            "proposal" => {
                let n = e.details["id"]
                    .as_str()
                    .and_then(|id| id.strip_prefix("p-"))
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
                self.highest_proposal = self.highest_proposal.max(n);
            }
            "approval" => {
                if let Some(sig) = e.details["signature"].as_str() {
                    self.signatures.insert(sig.trim().to_ascii_lowercase());
                }
            }
            _ => {}
        }
    }
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
    facts: Facts,
    /// A log whose chain lives in the fleet's shared store: appended
    /// lines wait here until the governance step that wrote them commits
    /// them there (see [`AuditLog::take_staged`]).
    staged: Option<Vec<String>>,
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
            facts: Facts::default(),
            staged: None,
        }
    }

    /// The local view of a chain kept in the fleet's shared store: it
    /// learns the chain line by line ([`AuditLog::absorb`]) and stages what
    /// this replica appends until a step commits it.
    pub fn shared() -> AuditLog {
        AuditLog {
            staged: Some(Vec::new()),
            ..AuditLog::memory()
        }
    }

    /// The lines appended since the last call (a shared log's), in order.
    pub fn take_staged(&mut self) -> Vec<String> {
        self.staged.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether appended lines wait to be committed.
    pub fn has_staged(&self) -> bool {
        self.staged.as_ref().is_some_and(|s| !s.is_empty())
    }

    /// What the entries seen so far tell (a shared log learns as it goes).
    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// Takes `line`, written by any replica, as the chain's next entry:
    /// it must follow the head in sequence, chain to it and hash to what
    /// it records, or the chain was tampered with (or forked) and nothing
    /// is taken.
    pub fn absorb(&mut self, line: &str) -> Result<(), AuditError> {
        let e = check_line(line.as_bytes(), self.seq, &self.head)
            .map_err(|what| AuditError::Broken {
                path: "the shared audit chain".into(),
                line: usize::try_from(self.seq + 1).unwrap_or(usize::MAX),
                what,
            })?
            .ok_or_else(|| AuditError::Broken {
                path: "the shared audit chain".into(),
                line: usize::try_from(self.seq + 1).unwrap_or(usize::MAX),
                what: "an empty line".into(),
            })?;
        self.facts.learn(&e);
        self.seq = e.seq;
        self.head = e.hash.clone();
        if self.recent.len() >= Self::KEEP {
            self.recent.pop_front();
        }
        self.recent.push_back(e);
        Ok(())
    }

    /// Goes on from a checkpoint of a shared chain whose oldest lines were
    /// trimmed: `entries` of them, the last hashing to `head`, and what
    /// they told (`facts`). The next line absorbed must chain to `head`.
    /// A log already past the checkpoint is left as it is.
    pub fn resume_at(&mut self, entries: u64, head: &str, facts: Facts) {
        if entries <= self.seq {
            return;
        }
        self.seq = entries;
        self.head = head.to_string();
        self.facts.merge(facts);
    }

    /// Opens (or creates) the file and verifies what it holds: a broken
    /// chain is an error, so nothing is ever appended after a tampered
    /// entry, and so is a chain that does not hold the head its head file
    /// recorded (rewritten with recomputed hashes, or cut short). A torn
    /// last line (an append interrupted by a crash) is truncated, and an
    /// `audit_recovered` entry says so.
    pub fn open(path: &Path) -> Result<AuditLog, AuditError> {
        let io = |e: std::io::Error| AuditError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let recorded = read_head(path)?;
        let want = recorded.as_ref().map(|r| r.entries);
        let mut facts = Facts::default();
        let mut hash_at = None;
        let scanned = if path.exists() {
            let f = std::fs::File::open(path).map_err(io)?;
            scan(
                &path.display().to_string(),
                std::io::BufReader::new(f),
                |e| {
                    facts.learn(e);
                    if Some(e.seq) == want {
                        hash_at = Some(e.hash.clone());
                    }
                },
            )?
        } else {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(io)?;
            Scanned {
                verified: Verified {
                    entries: 0,
                    head: GENESIS.to_string(),
                },
                torn: None,
                unterminated: false,
            }
        };
        if let Some(r) = &recorded {
            check_head(r, &scanned.verified, hash_at.as_deref())?;
        }
        if scanned.torn.is_some() || scanned.unterminated {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(io)?;
            if let Some(t) = &scanned.torn {
                f.set_len(t.offset).map_err(io)?;
            } else {
                use std::io::Seek;
                f.seek(std::io::SeekFrom::End(0)).map_err(io)?;
                f.write_all(b"\n").map_err(io)?;
            }
            f.sync_all().map_err(io)?;
        }
        let mut log = AuditLog {
            path: Some(path.to_path_buf()),
            seq: scanned.verified.entries,
            head: scanned.verified.head,
            recent: std::collections::VecDeque::new(),
            facts,
            staged: None,
        };
        if let Some(t) = scanned.torn {
            tracing::warn!(audit = %path.display(), line = t.line, bytes = t.bytes, "the audit log's last line was torn by an interrupted write: truncated");
            log.append(
                crate::clock::unix_ms() as u64,
                "audit_recovered",
                "kiln",
                serde_json::json!({"reason": "torn_last_line", "line": t.line, "offset": t.offset,
                                   "truncated_bytes": t.bytes, "error": t.what}),
            )?;
        } else if recorded.is_none() || want != Some(log.seq) {
            log.write_head()?;
        }
        Ok(log)
    }

    /// What the log told about the gateway when it was opened (once: the
    /// log keeps no copy).
    pub fn take_facts(&mut self) -> Facts {
        std::mem::take(&mut self.facts)
    }

    /// Rewrites the head file (when the log has a file).
    fn write_head(&self) -> Result<(), AuditError> {
        let Some(p) = &self.path else {
            return Ok(());
        };
        let rec = RecordedHead {
            entries: self.seq,
            head: self.head.clone(),
        };
        let bytes = serde_json::to_vec(&rec).unwrap_or_default();
        super::state::write_atomic(&head_path(p), &bytes).map_err(|e| AuditError::Io {
            path: head_path(p).display().to_string(),
            message: e.to_string(),
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
            // On disk before anyone is told it happened.
            f.sync_data().map_err(io)?;
        }
        if let Some(staged) = self.staged.as_mut() {
            staged.push(e.line());
            // A shared log learns from its own entries as from others'.
            self.facts.learn(&e);
        }
        self.seq = e.seq;
        self.head = e.hash.clone();
        if let Err(err) = self.write_head() {
            // The entry is in the log; a stale head file only means a
            // restart checks an earlier entry.
            tracing::error!(error = %err, "cannot write the audit log's head file");
        }
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
        let _ = std::fs::remove_file(head_path(&p));
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

    #[test]
    fn a_torn_tail_is_cut_and_a_short_or_rewritten_log_fails_its_head() {
        let dir = std::env::temp_dir().join(format!("kiln-audit-torn-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("audit.jsonl");
        let mut log = AuditLog::open(&p).unwrap();
        log.append(1, "a", "x", json!({})).unwrap();
        log.append(2, "b", "x", json!({})).unwrap();
        let good = std::fs::read_to_string(&p).unwrap();
        let mut torn = good.clone();
        torn.push_str("{\"seq\":3,\"ki");
        std::fs::write(&p, &torn).unwrap();
        assert!(verify_file(&p).is_err());
        let log = AuditLog::open(&p).unwrap();
        assert_eq!(log.entries(), 3);
        assert_eq!(log.recent().last().unwrap().kind, "audit_recovered");
        assert_eq!(verify_file_and_head(&p).unwrap().0.entries, 3);
        // The first two entries only: the head file knows there were three.
        std::fs::write(&p, &good).unwrap();
        assert!(matches!(AuditLog::open(&p), Err(AuditError::Head { .. })));
        assert!(matches!(
            verify_file_and_head(&p),
            Err(AuditError::Head { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
