//! Typed conditions and their evaluation. Each test compares one signal with
//! a constant resolved at compile time, so evaluation does no name lookups
//! and allocates nothing unless a trace is asked for.

use super::input::{Request, Signals};
use super::signal::{PoolField, TenantField, TierField};
use super::trace::Tracer;
use super::{ModelId, PoolId, TenantId, TierId};
use crate::units::{show, CmpOp, Ty};

/// What a test reads.
#[derive(Debug, Clone, PartialEq)]
pub enum Sig {
    Tenant,
    ApiKey,
    Model,
    Tier,
    Session,
    HasSession,
    /// The request came through the Batches API (its `x-kiln-batch`
    /// header is non-empty).
    Batch,
    PromptTokens,
    MaxTokens,
    Header(String),
    Tag(String),
    QuotaRemaining,
    /// The tighter of the tenant's and the tier's money budgets, % left.
    BudgetRemaining,
    EstimatedWait,
    TimeOfDay,
    Weekday,
    /// The date in the policy's zone (days since 1970-01-01).
    Date,
    /// The day of the month in the policy's zone.
    Day,
    /// Measured by the scheduler ([`super::signal`]).
    Pool(PoolId, PoolField),
    TierLive(TierId, TierField),
    TenantLive(TenantId, TenantField),
    ErrorRate,
}

impl Sig {
    pub fn ty(&self) -> Ty {
        match self {
            Sig::Tenant => Ty::Tenant,
            Sig::Model => Ty::Model,
            Sig::Tier => Ty::Tier,
            Sig::ApiKey | Sig::Session | Sig::Header(_) => Ty::Str,
            Sig::HasSession | Sig::Batch | Sig::Tag(_) => Ty::Bool,
            Sig::PromptTokens | Sig::MaxTokens => Ty::Count,
            Sig::QuotaRemaining | Sig::BudgetRemaining | Sig::ErrorRate => Ty::Percent,
            Sig::EstimatedWait => Ty::Duration,
            Sig::Pool(_, f) => f.doc().ty,
            Sig::TierLive(_, f) => f.doc().ty,
            Sig::TenantLive(_, f) => f.doc().ty,
            Sig::TimeOfDay => Ty::TimeOfDay,
            Sig::Weekday => Ty::Weekday,
            Sig::Date => Ty::Date,
            Sig::Day => Ty::DayOfMonth,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum TestOp {
    /// Equality on a dense id (tenant, model, tier, weekday).
    IdIn(Vec<u32>),
    StrIn(Vec<String>),
    Num(CmpOp, f64),
    /// Inclusive lower, exclusive upper; a time range may wrap midnight.
    Range(f64, f64),
    Truthy,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Test {
    pub sig: Sig,
    pub op: TestOp,
    pub negate: bool,
    /// The condition as written, for traces.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Cond {
    True,
    Test(Box<Test>),
    Not(Box<Cond>),
    And(Vec<Cond>),
    Or(Vec<Cond>),
}

/// The request as the evaluator sees it: names resolved to ids.
pub struct Ctx<'r> {
    pub req: &'r Request,
    pub tenant: Option<TenantId>,
    pub model: Option<ModelId>,
    pub tier: Option<TierId>,
    pub signals: &'r Signals,
}

enum Val<'a> {
    Id(Option<u32>),
    Str(Option<&'a str>),
    Num(f64),
    Bool(bool),
}

impl Cond {
    /// The tenants this condition can match, when it requires the tenant to
    /// be one of a fixed set at its top level.
    pub fn pinned_tenants(&self) -> Option<&[u32]> {
        match self {
            Cond::Test(t) if t.sig == Sig::Tenant && !t.negate => match &t.op {
                TestOp::IdIn(ids) => Some(ids),
                _ => None,
            },
            Cond::And(cs) => cs.iter().find_map(Cond::pinned_tenants),
            _ => None,
        }
    }

    /// The request headers this condition reads (`header("…")`), as
    /// written, appended to `out`.
    pub fn headers_read<'a>(&'a self, out: &mut Vec<&'a str>) {
        match self {
            Cond::True => {}
            Cond::Test(t) => match &t.sig {
                Sig::Header(h) => out.push(h),
                Sig::Batch => out.push(super::input::BATCH_HEADER),
                _ => {}
            },
            Cond::Not(c) => c.headers_read(out),
            Cond::And(cs) | Cond::Or(cs) => cs.iter().for_each(|c| c.headers_read(out)),
        }
    }

    /// Whether any test in this condition satisfies `f`.
    pub fn any_test(&self, f: &impl Fn(&Test) -> bool) -> bool {
        match self {
            Cond::True => false,
            Cond::Test(t) => f(t),
            Cond::Not(c) => c.any_test(f),
            Cond::And(cs) | Cond::Or(cs) => cs.iter().any(|c| c.any_test(f)),
        }
    }

    /// Evaluates a condition that reads only live signals (a rollout's
    /// rollback conditions), with no request.
    pub fn eval_signals<T: Tracer>(&self, signals: &Signals, t: &mut T) -> bool {
        let req = Request::default();
        let cx = Ctx {
            req: &req,
            tenant: None,
            model: None,
            tier: None,
            signals,
        };
        self.eval(&cx, t)
    }

    pub fn eval<T: Tracer>(&self, cx: &Ctx, t: &mut T) -> bool {
        match self {
            Cond::True => true,
            Cond::Test(test) => test.eval(cx, t),
            Cond::Not(c) => !c.eval(cx, t),
            Cond::And(cs) => cs.iter().all(|c| c.eval(cx, t)),
            Cond::Or(cs) => cs.iter().any(|c| c.eval(cx, t)),
        }
    }
}

impl Test {
    fn read<'a>(&self, cx: &Ctx<'a>) -> Val<'a> {
        let s = cx.signals;
        match &self.sig {
            Sig::Tenant => Val::Id(cx.tenant),
            Sig::Model => Val::Id(cx.model.map(u32::from)),
            Sig::Tier => Val::Id(cx.tier.map(u32::from)),
            Sig::ApiKey => Val::Str(cx.req.api_key.as_deref()),
            Sig::Session => Val::Str(cx.req.session.as_deref()),
            Sig::HasSession => Val::Bool(cx.req.session.as_deref().is_some_and(|s| !s.is_empty())),
            Sig::Batch => Val::Bool(cx.req.batch().is_some()),
            Sig::PromptTokens => Val::Num(cx.req.prompt_tokens as f64),
            Sig::MaxTokens => Val::Num(cx.req.max_tokens as f64),
            Sig::Header(h) => Val::Str(cx.req.header(h)),
            Sig::Tag(tag) => Val::Bool(cx.req.tags.iter().any(|x| x == tag)),
            Sig::QuotaRemaining => Val::Num(s.quota_remaining(cx.tenant)),
            Sig::BudgetRemaining => Val::Num(s.budget_remaining(cx.tenant, cx.tier)),
            Sig::EstimatedWait => Val::Num(s.estimated_wait),
            Sig::TimeOfDay => Val::Num(f64::from(s.time_of_day)),
            Sig::Weekday => Val::Id(Some(u32::from(s.weekday))),
            Sig::Date => Val::Num(f64::from(s.date)),
            Sig::Day => Val::Num(f64::from(s.day)),
            Sig::Pool(p, f) => Val::Num(s.pool(*p, *f)),
            Sig::TierLive(t, f) => Val::Num(s.tier(*t, *f)),
            Sig::TenantLive(t, f) => Val::Num(s.tenant(*t, *f)),
            Sig::ErrorRate => Val::Num(s.error_rate),
        }
    }

