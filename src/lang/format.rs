//! `kiln fmt`: one canonical layout, every comment kept.
//!
//! The formatter prints the AST back (two-space indent, one item per line, one
//! blank line between top-level items, blank lines between fields kept as at
//! most one) and re-inserts comments by source position: a comment before a
//! node stays before it; a comment at the end of a line stays at the end of
//! that node's line. Comments inside a construct that is printed on one line
//! (a condition split over lines, say) move to the line above it, never away.

use super::ast::*;
use super::comments::{scan, Comment};
use super::parser::escape;

const INDENT: &str = "  ";
/// Nested bodies are printed on one line when short and comment-free.
const INLINE_WIDTH: usize = 88;

/// Formats a parsed file. `text` must be the text `file` was parsed from.
pub fn format_file(file: &File, text: &str) -> String {
    let mut p = Printer {
        text,
        comments: scan(text),
        next: 0,
        out: String::new(),
        depth: 0,
        limit: usize::MAX,
    };
    for (i, item) in file.items.iter().enumerate() {
        if i > 0 {
            p.out.push('\n');
        }
        p.item(item);
    }
    p.flush_before(usize::MAX);
    let mut out = p.out;
    while out.ends_with("\n\n") {
        out.pop();
    }
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

struct Printer<'a> {
    text: &'a str,
    comments: Vec<Comment>,
    next: usize,
    out: String,
    depth: usize,
    /// Where the next sibling starts: a comment after it on the same source
    /// line belongs to that sibling, not to the node being printed.
    limit: usize,
}

