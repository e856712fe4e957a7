//! The compiler: AST → names resolved → types and units checked → validated
//! → lowered to an immutable [`DecisionGraph`]. Every stage reports into one
//! [`Diagnostics`] and goes on, so `kiln check` shows all violations at once.

mod dead;
mod decls;
mod keys;
mod lint;
mod rules;
mod subst;
pub mod units;
pub(crate) mod validate;

use crate::diag::{did_you_mean, Code, Diagnostic, Diagnostics};
use crate::graph::*;
use crate::lang::ast::{self, File, Ident, Item};
use crate::source::{FileId, SourceMap, Span};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

pub use lint::lint;
pub use lint::notes as lint_notes;
pub use lint::{build_features, SEMANTIC_CACHE_BUILT};
pub use lint::{DEFAULT_GATEWAY_IN_FLIGHT, DEFAULT_MIN_SAMPLES, DEFAULT_QUEUE_BOUND_TEXT};

/// The result of compiling a policy.
#[derive(Debug)]
pub struct Compiled {
    pub sources: SourceMap,
    pub files: Vec<(FileId, File)>,
    /// `None` when any error was found.
    pub graph: Option<DecisionGraph>,
    pub diagnostics: Diagnostics,
    /// Everything lints need that the graph does not keep.
    pub(crate) facts: Facts,
}

impl Compiled {
    pub fn has_errors(&self) -> bool {
        self.diagnostics.has_errors()
    }
}

/// Side facts gathered while compiling, for lints.
#[derive(Debug, Default, Clone)]
pub(crate) struct Facts {
    pub used: BTreeSet<(ast::DeclKind, String)>,
    pub used_variants: BTreeSet<(String, String)>,
    pub decl_spans: HashMap<(ast::DeclKind, String), Span>,
    pub variant_spans: HashMap<(String, String), Span>,
    /// Per rule block: each rule's span and its condition as a disjunction
    /// of conjunctions of atom texts (None when not in that normal form).
    pub blocks: Vec<BlockFacts>,
    /// (tenant, tier, span) pinned together by a classify rule.
    pub classify_pins: Vec<(String, String, Span)>,
    pub preempt_spans: HashMap<(String, String), Span>,
    pub fallback_asts: Vec<(Vec<TierId>, ast::Fallback)>,
    /// Signals read by a spelling whose meaning changed, and what changed.
    pub redefined: Vec<(Span, &'static str)>,
    /// Numeric comparison atoms (by their text in `blocks`): the signal
    /// compared and the values it allows, for numeric implication.
    pub num_atoms: HashMap<String, NumAtom>,
    /// Time-of-day ranges that wrap midnight (`20:00..08:00`).
    pub wrapping_times: Vec<WrappingTime>,
    /// `concurrent N` limits: whose (`tenant \`x\``), N and where.
    pub concurrent: Vec<(String, u64, Span)>,
    /// Tiers with a semantic cache and the span of its `semantic` key.
    pub semantic_caches: Vec<(String, Span)>,
    /// Where `require owner for [...]` rules are.
    pub owner_rules: Vec<Span>,
}

/// A comparison of a numeric signal with a constant: the values it allows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NumAtom {
    pub signal: String,
    pub lo: f64,
    pub lo_open: bool,
    pub hi: f64,
    pub hi_open: bool,
}

impl NumAtom {
    /// Does every value this atom allows also satisfy `other`?
    pub fn implies(&self, other: &NumAtom) -> bool {
        if self.signal != other.signal {
            return false;
        }
        let lo_ok = self.lo > other.lo || (self.lo == other.lo && (self.lo_open || !other.lo_open));
        let hi_ok = self.hi < other.hi || (self.hi == other.hi && (self.hi_open || !other.hi_open));
        lo_ok && hi_ok
    }
}

