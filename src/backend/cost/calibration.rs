//! Calibration: a TOML file that overrides the built-in GPU figures, the
//! global efficiency factors, and per-model and per-variant factors, so the
//! simulator can be fitted to measured step times. See
//! `examples/calibration.toml` for a commented example.
//!
//! ```toml
//! [efficiency]             # global; every key optional
//! mbu = 0.8                # memory-bandwidth utilisation, (0, 1]
//! mfu = 0.5                # FLOP utilisation, (0, 1]
//! step_overhead_ms = 1.0   # fixed cost per step, ≥ 0
//! seq_overhead_ms = 0.0    # cost per decoding sequence in a step, ≥ 0
//! activation_reserve = 0.1 # share of GPU memory not for weights/KV, [0, 1)
//! attention_q_per_kv = 8   # query heads per KV head (attention FLOPs), ≥ 0
//!
//! [gpu.H100]               # matched like a pool's kind: the longest key the
//! hbm_bandwidth = 3.0e12   # kind contains, case-insensitive; a key naming no
//!                          # built-in GPU must give hbm_bandwidth,
//!                          # dense_bf16_flops and memory
//!
//! [model.llama-70b]        # params, kv_per_token, attention_flops_per_pair
//! [model.llama-70b.variant.fp16]
//! time_factor = 1.1        # multiplies every step time, > 0
//! ```

use super::error::{CalibrationError, SimError};
use super::gpu::{self, GpuSpec};
use super::replica::Efficiency;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use toml::Spanned;

/// Global efficiency overrides (`[efficiency]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EfficiencyOverride {
    pub mbu: Option<f64>,
    pub mfu: Option<f64>,
    pub step_overhead_ms: Option<f64>,
    pub seq_overhead_ms: Option<f64>,
    pub activation_reserve: Option<f64>,
    pub attention_q_per_kv: Option<f64>,
}

/// GPU figure overrides (`[gpu."KEY"]`), or a new GPU kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuOverride {
    pub hbm_bandwidth: Option<f64>,
    pub dense_bf16_flops: Option<f64>,
    pub fp8_flops: Option<f64>,
    pub int8_ops: Option<f64>,
    pub memory: Option<f64>,
}

/// Per-variant factors (`[model.M.variant.V]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VariantOverride {
    pub mbu: Option<f64>,
    pub mfu: Option<f64>,
    pub step_overhead_ms: Option<f64>,
    /// Cost of each decoding sequence in a step (output head, sampling).
    pub seq_overhead_ms: Option<f64>,
    pub activation_reserve: Option<f64>,
    /// Multiplies every step time of the variant.
    pub time_factor: Option<f64>,
    /// KV bytes per token of this variant, replacing the precision rule.
    pub kv_bytes_per_token: Option<f64>,
}

/// Per-model overrides (`[model.M]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelOverride {
    pub params: Option<f64>,
    /// KV bytes per token at 16-bit.
    pub kv_per_token: Option<f64>,
    pub attention_flops_per_pair: Option<f64>,
    pub variants: BTreeMap<String, VariantOverride>,
}

/// A parsed calibration. `Calibration::default()` overrides nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    pub efficiency: EfficiencyOverride,
    /// Keyed as written in the file.
    pub gpus: BTreeMap<String, GpuOverride>,
    pub models: BTreeMap<String, ModelOverride>,
    /// File name and text, for diagnostics.
    source: Option<(String, String)>,
    /// Byte spans by dotted path (`gpu.H100.hbm_bandwidth`, `model.m`).
    spans: BTreeMap<String, Range<usize>>,
}

// ---- the TOML shape ----------------------------------------------------