impl Printer<'_> {
    fn indent(&mut self) {
        for _ in 0..self.depth {
            self.out.push_str(INDENT);
        }
    }

    fn line(&mut self, s: &str) {
        self.indent();
        self.out.push_str(s);
        self.out.push('\n');
    }

    /// Prints every comment that starts before `pos` on its own line.
    /// Comments before a node, and the blank line between them and the node
    /// when the source has one (a file header stays apart from the first item).
    fn leading(&mut self, pos: usize) {
        let before = self.next;
        self.flush_before(pos);
        if self.next > before {
            if let Some(c) = self.comments.get(self.next - 1) {
                if self.blank_between(c.start + c.text.len(), pos) {
                    self.out.push('\n');
                }
            }
        }
    }

    fn flush_before(&mut self, pos: usize) {
        let mut prev_end: Option<usize> = None;
        while let Some(c) = self.comments.get(self.next) {
            if c.start >= pos {
                break;
            }
            let (start, t) = (c.start, c.text.clone());
            // keep one blank line between comment paragraphs
            if prev_end.is_some_and(|e| self.blank_between(e, start)) {
                self.out.push('\n');
            }
            self.line(&t);
            prev_end = Some(start + t.len());
            self.next += 1;
        }
    }

    /// Appends a comment that sits at the end of the source line of `pos`
    /// to the line just printed, if it starts before `limit` (where the next
    /// node begins).
    fn trailing_before(&mut self, pos: usize, limit: usize) {
        let line = self.line_of(pos);
        if let Some(c) = self.comments.get(self.next) {
            if !c.own_line && c.line == line && c.start < limit {
                let t = c.text.clone();
                if self.out.ends_with('\n') {
                    self.out.pop();
                }
                self.out.push(' ');
                self.out.push_str(&t);
                self.out.push('\n');
                self.next += 1;
            }
        }
    }

    fn line_of(&self, pos: usize) -> usize {
        self.text
            .get(..pos.min(self.text.len()))
            .map(|s| s.matches('\n').count())
            .unwrap_or(0)
    }

    fn has_comment_in(&self, start: usize, end: usize) -> bool {
        self.comments[self.next..]
            .iter()
            .any(|c| c.start >= start && c.start < end)
    }

    /// True when the source has a blank line between `from` and `to`.
    fn blank_between(&self, from: usize, to: usize) -> bool {
        let Some(gap) = self.text.get(from..to) else {
            return false;
        };
        let lines: Vec<&str> = gap.split('\n').collect();
        lines.len() > 2
            && lines[1..lines.len() - 1]
                .iter()
                .any(|l| l.trim().is_empty())
    }

    /// A node printed as one line.
    fn one_line(&mut self, start: usize, end: usize, s: &str) {
        self.leading(start);
        self.flush_before(end);
        self.line(s);
        self.trailing_before(end.saturating_sub(1), self.limit);
    }

    /// Prints children in order, each knowing where the next one starts.
    /// `close` is where the closing bracket is: a comment after it belongs to
    /// the bracket's line, not to the last child.
    fn children<T>(
        &mut self,
        items: &[T],
        close: usize,
        start: impl Fn(&T) -> usize,
        end: impl Fn(&T) -> usize,
        mut print: impl FnMut(&mut Self, &T),
    ) {
        let outer = self.limit;
        let mut prev = None;
        for (i, it) in items.iter().enumerate() {
            self.gap(prev, start(it));
            self.limit = items.get(i + 1).map_or(close, &start);
            print(self, it);
            prev = Some(end(it));
        }
        self.limit = outer;
    }

    /// Opens a block: leading comments, the header and `{`.
    fn open(&mut self, start: usize, brace: usize, header: &str, first_child: usize) {
        self.leading(start);
        self.line(&format!("{header} {{"));
        self.trailing_before(brace, first_child);
        self.depth += 1;
    }

    fn close(&mut self, end: usize, closer: &str) {
        let brace = end.saturating_sub(1);
        self.flush_before(brace);
        self.depth = self.depth.saturating_sub(1);
        self.line(closer);
        self.trailing_before(brace, self.limit);
    }

    fn gap(&mut self, prev_end: Option<usize>, start: usize) {
        if let Some(pe) = prev_end {
            let first_comment = self.comments[self.next..]
                .iter()
                .find(|c| c.own_line && c.start >= pe)
                .map(|c| c.start)
                .unwrap_or(start)
                .min(start);
            if self.blank_between(pe, first_comment) {
                self.out.push('\n');
            }
        }
    }

    fn item(&mut self, item: &Item) {
        match item {
            Item::Decl(d) => {
                let header = format!("{} {}", d.kind.keyword(), d.name.name);
                self.block_body(d.span.start as usize, &header, &d.body, true);
            }
            Item::Settings(st) => self.block_body(st.span.start as usize, "policy", &st.body, true),
            Item::Classify(c) => self.rule_block(c.span.start as usize, "classify", &c.rules),
            Item::Route(r) => {
                let header = format!("route {} {}", name_set(&r.tiers), r.model.name);
                self.rule_block(r.span.start as usize, &header, &r.rules)
            }
            Item::Admit(a) => {
                let header = format!("admit {}", name_set(&a.tiers));
                self.rule_block(a.span.start as usize, &header, &a.rules)
            }
            Item::Fallback(f) => {
                let start = f.span.start as usize;
                let bracket = self
                    .text
                    .get(f.tiers.span.end as usize..f.span.end as usize)
                    .and_then(|s| s.find('['))
                    .map(|i| i + f.tiers.span.end as usize)
                    .unwrap_or(start);
                self.leading(start);
                self.line(&format!("fallback {} [", name_set(&f.tiers)));
                let first = f
                    .steps
                    .first()
                    .map_or(usize::MAX, |s| s.span.start as usize);
                self.trailing_before(bracket, first);
                self.depth += 1;
                let text = self.text;
                // the comma after a step belongs to its line
                let comma_end = |s: &Step| {
                    let end = s.span.end as usize;
                    text.get(end..)
                        .and_then(|r| {
                            let t = r.trim_start_matches([' ', '\t']);
                            t.starts_with(',').then(|| end + (r.len() - t.len()) + 1)
                        })
                        .unwrap_or(end)
                };
                let outer = self.limit;
                self.limit = usize::MAX;
                self.children(
                    &f.steps,
                    (f.span.end as usize).saturating_sub(1),
                    |s| s.span.start as usize,
                    comma_end,
                    |p, s| {
                        p.one_line(
                            s.span.start as usize,
                            comma_end(s),
                            &format!("{},", step(s)),
                        )
                    },
                );
                self.limit = outer;
                self.close(f.span.end as usize, "]");
            }
            Item::Rollout(r) => {
                let start = r.span.start as usize;
                let first = r
                    .items
                    .first()
                    .map_or(usize::MAX, |i| i.span().start as usize);
                self.open(start, brace_after(self.text, start), "rollout", first);
                let outer = self.limit;
                self.limit = usize::MAX;
                self.children(
                    &r.items,
                    (r.span.end as usize).saturating_sub(1),
                    |it| it.span().start as usize,
                    |it| it.span().end as usize,
                    |p, it| match it {
                        RolloutItem::Prop(prop) => p.property(prop),
                        RolloutItem::Rollback { cond, hold, span } => {
                            let mut s = format!("rollback when {}", expr(cond));
                            if let Some(h) = hold {
                                s.push_str(&format!(" for {}", value(h)));
                            }
                            p.one_line(span.start as usize, span.end as usize, &s);
                        }
                        RolloutItem::Stage(st) => p.stage(st),
                    },
                );
                self.limit = outer;
                self.close(r.span.end as usize, "}");
            }
            Item::Approval(a) => {
                let start = a.span.start as usize;
                let first = a
                    .rules
                    .first()
                    .map_or(usize::MAX, |r| r.span.start as usize);
                self.open(start, brace_after(self.text, start), "approval", first);
                let outer = self.limit;
                self.limit = usize::MAX;
                self.children(
                    &a.rules,
                    (a.span.end as usize).saturating_sub(1),
                    |r| r.span.start as usize,
                    |r| r.span.end as usize,
                    |p, r| {
                        let s = if r.owner {
                            format!("require owner for {}", name_set(&r.kinds))
                        } else {
                            format!(
                                "require {} from \"{}\" for {}",
                                r.count,
                                escape(&r.group),
                                name_set(&r.kinds)
                            )
                        };
                        p.one_line(r.span.start as usize, r.span.end as usize, &s);
                    },
                );
                self.limit = outer;
                self.close(a.span.end as usize, "}");
            }
        }
    }

    fn rule_block(&mut self, start: usize, header: &str, rb: &RuleBlock) {
        let first = rb
            .rules
            .first()
            .map_or(usize::MAX, |r| r.span.start as usize);
        self.open(start, rb.span.start as usize, header, first);
        let outer = self.limit;
        self.limit = usize::MAX;
        self.children(
            &rb.rules,
            (rb.span.end as usize).saturating_sub(1),
            |r| r.span.start as usize,
            |r| r.span.end as usize,
            |p, r| p.one_line(r.span.start as usize, r.span.end as usize, &rule(r)),
        );
        self.limit = outer;
        self.close(rb.span.end as usize, "}");
    }

    /// `header { props }`, inline when short and simple unless `force_block`.
    fn block_body(&mut self, start: usize, header: &str, body: &Body, force_block: bool) {
        let (bs, be) = (body.span.start as usize, body.span.end as usize);
        if !force_block && !self.has_comment_in(bs, be) {
            if let Some(inline) = inline_body(body) {
                let s = format!("{header} {inline}");
                if s.len() + self.depth * INDENT.len() <= INLINE_WIDTH {
                    self.one_line(start, be, &s);
                    return;
                }
            }
        }
        let first = body
            .props
            .first()
            .map_or(usize::MAX, |p| p.span.start as usize);
        self.open(start, bs, header, first);
        let outer = self.limit;
        self.limit = usize::MAX;
        self.children(
            &body.props,
            be.saturating_sub(1),
            |p| p.span.start as usize,
            |p| p.span.end as usize,
            |pr, p| pr.property(p),
        );
        self.limit = outer;
        self.close(be, "}");
    }

    /// A rollout stage: always a block, one field or gate a line.
    fn stage(&mut self, st: &Stage) {
        let start = st.span.start as usize;
        let first = st
            .items
            .first()
            .map_or(usize::MAX, |i| i.span().start as usize);
        let header = format!("stage {}", st.name.name);
        self.open(start, brace_after(self.text, start), &header, first);
        self.children(
            &st.items,
            (st.span.end as usize).saturating_sub(1),
            |it| it.span().start as usize,
            |it| it.span().end as usize,
            |p, it| match it {
                StageItem::Prop(prop) => p.property(prop),
                StageItem::Gate { cond, hold, span } => {
                    let mut s = format!("gate when {}", expr(cond));
                    if let Some(h) = hold {
                        s.push_str(&format!(" for {}", value(h)));
                    }
                    p.one_line(span.start as usize, span.end as usize, &s);
                }
            },
        );
        self.close(st.span.end as usize, "}");
    }

    fn property(&mut self, p: &Property) {
        let head = property_head(p);
        match &p.body {
            Some(b) => self.block_body(p.span.start as usize, &head, b, false),
            None => self.one_line(p.span.start as usize, p.span.end as usize, &head),
        }
    }
}

