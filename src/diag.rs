//! Diagnostics: one error/warning shape, rendered by miette (human), or as
//! JSON or SARIF 2.1.0 for machines. Codes are stable: CI gates and
//! `kiln:allow(...)` comments name them.

use crate::source::{SourceMap, Span};
use miette::{LabeledSpan, NamedSource, SourceCode};
use serde::Serialize;
use std::fmt;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// Every diagnostic kind kiln can emit. Error codes are `kiln::<name>`; lint
/// rule ids are the bare names, as written in `kiln:allow(<name>)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Code {
    // errors
    Io,
    Syntax,
    DuplicateDefinition,
    UnknownName,
    UnknownField,
    MissingField,
    UnitMismatch,
    InvalidValue,
    OutOfRange,
    InvalidOutcome,
    MissingDefault,
    RuleAfterDefault,
    MissingPiece,
    NoRoute,
    NoTerminal,
    FallbackCycle,
    FallbackNotTerminal,
    PreemptCycle,
    VariantDoesNotFit,
    IsolationViolation,
    UndeclaredSubstitution,
    ReserveOversubscribed,
    ReserveUnreachable,
    FeatureNotBuilt,
    // lints
    ShadowedRule,
    QuotaOversubscribed,
    TierWithoutSlo,
    TenantWithoutOwner,
    PreemptsHigherPriority,
    UnusedDefinition,
    TierNotGranted,
    DeadRule,
    SignalRedefined,
    UnknownLint,
    ReserveOnDedicatedPool,
    InfeasibleSlo,
    TimeRangeWraps,
    UnreachableLimit,
    RollbackOnFewSamples,
    OwnerUnresolved,
    RollbackOnSharedPool,
    AbsentHeaderMatches,
    ExceptionTooLong,
}

