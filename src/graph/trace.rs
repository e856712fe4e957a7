//! Decision traces for `kiln explain` and `/admin/explain`: which rules were
//! tried, each condition with the value it saw. The evaluator is generic over
//! [`Tracer`]; the hot path uses [`NoTrace`], which compiles to nothing.

use crate::units::{show, Ty};
use serde::Serialize;

pub trait Tracer {
    fn enabled(&self) -> bool;
    fn stage(&mut self, _stage: &str, _block: String) {}
    fn rule(&mut self, _rule: u32, _matched: bool) {}
    fn test(&mut self, _text: &str, _observed: String, _result: bool) {}
    fn note(&mut self, _note: String) {}
}

/// Tracing off.
pub struct NoTrace;

impl Tracer for NoTrace {
    #[inline(always)]
    fn enabled(&self) -> bool {
        false
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TestTrace {
    pub condition: String,
    pub observed: String,
    pub result: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleTrace {
    pub rule: u32,
    pub matched: bool,
    pub tests: Vec<TestTrace>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageTrace {
    pub stage: String,
    pub block: String,
    pub rules: Vec<RuleTrace>,
    pub notes: Vec<String>,
}

/// Records everything.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct Trace {
    pub stages: Vec<StageTrace>,
    #[serde(skip)]
    pending: Vec<TestTrace>,
}

impl Tracer for Trace {
    fn enabled(&self) -> bool {
        true
    }
    fn stage(&mut self, stage: &str, block: String) {
        self.stages.push(StageTrace {
            stage: stage.to_string(),
            block,
            rules: Vec::new(),
            notes: Vec::new(),
        });
    }
    fn rule(&mut self, rule: u32, matched: bool) {
        let tests = std::mem::take(&mut self.pending);
        if let Some(s) = self.stages.last_mut() {
            s.rules.push(RuleTrace {
                rule,
                matched,
                tests,
            });
        }
    }
    fn test(&mut self, text: &str, observed: String, result: bool) {
        self.pending.push(TestTrace {
            condition: text.to_string(),
            observed,
            result,
        });
    }
    fn note(&mut self, note: String) {
        if let Some(s) = self.stages.last_mut() {
            s.notes.push(note);
        }
    }
}

/// The human explanation of one decision: the request, each stage's rules
/// with the value every condition saw and where the rule is written, and
/// the decision. `kiln explain` and `/admin/explain?format=text` print it.
pub fn render(
    g: &super::DecisionGraph,
    sources: &crate::source::SourceMap,
    req: &super::Request,
    v: &super::DecisionView,
    t: &Trace,
) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "request: tenant={} model={} prompt_tokens={} max_tokens={}",
        req.tenant
            .as_deref()
            .or(req.api_key.as_deref())
            .unwrap_or("(none)"),
        req.model,
        req.prompt_tokens,
        req.max_tokens
    ));
    for (k, val) in &req.headers {
        s.push_str(&format!(" {k}={val}"));
    }
    s.push('\n');
    for st in &t.stages {
        s.push_str(&format!("\n{}  [{}]\n", st.stage, st.block));
        for r in &st.rules {
            let info = g.rules.get(r.rule as usize);
            let (text, at) = match info {
                Some(i) => (i.text.clone(), sources.describe(i.span)),
                None => ("?".into(), String::new()),
            };
            let mark = if r.matched { "✓" } else { "✗" };
            s.push_str(&format!(
                "  {mark} #{} {text}   ({at})\n",
                info.map(|i| i.index).unwrap_or(0)
            ));
            for tt in &r.tests {
                s.push_str(&format!(
                    "      {} {:<40} saw {}\n",
                    if tt.result { "true " } else { "false" },
                    tt.condition,
                    tt.observed
                ));
            }
        }
        for n in &st.notes {
            s.push_str(&format!("  · {n}\n"));
        }
    }
    s.push_str("\ndecision: ");
    let mut parts = vec![];
    if let Some(tn) = &v.tenant {
        parts.push(format!("tenant {tn}"));
    }
    parts.push(format!("tier {}", v.tier));
    if let Some(r) = &v.route {
        match &v.substituted_for {
            Some(asked) => parts.push(format!("route {r} (substituted for {asked})")),
            None => parts.push(format!("route {r}")),
        }
    }
    let mut adm = v.admission.clone();
    if let Some(w) = v.max_wait_ms {
        adm.push_str(&format!(" (max wait {})", show(Ty::Duration, w)));
    }
    if let Some(u) = &v.delay_until {
        adm.push_str(&format!(" until {u}"));
    }
    if let Some(st) = v.status {
        adm.push_str(&format!(" {st} \"{}\"", v.message.as_deref().unwrap_or("")));
        if let Some(ra) = v.retry_after_ms {
            adm.push_str(&format!(" retry after {}", show(Ty::Duration, ra)));
        }
    }
    parts.push(adm);
    if let Some(fs) = v.fallback_step {
        parts.push(format!("fallback step {fs}"));
    }
    s.push_str(&parts.join(" · "));
    s.push('\n');
    if let Some(line) = g
        .tier_id(&v.tier)
        .and_then(|t| g.tiers.get(t as usize))
        .and_then(|t| cache_line(&t.cache))
    {
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// What `kiln explain` says of the decided tier's caches, if it has any.
fn cache_line(c: &super::TierCache) -> Option<String> {
    let mut parts = Vec::new();
    if let Some(e) = c.exact {
        parts.push(format!(
            "exact ({} entries, ttl {}, {}): a deterministic request (temperature 0 or a seed, one choice) already answered is served from it, with no queue and no GPU time",
            e.max_entries,
            show(Ty::Duration, e.ttl_us as f64 / 1000.0),
            if e.shared { "shared by the tier's tenants" } else { "per tenant" }
        ));
    }
    if let Some(sm) = c.semantic {
        parts.push(format!(
            "semantic (similarity {}, {} entries, ttl {}, {}): a deterministic request whose question (the last user message, or its last paragraph) is at least that similar to a cached one, identical in everything else (system prompt, earlier turns, tools, images, the text before the compared part) and in its numbers, dates, names and negations, is served from it when no exact answer is; its lookup is skipped (`x-kiln-cache: skipped`) when the embedding does not finish within the gateway's budget",
            sm.min_similarity,
            sm.max_entries,
            show(Ty::Duration, sm.ttl_us as f64 / 1000.0),
            if sm.shared { "shared by the tier's tenants" } else { "per tenant" }
        ));
    }
    (!parts.is_empty()).then(|| format!("cache: {}", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explain_describes_the_semantic_cache_as_it_acts() {
        let c = super::super::TierCache {
            exact: Some(super::super::ExactSpec {
                max_entries: 500,
                ttl_us: 600_000_000,
                shared: false,
            }),
            semantic: Some(super::super::SemanticSpec {
                min_similarity: 0.95,
                max_entries: 5000,
                ttl_us: 3_600_000_000,
                shared: true,
            }),
        };
        insta::assert_snapshot!(cache_line(&c).unwrap_or_default());
    }
}
