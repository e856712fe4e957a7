//! The exact-response cache's cost per request: hashing a request's
//! canonical JSON (the gateway does it once per cacheable request), binding
//! it to tier, tenant and variant, a lookup that hits, and an insert into a
//! full 10,000-entry tier (one eviction each).
//!
//! cargo bench --bench cache
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::compile::compile_str;
use kiln::sched::cache::{content_key, scoped_key, Bounds, Caches};
use serde_json::json;
use std::hint::black_box;
use std::time::Duration;

const POLICY: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier t { priority 1 cache { exact { entries 10k, ttl 10m } } }
classify { default => tier t }
route t m { default => fp16 }
"#;

fn bench(c: &mut Criterion) {
    let g = compile_str("p.kiln", POLICY).graph.unwrap();
    // A chat request of about 1 KB: a system prompt and a question.
    let body = json!({
        "model": "m", "temperature": 0, "max_tokens": 256, "stream": true,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. ".repeat(24)},
            {"role": "user", "content": "What does kiln do with a repeated deterministic request?"},
        ],
    });
    eprintln!("request: {} bytes of JSON", body.to_string().len());
    let mut grp = c.benchmark_group("cache");
    grp.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    grp.bench_function("content_key (1 KB request)", |b| {
        b.iter(|| content_key(black_box(&body)))
    });
    let content = content_key(&body).unwrap();
    grp.bench_function("scoped_key", |b| {
        b.iter(|| scoped_key(black_box(&content), "t", Some("acme"), "m.fp16"))
    });
    let mut caches = Caches::new(&g, Bounds::default());
    let payload: std::sync::Arc<str> = std::sync::Arc::from("x".repeat(1500));
    let key = |i: u64| {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&i.to_le_bytes());
        k
    };
    for i in 0..10_000u64 {
        caches
            .insert(0, key(i), 1500, Some(payload.clone()), 0)
            .unwrap();
    }
    let mut i = 0u64;
    grp.bench_function("get (hit, 10k entries)", |b| {
        b.iter(|| {
            i = (i + 7919) % 10_000;
            caches.get(0, black_box(&key(i)), 1).is_some()
        })
    });
    let mut n = 10_000u64;
    grp.bench_function("insert (full tier, evicts one)", |b| {
        b.iter(|| {
            n += 1;
            caches.insert(0, key(n), 1500, Some(payload.clone()), 2)
        })
    });
    grp.finish();
    assert_eq!(caches.len(0), 10_000);
}

criterion_group!(benches, bench);
criterion_main!(benches);