impl Code {
    pub const ALL: &'static [Code] = &[
        Code::Io,
        Code::Syntax,
        Code::DuplicateDefinition,
        Code::UnknownName,
        Code::UnknownField,
        Code::MissingField,
        Code::UnitMismatch,
        Code::InvalidValue,
        Code::OutOfRange,
        Code::InvalidOutcome,
        Code::MissingDefault,
        Code::RuleAfterDefault,
        Code::MissingPiece,
        Code::NoRoute,
        Code::NoTerminal,
        Code::FallbackCycle,
        Code::FallbackNotTerminal,
        Code::PreemptCycle,
        Code::VariantDoesNotFit,
        Code::IsolationViolation,
        Code::UndeclaredSubstitution,
        Code::ReserveOversubscribed,
        Code::ReserveUnreachable,
        Code::FeatureNotBuilt,
        Code::ShadowedRule,
        Code::QuotaOversubscribed,
        Code::TierWithoutSlo,
        Code::TenantWithoutOwner,
        Code::PreemptsHigherPriority,
        Code::UnusedDefinition,
        Code::TierNotGranted,
        Code::DeadRule,
        Code::SignalRedefined,
        Code::UnknownLint,
        Code::ReserveOnDedicatedPool,
        Code::InfeasibleSlo,
        Code::TimeRangeWraps,
        Code::UnreachableLimit,
        Code::RollbackOnFewSamples,
        Code::OwnerUnresolved,
        Code::RollbackOnSharedPool,
        Code::AbsentHeaderMatches,
        Code::ExceptionTooLong,
    ];

    /// The stable short name.
    pub fn name(self) -> &'static str {
        match self {
            Code::Io => "io",
            Code::Syntax => "syntax",
            Code::DuplicateDefinition => "duplicate-definition",
            Code::UnknownName => "unknown-name",
            Code::UnknownField => "unknown-field",
            Code::MissingField => "missing-field",
            Code::UnitMismatch => "unit-mismatch",
            Code::InvalidValue => "invalid-value",
            Code::OutOfRange => "out-of-range",
            Code::InvalidOutcome => "invalid-outcome",
            Code::MissingDefault => "missing-default",
            Code::RuleAfterDefault => "rule-after-default",
            Code::MissingPiece => "missing-piece",
            Code::NoRoute => "no-route",
            Code::NoTerminal => "no-terminal",
            Code::FallbackCycle => "fallback-cycle",
            Code::FallbackNotTerminal => "fallback-not-terminal",
            Code::PreemptCycle => "preempt-cycle",
            Code::VariantDoesNotFit => "variant-does-not-fit",
            Code::IsolationViolation => "isolation-violation",
            Code::UndeclaredSubstitution => "undeclared-substitution",
            Code::ShadowedRule => "shadowed-rule",
            Code::QuotaOversubscribed => "quota-oversubscribed",
            Code::TierWithoutSlo => "tier-without-slo",
            Code::TenantWithoutOwner => "tenant-without-owner",
            Code::PreemptsHigherPriority => "preempts-higher-priority",
            Code::UnusedDefinition => "unused-definition",
            Code::TierNotGranted => "tier-not-granted",
            Code::DeadRule => "dead-rule",
            Code::SignalRedefined => "signal-redefined",
            Code::UnknownLint => "unknown-lint",
            Code::ReserveOversubscribed => "reserve-oversubscribed",
            Code::ReserveUnreachable => "reserve-unreachable",
            Code::ReserveOnDedicatedPool => "reserve-on-dedicated-pool",
            Code::InfeasibleSlo => "infeasible-slo",
            Code::FeatureNotBuilt => "feature-not-built",
            Code::TimeRangeWraps => "time-range-wraps",
            Code::UnreachableLimit => "unreachable-limit",
            Code::RollbackOnFewSamples => "rollback-on-few-samples",
            Code::OwnerUnresolved => "owner-unresolved",
            Code::RollbackOnSharedPool => "rollback-on-shared-pool",
            Code::AbsentHeaderMatches => "absent-header-matches",
            Code::ExceptionTooLong => "exception-too-long",
        }
    }

    pub fn from_name(name: &str) -> Option<Code> {
        Code::ALL.iter().copied().find(|c| c.name() == name)
    }

    pub fn is_lint(self) -> bool {
        self >= Code::ShadowedRule
    }

    /// The one-line rationale shown in SARIF rule metadata.
    pub fn rationale(self) -> &'static str {
        match self {
            Code::Io => "a policy file could not be read",
            Code::Syntax => "the text does not follow the kiln grammar",
            Code::DuplicateDefinition => "a name may be defined once across all files of a policy",
            Code::UnknownName => "every name a policy uses must be defined",
            Code::UnknownField => "a block only accepts the fields its kind defines",
            Code::MissingField => {
                "some fields are required for the runtime to enforce a definition"
            }
            Code::UnitMismatch => {
                "values carry units; comparing or assigning different units is a mistake"
            }
            Code::InvalidValue => "the value is outside what the field allows",
            Code::OutOfRange => {
                "every number in a policy has a range no real fleet reaches, so no policy can make kiln allocate in proportion to a number it contains"
            }
            Code::InvalidOutcome => "a rule's outcome must be one its block can act on",
            Code::MissingDefault => "rule blocks are first-match-wins and need an explicit default",
            Code::RuleAfterDefault => "a rule after the default can never match",
            Code::MissingPiece => "a policy needs its classify block and at least one tier",
            Code::NoRoute => "every tier needs a route for every model it may use",
            Code::NoTerminal => "every request must end in dispatch or reject",
            Code::FallbackCycle => "fallback chains that demote into each other never terminate",
            Code::FallbackNotTerminal => "a fallback chain must end in queue or reject",
            Code::PreemptCycle => "tiers preempting each other in a cycle would thrash",
            Code::VariantDoesNotFit => "a variant must fit on the GPUs of a pool it may run on",
            Code::IsolationViolation => "a route may not send a tier into a pool fenced against it",
            Code::UndeclaredSubstitution => {
                "serving a request with another model than the one it asked for must be declared, per tier, by the model asked for"
            }
            Code::ShadowedRule => {
                "an earlier rule matches every request this rule matches, so it never fires"
            }
            Code::QuotaOversubscribed => "quotas promise more capacity than the pools declare",
            Code::TierWithoutSlo => {
                "a tier without an SLO cannot be admitted or alerted on by latency"
            }
            Code::TenantWithoutOwner => {
                "every tenant needs an owner to page and to approve its changes"
            }
            Code::PreemptsHigherPriority => "preempting a higher-priority tier inverts priorities",
            Code::UnusedDefinition => {
                "a definition nothing refers to is dead weight or a typo elsewhere"
            }
            Code::TierNotGranted => {
                "classify sends a tenant to a tier its definition does not grant"
            }
            Code::DeadRule => {
                "a rule whose condition can never be true (or reads a signal that is constant there) never acts, though check accepts it"
            }
            Code::SignalRedefined => {
                "a signal spelling whose meaning changed: the rule may now act differently than when it was written"
            }
            Code::ReserveOversubscribed => {
                "the tiers' reserved shares of a pool cannot add up to more than the whole pool"
            }
            Code::ReserveUnreachable => {
                "a tier can only use capacity it reserves in a pool its routes and fallbacks reach"
            }
            Code::ReserveOnDedicatedPool => {
                "a pool only one tier can use is already all that tier's: a reserve there changes nothing"
            }
            Code::InfeasibleSlo => {
                "a TTFT SLO below the zero-load prefill time of ordinary prompts refuses them all as infeasible"
            }
            Code::FeatureNotBuilt => {
                "the policy uses a feature this kiln binary was built without, so `kiln serve` would refuse it"
            }
            Code::TimeRangeWraps => {
                "a time range whose start is after its end wraps midnight: it covers the night, not the hours between"
            }
            Code::UnreachableLimit => {
                "a concurrency limit above every request the fleet's replicas can run at once never binds"
            }
            Code::OwnerUnresolved => {
                "`require owner` asks the owner of what a change touches; where nothing names one, any approver counts"
            }
            Code::RollbackOnSharedPool => {
                "a pool's utilization and KV occupancy measure hardware the canary shares with the active version, so a rollback condition on them can roll a canary back for load it did not cause"
            }
            Code::RollbackOnFewSamples => {
                "below `[governance] min_samples` a rollback condition reads healthy signals, so one that holds on them rolls back a version before it has been tried"
            }
            Code::AbsentHeaderMatches => {
                "`header(\"…\") != \"\"` is true for a request without the header (absent is not the empty string), so it does not test that the header is set"
            }
            Code::ExceptionTooLong => {
                "an exception is a short, time-boxed grant; one that lasts longer than a month is a standing policy written where no one reviews it as one"
            }
            Code::UnknownLint => {
                "a `kiln:allow` naming no lint silences nothing, so the warning it meant to silence still shows, or a typo hides that it never did"
            }
        }
    }

    pub fn id(self) -> String {
        if self.is_lint() {
            format!("kiln::lint::{}", self.name())
        } else {
            format!("kiln::{}", self.name())
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A label: a span in the diagnostic's file and what it shows.
#[derive(Debug, Clone)]
pub struct Label {
    pub span: Span,
    pub text: String,
}

/// One finding. Implements [`miette::Diagnostic`]; attach the source with
/// [`Diagnostic::with_source`] (done by [`render`]) to show it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Diagnostic {
    pub code: Code,
    pub severity: Severity,
    pub message: String,
    /// The primary span: where the problem began.
    pub span: Option<Span>,
    pub labels: Vec<Label>,
    pub help: Option<String>,
    src_code: Option<NamedSource<Arc<str>>>,
}

impl Diagnostic {
    pub fn error(code: Code, message: impl Into<String>) -> Self {
        Diagnostic {
            code,
            severity: if code.is_lint() {
                Severity::Warning
            } else {
                Severity::Error
            },
            message: message.into(),
            span: None,
            labels: Vec::new(),
            help: None,
            src_code: None,
        }
    }

    /// Primary label.
    pub fn at(mut self, span: Span, text: impl Into<String>) -> Self {
        if self.span.is_none() {
            self.span = Some(span);
        }
        self.labels.push(Label {
            span,
            text: text.into(),
        });
        self
    }

    /// A secondary label; shown inline when in the same file, else in the help.
    pub fn also(mut self, span: Span, text: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            text: text.into(),
        });
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// Binds the file text so miette can draw the snippet; labels in other
    /// files are moved into the help as `file:line:col` references.
    pub fn with_source(mut self, sources: &SourceMap) -> Self {
        let Some(primary) = self.span else {
            return self;
        };
        let Some(file) = sources.get(primary.file) else {
            return self;
        };
        let mut notes = Vec::new();
        self.labels.retain(|l| {
            if l.span.file == primary.file {
                true
            } else {
                notes.push(format!("{} ({})", l.text, sources.describe(l.span)));
                false
            }
        });
        if !notes.is_empty() {
            let extra = notes.join("; ");
            self.help = Some(match self.help.take() {
                Some(h) => format!("{h}\nsee: {extra}"),
                None => format!("see: {extra}"),
            });
        }
        self.src_code = Some(NamedSource::new(file.name.clone(), file.text.clone()));
        self
    }

    /// 1-based (line, column) of the primary span, if any.
    pub fn position(&self, sources: &SourceMap) -> Option<(String, usize, usize, usize, usize)> {
        let span = self.span?;
        let file = sources.get(span.file)?;
        let (l, c) = file.line_col(span.start as usize);
        let (el, ec) = file.line_col(span.end as usize);
        Some((file.name.clone(), l, c, el, ec))
    }
}

