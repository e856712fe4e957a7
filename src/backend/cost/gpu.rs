//! GPU datasheet figures and the kind-string resolver.
//!
//! All figures are *dense* (no 2:4 sparsity) peak rates from NVIDIA's public
//! datasheets; memory and bandwidth use the datasheet's decimal units
//! (1 GB = 1e9 bytes, 1 TB/s = 1e12 bytes/s), the same units `memory 80GB`
//! has in a policy.

use super::error::SimError;

/// Peak figures of one GPU.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuSpec {
    /// Display name, e.g. `H100-SXM`.
    pub name: String,
    /// HBM (or GDDR) bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// Dense BF16/FP16 tensor-core throughput, FLOP/s.
    pub dense_bf16_flops: f64,
    /// Dense FP8 tensor-core throughput, FLOP/s. GPUs without FP8 tensor
    /// cores (A100) carry their BF16 rate: FP8 checkpoints run there as
    /// weight-only FP8 (Marlin kernels) with BF16 math.
    pub fp8_flops: f64,
    /// Dense INT8 tensor-core throughput, OP/s.
    pub int8_ops: f64,
    /// Memory of one GPU, bytes.
    pub memory: f64,
}

const TERA: f64 = 1e12;
const GB: f64 = 1e9;

/// One row of the built-in table: the lower-case pattern a pool's `kind`
/// must contain, and the figures.
struct Builtin {
    key: &'static str,
    name: &'static str,
    bw: f64,
    bf16: f64,
    fp8: f64,
    int8: f64,
    mem: f64,
}

/// The built-in table. Patterns are matched against the normalised kind
/// (lower case, spaces and underscores as `-`); the longest matching pattern
/// wins, so `L40S-48GB` is an L40S and not an L4, `H100-PCIe` not an SXM.
const BUILTINS: &[Builtin] = &[
    // NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 3.35 TB/s
    // HBM3; BF16 1,979 TFLOPS and FP8/INT8 3,958 with sparsity, so 989.4
    // and 1,978.9 dense; 80 GB.
    Builtin {
        key: "h100",
        name: "H100-SXM",
        bw: 3.35 * TERA,
        bf16: 989.4 * TERA,
        fp8: 1978.9 * TERA,
        int8: 1978.9 * TERA,
        mem: 80.0 * GB,
    },
    // Same datasheet, H100 PCIe column: 2 TB/s; BF16 1,513 / FP8 3,026
    // sparse (756 / 1,513 dense); 80 GB.
    Builtin {
        key: "h100-pcie",
        name: "H100-PCIe",
        bw: 2.0 * TERA,
        bf16: 756.0 * TERA,
        fp8: 1513.0 * TERA,
        int8: 1513.0 * TERA,
        mem: 80.0 * GB,
    },
    // Same datasheet, H100 NVL column: 3.9 TB/s; BF16 1,671 / FP8 3,341
    // sparse (835 / 1,671 dense); 94 GB.
    Builtin {
        key: "h100-nvl",
        name: "H100-NVL",
        bw: 3.9 * TERA,
        bf16: 835.0 * TERA,
        fp8: 1671.0 * TERA,
        int8: 1671.0 * TERA,
        mem: 94.0 * GB,
    },
    // NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: 4.8 TB/s
    // HBM3e; same tensor cores as the H100 SXM (BF16 989 dense, FP8/INT8
    // 1,979 dense); 141 GB.
    Builtin {
        key: "h200",
        name: "H200-SXM",
        bw: 4.8 * TERA,
        bf16: 989.4 * TERA,
        fp8: 1978.9 * TERA,
        int8: 1978.9 * TERA,
        mem: 141.0 * GB,
    },
    // NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column:
    // 2,039 GB/s HBM2e; BF16 312 TFLOPS dense; INT8 624 TOPS dense; no FP8
    // tensor cores (FP8 runs weight-only at the BF16 rate); 80 GB.
    Builtin {
        key: "a100",
        name: "A100-80GB-SXM",
        bw: 2.039 * TERA,
        bf16: 312.0 * TERA,
        fp8: 312.0 * TERA,
        int8: 624.0 * TERA,
        mem: 80.0 * GB,
    },
    // Same datasheet, A100 40GB column: 1,555 GB/s HBM2; same tensor cores.
    Builtin {
        key: "a100-40",
        name: "A100-40GB",
        bw: 1.555 * TERA,
        bf16: 312.0 * TERA,
        fp8: 312.0 * TERA,
        int8: 624.0 * TERA,
        mem: 40.0 * GB,
    },
    // NVIDIA L40S datasheet: 864 GB/s GDDR6; BF16 362.05 TFLOPS dense
    // (733 sparse); FP8 733 TFLOPS dense; INT8 733 TOPS dense; 48 GB.
    Builtin {
        key: "l40s",
        name: "L40S",
        bw: 0.864 * TERA,
        bf16: 362.05 * TERA,
        fp8: 733.0 * TERA,
        int8: 733.0 * TERA,
        mem: 48.0 * GB,
    },
    // NVIDIA L4 datasheet: 300 GB/s GDDR6; BF16 121 TFLOPS dense (242
    // sparse); FP8 242.5 TFLOPS dense; INT8 242.5 TOPS dense; 24 GB.
    // NVIDIA A10 datasheet: 600 GB/s, BF16 125 TF dense, INT8 250 TOPS, 24 GB
    // (the A10G of cloud instances is the same silicon).
    Builtin {
        key: "a10",
        name: "A10",
        bw: 0.6 * TERA,
        bf16: 125.0 * TERA,
        fp8: 125.0 * TERA,
        int8: 250.0 * TERA,
        mem: 24.0 * GB,
    },
    // NVIDIA T4 datasheet: 320 GB/s, FP16 65 TF (no BF16), INT8 130 TOPS, 16 GB.
    Builtin {
        key: "t4",
        name: "T4",
        bw: 0.32 * TERA,
        bf16: 65.0 * TERA,
        fp8: 65.0 * TERA,
        int8: 130.0 * TERA,
        mem: 16.0 * GB,
    },
    // AMD Instinct MI300X datasheet: 5.3 TB/s, BF16 1307.4 TF dense, FP8 and
    // INT8 2614.9 dense, 192 GB.
    Builtin {
        key: "mi300x",
        name: "MI300X",
        bw: 5.3 * TERA,
        bf16: 1307.4 * TERA,
        fp8: 2614.9 * TERA,
        int8: 2614.9 * TERA,
        mem: 192.0 * GB,
    },
    // NVIDIA HGX B200 (per GPU): 8 TB/s, BF16 2.25 PF dense, FP8 4.5 PF
    // dense, 180 GB.
    Builtin {
        key: "b200",
        name: "B200",
        bw: 8.0 * TERA,
        bf16: 2250.0 * TERA,
        fp8: 4500.0 * TERA,
        int8: 4500.0 * TERA,
        mem: 180.0 * GB,
    },
    Builtin {
        key: "l4",
        name: "L4",
        bw: 0.3 * TERA,
        bf16: 121.0 * TERA,
        fp8: 242.5 * TERA,
        int8: 242.5 * TERA,
        mem: 24.0 * GB,
    },
];