type Num = Option<Spanned<f64>>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    efficiency: Option<RawEfficiency>,
    #[serde(default)]
    gpu: BTreeMap<Spanned<String>, RawGpu>,
    #[serde(default)]
    model: BTreeMap<Spanned<String>, RawModel>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEfficiency {
    mbu: Num,
    mfu: Num,
    step_overhead_ms: Num,
    seq_overhead_ms: Num,
    activation_reserve: Num,
    attention_q_per_kv: Num,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    hbm_bandwidth: Num,
    dense_bf16_flops: Num,
    fp8_flops: Num,
    int8_ops: Num,
    memory: Num,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    params: Num,
    kv_per_token: Num,
    attention_flops_per_pair: Num,
    #[serde(default)]
    variant: BTreeMap<Spanned<String>, RawVariant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVariant {
    mbu: Num,
    mfu: Num,
    step_overhead_ms: Num,
    seq_overhead_ms: Num,
    activation_reserve: Num,
    time_factor: Num,
    kv_bytes_per_token: Num,
}

/// Takes a spanned number, recording its span under `path`.
fn take(spans: &mut BTreeMap<String, Range<usize>>, path: String, v: Num) -> Option<f64> {
    v.map(|s| {
        spans.insert(path, s.span());
        *s.get_ref()
    })
}

/// What a value must satisfy.
#[derive(Clone, Copy)]
enum Rule {
    /// 0 < v ≤ 1
    Fraction,
    /// 0 ≤ v < 1
    Reserve,
    Positive,
    NonNegative,
}

impl Rule {
    fn holds(self, v: f64) -> bool {
        v.is_finite()
            && match self {
                Rule::Fraction => v > 0.0 && v <= 1.0,
                Rule::Reserve => (0.0..1.0).contains(&v),
                Rule::Positive => v > 0.0,
                Rule::NonNegative => v >= 0.0,
            }
    }

    fn text(self) -> &'static str {
        match self {
            Rule::Fraction => "a fraction in (0, 1]",
            Rule::Reserve => "a fraction in [0, 1)",
            Rule::Positive => "a positive number",
            Rule::NonNegative => "a number ≥ 0",
        }
    }
}

impl Calibration {
    /// Parses calibration TOML held in memory; errors name the line.
    pub fn from_toml_str(text: &str) -> Result<Calibration, SimError> {
        Calibration::from_toml_named("calibration.toml", text)
    }