impl miette::Diagnostic for Diagnostic {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.code.id()))
    }

    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.severity {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display + 'a>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        self.src_code.as_ref().map(|s| s as &dyn SourceCode)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        self.src_code.as_ref()?;
        let primary = self.span;
        Some(Box::new(self.labels.iter().map(move |l| {
            let text = if l.text.is_empty() {
                None
            } else {
                Some(l.text.clone())
            };
            if Some(l.span) == primary {
                LabeledSpan::new_primary_with_span(text, l.span.range())
            } else {
                LabeledSpan::new_with_span(text, l.span.range())
            }
        })))
    }
}

/// The collector threaded through every compiler stage, so `kiln check`
/// reports all violations at once.
#[derive(Debug, Default, Clone)]
pub struct Diagnostics {
    pub items: Vec<Diagnostic>,
}

impl Diagnostics {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, d: Diagnostic) {
        self.items.push(d);
    }

    pub fn has_errors(&self) -> bool {
        self.items.iter().any(|d| d.severity == Severity::Error)
    }

    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.items.iter().filter(|d| d.severity == Severity::Error)
    }

    pub fn warnings(&self) -> impl Iterator<Item = &Diagnostic> {
        self.items
            .iter()
            .filter(|d| d.severity == Severity::Warning)
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn extend(&mut self, other: Diagnostics) {
        self.items.extend(other.items);
    }

    /// Stable order: by file, position, then code.
    pub fn sort(&mut self) {
        self.items.sort_by(|a, b| {
            let ka = a.span.map(|s| (s.file, s.start, s.end));
            let kb = b.span.map(|s| (s.file, s.start, s.end));
            ka.cmp(&kb)
                .then(a.code.cmp(&b.code))
                .then(a.message.cmp(&b.message))
        });
    }
}

