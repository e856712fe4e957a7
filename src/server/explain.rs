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

/// A bounded map: the oldest entries go first.
pub struct ExplainStore {
    cap: usize,
    inner: Mutex<(VecDeque<String>, HashMap<String, Shared>)>,
}

impl ExplainStore {
    pub fn new(cap: usize) -> ExplainStore {
        ExplainStore {
            cap: cap.max(1),
            inner: Mutex::new((VecDeque::new(), HashMap::new())),
        }
    }

    pub fn insert(&self, e: Entry) -> Shared {
        let id = e.id.clone();
        let shared = Arc::new(Mutex::new(e));
        if let Ok(mut g) = self.inner.lock() {
            let (order, map) = &mut *g;
            while order.len() >= self.cap {
                if let Some(old) = order.pop_front() {
                    map.remove(&old);
                }
            }
            order.push_back(id.clone());
            map.insert(id, shared.clone());
        }
        shared
    }

    pub fn get(&self, id: &str) -> Option<Entry> {
        let g = self.inner.lock().ok()?;
        let e = g.1.get(id)?.clone();
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
        let s = ExplainStore::new(2);
        let a = s.insert(entry("a"));
        s.insert(entry("b"));
        note(&a, 1.0, "queued", Some("priority"));
        assert_eq!(s.get("a").unwrap().events.len(), 1);
        s.insert(entry("c"));
        assert!(s.get("a").is_none());
        assert!(s.get("b").is_some() && s.get("c").is_some());
    }
}