    /// Parses calibration TOML, naming it `name` in diagnostics.
    pub fn from_toml_named(name: &str, text: &str) -> Result<Calibration, SimError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            CalibrationError::error(
                name,
                text,
                e.span(),
                e.message().to_string(),
                "here",
                Some("see examples/calibration.toml for the accepted tables and keys".into()),
            )
        })?;
        let mut c = Calibration {
            source: Some((name.to_string(), text.to_string())),
            ..Calibration::default()
        };
        let spans = &mut c.spans;
        if let Some(e) = raw.efficiency {
            let p = |k: &str| format!("efficiency.{k}");
            c.efficiency = EfficiencyOverride {
                mbu: take(spans, p("mbu"), e.mbu),
                mfu: take(spans, p("mfu"), e.mfu),
                step_overhead_ms: take(spans, p("step_overhead_ms"), e.step_overhead_ms),
                seq_overhead_ms: take(spans, p("seq_overhead_ms"), e.seq_overhead_ms),
                activation_reserve: take(spans, p("activation_reserve"), e.activation_reserve),
                attention_q_per_kv: take(spans, p("attention_q_per_kv"), e.attention_q_per_kv),
            };
        }
        for (key, g) in raw.gpu {
            spans.insert(format!("gpu.{}", key.get_ref()), key.span());
            let key = key.into_inner();
            let p = |k: &str| format!("gpu.{key}.{k}");
            let o = GpuOverride {
                hbm_bandwidth: take(spans, p("hbm_bandwidth"), g.hbm_bandwidth),
                dense_bf16_flops: take(spans, p("dense_bf16_flops"), g.dense_bf16_flops),
                fp8_flops: take(spans, p("fp8_flops"), g.fp8_flops),
                int8_ops: take(spans, p("int8_ops"), g.int8_ops),
                memory: take(spans, p("memory"), g.memory),
            };
            c.gpus.insert(key, o);
        }
        for (key, m) in raw.model {
            spans.insert(format!("model.{}", key.get_ref()), key.span());
            let key = key.into_inner();
            let p = |k: &str| format!("model.{key}.{k}");
            let mut o = ModelOverride {
                params: take(spans, p("params"), m.params),
                kv_per_token: take(spans, p("kv_per_token"), m.kv_per_token),
                attention_flops_per_pair: take(
                    spans,
                    p("attention_flops_per_pair"),
                    m.attention_flops_per_pair,
                ),
                variants: BTreeMap::new(),
            };
            for (vk, v) in m.variant {
                spans.insert(format!("model.{key}.variant.{}", vk.get_ref()), vk.span());
                let vk = vk.into_inner();
                let p = |k: &str| format!("model.{key}.variant.{vk}.{k}");
                let vo = VariantOverride {
                    mbu: take(spans, p("mbu"), v.mbu),
                    mfu: take(spans, p("mfu"), v.mfu),
                    step_overhead_ms: take(spans, p("step_overhead_ms"), v.step_overhead_ms),
                    seq_overhead_ms: take(spans, p("seq_overhead_ms"), v.seq_overhead_ms),
                    activation_reserve: take(spans, p("activation_reserve"), v.activation_reserve),
                    time_factor: take(spans, p("time_factor"), v.time_factor),
                    kv_bytes_per_token: take(spans, p("kv_bytes_per_token"), v.kv_bytes_per_token),
                };
                o.variants.insert(vk, vo);
            }
            c.models.insert(key, o);
        }
        c.validate()?;
        Ok(c)
    }

    /// Reads and parses a calibration file: the only I/O of the cost model.
    pub fn load(path: &Path) -> Result<Calibration, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Calibration::from_toml_named(&path.display().to_string(), &text)
    }

    /// An error about the value or table at `path`, pointing into the file
    /// when the calibration came from one.
    pub(crate) fn error_at(&self, path: &str, message: String, help: Option<String>) -> SimError {
        let (name, text) = match &self.source {
            Some((n, t)) => (n.as_str(), t.as_str()),
            None => ("calibration", ""),
        };
        let span = self.spans.get(path).cloned();
        let label = path.rsplit('.').next().unwrap_or(path).to_string();
        CalibrationError::error(name, text, span, message, label, help)
    }

    /// Checks every value's range, and that a GPU key naming no built-in
    /// GPU gives the figures a new kind needs.
    pub fn validate(&self) -> Result<(), SimError> {
        let mut checks: Vec<(String, Option<f64>, Rule)> = Vec::new();
        let e = &self.efficiency;
        checks.push(("efficiency.mbu".into(), e.mbu, Rule::Fraction));
        checks.push(("efficiency.mfu".into(), e.mfu, Rule::Fraction));
        checks.push((
            "efficiency.step_overhead_ms".into(),
            e.step_overhead_ms,
            Rule::NonNegative,
        ));
        checks.push((
            "efficiency.seq_overhead_ms".into(),
            e.seq_overhead_ms,
            Rule::NonNegative,
        ));
        checks.push((
            "efficiency.activation_reserve".into(),
            e.activation_reserve,
            Rule::Reserve,
        ));
        checks.push((
            "efficiency.attention_q_per_kv".into(),
            e.attention_q_per_kv,
            Rule::NonNegative,
        ));
        for (k, g) in &self.gpus {
            let p = |f: &str| format!("gpu.{k}.{f}");
            checks.push((p("hbm_bandwidth"), g.hbm_bandwidth, Rule::Positive));
            checks.push((p("dense_bf16_flops"), g.dense_bf16_flops, Rule::Positive));
            checks.push((p("fp8_flops"), g.fp8_flops, Rule::Positive));
            checks.push((p("int8_ops"), g.int8_ops, Rule::Positive));
            checks.push((p("memory"), g.memory, Rule::Positive));
        }
        for (k, m) in &self.models {
            let p = |f: &str| format!("model.{k}.{f}");
            checks.push((p("params"), m.params, Rule::Positive));
            checks.push((p("kv_per_token"), m.kv_per_token, Rule::Positive));
            checks.push((
                p("attention_flops_per_pair"),
                m.attention_flops_per_pair,
                Rule::NonNegative,
            ));
            for (vk, v) in &m.variants {
                let p = |f: &str| format!("model.{k}.variant.{vk}.{f}");
                checks.push((p("mbu"), v.mbu, Rule::Fraction));
                checks.push((p("mfu"), v.mfu, Rule::Fraction));
                checks.push((p("step_overhead_ms"), v.step_overhead_ms, Rule::NonNegative));
                checks.push((p("seq_overhead_ms"), v.seq_overhead_ms, Rule::NonNegative));
                checks.push((p("activation_reserve"), v.activation_reserve, Rule::Reserve));
                checks.push((p("time_factor"), v.time_factor, Rule::Positive));
                checks.push((
                    p("kv_bytes_per_token"),
                    v.kv_bytes_per_token,
                    Rule::Positive,
                ));
            }
        }
        for (path, v, rule) in checks {
            if let Some(v) = v {
                if !rule.holds(v) {
                    let key = path.rsplit('.').next().unwrap_or(&path).to_string();
                    return Err(self.error_at(
                        &path,
                        format!("`{key}` is {v}, but must be {}", rule.text()),
                        None,
                    ));
                }
            }
        }
        for (k, g) in &self.gpus {
            if GpuSpec::builtin(k).is_some() {
                continue;
            }
            let missing: Vec<&str> = [
                ("hbm_bandwidth", g.hbm_bandwidth),
                ("dense_bf16_flops", g.dense_bf16_flops),
                ("memory", g.memory),
            ]
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(n, _)| *n)
            .collect();
            if !missing.is_empty() {
                return Err(self.error_at(
                    &format!("gpu.{k}"),
                    format!(
                        "GPU `{k}` is not a built-in kind, so it needs {}",
                        missing.join(", ")
                    ),
                    Some(format!(
                        "built-in kinds: {}; or give every figure of the new GPU \
                         (fp8_flops and int8_ops default to dense_bf16_flops)",
                        gpu::known_kinds()
                    )),
                ));
            }
        }
        Ok(())
    }

    /// The global efficiency, the defaults with `[efficiency]` applied.
    pub fn efficiency(&self) -> Efficiency {
        let mut e = Efficiency::default();
        let o = &self.efficiency;
        apply(
            &mut e,
            o.mbu,
            o.mfu,
            (o.step_overhead_ms, o.seq_overhead_ms),
            o.activation_reserve,
        );
        if let Some(q) = o.attention_q_per_kv {
            e.attention_q_per_kv = q;
        }
        e
    }

    /// The efficiency of one variant: global, then the variant's table.
    pub fn variant_efficiency(&self, model: &str, variant: &str) -> Efficiency {
        let mut e = self.efficiency();
        if let Some(v) = self.variant(model, variant) {
            apply(
                &mut e,
                v.mbu,
                v.mfu,
                (v.step_overhead_ms, v.seq_overhead_ms),
                v.activation_reserve,
            );
        }
        e
    }

    pub fn model(&self, model: &str) -> Option<&ModelOverride> {
        self.models.get(model)
    }

    pub fn variant(&self, model: &str, variant: &str) -> Option<&VariantOverride> {
        self.models.get(model).and_then(|m| m.variants.get(variant))
    }

    /// The spec for a pool's `kind`: the longest key the kind contains,
    /// among the calibration's `[gpu]` keys and the built-in patterns; a
    /// calibration key wins a tie. A calibration key that names a built-in
    /// GPU overrides its figures; another key defines a new GPU.
    pub fn gpu_spec(&self, pool: &str, kind: &str) -> Result<GpuSpec, SimError> {
        let keys: Vec<String> = self.gpus.keys().map(|k| gpu::normalize(k)).collect();
        let ours = gpu::best_match(kind, keys.iter().map(String::as_str));
        let builtin_len = gpu::best_match(kind, gpu::builtin_keys()).map(|(_, len)| len);
        let Some((i, len)) = ours else {
            return GpuSpec::resolve(pool, kind);
        };
        if builtin_len.is_some_and(|b| b > len) {
            return GpuSpec::resolve(pool, kind);
        }
        let Some((key, o)) = self.gpus.iter().nth(i) else {
            return GpuSpec::resolve(pool, kind);
        };
        let mut spec = GpuSpec::builtin(key).unwrap_or_else(|| GpuSpec {
            name: key.clone(),
            hbm_bandwidth: 0.0,
            dense_bf16_flops: 0.0,
            fp8_flops: 0.0,
            int8_ops: 0.0,
            memory: 0.0,
        });
        let new_kind = spec.dense_bf16_flops == 0.0;
        if let Some(v) = o.hbm_bandwidth {
            spec.hbm_bandwidth = v;
        }
        if let Some(v) = o.dense_bf16_flops {
            spec.dense_bf16_flops = v;
        }
        if new_kind {
            spec.fp8_flops = spec.dense_bf16_flops;
            spec.int8_ops = spec.dense_bf16_flops;
        }
        if let Some(v) = o.fp8_flops {
            spec.fp8_flops = v;
        }
        if let Some(v) = o.int8_ops {
            spec.int8_ops = v;
        }
        if let Some(v) = o.memory {
            spec.memory = v;
        }
        if !(spec.hbm_bandwidth > 0.0 && spec.dense_bf16_flops > 0.0) {
            // Only a hand-built, unvalidated calibration gets here.
            return Err(self.error_at(
                &format!("gpu.{key}"),
                format!("GPU `{key}` lacks hbm_bandwidth or dense_bf16_flops"),
                None,
            ));
        }
        Ok(spec)
    }
}