fn brace_after(text: &str, start: usize) -> usize {
    text.get(start..)
        .and_then(|s| s.find('{'))
        .map(|i| i + start)
        .unwrap_or(start)
}

fn inline_body(b: &Body) -> Option<String> {
    if b.props.is_empty() {
        return Some("{}".to_string());
    }
    if b.props.iter().any(|p| p.body.is_some()) || b.props.len() > 4 {
        return None;
    }
    let parts: Vec<String> = b.props.iter().map(property_head).collect();
    // `labels { region = "eu", tier = "prod" }` reads better with commas
    let all_assign = b
        .props
        .iter()
        .all(|p| matches!(p.args, PropArgs::Assign(_)));
    let sep = if all_assign { ", " } else { " " };
    Some(format!("{{ {} }}", parts.join(sep)))
}

/// The grammar's flags (`flag` in `grammar/kiln.pest`): keys that never
/// take a value, so a word after one starts the next property.
const FLAGS: &[&str] = &[
    "preemptible",
    "backfill_only",
    "may_starve",
    "prefix_affinity",
    "exact_cache",
];

fn property_head(p: &Property) -> String {
    let mut s = p.key.name.clone();
    match &p.args {
        // Any other bare key would take the next word as its value when
        // re-read (`varian, t fp16` is two properties, `varian t fp16` one):
        // its comma is kept, so formatting never changes what parses.
        PropArgs::None if p.body.is_none() && !FLAGS.contains(&p.key.name.as_str()) => {
            s.push(',');
        }
        PropArgs::None => {}
        PropArgs::Assign(v) => {
            s.push_str(" = ");
            s.push_str(&value(v));
        }
        PropArgs::Values(vs) => {
            for v in vs {
                s.push(' ');
                s.push_str(&value(v));
            }
        }
    }
    s
}