/// A time range that wraps midnight, in minutes after midnight, and the
/// `delay until` of its rule's outcome, if any.
#[derive(Debug, Clone)]
pub(crate) struct WrappingTime {
    pub span: Span,
    pub from: u32,
    pub to: u32,
    pub delay_until: Option<(u32, Span)>,
}

#[derive(Debug, Clone)]
pub(crate) struct BlockFacts {
    pub name: String,
    pub rules: Vec<(Span, Option<Vec<Vec<String>>>)>,
}

/// Reads policy files: each path is a `.kiln` file or a directory searched
/// (not recursively) for `*.kiln`, in name order so ids are stable.
pub fn load(paths: &[PathBuf]) -> Result<SourceMap, Diagnostics> {
    let mut files = Vec::new();
    let mut diags = Diagnostics::new();
    for p in paths {
        if p.is_dir() {
            match std::fs::read_dir(p) {
                Ok(rd) => {
                    let mut found: Vec<PathBuf> = rd
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|f| f.extension().is_some_and(|x| x == "kiln"))
                        .collect();
                    found.sort();
                    if found.is_empty() {
                        diags.push(
                            Diagnostic::error(
                                Code::Io,
                                format!("no .kiln files in {}", p.display()),
                            )
                            .help("point kiln at a policy file or a directory of .kiln files"),
                        );
                    }
                    files.extend(found);
                }
                Err(e) => diags.push(io_error(p, &e)),
            }
        } else {
            files.push(p.clone());
        }
    }
    let mut sources = SourceMap::new();
    for f in files {
        match std::fs::read_to_string(&f) {
            Ok(text) => {
                sources.add(display_path(&f), text);
            }
            Err(e) => diags.push(io_error(&f, &e)),
        }
    }
    if diags.has_errors() {
        Err(diags)
    } else {
        Ok(sources)
    }
}

fn display_path(p: &Path) -> String {
    p.display().to_string()
}

fn io_error(p: &Path, e: &std::io::Error) -> Diagnostic {
    Diagnostic::error(Code::Io, format!("cannot read {}: {e}", p.display()))
        .help("check the path; kiln reads .kiln files and directories of them")
}

/// Parses every file (reporting every file's syntax error) and compiles.
pub fn compile(sources: SourceMap) -> Compiled {
    let mut diagnostics = Diagnostics::new();
    let mut files = Vec::new();
    for (id, f) in sources.files() {
        match crate::lang::parse(id, &f.text) {
            Ok(file) => files.push((id, file)),
            Err(d) => diagnostics.push(*d),
        }
    }
    if diagnostics.has_errors() {
        diagnostics.sort();
        return Compiled {
            sources,
            files,
            graph: None,
            diagnostics,
            facts: Facts::default(),
        };
    }
    let mut c = Compiler::new(&sources);
    c.collect(&files);
    c.lower_decls(&files);
    c.lower_rules(&files);
    let graph = c.finish();
    diagnostics.extend(std::mem::take(&mut c.diags));
    let facts = std::mem::take(&mut c.facts);
    drop(c);
    diagnostics.sort();
    let graph = if diagnostics.has_errors() {
        None
    } else {
        Some(graph)
    };
    Compiled {
        sources,
        files,
        graph,
        diagnostics,
        facts,
    }
}

/// Compiles policy text held in memory (tests, benchmarks, the fuzzer).
pub fn compile_str(name: &str, text: &str) -> Compiled {
    let mut sources = SourceMap::new();
    sources.add(name, text.to_string());
    compile(sources)
}

/// Name tables for one definition kind.
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub ids: HashMap<String, u32>,
    pub names: Vec<String>,
    pub spans: Vec<Span>,
}

impl Table {
    fn insert(&mut self, name: &str, span: Span) -> Result<u32, Span> {
        if let Some(&id) = self.ids.get(name) {
            return Err(self.spans[id as usize]);
        }
        let id = self.names.len() as u32;
        self.ids.insert(name.to_string(), id);
        self.names.push(name.to_string());
        self.spans.push(span);
        Ok(id)
    }
}

