//! Recorded traffic: importers over the real traces in `../shared/traces`,
//! the format's round trip, errors, merging and the `kiln traffic` CLI.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test and bench code may panic

use kiln::traffic::{
    self,
    import::{self, Mapping},
    servegen, Decision, ReadOptions, Record, TrafficError,
};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn traces() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces")
}

fn conv() -> PathBuf {
    traces().join("azure2023/AzureLLMInferenceTrace_conv.csv")
}

/// A scratch file under the target's tmp dir; one name a test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("traffic");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn bytes(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::new();
    traffic::write(&mut out, records).unwrap();
    out
}

fn is_sorted(records: &[Record]) -> bool {
    records.windows(2).all(|w| w[0].at_ms <= w[1].at_ms)
}

fn mapping() -> Mapping {
    let mut m = Mapping::new("llama-70b");
    m.tenant = Some("support-bot".into());
    m.headers.insert("x-kiln-tier".into(), "chat".into());
    m
}

/// Renders a diagnostic as a user sees it, without colour, the scratch
/// directory replaced by `[tmp]`; wide, so that where lines wrap does not
/// depend on the length of the scratch path.
fn render(e: &TrafficError) -> String {
    let mut s = String::new();
    miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
        .with_width(400)
        .render_report(&mut s, e)
        .unwrap();
    let dir = scratch("").display().to_string();
    s.replace(&dir, "[tmp]/")
        .replace("[tmp]//", "[tmp]/")
        .lines()
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn azure_conv_matches_the_readme() {
    let l = import::azure(conv(), &mapping()).unwrap();
    let r = &l.records;
    assert_eq!(r.len(), 19_366);
    assert!(l.skipped.is_empty());
    assert!(is_sorted(r));
    assert_eq!(r[0].at_ms, 0.0);
    assert_eq!(r[1].at_ms, 4314.579);
    // About 58 minutes.
    let span_min = r[r.len() - 1].at_ms / 60_000.0;
    assert!((57.0..59.0).contains(&span_min), "{span_min}");
    assert_eq!(
        (r[0].prompt_tokens, r[0].output_tokens, r[0].max_tokens),
        (374, 44, 44)
    );
    assert_eq!(r[0].tenant.as_deref(), Some("support-bot"));
    assert_eq!(r[0].request().header("X-Kiln-Tier"), Some("chat"));
    let all = traffic::stats::stats(r);
    let total = all.last().unwrap();
    assert_eq!(total.prompt_tokens.p50, 1020);
    assert_eq!(total.prompt_tokens.max, 14_050);
    assert_eq!(total.output_tokens.p50, 129);
    assert_eq!(total.output_tokens.max, 1000);
    // Importing twice gives the same bytes.
    let again = import::azure(conv(), &mapping()).unwrap();
    assert_eq!(bytes(r), bytes(&again.records));
}

#[test]
fn azure_code_matches_the_readme_with_options() {
    let path = traces().join("azure2023/AzureLLMInferenceTrace_code.csv");
    let plain = import::azure(&path, &Mapping::new("m")).unwrap().records;
    assert_eq!(plain.len(), 8_819);
    assert!(is_sorted(&plain));
    let mut m = Mapping::new("m");
    m.max_tokens = Some(2048);
    m.time_scale = 0.5;
    m.limit = Some(100);
    m.tags = vec!["code".into()];
    let fast = import::azure(&path, &m).unwrap().records;
    assert_eq!(fast.len(), 100);
    for (a, b) in fast.iter().zip(&plain) {
        assert_eq!(a.at_ms, b.at_ms * 0.5);
        assert_eq!((a.max_tokens, a.output_tokens), (2048, b.output_tokens));
        assert_eq!(a.tags, ["code"]);
    }
}

#[test]
fn mooncake_keeps_prefix_blocks() {
    let l = import::mooncake(
        traces().join("mooncake/conversation_trace.jsonl"),
        &Mapping::new("kimi"),
    )
    .unwrap();
    let r = &l.records;
    assert_eq!(r.len(), 12_031);
    assert!(is_sorted(r));
    assert_eq!(r[0].prefix_blocks[..3], [0, 1, 2]);
    assert_eq!((r[0].prompt_tokens, r[0].output_tokens), (6758, 500));
    // Every block is 512 tokens: the blocks cover the prompt.
    assert!(r
        .iter()
        .all(|x| x.prefix_blocks.len() as u64 == x.prompt_tokens.div_ceil(512)));
    let span_min = r[r.len() - 1].at_ms / 60_000.0;
    assert!((58.0..61.0).contains(&span_min), "{span_min}");
    let synthetic = import::mooncake(
        traces().join("mooncake/synthetic_trace.jsonl"),
        &Mapping::new("kimi"),
    )
    .unwrap();
    assert_eq!(synthetic.records.len(), 3_993);
}

#[test]
fn write_then_read_round_trips() {
    let recs = import::azure(conv(), &mapping()).unwrap().records;
    let path = scratch("conv.jsonl");
    std::fs::write(&path, bytes(&recs)).unwrap();
    let back = traffic::read(&path).unwrap();
    assert_eq!(back, recs);
    assert_eq!(bytes(&back), std::fs::read(&path).unwrap());
    // The streaming reader yields the same, in file order.
    let streamed: Vec<Record> = traffic::Reader::open(&path, ReadOptions::default())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(streamed, recs);
}

fn sizes() -> Vec<Record> {
    import::azure(conv(), &Mapping::new("m")).unwrap().records
}

fn servegen_import(seed: u64, clients: servegen::Clients, sizes: &[Record]) -> Vec<Record> {
    let opts = servegen::Options {
        seed,
        // A busy stretch of day 4, two minutes.
        start_s: 338_000.0,
        duration_s: 120.0,
        clients,
        tenant_prefix: "client-".into(),
    };
    let dir = traces().join("servegen/language-m-small");
    let l = servegen::import(dir, &Mapping::new("qwen"), &opts, sizes).unwrap();
    assert!(l.skipped.is_empty());
    l.records
}

#[test]
fn servegen_is_seeded_and_windowed() {
    let sizes = sizes();
    let a = servegen_import(7, servegen::Clients::First(3), &sizes);
    let b = servegen_import(7, servegen::Clients::First(3), &sizes);
    let c = servegen_import(8, servegen::Clients::First(3), &sizes);
    assert!(a.len() > 100, "{}", a.len());
    assert!(is_sorted(&a));
    assert_eq!(bytes(&a), bytes(&b));
    assert_ne!(bytes(&a), bytes(&c));
    assert!(a.iter().all(|r| r.at_ms >= 0.0 && r.at_ms < 120_000.0));
    let tenants: std::collections::BTreeSet<&str> =
        a.iter().filter_map(|r| r.tenant.as_deref()).collect();
    assert!(tenants
        .iter()
        .all(|t| ["client-0", "client-1", "client-2"].contains(t)));
    // Sizes come from the sizes trace.
    let known: std::collections::HashSet<(u64, u64)> = sizes
        .iter()
        .map(|r| (r.prompt_tokens, r.output_tokens))
        .collect();
    assert!(a
        .iter()
        .all(|r| known.contains(&(r.prompt_tokens, r.output_tokens))));
    // One client's arrivals do not depend on which others are generated.
    let only0 = servegen_import(7, servegen::Clients::Ids(vec![0]), &sizes);
    let from_a: Vec<&Record> = a
        .iter()
        .filter(|r| r.tenant.as_deref() == Some("client-0"))
        .collect();
    assert_eq!(only0.iter().collect::<Vec<_>>(), from_a);
}

#[test]
fn servegen_rejects_bad_options() {
    let dir = traces().join("servegen/language-m-small");
    let m = Mapping::new("q");
    let opts = servegen::Options::default();
    let e = servegen::import(&dir, &m, &opts, &[]).unwrap_err();
    assert!(!e.is_malformed());
    let one = [Record::default()];
    let missing = servegen::Options {
        clients: servegen::Clients::Ids(vec![999]),
        ..servegen::Options::default()
    };
    let e = servegen::import(&dir, &m, &missing, &one).unwrap_err();
    assert!(e.to_string().contains("no client 999"), "{e}");
    let e = servegen::import(traces().join("azure2023"), &m, &opts, &one).unwrap_err();
    assert!(e.to_string().contains("no ServeGen client traces"), "{e}");
}

const BAD_JSONL: &str = concat!(
    "{\"at_ms\":0,\"model\":\"m\"}\n",
    "{\"at_ms\":5,\"model\":\"m\",\"tenat\":\"support-bot\"}\n",
    "{\"at_ms\":2,\"model\":\"m\"}\n",
    "{\"at_ms\":3,\"model\":\"m\",\"prompt_tokens\":-4}\n",
    "{\"at_ms\":1,\"model\":\"m\"}\n",
);

#[test]
fn malformed_line_names_file_and_line() {
    let path = scratch("bad.jsonl");
    std::fs::write(&path, BAD_JSONL).unwrap();
    let e = traffic::read(&path).unwrap_err();
    assert!(e.is_malformed());
    assert_eq!(e.line(), Some(2));
    assert!(e
        .to_string()
        .starts_with(&format!("{}:2: ", path.display())));
    insta::assert_snapshot!("malformed_jsonl", render(&e));
}

#[test]
fn malformed_azure_row_is_pointed_at() {
    let path = scratch("bad.csv");
    std::fs::write(
        &path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,39x,109",
    )
    .unwrap();
    let e = import::azure(&path, &Mapping::new("m")).unwrap_err();
    assert_eq!(e.line(), Some(3));
    insta::assert_snapshot!("malformed_azure", render(&e));
}

#[test]
fn skip_malformed_counts_what_it_skips() {
    let path = scratch("skip.jsonl");
    std::fs::write(&path, BAD_JSONL).unwrap();
    let l = traffic::read_with(
        &path,
        ReadOptions {
            skip_malformed: true,
        },
    )
    .unwrap();
    assert_eq!(l.skipped, vec![2, 4]);
    let at: Vec<f64> = l.records.iter().map(|r| r.at_ms).collect();
    assert_eq!(at, [0.0, 1.0, 2.0]);
}

#[test]
fn merge_orders_by_time_and_keeps_input_order_on_ties() {
    let mk = |at_ms: f64, t: &str| Record {
        at_ms,
        tenant: Some(t.into()),
        model: "m".into(),
        ..Record::default()
    };
    let a = scratch("merge-a.jsonl");
    let b = scratch("merge-b.jsonl");
    std::fs::write(&a, bytes(&[mk(0.0, "a0"), mk(1.0, "a1"), mk(1.0, "a2")])).unwrap();
    std::fs::write(&b, bytes(&[mk(1.0, "b1"), mk(0.5, "b0")])).unwrap();
    let m = traffic::merge([traffic::read(&a).unwrap(), traffic::read(&b).unwrap()]);
    let order: Vec<&str> = m.iter().filter_map(|r| r.tenant.as_deref()).collect();
    assert_eq!(order, ["a0", "b0", "a1", "a2", "b1"]);

    // The real traces: conv and code together.
    let code = import::azure(
        traces().join("azure2023/AzureLLMInferenceTrace_code.csv"),
        &Mapping::new("m"),
    )
    .unwrap()
    .records;
    let merged = traffic::merge([sizes(), code]);
    assert_eq!(merged.len(), 19_366 + 8_819);
    assert!(is_sorted(&merged));
}

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

#[test]
fn cli_imports_merges_and_exits_by_convention() {
    let conv_s = conv().display().to_string();
    let out = scratch("cli-conv.jsonl");
    let out_s = out.display().to_string();
    let o = kiln(&[
        "traffic",
        "import",
        "azure",
        &conv_s,
        "--tenant",
        "support-bot",
        "--model",
        "llama-70b",
        "--header",
        "x-kiln-tier=chat",
        "-o",
        &out_s,
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lib = import::azure(conv(), &mapping()).unwrap().records;
    assert_eq!(std::fs::read(&out).unwrap(), bytes(&lib));
    // A successful import says what it wrote, on stderr (stdout may be the data).
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains(&format!("imported {} requests (1 tenant,", lib.len()))
            && said.contains(&format!("to {out_s}")),
        "{said}"
    );

    // Standard output, merge with time scale.
    let o = kiln(&["traffic", "merge", &out_s, "--time-scale", "2", "-o", "-"]);
    assert_eq!(o.status.code(), Some(0));
    let mut doubled = lib.clone();
    traffic::scale_time(&mut doubled, 2.0);
    assert_eq!(o.stdout, bytes(&doubled));

    // Malformed: exit 1, the file and line on stderr; skipped: exit 0.
    let bad = scratch("cli-bad.jsonl");
    std::fs::write(&bad, BAD_JSONL).unwrap();
    let bad_s = bad.display().to_string();
    let o = kiln(&["traffic", "stats", &bad_s]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("{bad_s}:2:")), "{err}");
    let o = kiln(&["traffic", "stats", &bad_s, "--skip-malformed"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stderr).contains("skipped 2 malformed lines (line 2, 4)"));
    assert!(String::from_utf8_lossy(&o.stdout).contains("(all)"));

    // Usage and I/O: exit 2.
    let o = kiln(&["traffic", "import", "azure", &conv_s]);
    assert_eq!(o.status.code(), Some(2), "--model is required");
    let o = kiln(&[
        "traffic",
        "import",
        "azure",
        "/nonexistent.csv",
        "--model",
        "m",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let o = kiln(&[
        "traffic", "import", "azure", &conv_s, "--model", "m", "--header", "novalue",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let o = kiln(&[
        "traffic",
        "import",
        "azure",
        &conv_s,
        "--model",
        "m",
        "--time-scale",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn cli_servegen() {
    let sizes = scratch("cli-sizes.jsonl");
    std::fs::write(&sizes, bytes(&self::sizes())).unwrap();
    let dir = traces()
        .join("servegen/language-m-small")
        .display()
        .to_string();
    let sizes_s = sizes.display().to_string();
    let run = |seed: &str| {
        kiln(&[
            "traffic",
            "import",
            "servegen",
            &dir,
            "--model",
            "qwen",
            "--sizes-from",
            &sizes_s,
            "--seed",
            seed,
            "--start",
            "338000",
            "--duration",
            "60",
            "--client",
            "0,2",
            "--tenant-prefix",
            "team-",
        ])
    };
    let a = run("1");
    assert_eq!(
        a.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&a.stderr)
    );
    assert_eq!(a.stdout, run("1").stdout);
    assert_ne!(a.stdout, run("2").stdout);
    let text = String::from_utf8(a.stdout).unwrap();
    assert!(text.lines().count() > 10);
    assert!(text
        .lines()
        .all(|l| l.contains("\"tenant\":\"team-0\"") || l.contains("\"tenant\":\"team-2\"")));
    let o = kiln(&[
        "traffic",
        "import",
        "servegen",
        &dir,
        "--model",
        "q",
        "--sizes-from",
        &sizes_s,
        "--tenant",
        "x",
    ]);
    assert_eq!(o.status.code(), Some(2));
}

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,12}"
}

prop_compose! {
    fn decision()(
        tier in proptest::option::of(text()),
        tenant in proptest::option::of(text()),
        route in proptest::option::of(text()),
        substituted_for in proptest::option::of(text()),
        admission in proptest::option::of(text()),
        status in proptest::option::of(any::<u16>()),
        fallback_step in proptest::option::of(any::<u32>()),
        reason in proptest::option::of(text()),
        waited_for in proptest::option::of(text()),
        replica in proptest::option::of(any::<u32>()),
    ) -> Decision {
        Decision { tier, tenant, route, substituted_for, admission, status, fallback_step, reason, waited_for, cache: None, replica }
    }
}

prop_compose! {
    fn record()(
        at_ms in 0.0f64..1e12,
        ids in (proptest::option::of(text()), proptest::option::of(text()), proptest::option::of(text())),
        model in text(),
        headers in proptest::collection::btree_map(text(), text(), 0..3),
        tags in proptest::collection::vec(text(), 0..3),
        session in proptest::option::of(text()),
        tokens in (any::<u64>(), any::<u64>(), any::<u64>()),
        prefix_blocks in proptest::collection::vec(any::<u64>(), 0..5),
        policy_version in proptest::option::of(text()),
        decision in proptest::option::of(decision()),
        latencies in (
            proptest::option::of(0.0f64..1e9),
            proptest::option::of(0.0f64..1e9),
            proptest::option::of(0.0f64..1e9),
            proptest::option::of(0.0f64..1e9),
        ),
    ) -> Record {
        let (id, tenant, api_key) = ids;
        let (queue_ms, ttft_ms, e2e_ms, deadline_ms) = latencies;
        let (prompt_tokens, max_tokens, output_tokens) = tokens;
        Record {
            v: 1, at_ms, id, tenant, api_key, model, headers, tags, session,
            prompt_tokens, max_tokens, output_tokens, prefix_blocks,
            policy_version, decision, queue_ms, ttft_ms, e2e_ms, deadline_ms,
            cache_key: None,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn arbitrary_records_round_trip(mut recs in proptest::collection::vec(record(), 0..8)) {
        let path = scratch(&format!("prop-{:?}.jsonl", std::thread::current().id()));
        let written = bytes(&recs);
        std::fs::write(&path, &written).unwrap();
        let back = traffic::read(&path).unwrap();
        traffic::sort(&mut recs);
        prop_assert_eq!(&back, &recs);
        prop_assert_eq!(bytes(&back), bytes(&recs));
        // A record is exactly one line.
        prop_assert_eq!(written.iter().filter(|b| **b == b'\n').count(), recs.len());
    }
}

#[test]
fn empty_headers_and_unknown_decision_fields() {
    let mut r = Record {
        model: "m".into(),
        ..Record::default()
    };
    r.headers = BTreeMap::new();
    let line = String::from_utf8(bytes(&[r])).unwrap();
    assert!(!line.contains("headers"));
    let e = traffic::Reader::new(
        "{\"at_ms\":0,\"model\":\"m\",\"decision\":{\"tier\":\"x\",\"why\":1}}".as_bytes(),
        "d.jsonl",
        ReadOptions::default(),
    )
    .next()
    .unwrap()
    .unwrap_err();
    assert!(e.to_string().contains("unknown field `why`"), "{e}");
}