/// Renders one diagnostic as miette draws it, without colour (for files,
/// snapshots and non-terminals) or with the terminal's theme.
pub fn render(d: &Diagnostic, sources: &SourceMap, color: bool) -> String {
    use miette::{GraphicalReportHandler, GraphicalTheme};
    let d = d.clone().with_source(sources);
    let theme = if color {
        GraphicalTheme::unicode()
    } else {
        GraphicalTheme::unicode_nocolor()
    };
    let handler = GraphicalReportHandler::new_themed(theme).with_width(100);
    let mut out = String::new();
    if handler.render_report(&mut out, &d).is_err() {
        out = format!("{}: {}\n", d.code.id(), d.message);
    }
    out
}

/// JSON form of one diagnostic (see README "Diagnostics as JSON").
#[derive(Debug, Serialize)]
pub struct JsonDiagnostic {
    pub code: String,
    pub severity: Severity,
    pub message: String,
    pub file: Option<String>,
    pub line: Option<usize>,
    pub column: Option<usize>,
    pub end_line: Option<usize>,
    pub end_column: Option<usize>,
    pub labels: Vec<JsonLabel>,
    pub help: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct JsonLabel {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub text: String,
}

pub fn to_json(d: &Diagnostic, sources: &SourceMap) -> JsonDiagnostic {
    let pos = d.position(sources);
    JsonDiagnostic {
        code: d.code.id(),
        severity: d.severity,
        message: d.message.clone(),
        file: pos.as_ref().map(|p| p.0.clone()),
        line: pos.as_ref().map(|p| p.1),
        column: pos.as_ref().map(|p| p.2),
        end_line: pos.as_ref().map(|p| p.3),
        end_column: pos.as_ref().map(|p| p.4),
        labels: d
            .labels
            .iter()
            .filter_map(|l| {
                let f = sources.get(l.span.file)?;
                let (line, column) = f.line_col(l.span.start as usize);
                Some(JsonLabel {
                    file: f.name.clone(),
                    line,
                    column,
                    text: l.text.clone(),
                })
            })
            .collect(),
        help: d.help.clone(),
    }
}

/// SARIF 2.1.0 log for GitHub code scanning.
pub fn to_sarif(diags: &[Diagnostic], sources: &SourceMap) -> serde_json::Value {
    use serde_json::json;
    let mut codes: Vec<Code> = diags.iter().map(|d| d.code).collect();
    codes.sort();
    codes.dedup();
    let rules: Vec<_> = codes
        .iter()
        .map(|c| {
            json!({
                "id": c.id(),
                "name": c.name(),
                "shortDescription": { "text": c.rationale() },
                "defaultConfiguration": { "level": if c.is_lint() { "warning" } else { "error" } },
            })
        })
        .collect();
    let results: Vec<_> = diags
        .iter()
        .map(|d| {
            let rule_index = codes.iter().position(|c| *c == d.code).unwrap_or(0);
            let mut text = d.message.clone();
            if let Some(h) = &d.help {
                text.push_str("\nhelp: ");
                text.push_str(h);
            }
            let locations: Vec<_> = d
                .position(sources)
                .map(|(file, l, c, el, ec)| {
                    vec![json!({
                        "physicalLocation": {
                            "artifactLocation": { "uri": file },
                            "region": { "startLine": l, "startColumn": c, "endLine": el, "endColumn": ec }
                        }
                    })]
                })
                .unwrap_or_default();
            json!({
                "ruleId": d.code.id(),
                "ruleIndex": rule_index,
                "level": match d.severity { Severity::Error => "error", Severity::Warning => "warning" },
                "message": { "text": text },
                "locations": locations,
            })
        })
        .collect();
    json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": { "driver": {
                "name": "kiln",
                "version": env!("CARGO_PKG_VERSION"),
                "rules": rules,
            }},
            "results": results,
        }]
    })
}

/// "did you mean `x`?" when a candidate is close to `name`.
pub fn suggest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<String> {
    did_you_mean(name, candidates).map(|s| format!("did you mean `{s}`?"))
}

/// Edit-distance suggestion among names in scope.
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let mut best: Option<(&str, f64)> = None;
    for c in candidates {
        let score = strsim::jaro_winkler(name, c);
        let lev = strsim::levenshtein(name, c);
        let close = score > 0.82 || lev <= 2.max(name.len() / 4);
        if close && best.is_none_or(|(_, s)| score > s) {
            best = Some((c, score));
        }
    }
    best.map(|(c, _)| c)
}