pub(crate) struct Compiler<'s> {
    pub sources: &'s SourceMap,
    pub diags: Diagnostics,
    pub pools: Table,
    pub models: Table,
    pub tiers: Table,
    pub tenants: Table,
    pub cohorts: Table,
    pub exceptions: Table,
    pub g: DecisionGraph,
    pub facts: Facts,
    /// Rule blocks seen: (tier, model) routes, admits and fallbacks by tier.
    pub route_spans: HashMap<(TierId, ModelId), Span>,
    pub admit_spans: HashMap<TierId, Span>,
    pub fallback_spans: HashMap<TierId, Span>,
    /// `fallback` outcomes by tier, to check a chain exists.
    pub fallback_uses: Vec<(TierId, Span)>,
    pub classify_span: Option<Span>,
    /// `served_by` properties of each model, lowered once every model is.
    pub served_by: Vec<(ModelId, ast::Property)>,
    /// Each API key seen so far: the tenant it was given to and where.
    pub api_keys: HashMap<String, (String, Span)>,
    /// A `policy { … }` block was lowered.
    pub seen_settings: bool,
}

impl<'s> Compiler<'s> {
    fn new(sources: &'s SourceMap) -> Self {
        Compiler {
            sources,
            diags: Diagnostics::new(),
            pools: Table::default(),
            models: Table::default(),
            tiers: Table::default(),
            tenants: Table::default(),
            cohorts: Table::default(),
            exceptions: Table::default(),
            g: DecisionGraph::empty(),
            facts: Facts::default(),
            route_spans: HashMap::new(),
            admit_spans: HashMap::new(),
            fallback_spans: HashMap::new(),
            fallback_uses: Vec::new(),
            classify_span: None,
            served_by: Vec::new(),
            api_keys: HashMap::new(),
            seen_settings: false,
        }
    }