/// A TOML key, quoted unless bare-safe.
fn toml_key(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return s.to_string();
    }
    let mut q = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            c if c.is_control() => q.push_str(&format!("\\u{:04X}", c as u32)),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

impl Calibration {
    /// The calibration as TOML that [`Calibration::from_toml_str`] reads
    /// back to an equal value (less the source kept for diagnostics).
    pub fn to_toml(&self) -> String {
        let mut out = String::new();
        let mut table = |header: String, keys: &[(&str, Option<f64>)]| {
            if keys.iter().all(|(_, v)| v.is_none()) {
                return;
            }
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&header);
            out.push('\n');
            for (k, v) in keys {
                if let Some(v) = v {
                    // Debug always writes a TOML float (`1.0`, `0.25`).
                    out.push_str(&format!("{k} = {v:?}\n"));
                }
            }
        };
        let e = &self.efficiency;
        table(
            "[efficiency]".into(),
            &[
                ("mbu", e.mbu),
                ("mfu", e.mfu),
                ("step_overhead_ms", e.step_overhead_ms),
                ("seq_overhead_ms", e.seq_overhead_ms),
                ("activation_reserve", e.activation_reserve),
                ("attention_q_per_kv", e.attention_q_per_kv),
            ],
        );
        for (k, g) in &self.gpus {
            table(
                format!("[gpu.{}]", toml_key(k)),
                &[
                    ("hbm_bandwidth", g.hbm_bandwidth),
                    ("dense_bf16_flops", g.dense_bf16_flops),
                    ("fp8_flops", g.fp8_flops),
                    ("int8_ops", g.int8_ops),
                    ("memory", g.memory),
                ],
            );
        }
        for (k, m) in &self.models {
            let mk = toml_key(k);
            table(
                format!("[model.{mk}]"),
                &[
                    ("params", m.params),
                    ("kv_per_token", m.kv_per_token),
                    ("attention_flops_per_pair", m.attention_flops_per_pair),
                ],
            );
            for (vk, v) in &m.variants {
                table(
                    format!("[model.{mk}.variant.{}]", toml_key(vk)),
                    &[
                        ("mbu", v.mbu),
                        ("mfu", v.mfu),
                        ("step_overhead_ms", v.step_overhead_ms),
                        ("seq_overhead_ms", v.seq_overhead_ms),
                        ("activation_reserve", v.activation_reserve),
                        ("time_factor", v.time_factor),
                        ("kv_bytes_per_token", v.kv_bytes_per_token),
                    ],
                );
            }
        }
        out
    }
}