impl Builtin {
    fn spec(&self) -> GpuSpec {
        GpuSpec {
            name: self.name.to_string(),
            hbm_bandwidth: self.bw,
            dense_bf16_flops: self.bf16,
            fp8_flops: self.fp8,
            int8_ops: self.int8,
            memory: self.mem,
        }
    }
}

/// Lower case, with spaces and underscores as `-`: `H100 PCIe` and
/// `h100_pcie` both become `h100-pcie`.
pub(crate) fn normalize(kind: &str) -> String {
    kind.trim()
        .chars()
        .map(|c| match c {
            ' ' | '_' => '-',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

/// The longest of `keys` (already normalised) that `kind` contains, with
/// its position in `keys`. Ties go to the earlier key.
pub(crate) fn best_match<'a>(
    kind: &str,
    keys: impl Iterator<Item = &'a str>,
) -> Option<(usize, usize)> {
    let kind = normalize(kind);
    let mut best: Option<(usize, usize)> = None;
    for (i, key) in keys.enumerate() {
        if !key.is_empty() && kind.contains(key) && best.is_none_or(|(_, len)| key.len() > len) {
            best = Some((i, key.len()));
        }
    }
    best
}

impl GpuSpec {
    /// The built-in table, in table order.
    pub fn builtins() -> Vec<GpuSpec> {
        BUILTINS.iter().map(Builtin::spec).collect()
    }

    /// The built-in spec for a pool's `kind` string, matched case-insensitively
    /// by the longest built-in pattern it contains (`"H100-80GB"` → H100 SXM).
    pub fn builtin(kind: &str) -> Option<GpuSpec> {
        best_match(kind, builtin_keys())
            .and_then(|(i, _)| BUILTINS.get(i))
            .map(Builtin::spec)
    }

    /// Like [`GpuSpec::builtin`], but an unknown kind is a
    /// [`SimError::UnknownGpuKind`] naming the pool.
    pub fn resolve(pool: &str, kind: &str) -> Result<GpuSpec, SimError> {
        GpuSpec::builtin(kind).ok_or_else(|| SimError::UnknownGpuKind {
            pool: pool.to_string(),
            kind: kind.to_string(),
            known: known_kinds(),
        })
    }
}

/// The built-in patterns, normalised, in table order.
pub(crate) fn builtin_keys() -> impl Iterator<Item = &'static str> {
    BUILTINS.iter().map(|b| b.key)
}

/// The built-in patterns, for help lines: `H100, H100-PCIe, …`.
pub(crate) fn known_kinds() -> String {
    BUILTINS
        .iter()
        .map(|b| b.key.to_ascii_uppercase().replace("PCIE", "PCIe"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_policy_kinds() {
        let name = |k: &str| GpuSpec::builtin(k).map(|s| s.name);
        assert_eq!(name("H100-80GB").as_deref(), Some("H100-SXM"));
        assert_eq!(name("h100 PCIe 80GB").as_deref(), Some("H100-PCIe"));
        assert_eq!(name("NVIDIA H100 NVL").as_deref(), Some("H100-NVL"));
        assert_eq!(name("H200-141GB").as_deref(), Some("H200-SXM"));
        assert_eq!(name("A100-80GB").as_deref(), Some("A100-80GB-SXM"));
        assert_eq!(name("A100-40GB").as_deref(), Some("A100-40GB"));
        assert_eq!(name("L40S-48GB").as_deref(), Some("L40S"));
        assert_eq!(name("L4-24GB").as_deref(), Some("L4"));
        assert_eq!(name("L4").as_deref(), Some("L4"));
        assert_eq!(name("MI300X").as_deref(), Some("MI300X"));
        assert_eq!(name("Gaudi3"), None);
    }

    #[test]
    fn unknown_kind_is_an_error_with_known_kinds() {
        let err = GpuSpec::resolve("intel", "Gaudi3").unwrap_err();
        assert!(matches!(err, SimError::UnknownGpuKind { .. }));
        let help = miette::Diagnostic::help(&err).map(|h| h.to_string());
        let help = help.unwrap_or_default();
        assert!(help.contains("H100") && help.contains("L40S"), "{help}");
    }
}