    pub fn err(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    fn table(&self, kind: ast::DeclKind) -> &Table {
        match kind {
            ast::DeclKind::Pool => &self.pools,
            ast::DeclKind::Model => &self.models,
            ast::DeclKind::Tier => &self.tiers,
            ast::DeclKind::Tenant => &self.tenants,
            ast::DeclKind::Cohort => &self.cohorts,
            ast::DeclKind::Exception => &self.exceptions,
        }
    }

    /// Resolves a name of a kind, reporting unknown-name with a suggestion.
    pub fn resolve(&mut self, kind: ast::DeclKind, id: &Ident) -> Option<u32> {
        let t = self.table(kind);
        if let Some(&i) = t.ids.get(&id.name) {
            self.facts.used.insert((kind, id.name.clone()));
            return Some(i);
        }
        let suggestion = did_you_mean(&id.name, t.names.iter().map(String::as_str));
        let kw = kind.keyword();
        let help = match suggestion {
            Some(s) => format!("did you mean `{s}`?"),
            None if t.names.is_empty() => format!("define it with `{kw} {} {{ … }}`", id.name),
            None => format!(
                "defined {kw}s are: {}",
                t.names
                    .iter()
                    .take(12)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        self.err(
            Diagnostic::error(Code::UnknownName, format!("unknown {kw} `{}`", id.name))
                .at(id.span, format!("no {kw} is named `{}`", id.name))
                .help(help),
        );
        None
    }

    /// Pass 1: every definition's name, across all files, so that order and
    /// file boundaries do not matter.
    fn collect(&mut self, files: &[(FileId, File)]) {
        for (_, f) in files {
            for item in &f.items {
                match item {
                    Item::Decl(d) => {
                        let table = match d.kind {
                            ast::DeclKind::Pool => &mut self.pools,
                            ast::DeclKind::Model => &mut self.models,
                            ast::DeclKind::Tier => &mut self.tiers,
                            ast::DeclKind::Tenant => &mut self.tenants,
                            ast::DeclKind::Cohort => &mut self.cohorts,
                            ast::DeclKind::Exception => &mut self.exceptions,
                        };
                        if let Err(first) = table.insert(&d.name.name, d.name.span) {
                            let kw = d.kind.keyword();
                            let first_at = self.sources.describe(first);
                            self.diags.push(
                                Diagnostic::error(
                                    Code::DuplicateDefinition,
                                    format!("{kw} `{}` is defined twice", d.name.name),
                                )
                                .at(d.name.span, "defined again here")
                                .also(first, "first defined here")
                                .help(format!(
                                    "names are global across the policy's files; rename or remove one (first at {first_at})"
                                )),
                            );
                        } else {
                            self.facts
                                .decl_spans
                                .insert((d.kind, d.name.name.clone()), d.name.span);
                        }
                    }
                    Item::Classify(c) => {
                        if let Some(first) = self.classify_span {
                            let first_at = self.sources.describe(first);
                            self.diags.push(
                                Diagnostic::error(
                                    Code::DuplicateDefinition,
                                    "the policy has two classify blocks",
                                )
                                .at(
                                    Span {
                                        end: c.span.start + 8,
                                        ..c.span
                                    },
                                    "second classify block",
                                )
                                .also(first, "first classify block")
                                .help(format!(
                                    "merge them into one ordered block (the first is at {first_at})"
                                )),
                            );
                        } else {
                            self.classify_span = Some(Span {
                                end: c.span.start + 8,
                                ..c.span
                            });
                        }
                    }
                    _ => {}
                }
            }
        }
        if self.classify_span.is_none() && !files.is_empty() {
            let span = files
                .first()
                .map(|(id, _)| Span::new(*id, 0, 0))
                .unwrap_or_default();
            self.diags.push(
                Diagnostic::error(Code::MissingPiece, "the policy has no classify block")
                    .at(span, "")
                    .help("add `classify { default => tier <name> }`: every request needs a tier"),
            );
        }
        if self.tiers.names.is_empty() && !files.is_empty() {
            let span = files
                .first()
                .map(|(id, _)| Span::new(*id, 0, 0))
                .unwrap_or_default();
            self.diags.push(
                Diagnostic::error(Code::MissingPiece, "the policy defines no tier")
                    .at(span, "")
                    .help("add at least one `tier <name> { priority N }`"),
            );
        }
    }

    fn finish(&mut self) -> DecisionGraph {
        slo_rollbacks(&mut self.g);
        validate::run(self);
        let g = &mut self.g;
        let nt = g.tenants.len();
        g.classify.index(nt);
        for rs in g.routes.iter_mut().flatten() {
            rs.index(nt);
        }
        for rs in g.admits.iter_mut().flatten() {
            rs.index(nt);
        }
        g.index.pools = self
            .pools
            .ids
            .iter()
            .map(|(k, v)| (k.clone(), *v as PoolId))
            .collect();
        g.index.models = self
            .models
            .ids
            .iter()
            .map(|(k, v)| (k.clone(), *v as ModelId))
            .collect();
        g.index.tiers = self
            .tiers
            .ids
            .iter()
            .map(|(k, v)| (k.clone(), *v as TierId))
            .collect();
        g.index.tenants = self
            .tenants
            .ids
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (i, t) in g.tenants.iter().enumerate() {
            for k in &t.api_keys {
                g.index.api_keys.insert(k.clone(), i as TenantId);
            }
        }
        std::mem::replace(g, DecisionGraph::empty())
    }
}

/// A rollout rolls back on its tiers' `slo { error_rate }`: a tier whose
/// errors stay above its objective for 5 minutes of the canary's (or the
/// watch's) traffic trips it, unless a `rollback when` of the block
/// already reads that tier's `error_rate`. Written as the rollback line
/// would be, so `kiln status` shows it with the others.
fn slo_rollbacks(g: &mut DecisionGraph) {
    use crate::graph::signal::TierField;
    use crate::graph::{Cond, Rollback, Sig, Test, TestOp};
    fn reads(c: &Cond, sig: &Sig) -> bool {
        match c {
            Cond::True => false,
            Cond::Test(t) => t.sig == *sig,
            Cond::Not(c) => reads(c, sig),
            Cond::And(v) | Cond::Or(v) => v.iter().any(|c| reads(c, sig)),
        }
    }
    let Some(r) = g.rollout.as_mut() else { return };
    for (i, t) in g.tiers.iter().enumerate() {
        let Some(limit) = t.slo.error_rate else {
            continue;
        };
        let sig = Sig::TierLive(i as TierId, TierField::ErrorRate);
        if r.rollbacks.iter().any(|b| reads(&b.cond, &sig)) {
            continue;
        }
        let text = format!("tier({}).error_rate > {limit}%", t.name);
        r.rollbacks.push(Rollback {
            cond: Cond::Test(Box::new(Test {
                sig,
                op: TestOp::Num(crate::units::CmpOp::Gt, limit),
                negate: false,
                text: text.clone(),
            })),
            hold: Some(300_000.0),
            text: format!("{text} for 5m (its slo)"),
            span: t.span,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::compile_str;

    const POLICY: &str = r#"
pool p { gpus 1 kind "H100-80GB" memory 80GB }
model m { variant fp16 { memory 10GB pools [p] } }
tier chat { priority 100 slo { ttft 500ms error_rate 1% } }
tier agent { priority 90 slo { ttft 1s error_rate 2.5% } }
tier bulk { priority 10 slo { window 1h throughput { tokens 50k/min requests 2/s } deadline soft } }
tenant t { owner "o" tiers [chat, agent, bulk] }
classify { default => tier chat }
route [chat, agent, bulk] m { default => fp16 }
rollout {
  canary { share 5% }
  rollback when tier(agent).error_rate > 5%
}
"#;

    #[test]
    fn an_error_rate_slo_arms_the_rollout_unless_a_rollback_reads_it() {
        let c = compile_str("t.kiln", POLICY);
        let g = c.graph.expect("compiles");
        let bulk = &g.tiers[2].slo;
        assert_eq!(bulk.deadline, crate::graph::Deadline::Soft);
        let tp = bulk.throughput.expect("throughput");
        assert!((tp.tokens_per_s.unwrap() - 50_000.0 / 60.0).abs() < 1e-9);
        assert_eq!(tp.requests_per_s, Some(2.0));
        assert_eq!(g.tiers[0].slo.error_rate, Some(1.0));
        let texts: Vec<&str> = g
            .rollout
            .as_ref()
            .unwrap()
            .rollbacks
            .iter()
            .map(|r| r.text.as_str())
            .collect();
        // agent's own rollback stands; chat's comes from its SLO.
        assert_eq!(
            texts,
            [
                "tier(agent).error_rate > 5%",
                "tier(chat).error_rate > 1% for 5m (its slo)"
            ]
        );
        let plan = crate::governance::rollout::Plan::of(&g, 60_000.0, 60_000.0);
        assert_eq!(plan.rollbacks[1].hold_ms, Some(300_000.0));
        // The same condition as the line written by hand.
        let by_hand = POLICY.replace(
            "  rollback when tier(agent)",
            "  rollback when tier(chat).error_rate > 1% for 5m\n  rollback when tier(agent)",
        );
        let h = compile_str("t.kiln", &by_hand).graph.expect("compiles");
        let hr = &h.rollout.as_ref().unwrap().rollbacks;
        assert_eq!(hr.len(), 2, "nothing derived when a line reads it");
        let derived = &g.rollout.as_ref().unwrap().rollbacks[1];
        assert_eq!(hr[0].cond, derived.cond);
        assert_eq!(hr[0].hold, derived.hold);
        // Without a rollout block nothing is armed.
        let c = compile_str("t.kiln", &POLICY[..POLICY.find("rollout").unwrap()]);
        assert!(c.graph.unwrap().rollout.is_none());
    }
}
