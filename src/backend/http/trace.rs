//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the
//! `traceparent` header kiln passes to HTTP upstreams. A client's trace is
//! continued (its trace id and flags kept, kiln's own span id as the
//! parent the upstream sees); a request without a valid one starts a
//! trace.

use std::fmt;

/// The header's name.
pub const TRACEPARENT: &str = "traceparent";

/// Inside the gateway only: the client's span id (16 hex digits) where its
/// `traceparent` named one. The gateway replaces `traceparent` with its
/// own span's on arrival (what upstream calls and the request's
/// OpenTelemetry span use) and keeps the client's here, as that span's
/// parent; a value a client sends under this name is dropped.
pub const CLIENT_PARENT: &str = "x-kiln-parent-span";

/// One `traceparent` value: `00-<trace id>-<parent id>-<flags>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub parent_id: u64,
    pub flags: u8,
}

impl TraceParent {
    /// Parses a header value; `None` when it is not a valid one (an
    /// all-zero id, version `ff`, the wrong lengths, upper-case hex).
    /// Later versions are read by their first four fields, as the
    /// specification asks.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let v = value.trim();
        let mut parts = v.split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let parent = parts.next()?;
        let flags = parts.next()?;
        let lower_hex = |s: &str, n: usize| {
            s.len() == n
                && s.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        };
        if !lower_hex(version, 2) || version == "ff" {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        if !lower_hex(trace, 32) || !lower_hex(parent, 16) || !lower_hex(flags, 2) {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let parent_id = u64::from_str_radix(parent, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        (trace_id != 0 && parent_id != 0).then_some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// kiln's hop: the client's trace continued with a new span id, or a
    /// new sampled trace when `incoming` is absent or invalid.
    pub fn child_of(incoming: Option<&str>) -> TraceParent {
        match incoming.and_then(TraceParent::parse) {
            Some(t) => TraceParent {
                parent_id: span_id(),
                ..t
            },
            None => TraceParent {
                trace_id: trace_id(),
                parent_id: span_id(),
                flags: 0x01,
            },
        }
    }

    /// The trace id as the header writes it (32 lower-case hex digits).
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

/// Random bytes from a per-thread ChaCha8 generator, seeded once per
/// thread from the OS: trace and span ids are made for every request, and
/// a system call for each (three a request) showed in the gateway's
/// profile. Ids need only be unlikely to collide, not secret.
fn random_bytes<const N: usize>() -> [u8; N] {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::cell::RefCell;
    thread_local! {
        static RNG: RefCell<ChaCha8Rng> = RefCell::new(ChaCha8Rng::from_seed(os_seed()));
    }
    let mut b = [0u8; N];
    RNG.with(|r| r.borrow_mut().fill(&mut b[..]));
    b
}

/// A seed from the OS, or (without OS randomness) from the clock and the
/// thread.
fn os_seed() -> [u8; 32] {
    let mut b = [0u8; 32];
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(1);
        let th = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            std::thread::current().id().hash(&mut h);
            u128::from(h.finish())
        };
        let x = t ^ (th << 64) ^ th;
        for (i, v) in b.iter_mut().enumerate() {
            *v = (x >> ((i % 16) * 8)) as u8 ^ (i as u8).wrapping_mul(151);
        }
    }
    b
}

fn trace_id() -> u128 {
    u128::from_be_bytes(random_bytes::<16>()).max(1)
}

fn span_id() -> u64 {
    u64::from_be_bytes(random_bytes::<8>()).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_writes_the_specifications_example() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceParent::parse(v);
        assert_eq!(t.map(|t| t.to_string()).as_deref(), Some(v));
    }

    #[test]
    fn refuses_invalid_values() {
        for v in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(v), None, "{v}");
        }
        // A later version is read by its first four fields.
        assert!(
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x")
                .is_some()
        );
    }

    #[test]
    fn fresh_ids_do_not_repeat_within_or_across_threads() {
        // Each thread seeds its own generator: ids from threads started
        // together must still differ.
        let handles: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..2_000)
                        .map(|_| {
                            let t = TraceParent::child_of(None);
                            (t.trace_id, t.parent_id)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut traces = std::collections::HashSet::new();
        let mut spans = std::collections::HashSet::new();
        for h in handles {
            for (t, s) in h.join().unwrap() {
                assert!(t != 0 && s != 0);
                assert!(traces.insert(t), "trace id {t:x} repeated");
                spans.insert(s);
            }
        }
        // 64-bit span ids: a repeat among 8,000 is a broken generator.
        assert_eq!(spans.len(), 8_000);
    }

    #[test]
    fn a_child_keeps_the_trace_and_flags_with_a_new_parent() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let c = TraceParent::child_of(Some(v));
        assert_eq!(c.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.flags, 0);
        assert_ne!(c.parent_id, 0x00f0_67aa_0ba9_02b7);
        let fresh = TraceParent::child_of(Some("garbage"));
        assert_eq!(fresh.flags, 1);
        assert!(TraceParent::parse(&fresh.to_string()).is_some());
    }
}
