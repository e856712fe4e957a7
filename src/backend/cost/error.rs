//! Errors of the cost model: typed, and miette diagnostics with a help line.

use miette::{Diagnostic, NamedSource, SourceSpan};

/// Why a cost model could not be built, or a calibration file not read.
#[derive(Debug, thiserror::Error, Diagnostic)]
pub enum SimError {
    #[error("pool `{pool}` has GPU kind \"{kind}\", which the cost model does not know")]
    #[diagnostic(
        code(kiln::replay::unknown_gpu_kind),
        help(
            "known GPU kinds (matched case-insensitively inside the kind string): {known}; \
             or describe this GPU in a calibration file's [gpu.\"{kind}\"] table \
             (hbm_bandwidth, dense_bf16_flops, memory)"
        )
    )]
    UnknownGpuKind {
        pool: String,
        kind: String,
        known: String,
    },

    #[error("model `{model}` has no parameter count, which the cost model needs")]
    #[diagnostic(
        code(kiln::replay::missing_params),
        help("add `params 70B` (the model's parameter count) to model `{model}`")
    )]
    MissingParams { model: String },

    #[error("model `{model}` has no KV-cache size per token, which the cost model needs")]
    #[diagnostic(
        code(kiln::replay::missing_kv_per_token),
        help(
            "add `kv_per_token 320KB` to model `{model}`: 2 (K and V) × layers × KV heads × \
             head dim × 2 bytes; Llama-3-70B is 80 × 8 × 128 × 4 = 320KB"
        )
    )]
    MissingKvPerToken { model: String },

    #[error(
        "{model}.{variant} does not fit pool `{pool}`: {weights_gb:.1} GB of weights, \
         {usable_gb:.1} GB usable on {tp} GPU(s) after the activation reserve"
    )]
    #[diagnostic(
        code(kiln::replay::weights_do_not_fit),
        help(
            "raise `gpus_per_replica`, pick a lower precision, or correct `params`; \
             usable memory is gpus × memory × (1 − activation_reserve)"
        )
    )]
    WeightsDoNotFit {
        model: String,
        variant: String,
        pool: String,
        tp: u32,
        weights_gb: f64,
        usable_gb: f64,
    },

    #[error(transparent)]
    #[diagnostic(transparent)]
    Calibration(Box<CalibrationError>),

    #[error("cannot read calibration file {path}: {source}")]
    #[diagnostic(
        code(kiln::replay::io),
        help("check the path; a calibration file is TOML, see examples/calibration.toml")
    )]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A problem in a calibration file, pointing at its place in the file.
#[derive(Debug, thiserror::Error, Diagnostic)]
#[error("{name}:{line}: {message}")]
#[diagnostic(code(kiln::replay::calibration))]
pub struct CalibrationError {
    /// The file name as given.
    pub name: String,
    /// 1-based line of the problem (1 when toml gave no place).
    pub line: usize,
    pub message: String,
    #[source_code]
    pub src: NamedSource<String>,
    #[label("{label}")]
    pub span: Option<SourceSpan>,
    pub label: String,
    #[help]
    pub help: Option<String>,
}

impl CalibrationError {
    pub(crate) fn error(
        name: &str,
        text: &str,
        span: Option<std::ops::Range<usize>>,
        message: impl Into<String>,
        label: impl Into<String>,
        help: Option<String>,
    ) -> SimError {
        let line = span
            .as_ref()
            .map(|s| {
                let end = s.start.min(text.len());
                text.as_bytes()[..end]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1
            })
            .unwrap_or(1);
        SimError::Calibration(Box::new(CalibrationError {
            name: name.to_string(),
            line,
            message: message.into(),
            src: NamedSource::new(name, text.to_string()),
            span: span.map(|s| SourceSpan::from(s.start..s.end.max(s.start))),
            label: label.into(),
            help,
        }))
    }
}
