//! Recent decisions kept for `GET /admin/explain/{id}`: the request, the
//! policy version and live signals it was decided with (the trace is
//! recomputed on demand, so the hot path pays only for a few clones), and
//! what the scheduler did to it, with reason codes and times.

use crate::graph::{DecisionGraph, Request, Signals};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Serialize)]
pub struct SchedEvent {
    /// Milliseconds since the request arrived.
    pub at_ms: f64,
    pub event: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// When the scheduler saw the request, in microseconds on its own clock
/// (the replay's time base: `kiln simulate` reports the same numbers for
/// the same trace on a virtual clock).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ClockTimes {
    pub arrived_us: Option<u64>,
    pub started_us: Option<u64>,
    pub finished_us: Option<u64>,
}

#[derive(Clone)]
pub struct Entry {
    pub id: String,
    pub endpoint: &'static str,
    pub received_unix_ms: f64,
    pub request: Request,
    pub version: Option<Arc<str>>,
    pub graph: Option<Arc<DecisionGraph>>,
    pub signals: Option<Arc<Signals>>,
    pub events: Vec<SchedEvent>,
    pub outcome: Option<String>,
    pub replica: Option<String>,
    pub clock: ClockTimes,
}

pub type Shared = Arc<Mutex<Entry>>;

/// What an entry holds besides its strings: the struct, the map slot, and
/// room for the scheduler events appended after it is stored.
const ENTRY_OVERHEAD: usize = 1024;

impl Entry {
    /// An estimate of the memory this entry holds, in bytes: its strings
    /// (the request's headers, tags, session, model) plus a fixed overhead.
    /// The graph and signals are shared with the executor, not counted.
    pub fn estimated_bytes(&self) -> usize {
        let r = &self.request;
        let headers: usize = r.headers.iter().map(|(k, v)| k.len() + v.len() + 48).sum();
        let tags: usize = r.tags.iter().map(|t| t.len() + 24).sum();
        ENTRY_OVERHEAD
            + self.id.len()
            + headers
            + tags
            + r.session.as_ref().map_or(0, String::len)
            + r.tenant.as_ref().map_or(0, String::len)
            + r.model.len()
    }
}

#[derive(Default)]
struct Inner {
    /// Ids oldest first, with the size each was stored at.
    order: VecDeque<(String, usize)>,
    map: HashMap<String, Shared>,
    bytes: usize,
}

/// A map bounded in entries and in (estimated) bytes: the oldest entries
/// go first.
pub struct ExplainStore {
    cap: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

impl ExplainStore {
    pub fn new(cap: usize, max_bytes: usize) -> ExplainStore {
        ExplainStore {
            cap: cap.max(1),
            max_bytes: max_bytes.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn insert(&self, e: Entry) -> Shared {
        let id = e.id.clone();
        let size = e.estimated_bytes();
        let shared = Arc::new(Mutex::new(e));
        if let Ok(mut g) = self.inner.lock() {
            let inner = &mut *g;
            while !inner.order.is_empty()
                && (inner.order.len() >= self.cap || inner.bytes + size > self.max_bytes)
            {
                if let Some((old, n)) = inner.order.pop_front() {
                    inner.map.remove(&old);
                    inner.bytes = inner.bytes.saturating_sub(n);
                }
            }
            // One entry larger than the whole budget is not kept.
            if size <= self.max_bytes {
                inner.order.push_back((id.clone(), size));
                inner.map.insert(id, shared.clone());
                inner.bytes += size;
            }
        }
        shared
    }

    /// Entries held and their estimated bytes.
    pub fn usage(&self) -> (usize, usize) {
        self.inner
            .lock()
            .map(|g| (g.order.len(), g.bytes))
            .unwrap_or((0, 0))
    }

    pub fn get(&self, id: &str) -> Option<Entry> {
        let g = self.inner.lock().ok()?;
        let e = g.map.get(id)?.clone();
        drop(g);
        let e = e.lock().ok()?.clone();
        Some(e)
    }
}

/// Records a scheduler-clock time on an entry.
pub fn clock(e: &Shared, set: impl FnOnce(&mut ClockTimes)) {
    if let Ok(mut g) = e.lock() {
        set(&mut g.clock);
    }
}

/// Appends a scheduler event to an entry (ignoring a poisoned lock: the
/// explanation is best effort, the request is not).
pub fn note(e: &Shared, at_ms: f64, event: impl Into<String>, reason: Option<&str>) {
    if let Ok(mut g) = e.lock() {
        g.events.push(SchedEvent {
            at_ms: (at_ms * 1000.0).round() / 1000.0,
            event: event.into(),
            reason: reason.map(str::to_string),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str) -> Entry {
        Entry {
            id: id.into(),
            endpoint: "chat",
            received_unix_ms: 0.0,
            request: Request::default(),
            version: None,
            graph: None,
            signals: None,
            events: vec![],
            outcome: None,
            replica: None,
            clock: ClockTimes::default(),
        }
    }

    #[test]
    fn bounded_and_oldest_first_out() {
        let s = ExplainStore::new(2, usize::MAX);
        let a = s.insert(entry("a"));
        s.insert(entry("b"));
        note(&a, 1.0, "queued", Some("priority"));
        assert_eq!(s.get("a").unwrap().events.len(), 1);
        s.insert(entry("c"));
        assert!(s.get("a").is_none());
        assert!(s.get("b").is_some() && s.get("c").is_some());
    }

    #[test]
    fn bounded_in_bytes_not_only_entries() {
        // Entries with 200 KB of headers each: a 1 MB budget keeps at most
        // five, however many entries the count allows.
        let s = ExplainStore::new(10_000, 1_000_000);
        for i in 0..50 {
            let mut e = entry(&format!("e{i}"));
            e.request
                .headers
                .insert("x-big".into(), "v".repeat(200_000));
            s.insert(e);
        }
        let (n, bytes) = s.usage();
        assert!((1..=5).contains(&n), "{n} entries");
        assert!(bytes <= 1_000_000, "{bytes} bytes");
        assert!(s.get("e49").is_some() && s.get("e0").is_none());
        // An entry larger than the budget is not kept (and evicts nothing
        // it need not).
        let mut e = entry("huge");
        e.request.headers.insert("x".into(), "v".repeat(2_000_000));
        s.insert(e);
        assert!(s.get("huge").is_none());
    }
}