pub fn name_set(n: &NameSet) -> String {
    let names: Vec<&str> = n.names.iter().map(|i| i.name.as_str()).collect();
    if n.bracketed || names.len() != 1 {
        format!("[{}]", names.join(", "))
    } else {
        names.join("")
    }
}

pub fn rule(r: &Rule) -> String {
    match &r.cond {
        Some(c) => format!("when {} => {}", expr(c), outcome(&r.outcome)),
        None => format!("default => {}", outcome(&r.outcome)),
    }
}

pub fn outcome(o: &Outcome) -> String {
    o.items
        .iter()
        .map(outcome_item)
        .collect::<Vec<_>>()
        .join(" ")
}

fn path(p: &[Ident]) -> String {
    p.iter()
        .map(|i| i.name.as_str())
        .collect::<Vec<_>>()
        .join(".")
}

fn outcome_item(i: &OutcomeItem) -> String {
    match i {
        OutcomeItem::Tier(t) => format!("tier {}", t.name),
        OutcomeItem::Tenant(t) => format!("tenant {}", t.name),
        OutcomeItem::Accept(_) => "accept".into(),
        OutcomeItem::Fallback(_) => "fallback".into(),
        OutcomeItem::Queue { max_wait, .. } => format!("queue {}", value(max_wait)),
        OutcomeItem::Delay { until, .. } => format!("delay until {}", value(until)),
        OutcomeItem::Hold { max_wait, .. } => match max_wait {
            Some(w) => format!("hold max_wait {}", value(w)),
            None => "hold".into(),
        },
        OutcomeItem::Degrade {
            variant,
            max_tokens,
            ..
        } => {
            let mut s = "degrade".to_string();
            if let Some(v) = variant {
                s.push_str(&format!(" variant {}", path(v)));
            }
            if let Some(m) = max_tokens {
                s.push_str(&format!(" max_tokens {}", value(m)));
            }
            s
        }
        OutcomeItem::Target { path: p, pool, .. } => match pool {
            Some(pool) => format!("{} on {}", path(p), pool.name),
            None => path(p),
        },
        OutcomeItem::Reject(r) => reject(r),
    }
}