fn apply(
    e: &mut Efficiency,
    mbu: Option<f64>,
    mfu: Option<f64>,
    (overhead_ms, seq_overhead_ms): (Option<f64>, Option<f64>),
    reserve: Option<f64>,
) {
    if let Some(v) = mbu {
        e.mbu = v;
    }
    if let Some(v) = mfu {
        e.mfu = v;
    }
    if let Some(v) = overhead_ms {
        e.step_overhead = v / 1e3;
    }
    if let Some(v) = seq_overhead_ms {
        e.seq_overhead = v / 1e3;
    }
    if let Some(v) = reserve {
        e.activation_reserve = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_applies() {
        let c = Calibration::from_toml_str(
            "[efficiency]\nmbu = 0.7\nstep_overhead_ms = 2\n\n[gpu.H100]\nhbm_bandwidth = 3.0e12\n\n\
             [gpu.Gaudi3]\nhbm_bandwidth = 3.7e12\ndense_bf16_flops = 1835e12\nmemory = 128e9\n\n\
             [model.m]\nparams = 7e9\n[model.m.variant.fp16]\ntime_factor = 1.2\nmfu = 0.4\n",
        )
        .unwrap();
        let e = c.efficiency();
        assert_eq!(e.mbu, 0.7);
        assert_eq!(e.step_overhead, 0.002);
        assert_eq!(e.mfu, 0.5);
        let v = c.variant_efficiency("m", "fp16");
        assert_eq!((v.mbu, v.mfu), (0.7, 0.4));
        let h100 = c.gpu_spec("p", "H100-80GB").unwrap();
        assert_eq!(h100.hbm_bandwidth, 3.0e12);
        assert_eq!(h100.dense_bf16_flops, 989.4e12);
        // The more specific built-in wins over the calibration's `H100`.
        let pcie = c.gpu_spec("p", "H100-PCIe").unwrap();
        assert_eq!(pcie.hbm_bandwidth, 2.0e12);
        let mi = c.gpu_spec("p", "Intel Gaudi3").unwrap();
        // A GPU only the calibration knows: fp8 defaults to its bf16 rate.
        assert_eq!(mi.fp8_flops, 1835e12);
        assert_eq!(mi.memory, 128e9);
        assert_eq!(
            c.variant("m", "fp16").and_then(|v| v.time_factor),
            Some(1.2)
        );
    }

    #[test]
    fn to_toml_reads_back_equal() {
        let c = Calibration::from_toml_str(
            "[efficiency]\nmbu = 0.7\nstep_overhead_ms = 2\n\n[gpu.CPU]\nhbm_bandwidth = 10e9\n\
             dense_bf16_flops = 1e11\nmemory = 2e9\n\n[model.\"m.x\"]\nparams = 7e9\n\
             [model.\"m.x\".variant.q4]\ntime_factor = 0.5\nmfu = 1.25e-7\n",
        )
        .unwrap();
        let back = Calibration::from_toml_str(&c.to_toml()).unwrap();
        assert_eq!(back.efficiency, c.efficiency);
        assert_eq!(back.gpus, c.gpus);
        assert_eq!(back.models, c.models);
    }

    fn err_text(text: &str) -> (usize, String) {
        match Calibration::from_toml_str(text) {
            Err(SimError::Calibration(e)) => (e.line, e.message.clone()),
            other => panic!("expected a calibration error, got {other:?}"),
        }
    }

    #[test]
    fn syntax_error_names_the_line() {
        let (line, msg) = err_text("[efficiency]\nmbu = 0.8\nmfu = = 3\n");
        assert_eq!(line, 3, "{msg}");
    }

    #[test]
    fn unknown_key_names_the_line() {
        let (line, msg) = err_text("[efficiency]\nmbu = 0.8\n\n[gpu.H100]\nbandwidth = 3e12\n");
        assert_eq!(line, 5, "{msg}");
        assert!(msg.contains("bandwidth"), "{msg}");
    }

    #[test]
    fn out_of_range_value_names_the_line() {
        let (line, msg) = err_text("[efficiency]\nmbu = 0.8\nmfu = 1.5\n");
        assert_eq!(line, 3);
        assert!(msg.contains("mfu") && msg.contains("(0, 1]"), "{msg}");
    }

    #[test]
    fn new_gpu_needs_its_figures() {
        let (line, msg) = err_text("\n[gpu.Gaudi3]\nhbm_bandwidth = 3.7e12\n");
        assert!(line <= 3, "{line}");
        assert!(
            msg.contains("dense_bf16_flops") && msg.contains("memory"),
            "{msg}"
        );
    }

    #[test]
    fn rendered_diagnostic_shows_the_file() {
        let err = Calibration::from_toml_named("cal.toml", "[efficiency]\nmbu = 2\n").unwrap_err();
        let mut out = String::new();
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
            .render_report(&mut out, &err)
            .unwrap();
        assert!(out.contains("cal.toml:2"), "{out}");
        assert!(out.contains("mbu = 2"), "{out}");
    }
}