    pub fn eval<T: Tracer>(&self, cx: &Ctx, t: &mut T) -> bool {
        let v = self.read(cx);
        let r = match (&self.op, &v) {
            (TestOp::IdIn(ids), Val::Id(Some(x))) => ids.contains(x),
            (TestOp::IdIn(_), Val::Id(None)) => false,
            (TestOp::StrIn(ss), Val::Str(Some(x))) => ss.iter().any(|s| s == x),
            (TestOp::StrIn(_), Val::Str(None)) => false,
            (TestOp::Num(op, k), Val::Num(x)) => match op {
                CmpOp::Eq => x == k,
                CmpOp::Ne => x != k,
                CmpOp::Lt => x < k,
                CmpOp::Le => x <= k,
                CmpOp::Gt => x > k,
                CmpOp::Ge => x >= k,
            },
            (TestOp::Range(lo, hi), Val::Num(x)) => {
                if lo <= hi {
                    x >= lo && x < hi
                } else {
                    x >= lo || x < hi
                }
            }
            (TestOp::Truthy, Val::Bool(b)) => *b,
            _ => false,
        };
        let r = r != self.negate;
        if t.enabled() {
            t.test(&self.text, self.observed(cx, &v), r);
        }
        r
    }

    fn observed(&self, cx: &Ctx, v: &Val) -> String {
        let ty = self.sig.ty();
        match v {
            Val::Id(None) | Val::Str(None) => "absent".to_string(),
            Val::Id(Some(id)) => match self.sig {
                Sig::Weekday => show(Ty::Weekday, f64::from(*id)),
                _ => cx.signals.name_of(ty, *id),
            },
            Val::Str(Some(s)) => format!("\"{s}\""),
            Val::Num(x) => show(ty, *x),
            Val::Bool(b) => b.to_string(),
        }
    }
}