fn reject(r: &RejectSpec) -> String {
    let mut s = format!("reject {}", r.status);
    if let Some(m) = &r.message {
        s.push_str(&format!(" \"{}\"", escape(m)));
    }
    if let Some(ra) = &r.retry_after {
        s.push_str(&format!(" retry_after {}", value(ra)));
    }
    s
}

pub fn step(s: &Step) -> String {
    match &s.kind {
        StepKind::Route { path: p, pool } => match pool {
            Some(pool) => format!("route {} on {}", path(p), pool.name),
            None => format!("route {}", path(p)),
        },
        StepKind::Queue(v) => format!("queue {}", value(v)),
        StepKind::Demote(t) => format!("demote {}", t.name),
        StepKind::Reject(r) => reject(r),
    }
}

pub fn expr(e: &Expr) -> String {
    match &e.kind {
        ExprKind::Or(parts) => parts.iter().map(expr).collect::<Vec<_>>().join(" or "),
        ExprKind::And(parts) => parts.iter().map(expr).collect::<Vec<_>>().join(" and "),
        ExprKind::Not(inner) => format!("not {}", expr(inner)),
        ExprKind::Paren(inner) => format!("({})", expr(inner)),
        ExprKind::Cmp { lhs, op, rhs } => {
            format!("{} {} {}", operand(lhs), op.symbol(), operand(rhs))
        }
        ExprKind::In { lhs, set } => format!("{} in {}", operand(lhs), value(set)),
        ExprKind::Truth(o) => operand(o),
    }
}

pub fn operand(o: &Operand) -> String {
    match o {
        Operand::Lit(v) => value(v),
        Operand::Ref(r) => {
            let mut s = r.base.name.clone();
            match &r.arg {
                Some(CallArg::Str(a, _)) => s.push_str(&format!("(\"{}\")", escape(a))),
                Some(CallArg::Name(n)) => s.push_str(&format!("({})", n.name)),
                None => {}
            }
            for f in &r.fields {
                s.push('.');
                s.push_str(&f.name);
            }
            s
        }
    }
}

pub fn value(v: &Value) -> String {
    match &v.kind {
        ValueKind::Quantity(q) => q.raw.clone(),
        ValueKind::Str(s) => format!("\"{}\"", escape(s)),
        ValueKind::Bool(b) => b.to_string(),
        ValueKind::TimeOfDay(c) => format!("{:02}:{:02}", c.hour, c.minute),
        ValueKind::Date(d) => format!("{:04}-{:02}-{:02}", d.year, d.month, d.day),
        ValueKind::Path(p) => path(p),
        ValueKind::List(items) => format!(
            "[{}]",
            items.iter().map(value).collect::<Vec<_>>().join(", ")
        ),
        ValueKind::Range(a, b) => format!("{}..{}", value(a), value(b)),
    }
}
