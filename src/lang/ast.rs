//! The abstract syntax tree. Every node carries the [`Span`] it came from.
//! The AST is what the user wrote, nothing resolved: names are strings and
//! quantities keep their literal text so `kiln fmt` can print them back.

use crate::source::Span;

#[derive(Debug, Clone, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// One parsed file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct File {
    pub items: Vec<Item>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Decl(Decl),
    Classify(Classify),
    Route(Route),
    Admit(Admit),
    Fallback(Fallback),
    Rollout(Rollout),
    Approval(Approval),
    /// `policy { timezone "…" }`: the policy's own settings.
    Settings(Settings),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub body: Body,
    pub span: Span,
}

impl Item {
    pub fn span(&self) -> Span {
        match self {
            Item::Decl(d) => d.span,
            Item::Classify(c) => c.span,
            Item::Route(r) => r.span,
            Item::Admit(a) => a.span,
            Item::Fallback(f) => f.span,
            Item::Rollout(r) => r.span,
            Item::Approval(a) => a.span,
            Item::Settings(s) => s.span,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeclKind {
    Pool,
    Model,
    Tier,
    Tenant,
    Cohort,
    /// `exception NAME { … }`: a time-boxed grant to a tier or tenant.
    Exception,
}

impl DeclKind {
    pub fn keyword(self) -> &'static str {
        match self {
            DeclKind::Pool => "pool",
            DeclKind::Model => "model",
            DeclKind::Tier => "tier",
            DeclKind::Tenant => "tenant",
            DeclKind::Cohort => "cohort",
            DeclKind::Exception => "exception",
        }
    }
}

/// `pool h100 { … }`, `tier batch { … }` and friends.
#[derive(Debug, Clone, PartialEq)]
pub struct Decl {
    pub kind: DeclKind,
    pub name: Ident,
    pub body: Body,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Body {
    pub props: Vec<Property>,
    pub span: Span,
}

/// `key value…`, `key = value`, a flag, each with an optional nested body.
#[derive(Debug, Clone, PartialEq)]
pub struct Property {
    pub key: Ident,
    pub args: PropArgs,
    pub body: Option<Body>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PropArgs {
    /// A flag (`preemptible`) or a key followed only by a body (`slo { … }`).
    None,
    Assign(Value),
    Values(Vec<Value>),
}

impl PropArgs {
    pub fn values(&self) -> &[Value] {
        match self {
            PropArgs::None => &[],
            PropArgs::Assign(v) => std::slice::from_ref(v),
            PropArgs::Values(v) => v,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    pub kind: ValueKind,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ValueKind {
    Quantity(Quantity),
    Str(String),
    Bool(bool),
    /// `HH:MM` as written; [`Clock::minutes`] checks it is a real time.
    TimeOfDay(Clock),
    /// `YYYY-MM-DD` as written; the compiler checks it is a real day.
    Date(CivilDate),
    /// `name` or `model.variant`.
    Path(Vec<Ident>),
    List(Vec<Value>),
    Range(Box<Value>, Box<Value>),
}

/// A date as written (`2026-12-28`), not yet checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilDate {
    pub year: u16,
    pub month: u8,
    pub day: u8,
}

/// A time of day as written (`09:30`): two digits each, not yet checked,
/// so that the compiler can point at `25:00` or `09:75` instead of the
/// parser failing with "expected …".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    pub hour: u8,
    pub minute: u8,
}

impl Clock {
    /// Minutes after midnight; `None` past `23:59` (hours 00–23, minutes 00–59).
    pub fn minutes(self) -> Option<u16> {
        (self.hour < 24 && self.minute < 60)
            .then(|| u16::from(self.hour) * 60 + u16::from(self.minute))
    }

    /// `24:00`: the end of the day, allowed only as the end of a range.
    pub fn is_end_of_day(self) -> bool {
        self.hour == 24 && self.minute == 0
    }
}

/// A number with its unit, exactly as written: `500ms`, `2M/min`, `80GB`.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantity {
    pub raw: String,
    pub number: f64,
    pub multiplier: Option<char>,
    pub unit: Option<String>,
    pub per: Option<String>,
}

// ---------------------------------------------------------------- rules

/// `[a, b]` or `a`: the tiers a route/admit/fallback block applies to.
#[derive(Debug, Clone, PartialEq)]
pub struct NameSet {
    pub names: Vec<Ident>,
    pub bracketed: bool,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RuleBlock {
    pub rules: Vec<Rule>,
    pub span: Span,
}

/// `when COND => OUTCOME` or, with no condition, `default => OUTCOME`.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub cond: Option<Expr>,
    pub outcome: Outcome,
    /// The `when …` or `default` head, where diagnostics about the rule point.
    pub head: Span,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub items: Vec<OutcomeItem>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum OutcomeItem {
    Tier(Ident),
    Tenant(Ident),
    Accept(Span),
    Fallback(Span),
    Queue {
        max_wait: Value,
        span: Span,
    },
    Delay {
        until: Value,
        span: Span,
    },
    /// `hold [max_wait D]`.
    Hold {
        max_wait: Option<Value>,
        span: Span,
    },
    Degrade {
        variant: Option<Vec<Ident>>,
        max_tokens: Option<Value>,
        span: Span,
    },
    Target {
        path: Vec<Ident>,
        pool: Option<Ident>,
        span: Span,
    },
    Reject(RejectSpec),
}

impl OutcomeItem {
    pub fn span(&self) -> Span {
        match self {
            OutcomeItem::Tier(i) | OutcomeItem::Tenant(i) => i.span,
            OutcomeItem::Accept(s) | OutcomeItem::Fallback(s) => *s,
            OutcomeItem::Queue { span, .. }
            | OutcomeItem::Delay { span, .. }
            | OutcomeItem::Hold { span, .. }
            | OutcomeItem::Degrade { span, .. }
            | OutcomeItem::Target { span, .. } => *span,
            OutcomeItem::Reject(r) => r.span,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RejectSpec {
    pub status: u16,
    pub status_span: Span,
    pub message: Option<String>,
    pub retry_after: Option<Value>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Classify {
    pub rules: RuleBlock,
    pub span: Span,
}

/// `route TIERS MODEL { rules }`: how requests of those tiers for that model
/// pick a variant and pool.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub tiers: NameSet,
    pub model: Ident,
    pub rules: RuleBlock,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Admit {
    pub tiers: NameSet,
    pub rules: RuleBlock,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Fallback {
    pub tiers: NameSet,
    pub steps: Vec<Step>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub kind: StepKind,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StepKind {
    Route {
        path: Vec<Ident>,
        pool: Option<Ident>,
    },
    Queue(Value),
    Demote(Ident),
    Reject(RejectSpec),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    pub items: Vec<RolloutItem>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RolloutItem {
    Prop(Property),
    Rollback {
        cond: Expr,
        hold: Option<Value>,
        span: Span,
    },
    Stage(Stage),
}

impl RolloutItem {
    pub fn span(&self) -> Span {
        match self {
            RolloutItem::Prop(p) => p.span,
            RolloutItem::Rollback { span, .. } => *span,
            RolloutItem::Stage(s) => s.span,
        }
    }
}

/// `stage pilot { tenants [a] duration 30m gate when COND for 5m }`
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    pub name: Ident,
    pub items: Vec<StageItem>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StageItem {
    Prop(Property),
    Gate {
        cond: Expr,
        hold: Option<Value>,
        span: Span,
    },
}

impl StageItem {
    pub fn span(&self) -> Span {
        match self {
            StageItem::Prop(p) => p.span,
            StageItem::Gate { span, .. } => *span,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Approval {
    pub rules: Vec<Require>,
    pub span: Span,
}

/// `require 2 from "platform-leads" for [priority_increase]`
#[derive(Debug, Clone, PartialEq)]
pub struct Require {
    /// `require owner for [...]`: the owners of what the change touches
    /// (then `count` is 1 and `group` empty).
    pub owner: bool,
    pub count: u32,
    pub count_span: Span,
    pub group: String,
    pub group_span: Span,
    pub kinds: NameSet,
    pub span: Span,
}

// ---------------------------------------------------------------- expressions

#[derive(Debug, Clone, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

/// Comparison operators are shared with the graph, which evaluates them.
pub use crate::units::CmpOp;

#[derive(Debug, Clone, PartialEq)]
pub enum ExprKind {
    Or(Vec<Expr>),
    And(Vec<Expr>),
    Not(Box<Expr>),
    /// Kept so the formatter prints the user's grouping back.
    Paren(Box<Expr>),
    Cmp {
        lhs: Operand,
        op: CmpOp,
        rhs: Operand,
    },
    In {
        lhs: Operand,
        set: Value,
    },
    /// A boolean signal on its own: `has_session`, `tag("nightly")`.
    Truth(Operand),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Ref(Reference),
    Lit(Value),
}

impl Operand {
    pub fn span(&self) -> Span {
        match self {
            Operand::Ref(r) => r.span,
            Operand::Lit(v) => v.span,
        }
    }
}

/// `tenant`, `header("x")`, `pool(h100).utilization`, or a bare name.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub base: Ident,
    pub arg: Option<CallArg>,
    pub fields: Vec<Ident>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum CallArg {
    Str(String, Span),
    Name(Ident),
}
