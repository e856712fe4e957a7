//! Errors of the traffic module: I/O, malformed lines (naming the file and
//! the 1-based line, with the line shown), and unusable options.

use miette::{MietteError, MietteSpanContents, SourceCode, SourceSpan, SpanContents};
use std::path::Path;

/// Everything that can go wrong reading, importing or writing traffic.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum TrafficError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    #[diagnostic(code(kiln::traffic::io))]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// One line of the input is not what the format says.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Malformed(Box<MalformedLine>),
    /// An option or a combination of inputs that cannot work (an empty
    /// sizes trace, a time scale of zero, a directory without traces).
    #[error("{0}")]
    #[diagnostic(code(kiln::traffic::invalid))]
    Invalid(String),
}

impl TrafficError {
    /// True for a malformed line (exit code 1); false for I/O and usage
    /// errors (exit code 2).
    pub fn is_malformed(&self) -> bool {
        matches!(self, TrafficError::Malformed(_))
    }

    /// The 1-based line of a malformed-line error.
    pub fn line(&self) -> Option<usize> {
        match self {
            TrafficError::Malformed(m) => Some(m.line),
            _ => None,
        }
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        TrafficError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// A malformed line: the file, the 1-based line, what is wrong and where.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
#[error("{path}:{line}: {message}")]
#[diagnostic(code(kiln::traffic::malformed), help("{help}"))]
pub struct MalformedLine {
    pub path: String,
    /// 1-based.
    pub line: usize,
    pub message: String,
    pub help: String,
    #[source_code]
    pub source_line: LineSource,
    #[label("{label}")]
    pub span: SourceSpan,
    pub label: String,
}

/// What kind of input a line came from, to give the right help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Kiln,
    Azure,
    Mooncake,
    Servegen,
}

impl Kind {
    fn help(self) -> &'static str {
        match self {
            Kind::Kiln => "each line must be one JSON object in the kiln traffic format, version 1 (docs/traffic.md: \"Recorded traffic\"); --skip-malformed skips and counts bad lines",
            Kind::Azure => "expected `TIMESTAMP,ContextTokens,GeneratedTokens` rows such as `2023-11-16 18:15:46.6805900,374,44`; --skip-malformed skips and counts bad lines",
            Kind::Mooncake => "expected one JSON object a line with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`; --skip-malformed skips and counts bad lines",
            Kind::Servegen => "expected `window_start_s,rate_req_per_s,cv,distribution,param1,param2` rows, distribution `Gamma`, `Weibull` or empty; --skip-malformed skips and counts bad lines",
        }
    }
}

/// Where a line came from: enough to build a malformed-line error.
#[derive(Debug, Clone, Copy)]
pub(crate) struct At<'a> {
    pub kind: Kind,
    pub path: &'a str,
    /// 1-based.
    pub line: usize,
    pub text: &'a str,
}

impl At<'_> {
    /// A malformed-line error. `at` is the byte offset in the line the
    /// problem is found at and `len` how many bytes to underline (clamped
    /// to the line and to character boundaries).
    pub(crate) fn error(
        &self,
        at: usize,
        len: usize,
        message: impl Into<String>,
        label: impl Into<String>,
    ) -> TrafficError {
        let text = self.text;
        let mut start = at.min(text.len());
        while start > 0 && !text.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = start.saturating_add(len).min(text.len());
        while end > start && !text.is_char_boundary(end) {
            end -= 1;
        }
        TrafficError::Malformed(Box::new(MalformedLine {
            path: self.path.to_string(),
            line: self.line,
            message: message.into(),
            help: self.kind.help().to_string(),
            source_line: LineSource {
                name: self.path.to_string(),
                text: text.to_string(),
                line: self.line,
            },
            span: SourceSpan::new(start.into(), end - start),
            label: label.into(),
        }))
    }

    /// The whole line underlined.
    pub(crate) fn whole(
        &self,
        message: impl Into<String>,
        label: impl Into<String>,
    ) -> TrafficError {
        self.error(0, self.text.len(), message, label)
    }

    /// A serde_json error, pointed at the column the parser stopped at.
    pub(crate) fn json(&self, e: &serde_json::Error) -> TrafficError {
        let msg = json_message(e);
        let mut label = msg.split(", expected").next().unwrap_or(&msg).to_string();
        if let Some(guess) = did_you_mean(&msg) {
            label.push_str(&format!("; did you mean `{guess}`?"));
        }
        let col = e.column().saturating_sub(1);
        self.error(col, 1, msg, label)
    }
}

/// One line of a file, shown by miette under its real file name and line
/// number (the file itself is not kept in memory).
#[derive(Debug, Clone)]
pub struct LineSource {
    name: String,
    text: String,
    /// 1-based.
    line: usize,
}

impl SourceCode for LineSource {
    fn read_span<'a>(
        &'a self,
        span: &SourceSpan,
        context_lines_before: usize,
        context_lines_after: usize,
    ) -> Result<Box<dyn SpanContents<'a> + 'a>, MietteError> {
        let inner = self
            .text
            .read_span(span, context_lines_before, context_lines_after)?;
        Ok(Box::new(MietteSpanContents::new_named(
            self.name.clone(),
            inner.data(),
            *inner.span(),
            inner.line() + self.line.saturating_sub(1),
            inner.column(),
            inner.line_count(),
        )))
    }
}

/// For serde's "unknown field `x`, expected one of `a`, `b`": the
/// expected name closest to `x`, if it is close.
fn did_you_mean(msg: &str) -> Option<&str> {
    let rest = msg.strip_prefix("unknown field `")?;
    let (unknown, rest) = rest.split_once('`')?;
    rest.split('`')
        .skip(1)
        .step_by(2)
        .map(|name| (strsim::levenshtein(unknown, name), name))
        .filter(|(d, name)| *d <= 2.max(name.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, name)| name)
}

/// serde_json's message without its " at line L column C" suffix (the
/// line is ours, not the parser's, which only ever saw one line).
pub(crate) fn json_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}
