//! Lowering declarations (pool, model/variant, tier, tenant, cohort, rollout,
//! approval) against their field schemas, with units checked.

use super::units::{self, Ty};
use super::Compiler;
use crate::diag::{suggest, Code, Diagnostic};
use crate::graph::limits;
use crate::graph::*;
use crate::lang::ast::{self, Body, DeclKind, Item, PropArgs, Property, Value, ValueKind};
use crate::lang::format;
use crate::source::FileId;
use std::collections::BTreeMap;

mod exception;
pub use exception::MAX_EXCEPTION_DAYS;

const POOL_FIELDS: &[&str] = &[
    "gpus",
    "kind",
    "memory",
    "labels",
    "allow_tiers",
    "deny_tiers",
    "allow_tenants",
    "deny_tenants",
    "signal_window",
    "description",
    "price",
    "owner",
    "escalation",
];
const MODEL_FIELDS: &[&str] = &[
    "variant",
    "description",
    "params",
    "kv_per_token",
    "served_by",
    "quota",
    "value",
];
const VARIANT_FIELDS: &[&str] = &[
    "precision",
    "memory",
    "gpus_per_replica",
    "max_batch",
    "max_batch_tokens",
    "pools",
    "quality",
];
const TIER_FIELDS: &[&str] = &[
    "priority",
    "slo",
    "batch",
    "preemptible",
    "preempts",
    "backfill_only",
    "aging",
    "may_starve",
    "models",
    "prefix_affinity",
    "exact_cache",
    "cache",
    "signal_window",
    "on_preempt",
    "reserve",
    "fair_share",
    "quota",
    "completion_windows",
    "budget",
    "description",
    "owner",
    "escalation",
];
const FAIR_SHARE_FIELDS: &[&str] = &["window"];
const CACHE_FIELDS: &[&str] = &["exact", "semantic"];
const EXACT_CACHE_FIELDS: &[&str] = &["entries", "ttl", "shared"];
const SEMANTIC_CACHE_FIELDS: &[&str] = &["similarity", "entries", "ttl", "shared"];
const SLO_FIELDS: &[&str] = &[
    "ttft",
    "p95",
    "window",
    "error_rate",
    "throughput",
    "deadline",
];
const THROUGHPUT_FIELDS: &[&str] = &["tokens", "requests"];
const BATCH_FIELDS: &[&str] = &["max_wait"];
const TENANT_FIELDS: &[&str] = &[
    "owner",
    "escalation",
    "tiers",
    "cohort",
    "quota",
    "weight",
    "borrow",
    "lend",
    "retry_budget",
    "session_steps",
    "cost",
    "budget",
    "api_keys",
    "signal_window",
    "description",
];
const QUOTA_FIELDS: &[&str] = &["tokens", "requests", "concurrent", "gpu_seconds"];
const COHORT_FIELDS: &[&str] = &["owner", "escalation", "description"];
const ROLLOUT_FIELDS: &[&str] = &["shadow", "canary"];
const SETTINGS_FIELDS: &[&str] = &["timezone", "owner", "escalation"];
const CANARY_FIELDS: &[&str] = &["share", "tenants", "duration"];
const STAGE_FIELDS: &[&str] = &["share", "tenants", "tiers", "models", "duration"];

/// One cache block's settings, checked.
struct CacheSettings {
    entries: u32,
    ttl_us: u64,
    shared: bool,
    fields_similarity: Option<f32>,
    /// `similarity` was written (valid or not).
    similarity_seen: bool,
}

/// Fields of one block, checked against its schema.
pub(crate) struct Fields<'a> {
    what: String,
    map: BTreeMap<&'a str, &'a Property>,
    repeated: Vec<&'a Property>,
}

impl<'a> Fields<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Property> {
        self.map.get(key).copied()
    }
}

impl Compiler<'_> {
    pub(crate) fn fields<'a>(
        &mut self,
        body: &'a Body,
        allowed: &[&str],
        what: &str,
        repeatable: &[&str],
    ) -> Fields<'a> {
        let mut f = Fields {
            what: what.to_string(),
            map: BTreeMap::new(),
            repeated: Vec::new(),
        };
        for p in &body.props {
            let k = p.key.name.as_str();
            if !allowed.contains(&k) {
                let help = suggest(k, allowed.iter().copied())
                    .unwrap_or_else(|| format!("{what} accepts: {}", allowed.join(", ")));
                self.err(
                    Diagnostic::error(Code::UnknownField, format!("{what} has no field `{k}`"))
                        .at(p.key.span, "unknown field")
                        .help(help),
                );
                continue;
            }
            if repeatable.contains(&k) {
                f.repeated.push(p);
                continue;
            }
            if let Some(first) = f.map.get(k) {
                let first_span = first.key.span;
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("`{k}` is set twice in {what}"),
                    )
                    .at(p.key.span, "set again here")
                    .also(first_span, "first set here")
                    .help("keep one of them"),
                );
                continue;
            }
            f.map.insert(k, p);
        }
        f
    }

    fn require<'a>(
        &mut self,
        f: &Fields<'a>,
        key: &str,
        at: &ast::Ident,
        example: &str,
    ) -> Option<&'a Property> {
        let p = f.get(key);
        if p.is_none() {
            self.err(
                Diagnostic::error(Code::MissingField, format!("{} needs `{key}`", f.what))
                    .at(at.span, format!("`{key}` is missing"))
                    .help(format!("add `{key} {example}`")),
            );
        }
        p
    }

    /// The single value of a property, or a diagnostic.
    fn one<'a>(&mut self, p: &'a Property, expect: &str) -> Option<&'a Value> {
        match p.args.values() {
            [v] if p.body.is_none() => Some(v),
            _ => {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!("`{}` takes one value", p.key.name),
                    )
                    .at(p.span, format!("expected {expect}"))
                    .help(format!("write `{} {expect}`", p.key.name)),
                );
                None
            }
        }
    }

    /// A quantity of one type, in base units, within its type's range.
    pub(crate) fn quantity(&mut self, v: &Value, ty: Ty, what: &str) -> Option<f64> {
        let x = self.quantity_of_type(v, ty, what)?;
        self.in_type_range(v, x, ty, what)
    }

    /// A quantity of one type, in base units, its range not yet checked.
    fn quantity_of_type(&mut self, v: &Value, ty: Ty, what: &str) -> Option<f64> {
        match units::literal(v) {
            Some(Ok(t)) if t.ty == ty => Some(t.value),
            Some(Ok(t)) => {
                self.err(
                    Diagnostic::error(
                        Code::UnitMismatch,
                        format!(
                            "{what} is {}, found {} `{}`",
                            ty.describe(),
                            ty_article(t.ty),
                            format::value(v)
                        ),
                    )
                    .at(v.span, format!("this is {}", ty_article(t.ty)))
                    .help(
                        units::missing_unit(ty, v)
                            .unwrap_or_else(|| format!("write {what} as {}", ty.describe())),
                    ),
                );
                None
            }
            Some(Err(e)) => {
                if let Some(d) = units::bad_time(v) {
                    self.err(d);
                    return None;
                }
                self.err(
                    Diagnostic::error(Code::InvalidValue, format!("{what}: {}", e.0))
                        .at(v.span, "not a valid quantity")
                        .help(format!("write {what} as {}", ty.describe())),
                );
                None
            }
            None => {
                self.err(
                    Diagnostic::error(
                        Code::UnitMismatch,
                        format!("{what} is {}, found `{}`", ty.describe(), format::value(v)),
                    )
                    .at(v.span, format!("expected {}", ty.short()))
                    .help(format!("write {what} as {}", ty.describe())),
                );
                None
            }
        }
    }

    /// Every quantity of type `ty` is at most its type's limit
    /// ([`limits`]); a larger one is reported (`out-of-range`) and dropped.
    pub(crate) fn in_type_range(
        &mut self,
        v: &Value,
        value: f64,
        ty: Ty,
        what: &str,
    ) -> Option<f64> {
        let (max, shown) = match ty {
            Ty::Count => (limits::MAX_COUNT, "10^15".to_string()),
            Ty::Duration => (limits::MAX_DURATION_MS, "366 days (`366d`)".to_string()),
            Ty::Size => (limits::MAX_SIZE_BYTES, "1 PB (`1000TB`)".to_string()),
            Ty::Rate => (limits::MAX_RATE_PER_S, "10^12 a second".to_string()),
            Ty::Percent => (limits::MAX_PERCENT, "100%".to_string()),
            _ => return Some(value),
        };
        if value.is_finite() && (0.0..=max).contains(&value) {
            return Some(value);
        }
        if ty == Ty::Percent {
            // Every percentage kiln reads is a share of a whole.
            self.err(
                Diagnostic::error(Code::OutOfRange, format!("{what} is above 100%"))
                    .at(v.span, "a share is at most 100%")
                    .help(format!("write {what} as a percentage from 0% to 100%")),
            );
            return None;
        }
        self.out_of_range(v.span, what, &format!("{what} is at most {shown}"));
        None
    }

    /// Reports a number outside its field's range; `limit` is the help line.
    pub(crate) fn out_of_range(&mut self, span: crate::source::Span, what: &str, limit: &str) {
        self.err(
            Diagnostic::error(Code::OutOfRange, format!("{what} is out of range"))
                .at(span, "too large")
                .help(format!(
                    "{limit}: kiln's limits keep every allocation a policy causes small"
                )),
        );
    }

    /// A quantity of `ty` at most `max` (a field's own limit, below its
    /// type's); `Err` when it was reported out of range.
    fn prop_bounded(
        &mut self,
        p: Option<&Property>,
        ty: Ty,
        what: &str,
        max: f64,
        limit: &str,
    ) -> Result<Option<f64>, ()> {
        let Some(p) = p else { return Ok(None) };
        let Some(v) = self.one(p, ty.short()) else {
            return Ok(None);
        };
        let Some(x) = self.quantity_of_type(v, ty, what) else {
            return Ok(None);
        };
        if !x.is_finite() || x > max {
            self.out_of_range(v.span, what, limit);
            return Err(());
        }
        Ok(Some(x))
    }

    /// `signal_window 5m`: the sliding window of the entity's measured
    /// signals, from 1s to 1d.
    fn signal_window(&mut self, p: Option<&Property>) -> f64 {
        let Some(p) = p else {
            return crate::graph::signal::DEFAULT_WINDOW_MS;
        };
        let Some(v) = self.one(p, "duration") else {
            return crate::graph::signal::DEFAULT_WINDOW_MS;
        };
        match self.quantity_of_type(v, Ty::Duration, "`signal_window`") {
            Some(x)
                if (limits::MIN_SIGNAL_WINDOW_MS..=limits::MAX_SIGNAL_WINDOW_MS).contains(&x) =>
            {
                x
            }
            Some(x) if x < limits::MIN_SIGNAL_WINDOW_MS => {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "`signal_window` is shorter than 1s")
                        .at(v.span, "too short")
                        .help("a window slides in sixteenths of itself; below 1s a rate rests on too few requests to act on. Write 1s or more"),
                );
                crate::graph::signal::DEFAULT_WINDOW_MS
            }
            Some(_) => {
                self.out_of_range(
                    v.span,
                    "`signal_window`",
                    "`signal_window` is from 1s to 1d",
                );
                crate::graph::signal::DEFAULT_WINDOW_MS
            }
            None => crate::graph::signal::DEFAULT_WINDOW_MS,
        }
    }

    fn prop_quantity(&mut self, p: Option<&Property>, ty: Ty, what: &str) -> Option<f64> {
        let p = p?;
        let v = self.one(p, ty.short())?;
        self.quantity(v, ty, what)
    }

    /// A whole number of at least 1 (batch sizes, GPU counts).
    fn positive_count(&mut self, p: Option<&Property>, what: &str, max: u32) -> Option<u32> {
        let v = self
            .prop_bounded(
                p,
                Ty::Count,
                what,
                f64::from(max),
                &format!("{what} is at most {max}"),
            )
            .ok()
            .flatten()?;
        if v < 1.0 || v.fract() != 0.0 {
            if let Some(p) = p {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!("{what} is a whole number, at least 1"),
                    )
                    .at(p.span, "not a positive whole number")
                    .help(format!("write {what} as a count like `256`")),
                );
            }
            return None;
        }
        Some(v as u32)
    }

    fn prop_percent(&mut self, p: Option<&Property>, what: &str) -> Option<f64> {
        let v = self.prop_quantity(p, Ty::Percent, what)?;
        if !(0.0..=100.0).contains(&v) {
            if let Some(p) = p {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!("{what} must be between 0% and 100%"),
                    )
                    .at(p.span, "out of range")
                    .help("write a percentage from 0% to 100%"),
                );
            }
            return None;
        }
        Some(v)
    }

    fn prop_string(&mut self, p: Option<&Property>) -> Option<String> {
        let p = p?;
        let v = self.one(p, "\"text\"")?;
        match &v.kind {
            ValueKind::Str(s) => Some(s.clone()),
            _ => {
                self.err(
                    Diagnostic::error(Code::UnitMismatch, format!("`{}` is a string", p.key.name))
                        .at(v.span, "expected a string")
                        .help(format!(
                            "quote it: `{} \"{}\"`",
                            p.key.name,
                            format::value(v)
                        )),
                );
                None
            }
        }
    }

    /// `owner "team"` and `escalation "contact"` of a block: each a
    /// non-empty string, and an escalation contact only beside an owner.
    fn owner(&mut self, f: &Fields, what: &str) -> Owner {
        let one = |c: &mut Self, key: &str| {
            let p = f.get(key)?;
            let s = c.prop_string(Some(p))?;
            if s.trim().is_empty() {
                c.err(
                    Diagnostic::error(Code::InvalidValue, format!("the `{key}` of {what} is empty"))
                        .at(p.span, "empty")
                        .help(format!(
                            "name a team, group or person, like `{key} \"ml-platform\"`; an approval rule `require owner` counts an approver of that name or group"
                        )),
                );
                return None;
            }
            Some(s)
        };
        let owner = one(self, "owner");
        let escalation = one(self, "escalation");
        if let (None, Some(p)) = (&owner, f.get("escalation")) {
            if f.get("owner").is_none() {
                self.err(
                    Diagnostic::error(
                        Code::MissingField,
                        format!("{what} has an escalation contact but no owner"),
                    )
                    .at(p.span, "escalation without an owner")
                    .help("add `owner \"team\"` beside it: the escalation contact is whom to call when the owner does not answer"),
                );
            }
        }
        Owner { owner, escalation }
    }

    /// `[a, b]` or a single name, each resolved to a definition of `kind`.
    fn prop_names(&mut self, p: Option<&Property>, kind: DeclKind) -> Vec<u32> {
        let Some(p) = p else { return Vec::new() };
        let items: Vec<&Value> = match p.args.values() {
            [v] => match &v.kind {
                ValueKind::List(items) => items.iter().collect(),
                _ => vec![v],
            },
            vs => vs.iter().collect(),
        };
        let mut out = Vec::new();
        for v in items {
            match &v.kind {
                ValueKind::Path(path) if path.len() == 1 => {
                    if let Some(id) = self.resolve(kind, &path[0]) {
                        if !out.contains(&id) {
                            out.push(id);
                        }
                    }
                }
                _ => self.err(
                    Diagnostic::error(
                        Code::UnitMismatch,
                        format!("`{}` lists {} names", p.key.name, kind.keyword()),
                    )
                    .at(v.span, format!("expected a {} name", kind.keyword()))
                    .help(format!("write `{} [name, …]`", p.key.name)),
                ),
            }
        }
        out
    }

    fn flag(&mut self, f: &Fields, key: &str) -> bool {
        match f.get(key) {
            Some(p) => {
                if !matches!(p.args, PropArgs::None) || p.body.is_some() {
                    self.err(
                        Diagnostic::error(
                            Code::InvalidValue,
                            format!("`{key}` is a flag and takes no value"),
                        )
                        .at(p.span, "remove the value")
                        .help(format!("write just `{key}`; leave it out to turn it off")),
                    );
                }
                true
            }
            None => false,
        }
    }

    fn sub_body<'a>(&mut self, p: Option<&'a Property>) -> Option<&'a Body> {
        let p = p?;
        match &p.body {
            Some(b) if p.args.values().is_empty() => Some(b),
            _ => {
                self.err(
                    Diagnostic::error(Code::InvalidValue, format!("`{}` is a block", p.key.name))
                        .at(p.span, "expected `{ … }`")
                        .help(format!("write `{} {{ … }}`", p.key.name)),
                );
                None
            }
        }
    }

    fn is_first(&self, d: &ast::Decl) -> bool {
        let t = match d.kind {
            DeclKind::Pool => &self.pools,
            DeclKind::Model => &self.models,
            DeclKind::Tier => &self.tiers,
            DeclKind::Tenant => &self.tenants,
            DeclKind::Cohort => &self.cohorts,
            DeclKind::Exception => &self.exceptions,
        };
        t.ids
            .get(&d.name.name)
            .is_some_and(|&i| t.spans[i as usize] == d.name.span)
    }

    pub(crate) fn lower_decls(&mut self, files: &[(FileId, ast::File)]) {
        let decls: Vec<&ast::Decl> = files
            .iter()
            .flat_map(|(_, f)| f.items.iter())
            .filter_map(|i| match i {
                Item::Decl(d) => Some(d),
                _ => None,
            })
            .collect();
        // Pools first: variants need their sizes. Then the rest in order.
        for kind in [
            DeclKind::Pool,
            DeclKind::Cohort,
            DeclKind::Tier,
            DeclKind::Model,
            DeclKind::Tenant,
            DeclKind::Exception,
        ] {
            for d in decls.iter().filter(|d| d.kind == kind) {
                if !self.is_first(d) {
                    continue;
                }
                match kind {
                    DeclKind::Pool => self.pool(d),
                    DeclKind::Cohort => self.cohort(d),
                    DeclKind::Tier => self.tier(d),
                    DeclKind::Model => self.model(d),
                    DeclKind::Tenant => self.tenant(d),
                    DeclKind::Exception => self.exception(d),
                }
            }
        }
        self.lower_substitutions();
        for (_, f) in files {
            for item in &f.items {
                match item {
                    Item::Rollout(r) => self.rollout(r),
                    Item::Approval(a) => self.approval(a),
                    Item::Settings(st) => self.settings(st),
                    _ => {}
                }
            }
        }
    }

    fn pool(&mut self, d: &ast::Decl) {
        let what = format!("pool `{}`", d.name.name);
        let f = self.fields(&d.body, POOL_FIELDS, &what, &[]);
        let gpus = self.require(&f, "gpus", &d.name, "8");
        let gpus = self
            .prop_bounded(
                gpus,
                Ty::Count,
                "`gpus`",
                f64::from(limits::MAX_POOL_GPUS),
                &format!(
                    "a pool has at most {} GPUs, and a policy {} over all its pools; split a larger fleet into pools",
                    limits::MAX_POOL_GPUS,
                    limits::MAX_TOTAL_GPUS
                ),
            );
        let too_many = gpus.is_err();
        let gpus = gpus.ok().flatten().unwrap_or(0.0);
        if !too_many && (gpus < 1.0 || gpus.fract() != 0.0) {
            if let Some(p) = f.get("gpus") {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        "a pool needs a whole number of GPUs, at least 1",
                    )
                    .at(p.span, "not a positive whole number")
                    .help("write `gpus 8`"),
                );
            }
        }
        let kind = self.require(&f, "kind", &d.name, "\"H100-80GB\"");
        let kind = self.prop_string(kind).unwrap_or_default();
        let mem = self.require(&f, "memory", &d.name, "80GB");
        let gpu_memory = self
            .prop_quantity(mem, Ty::Size, "`memory` (per GPU)")
            .unwrap_or(0.0);
        let mut labels = BTreeMap::new();
        if let Some(b) = self.sub_body(f.get("labels")) {
            for p in &b.props {
                match (p.args.values(), &p.body) {
                    ([v], None) => {
                        let text = match &v.kind {
                            ValueKind::Str(s) => s.clone(),
                            _ => format::value(v),
                        };
                        labels.insert(p.key.name.clone(), text);
                    }
                    _ => self.err(
                        Diagnostic::error(Code::InvalidValue, "a label is `key = \"value\"`")
                            .at(p.span, "not a label")
                            .help("write labels as `labels { region = \"eu\" }`"),
                    ),
                }
            }
        }
        let allow_tiers = f.get("allow_tiers").map(|p| {
            self.prop_names(Some(p), DeclKind::Tier)
                .into_iter()
                .map(|x| x as TierId)
                .collect()
        });
        let deny_tiers = self
            .prop_names(f.get("deny_tiers"), DeclKind::Tier)
            .into_iter()
            .map(|x| x as TierId)
            .collect();
        let allow_tenants = f
            .get("allow_tenants")
            .map(|p| self.prop_names(Some(p), DeclKind::Tenant));
        let deny_tenants = self.prop_names(f.get("deny_tenants"), DeclKind::Tenant);
        let mut gpus = gpus.max(0.0) as u32;
        let before: u32 = self.g.pools.iter().map(|p| p.gpus).sum();
        if before.saturating_add(gpus) > limits::MAX_TOTAL_GPUS {
            if let Some(p) = f.get("gpus") {
                self.out_of_range(
                    p.span,
                    &format!(
                        "the GPUs of all pools, {} with this one,",
                        before.saturating_add(gpus)
                    ),
                    &format!(
                        "a policy has at most {} GPUs over all its pools",
                        limits::MAX_TOTAL_GPUS
                    ),
                );
            }
            gpus = 0;
        }
        let signal_window = self.signal_window(f.get("signal_window"));
        let owner = self.owner(&f, &what);
        // `price 3.2/h` is currency per GPU-hour, like a tenant's `cost`.
        let price_per_gpu_hour = self
            .prop_quantity(
                f.get("price"),
                Ty::Rate,
                "`price` (per GPU-hour, like `3.2/h`)",
            )
            .map(|per_s| per_s * 3600.0);
        self.g.pools.push(Pool {
            name: d.name.name.clone(),
            gpus,
            kind,
            gpu_memory,
            labels,
            allow_tiers,
            deny_tiers,
            allow_tenants,
            deny_tenants,
            signal_window,
            price_per_gpu_hour,
            owner,
            span: d.name.span,
        });
    }

    fn cohort(&mut self, d: &ast::Decl) {
        let what = format!("cohort `{}`", d.name.name);
        let f = self.fields(&d.body, COHORT_FIELDS, &what, &[]);
        let Owner { owner, escalation } = self.owner(&f, &what);
        let _ = self.prop_string(f.get("description"));
        self.g.cohorts.push(Cohort {
            name: d.name.name.clone(),
            owner,
            escalation,
            span: d.name.span,
        });
    }

    fn tier(&mut self, d: &ast::Decl) {
        let what = format!("tier `{}`", d.name.name);
        let f = self.fields(&d.body, TIER_FIELDS, &what, &[]);
        let prio = self.require(&f, "priority", &d.name, "50");
        let priority = self
            .prop_bounded(
                prio,
                Ty::Count,
                "`priority`",
                limits::MAX_PRIORITY,
                "`priority` is from 0 to 1000000",
            )
            .ok()
            .flatten()
            .unwrap_or(0.0);
        let mut slo = Slo::default();
        if let Some(b) = self.sub_body(f.get("slo")) {
            let s = self.fields(b, SLO_FIELDS, &format!("the slo of {what}"), &[]);
            slo.ttft = self.prop_quantity(s.get("ttft"), Ty::Duration, "`ttft`");
            slo.e2e_p95 = self.prop_quantity(s.get("p95"), Ty::Duration, "`p95`");
            slo.window = self.prop_quantity(s.get("window"), Ty::Duration, "`window`");
            slo.error_rate = self.prop_percent(s.get("error_rate"), "`error_rate`");
            slo.throughput = self.throughput(s.get("throughput"), &what);
            slo.deadline = self.deadline(s.get("deadline"));
        }
        let mut batch_max_wait = None;
        if let Some(b) = self.sub_body(f.get("batch")) {
            let s = self.fields(
                b,
                BATCH_FIELDS,
                &format!("the batch settings of {what}"),
                &[],
            );
            batch_max_wait = self.prop_quantity(s.get("max_wait"), Ty::Duration, "`max_wait`");
        }
        let preemptible = self.flag(&f, "preemptible");
        let backfill_only = self.flag(&f, "backfill_only");
        let may_starve = self.flag(&f, "may_starve");
        let prefix_affinity = self.flag(&f, "prefix_affinity");
        let cache = self.tier_cache(&f, &what);
        let preempts: Vec<TierId> = self
            .prop_names(f.get("preempts"), DeclKind::Tier)
            .into_iter()
            .map(|x| x as TierId)
            .collect();
        if let Some(p) = f.get("preempts") {
            for v in list_items(p) {
                if let ValueKind::Path(path) = &v.kind {
                    if let Some(n) = path.first() {
                        self.facts
                            .preempt_spans
                            .insert((d.name.name.clone(), n.name.clone()), v.span);
                    }
                }
            }
        }
        let aging = self.prop_quantity(f.get("aging"), Ty::Duration, "`aging`");
        let models = f.get("models").map(|p| {
            self.prop_names(Some(p), DeclKind::Model)
                .into_iter()
                .map(|x| x as ModelId)
                .collect()
        });
        let on_preempt = self.on_preempt(f.get("on_preempt"), preemptible);
        let reserve = self.tier_reserve(f.get("reserve"), &what);
        let quota = self.scoped_quota(f.get("quota"), &what);
        let mut fair_share_window = None;
        if let Some(b) = self.sub_body(f.get("fair_share")) {
            let s = self.fields(
                b,
                FAIR_SHARE_FIELDS,
                &format!("the fair share of {what}"),
                &[],
            );
            fair_share_window = self.fair_share_window(s.get("window"));
        }
        let completion_windows = self.completion_windows(f.get("completion_windows"));
        let budget = self.budget(f.get("budget"), &what);
        let owner = self.owner(&f, &what);
        let _ = self.prop_string(f.get("description"));
        let signal_window = self.signal_window(f.get("signal_window"));
        self.g.tiers.push(Tier {
            name: d.name.name.clone(),
            priority: priority as i64,
            slo,
            batch_max_wait,
            preemptible,
            preempts,
            backfill_only,
            aging,
            may_starve,
            models,
            prefix_affinity,
            cache,
            signal_window,
            on_preempt,
            reserve,
            fair_share_window,
            quota,
            completion_windows,
            budget,
            owner,
            span: d.name.span,
        });
    }

    /// `exact_cache` (an exact cache with the defaults) or `cache { exact {
    /// entries 10000, ttl 10m, shared } semantic { similarity 0.92,
    /// entries 5000, ttl 1h } }`: every number checked, an unknown key
    /// named with a "did you mean".
    fn tier_cache(&mut self, f: &Fields, what: &str) -> TierCache {
        let flag = self.flag(f, "exact_cache");
        let mut cache = TierCache {
            exact: flag.then_some(ExactSpec::DEFAULT),
            semantic: None,
        };
        let Some(p) = f.get("cache") else {
            return cache;
        };
        let Some(b) = self.sub_body(Some(p)) else {
            return cache;
        };
        let c = self.fields(b, CACHE_FIELDS, &format!("the cache of {what}"), &[]);
        if let Some(e) = c.get("exact") {
            if let (true, Some(flag_p)) = (flag, f.get("exact_cache")) {
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("{what} declares its exact cache twice"),
                    )
                    .at(e.key.span, "declared again here")
                    .also(flag_p.key.span, "first declared here")
                    .help("keep `cache { exact { … } }` (it sets the size and time to live) and remove `exact_cache`"),
                );
            }
            let d = ExactSpec::DEFAULT;
            let s = self.cache_settings(
                e,
                EXACT_CACHE_FIELDS,
                &format!("the exact cache of {what}"),
                d.max_entries,
                d.ttl_us,
            );
            cache.exact = Some(ExactSpec {
                max_entries: s.entries,
                ttl_us: s.ttl_us,
                shared: s.shared,
            });
        }
        if let Some(e) = c.get("semantic") {
            self.facts
                .semantic_caches
                .push((what.to_string(), e.key.span));
            let s = self.cache_settings(
                e,
                SEMANTIC_CACHE_FIELDS,
                &format!("the semantic cache of {what}"),
                5_000,
                3_600 * 1_000_000,
            );
            let similarity = match s.fields_similarity {
                Some(x) => x,
                None if s.similarity_seen => 1.0,
                None => {
                    self.err(
                        Diagnostic::error(
                            Code::MissingField,
                            format!("the semantic cache of {what} needs `similarity`"),
                        )
                        .at(e.key.span, "`similarity` is missing")
                        .help("add `similarity 0.92`: how close (cosine, above 0 and at most 1) a prompt must be to a cached one to reuse its answer"),
                    );
                    1.0
                }
            };
            cache.semantic = Some(SemanticSpec {
                min_similarity: similarity,
                max_entries: s.entries,
                ttl_us: s.ttl_us,
                shared: s.shared,
            });
        }
        cache
    }

    /// The settings of one cache block (`exact { … }`, `semantic { … }`);
    /// a bare `exact` takes the defaults.
    fn cache_settings(
        &mut self,
        p: &Property,
        allowed: &[&str],
        what: &str,
        entries: u32,
        ttl_us: u64,
    ) -> CacheSettings {
        let mut out = CacheSettings {
            entries,
            ttl_us,
            shared: false,
            fields_similarity: None,
            similarity_seen: false,
        };
        if p.body.is_none() && p.args.values().is_empty() {
            return out;
        }
        let Some(b) = self.sub_body(Some(p)) else {
            return out;
        };
        let s = self.fields(b, allowed, what, &[]);
        if let Some(e) = s.get("entries") {
            if let Some(v) = self.one(e, "10000") {
                match self.quantity_of_type(v, Ty::Count, "`entries`") {
                    Some(x) if (1.0..=limits::MAX_CACHE_ENTRIES).contains(&x) && x.fract() == 0.0 => {
                        out.entries = x as u32;
                    }
                    Some(x) if x.is_finite() && x >= 1.0 && x.fract() != 0.0 => self.err(
                        Diagnostic::error(Code::InvalidValue, "`entries` is a whole number")
                            .at(v.span, "not a whole number")
                            .help("write how many answers the cache keeps, like `entries 10000`"),
                    ),
                    Some(_) => self.err(
                        Diagnostic::error(Code::OutOfRange, "`entries` is out of range")
                            .at(v.span, "not from 1 to 1000000")
                            .help("a cache keeps from 1 to 1000000 answers (`entries 10000`); kiln's limits keep every allocation a policy causes small"),
                    ),
                    None => {}
                }
            }
        }
        if let Some(t) = s.get("ttl") {
            if let Some(v) = self.one(t, "10m") {
                match self.quantity_of_type(v, Ty::Duration, "`ttl`") {
                    Some(x) if (limits::MIN_CACHE_TTL_MS..=limits::MAX_CACHE_TTL_MS).contains(&x) => {
                        out.ttl_us = (x * 1000.0).round() as u64;
                    }
                    Some(_) => self.err(
                        Diagnostic::error(Code::OutOfRange, "`ttl` is out of range")
                            .at(v.span, "not from 1s to 7d")
                            .help("a cached answer lives from 1s to 7d (`ttl 10m`); past its time to live it is served fresh again"),
                    ),
                    None => {}
                }
            }
        }
        if let Some(sh) = s.get("shared") {
            out.shared = match (sh.args.values(), &sh.body) {
                ([], None) => true,
                ([v], None) if matches!(v.kind, ValueKind::Bool(_)) => {
                    matches!(v.kind, ValueKind::Bool(true))
                }
                _ => {
                    self.err(
                        Diagnostic::error(Code::InvalidValue, "`shared` takes no value")
                            .at(sh.span, "remove the value")
                            .help("write `shared` to let the tier's tenants reuse each other's answers; leave it out to keep each tenant's own"),
                    );
                    false
                }
            };
        }
        if let Some(sim) = s.get("similarity") {
            out.similarity_seen = true;
            if let Some(v) = self.one(sim, "0.92") {
                let x = match units::literal(v) {
                    Some(Ok(t)) if t.ty == Ty::Count => Some(t.value),
                    Some(Ok(t)) if t.ty == Ty::Percent => Some(t.value / 100.0),
                    _ => None,
                };
                match x {
                    Some(x) if x > 0.0 && x <= 1.0 => out.fields_similarity = Some(x as f32),
                    Some(_) => self.err(
                        Diagnostic::error(Code::OutOfRange, "`similarity` is out of range")
                            .at(v.span, "not above 0 and at most 1")
                            .help("write the least cosine similarity that reuses an answer, above 0 and at most 1, like `similarity 0.92`"),
                    ),
                    None => self.err(
                        Diagnostic::error(
                            Code::UnitMismatch,
                            format!("`similarity` is a number, found `{}`", format::value(v)),
                        )
                        .at(v.span, "expected a number")
                        .help("write the least cosine similarity that reuses an answer, above 0 and at most 1, like `similarity 0.92`"),
                    ),
                }
            }
        }
        out
    }

    /// `throughput { tokens 50k/min requests 20/s }`: either or both, each
    /// a rate above zero.
    fn throughput(&mut self, p: Option<&Property>, what: &str) -> Option<Throughput> {
        let b = self.sub_body(p)?;
        let f = self.fields(
            b,
            THROUGHPUT_FIELDS,
            &format!("the throughput objective of {what}"),
            &[],
        );
        let t = Throughput {
            tokens_per_s: self.prop_quantity(
                f.get("tokens"),
                Ty::Rate,
                "`tokens` (a rate, like `50k/min`)",
            ),
            requests_per_s: self.prop_quantity(
                f.get("requests"),
                Ty::Rate,
                "`requests` (a rate, like `20/s`)",
            ),
        };
        let positive = |x: Option<f64>| x.is_none_or(|v| v > 0.0);
        if let Some(p) = p {
            if t.tokens_per_s.is_none() && t.requests_per_s.is_none() {
                self.err(
                    Diagnostic::error(Code::MissingField, "the throughput objective names no rate")
                        .at(p.span, "empty")
                        .help("write `throughput { tokens 50k/min }` or `throughput { requests 20/s }`"),
                );
                return None;
            }
            if !positive(t.tokens_per_s) || !positive(t.requests_per_s) {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        "a throughput objective of zero asks for nothing",
                    )
                    .at(p.span, "zero")
                    .help("write a rate above zero, or remove `throughput`"),
                );
                return None;
            }
        }
        Some(t)
    }

    /// `deadline hard|soft` (hard when absent).
    fn deadline(&mut self, p: Option<&Property>) -> Deadline {
        let Some(p) = p else {
            return Deadline::default();
        };
        let Some(v) = self.one(p, "hard") else {
            return Deadline::default();
        };
        let word = match &v.kind {
            ValueKind::Path(path) if path.len() == 1 => Some(&path[0]),
            _ => None,
        };
        match word.and_then(|w| Deadline::parse(&w.name)) {
            Some(d) => d,
            None => {
                let help = word
                    .and_then(|w| suggest(&w.name, Deadline::NAMES.iter().copied()))
                    .unwrap_or_else(|| {
                        "write `deadline hard` (work that would miss its window is refused) or `deadline soft` (it runs late and counts a miss)".into()
                    });
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        format!(
                            "`deadline` is `hard` or `soft`, found `{}`",
                            format::value(v)
                        ),
                    )
                    .at(v.span, "not hard or soft")
                    .help(help),
                );
                Deadline::default()
            }
        }
    }

    /// `on_preempt requeue|reject`: only on a preemptible tier, where it
    /// acts (anywhere else it could never act, so it is an error).
    fn on_preempt(&mut self, p: Option<&Property>, preemptible: bool) -> OnPreempt {
        let Some(p) = p else {
            return OnPreempt::default();
        };
        let Some(v) = self.one(p, "requeue") else {
            return OnPreempt::default();
        };
        let word = match &v.kind {
            ValueKind::Path(path) if path.len() == 1 => Some(&path[0]),
            _ => None,
        };
        let Some(choice) = word.and_then(|w| OnPreempt::parse(&w.name)) else {
            let help = word
                .and_then(|w| suggest(&w.name, OnPreempt::NAMES.iter().copied()))
                .unwrap_or_else(|| {
                    "write `on_preempt requeue` (the client keeps waiting) or `on_preempt reject` (it is told 503 `preempted`)".into()
                });
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    format!(
                        "`on_preempt` is `requeue` or `reject`, found `{}`",
                        format::value(v)
                    ),
                )
                .at(v.span, "not requeue or reject")
                .help(help),
            );
            return OnPreempt::default();
        };
        if !preemptible {
            self.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    "`on_preempt` on a tier that is not `preemptible` never acts",
                )
                .at(p.span, "this tier is never preempted")
                .help("add `preemptible` to the tier, or remove `on_preempt`"),
            );
        }
        choice
    }

    /// `reserve { POOL SHARE … }`: a percentage of each named pool, above
    /// 0% and at most 100%, each pool once. (Whether the pools' reserves
    /// add up, and whether the tier can run there, is checked once every
    /// tier and route is known: see `validate`.)
    fn tier_reserve(&mut self, p: Option<&Property>, what: &str) -> Vec<Reserve> {
        let mut out: Vec<Reserve> = Vec::new();
        let Some(b) = self.sub_body(p) else {
            return out;
        };
        for p in &b.props {
            let Some(pool) = self.resolve(DeclKind::Pool, &p.key) else {
                continue;
            };
            let pool = pool as PoolId;
            if let Some(prev) = out.iter().find(|r| r.pool == pool) {
                let prev = prev.span;
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("{what} reserves pool `{}` twice", p.key.name),
                    )
                    .at(p.key.span, "reserved again here")
                    .also(prev, "first reserved here")
                    .help("keep one share per pool"),
                );
                continue;
            }
            let Some(share) = self.prop_percent(Some(p), "a reserved share") else {
                continue;
            };
            if share <= 0.0 {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "a reserved share must be above 0%")
                        .at(p.span, "reserves nothing")
                        .help(format!("write `{} 25%`, or remove the line", p.key.name)),
                );
                continue;
            }
            out.push(Reserve {
                pool,
                share,
                span: p.span,
            });
        }
        out
    }

    /// A tier's or a model's `quota { tokens, requests, concurrent,
    /// gpu_seconds }`, as a tenant's is written.
    fn scoped_quota(&mut self, p: Option<&Property>, what: &str) -> Quota {
        let mut quota = Quota::default();
        if let Some(b) = self.sub_body(p) {
            let q = self.fields(b, QUOTA_FIELDS, &format!("the quota of {what}"), &[]);
            quota.tokens = self.prop_quantity(q.get("tokens"), Ty::Rate, "`tokens`");
            quota.requests = self.prop_quantity(q.get("requests"), Ty::Rate, "`requests`");
            quota.concurrent = self
                .prop_quantity(q.get("concurrent"), Ty::Count, "`concurrent`")
                .map(|x| x.max(0.0) as u64);
            if let (Some(n), Some(p)) = (quota.concurrent, q.get("concurrent")) {
                self.facts.concurrent.push((what.to_string(), n, p.span));
            }
            quota.gpu_seconds = self.prop_quantity(q.get("gpu_seconds"), Ty::Rate, "`gpu_seconds`");
        }
        quota
    }

    /// A fair-share window: a duration from 1 second to 30 days
    /// ([`limits::MIN_FAIR_SHARE_WINDOW_MS`], [`limits::MAX_FAIR_SHARE_WINDOW_MS`]).
    /// `completion_windows [1h, 24h]`: the Batches API completion windows
    /// the tier accepts, each from 1m to 7d, each once, at least one;
    /// `[24h]` when absent (or when none written is valid).
    fn completion_windows(&mut self, p: Option<&Property>) -> Vec<f64> {
        let default = vec![limits::DEFAULT_COMPLETION_WINDOW_MS];
        let Some(p) = p else { return default };
        if p.body.is_some() {
            self.err(
                Diagnostic::error(Code::InvalidValue, "`completion_windows` takes a list")
                    .at(p.span, "expected a list of durations")
                    .help("write `completion_windows [1h, 24h]`"),
            );
            return default;
        }
        let items = list_items(p);
        if items.is_empty() {
            self.err(
                Diagnostic::error(Code::InvalidValue, "`completion_windows` is empty")
                    .at(p.span, "no window")
                    .help("list at least one, like `completion_windows [24h]`, or leave it out to accept 24h only"),
            );
            return default;
        }
        let mut out: Vec<f64> = Vec::new();
        let mut spans: Vec<crate::source::Span> = Vec::new();
        for v in items {
            let Some(ms) = self.quantity_of_type(v, Ty::Duration, "a completion window") else {
                continue;
            };
            if !ms.is_finite()
                || !(limits::MIN_COMPLETION_WINDOW_MS..=limits::MAX_COMPLETION_WINDOW_MS)
                    .contains(&ms)
            {
                self.err(
                    Diagnostic::error(Code::OutOfRange, "a completion window is out of range")
                        .at(v.span, "outside 1m to 7d")
                        .help("a completion window is from 1m to 7d, like the Batches API's `24h`"),
                );
                continue;
            }
            if let Some(i) = out.iter().position(|&x| x == ms) {
                let mut d = Diagnostic::error(
                    Code::InvalidValue,
                    format!("completion window `{}` is listed twice", format::value(v)),
                )
                .at(v.span, "again here");
                if let Some(first) = spans.get(i) {
                    d = d.also(*first, "first here");
                }
                self.err(d.help("list each completion window once"));
                continue;
            }
            out.push(ms);
            spans.push(v.span);
        }
        if out.is_empty() {
            default
        } else {
            out
        }
    }

    fn fair_share_window(&mut self, p: Option<&Property>) -> Option<f64> {
        let p = p?;
        let v = self.one(p, "5m")?;
        let ms = self.quantity_of_type(v, Ty::Duration, "the fair-share `window`")?;
        if !ms.is_finite()
            || !(limits::MIN_FAIR_SHARE_WINDOW_MS..=limits::MAX_FAIR_SHARE_WINDOW_MS).contains(&ms)
        {
            self.err(
                Diagnostic::error(Code::OutOfRange, "the fair-share `window` is out of range")
                    .at(v.span, "outside 1s to 30d")
                    .help("a fair-share window is from 1s to 30d: kiln's limits keep fair share meaningful and its arithmetic exact"),
            );
            return None;
        }
        Some(ms)
    }

    fn model(&mut self, d: &ast::Decl) {
        let what = format!("model `{}`", d.name.name);
        let f = self.fields(&d.body, MODEL_FIELDS, &what, &["variant", "served_by"]);
        let id = self.g.models.len() as ModelId;
        for p in f.repeated.iter().filter(|p| p.key.name == "served_by") {
            self.served_by.push((id, (*p).clone()));
        }
        let _ = self.prop_string(f.get("description"));
        let params = self.prop_quantity(f.get("params"), Ty::Count, "`params`");
        let kv_per_token = self.prop_quantity(f.get("kv_per_token"), Ty::Size, "`kv_per_token`");
        let quota = self.scoped_quota(f.get("quota"), &what);
        // `value 0.04`: currency per answered request.
        let value_per_request = self.prop_quantity(
            f.get("value"),
            Ty::Count,
            "`value` (what an answered request is worth, like `0.04`)",
        );
        let mut variants: Vec<Variant> = Vec::new();
        for p in f.repeated.clone() {
            if p.key.name != "variant" {
                continue;
            }
            let name = match p.args.values() {
                [v] => match &v.kind {
                    ValueKind::Path(path) if path.len() == 1 => Some(path[0].clone()),
                    _ => None,
                },
                _ => None,
            };
            let (Some(name), Some(body)) = (name, &p.body) else {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "a variant is `variant NAME { … }`")
                        .at(p.span, "malformed variant")
                        .help("write `variant int4 { precision int4 memory 40GB pools [shared] }`"),
                );
                continue;
            };
            if let Some(prev) = variants.iter().find(|v| v.name == name.name) {
                let prev_span = prev.span;
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("variant `{}` is defined twice in {what}", name.name),
                    )
                    .at(name.span, "defined again here")
                    .also(prev_span, "first defined here")
                    .help("rename or remove one"),
                );
                continue;
            }
            let vwhat = format!("variant `{}.{}`", d.name.name, name.name);
            let vf = self.fields(body, VARIANT_FIELDS, &vwhat, &[]);
            let precision = match vf.get("precision") {
                Some(pp) => match self.one(pp, "fp16").map(|v| &v.kind) {
                    Some(ValueKind::Path(path)) if path.len() == 1 => {
                        match Precision::parse(&path[0].name) {
                            Some(pr) => Some(pr),
                            None => {
                                let help =
                                    suggest(&path[0].name, Precision::NAMES).unwrap_or_else(|| {
                                        format!("precisions are: {}", Precision::NAMES.join(", "))
                                    });
                                self.err(
                                    Diagnostic::error(
                                        Code::InvalidValue,
                                        format!("unknown precision `{}`", path[0].name),
                                    )
                                    .at(path[0].span, "not a precision")
                                    .help(help),
                                );
                                None
                            }
                        }
                    }
                    _ => None,
                },
                None => Precision::parse(&name.name),
            };
            if precision.is_none() && vf.get("precision").is_none() {
                self.err(
                    Diagnostic::error(Code::MissingField, format!("{vwhat} needs `precision`"))
                        .at(name.span, "precision unknown")
                        .help("add `precision fp16` (or int8, int4, …); a variant named after its precision may leave it out"),
                );
            }
            let mem = self.require(&vf, "memory", &name, "40GB");
            let memory = self.prop_quantity(mem, Ty::Size, "`memory`").unwrap_or(0.0);
            let gpus = self
                .prop_bounded(
                    vf.get("gpus_per_replica"),
                    Ty::Count,
                    "`gpus_per_replica`",
                    f64::from(limits::MAX_POOL_GPUS),
                    &format!(
                        "`gpus_per_replica` is at most {}, the most GPUs a pool has",
                        limits::MAX_POOL_GPUS
                    ),
                )
                .ok()
                .flatten()
                .unwrap_or(1.0);
            if gpus < 1.0 || gpus.fract() != 0.0 {
                if let Some(pp) = vf.get("gpus_per_replica") {
                    self.err(
                        Diagnostic::error(
                            Code::InvalidValue,
                            "`gpus_per_replica` is a whole number, at least 1",
                        )
                        .at(pp.span, "not a positive whole number")
                        .help("write `gpus_per_replica 2`"),
                    );
                }
            }
            let pp = self.require(&vf, "pools", &name, "[h100]");
            let pools: Vec<PoolId> = self
                .prop_names(pp, DeclKind::Pool)
                .into_iter()
                .map(|x| x as PoolId)
                .collect();
            let quality = self.prop_string(vf.get("quality"));
            let max_batch = self
                .positive_count(vf.get("max_batch"), "`max_batch`", limits::MAX_BATCH)
                .unwrap_or(256);
            let max_batch_tokens = self.positive_count(
                vf.get("max_batch_tokens"),
                "`max_batch_tokens`",
                limits::MAX_TOKENS,
            );
            self.facts
                .variant_spans
                .insert((d.name.name.clone(), name.name.clone()), name.span);
            variants.push(Variant {
                name: name.name.clone(),
                precision: precision.unwrap_or(Precision::Fp16),
                memory,
                gpus_per_replica: gpus.max(1.0) as u32,
                pools,
                quality,
                max_batch,
                max_batch_tokens,
                span: name.span,
            });
        }
        if variants.is_empty() {
            self.err(
                Diagnostic::error(Code::MissingField, format!("{what} has no variant"))
                    .at(d.name.span, "no variant")
                    .help("add `variant fp16 { memory 140GB gpus_per_replica 2 pools [h100] }`"),
            );
        }
        self.g.models.push(Model {
            name: d.name.name.clone(),
            variants,
            params,
            kv_per_token,
            quota,
            value_per_request,
            span: d.name.span,
        });
    }

    /// `budget 500/day` or `budget 12k/month`: currency per calendar day or
    /// month. Its own parse: `/month` is a period no other rate may use.
    fn budget(&mut self, p: Option<&Property>, what: &str) -> Option<Budget> {
        let p = p?;
        let v = self.one(p, "an amount per day or month")?;
        let bad = |c: &mut Self, label: &str| {
            c.err(
                Diagnostic::error(
                    Code::InvalidValue,
                    format!("{what}'s `budget` is an amount of money per day or per month"),
                )
                .at(v.span, label.to_string())
                .help("write `budget 500/day` or `budget 12k/month` (in the currency of `price` and `cost`; a month and a day are the policy's calendar ones)"),
            );
        };
        let ValueKind::Quantity(q) = &v.kind else {
            bad(self, "not an amount per period");
            return None;
        };
        let period = match q.per.as_deref() {
            Some("day" | "d") => BudgetPeriod::Day,
            Some("month") => BudgetPeriod::Month,
            _ => {
                bad(self, "no `/day` or `/month`");
                return None;
            }
        };
        let amount = match units::quantity(&ast::Quantity {
            per: None,
            ..q.clone()
        }) {
            Ok(t) if t.ty == Ty::Count && t.value.is_finite() && t.value > 0.0 => t.value,
            _ => {
                bad(self, "not a positive amount");
                return None;
            }
        };
        Some(Budget { amount, period })
    }

    fn tenant(&mut self, d: &ast::Decl) {
        let what = format!("tenant `{}`", d.name.name);
        let f = self.fields(&d.body, TENANT_FIELDS, &what, &[]);
        let Owner { owner, escalation } = self.owner(&f, &what);
        let tp = self.require(&f, "tiers", &d.name, "[interactive]");
        let tiers: Vec<TierId> = self
            .prop_names(tp, DeclKind::Tier)
            .into_iter()
            .map(|x| x as TierId)
            .collect();
        let cohort = match f.get("cohort") {
            Some(p) => match self.one(p, "NAME").map(|v| &v.kind) {
                Some(ValueKind::Path(path)) if path.len() == 1 => {
                    let id = path[0].clone();
                    self.resolve(DeclKind::Cohort, &id).map(|x| x as CohortId)
                }
                _ => None,
            },
            None => None,
        };
        let mut quota = Quota::default();
        if let Some(b) = self.sub_body(f.get("quota")) {
            let q = self.fields(b, QUOTA_FIELDS, &format!("the quota of {what}"), &[]);
            quota.tokens = self.prop_quantity(q.get("tokens"), Ty::Rate, "`tokens`");
            quota.requests = self.prop_quantity(q.get("requests"), Ty::Rate, "`requests`");
            quota.concurrent = self
                .prop_quantity(q.get("concurrent"), Ty::Count, "`concurrent`")
                .map(|x| x.max(0.0) as u64);
            if let (Some(n), Some(p)) = (quota.concurrent, q.get("concurrent")) {
                self.facts.concurrent.push((what.to_string(), n, p.span));
            }
            quota.gpu_seconds = self.prop_quantity(q.get("gpu_seconds"), Ty::Rate, "`gpu_seconds`");
        }
        let weight = self
            .prop_quantity(f.get("weight"), Ty::Count, "`weight`")
            .unwrap_or(1.0);
        if weight <= 0.0 {
            if let Some(p) = f.get("weight") {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "a fair-share weight must be positive")
                        .at(p.span, "not positive")
                        .help(
                            "write `weight 1` or more; a tenant with no share should have no tier",
                        ),
                );
            }
        }
        let borrow = self
            .prop_percent(f.get("borrow"), "`borrow`")
            .unwrap_or(0.0);
        let lend = self.prop_percent(f.get("lend"), "`lend`").unwrap_or(0.0);
        if (borrow > 0.0 || lend > 0.0) && cohort.is_none() {
            let p = f.get("borrow").or(f.get("lend"));
            if let Some(p) = p {
                self.err(
                    Diagnostic::error(
                        Code::MissingField,
                        format!("{what} borrows or lends but has no cohort"),
                    )
                    .at(p.span, "borrowing happens within a cohort")
                    .help("add `cohort <name>` and define `cohort <name> { owner \"…\" }`"),
                );
            }
        }
        let retry_budget = self.prop_percent(f.get("retry_budget"), "`retry_budget`");
        let session_steps = self
            .prop_quantity(f.get("session_steps"), Ty::Count, "`session_steps`")
            .map(|x| x.max(0.0) as u64);
        // `cost 2.5/h` is currency per GPU-hour.
        let cost_per_gpu_hour = self
            .prop_quantity(
                f.get("cost"),
                Ty::Rate,
                "`cost` (per GPU-hour, like `2.5/h`)",
            )
            .map(|per_s| per_s * 3600.0);
        let budget = self.budget(f.get("budget"), &what);
        let api_keys = match f.get("api_keys") {
            Some(p) => list_items(p)
                .into_iter()
                .filter_map(|v| match &v.kind {
                    ValueKind::Str(s) => self.api_key(s, &d.name.name, v.span),
                    _ => {
                        self.err(
                            Diagnostic::error(Code::UnitMismatch, "API key ids are strings")
                                .at(v.span, "expected a string")
                                .help("write `api_keys [\"key-id\"]`"),
                        );
                        None
                    }
                })
                .collect(),
            None => Vec::new(),
        };
        let _ = self.prop_string(f.get("description"));
        let signal_window = self.signal_window(f.get("signal_window"));
        self.g.tenants.push(Tenant {
            name: d.name.name.clone(),
            owner,
            escalation,
            tiers,
            cohort,
            quota,
            weight,
            borrow,
            lend,
            retry_budget,
            session_steps,
            cost_per_gpu_hour,
            budget,
            api_keys,
            signal_window,
            span: d.name.span,
        });
    }

    /// `policy { timezone "Europe/Berlin" }`.
    fn settings(&mut self, st: &ast::Settings) {
        if std::mem::replace(&mut self.seen_settings, true) {
            self.err(
                Diagnostic::error(
                    Code::DuplicateDefinition,
                    "the policy has two policy blocks",
                )
                .at(st.span, "second policy block")
                .help("a policy has at most one `policy { … }` block; merge them"),
            );
            return;
        }
        let f = self.fields(&st.body, SETTINGS_FIELDS, "the policy block", &[]);
        self.g.owner = self.owner(&f, "the policy");
        let Some(p) = f.get("timezone") else {
            return;
        };
        let Some(name) = self.prop_string(Some(p)) else {
            return;
        };
        match crate::units::calendar::Zone::get(&name) {
            Ok(z) => self.g.timezone = Some(z),
            Err(_) => {
                self.err(
                    Diagnostic::error(Code::InvalidValue, format!("`{name}` is not a time zone"))
                        .at(p.span, "not in the IANA time zone database")
                        .help("name an IANA zone, like \"Europe/Berlin\", \"America/New_York\" or \"UTC\"; `time`, `weekday`, `date` and `day` then read that zone's clock, daylight saving included"),
                );
            }
        }
    }

    fn rollout(&mut self, r: &ast::Rollout) {
        if self.g.rollout.is_some() {
            self.err(
                Diagnostic::error(
                    Code::DuplicateDefinition,
                    "the policy has two rollout blocks",
                )
                .at(ast::Item::Rollout(r.clone()).span(), "second rollout block")
                .help("a policy has at most one rollout block; merge them"),
            );
            return;
        }
        let mut out = Rollout::default();
        let props: Vec<Property> = r
            .items
            .iter()
            .filter_map(|i| match i {
                ast::RolloutItem::Prop(p) => Some(p.clone()),
                _ => None,
            })
            .collect();
        let body = Body {
            props,
            span: r.span,
        };
        let f = self.fields(&body, ROLLOUT_FIELDS, "the rollout block", &[]);
        out.shadow = self.prop_quantity(f.get("shadow"), Ty::Duration, "`shadow`");
        if let Some(b) = self.sub_body(f.get("canary")) {
            let c = self.fields(b, CANARY_FIELDS, "the canary", &[]);
            out.canary_share = self.prop_percent(c.get("share"), "`share`");
            out.canary_tenants = self.prop_names(c.get("tenants"), DeclKind::Tenant);
            out.canary_duration = self.prop_quantity(c.get("duration"), Ty::Duration, "`duration`");
            if out.canary_share.is_none() && out.canary_tenants.is_empty() {
                self.err(
                    Diagnostic::error(
                        Code::MissingField,
                        "the canary names neither a share nor tenants",
                    )
                    .at(
                        f.get("canary").map(|p| p.key.span).unwrap_or(r.span),
                        "empty canary",
                    )
                    .help("add `share 5%` or `tenants [name]`"),
                );
            }
        }
        for i in &r.items {
            if let ast::RolloutItem::Stage(st) = i {
                self.rollout_stage(st, &mut out);
            }
        }
        if let (Some(c), Some(first)) = (f.get("canary"), out.stages.first()) {
            self.err(
                Diagnostic::error(
                    Code::DuplicateDefinition,
                    "the rollout has both a canary and stages",
                )
                .at(c.key.span, "canary")
                .also(first.span, "first stage")
                .help("`canary { … }` is a one-stage rollout: write it as a `stage canary { … }` among the others"),
            );
        }
        for i in &r.items {
            if let ast::RolloutItem::Rollback { cond, hold, span } = i {
                let c = self.condition(cond, super::rules::Scope::Rollout);
                let hold = hold
                    .as_ref()
                    .and_then(|h| self.quantity(h, Ty::Duration, "the hold time after `for`"));
                out.rollbacks.push(Rollback {
                    cond: c,
                    hold,
                    text: format::expr(cond),
                    span: *span,
                });
            }
        }
        self.g.rollout = Some(out);
    }

    /// One `stage NAME { … }` of a rollout block, appended to `out`.
    fn rollout_stage(&mut self, st: &ast::Stage, out: &mut Rollout) {
        if let Some(prev) = out.stages.iter().find(|s| s.name == st.name.name) {
            self.err(
                Diagnostic::error(
                    Code::DuplicateDefinition,
                    format!("the rollout has two stages named `{}`", st.name.name),
                )
                .at(st.name.span, "second stage of that name")
                .also(prev.span, "first one")
                .help("give each stage its own name: status, audit and metrics name the stage"),
            );
            return;
        }
        let props: Vec<Property> = st
            .items
            .iter()
            .filter_map(|i| match i {
                ast::StageItem::Prop(p) => Some(p.clone()),
                ast::StageItem::Gate { .. } => None,
            })
            .collect();
        let body = Body {
            props,
            span: st.span,
        };
        let what = format!("stage `{}`", st.name.name);
        let f = self.fields(&body, STAGE_FIELDS, &what, &[]);
        let share = self.prop_percent(f.get("share"), "`share`");
        let tenants = self.prop_names(f.get("tenants"), DeclKind::Tenant);
        // Ids are u16 for tiers and models (the compiler bounds their counts).
        let narrow = |v: Vec<u32>| {
            v.into_iter()
                .filter_map(|i| u16::try_from(i).ok())
                .collect()
        };
        let tiers = narrow(self.prop_names(f.get("tiers"), DeclKind::Tier));
        let models = narrow(self.prop_names(f.get("models"), DeclKind::Model));
        let duration = self.prop_quantity(f.get("duration"), Ty::Duration, "`duration`");
        let named = ["share", "tenants", "tiers", "models"]
            .iter()
            .any(|k| f.get(k).is_some());
        if !named {
            self.err(
                Diagnostic::error(
                    Code::MissingField,
                    format!("stage `{}` names no traffic", st.name.name),
                )
                .at(st.name.span, "empty stage")
                .help("scope it with `tenants [..]`, `tiers [..]` or `models [..]` (they restrict together), and/or `share 5%` (a share of what they select, or of all traffic)"),
            );
        }
        let mut gates = Vec::new();
        for i in &st.items {
            if let ast::StageItem::Gate { cond, hold, span } = i {
                let c = self.condition(cond, super::rules::Scope::Rollout);
                let hold = hold
                    .as_ref()
                    .and_then(|h| self.quantity(h, Ty::Duration, "the hold time after `for`"));
                gates.push(Rollback {
                    cond: c,
                    hold,
                    text: format::expr(cond),
                    span: *span,
                });
            }
        }
        out.stages.push(crate::graph::RolloutStage {
            name: st.name.name.clone(),
            share,
            tenants,
            tiers,
            models,
            duration,
            gates,
            span: st.span,
        });
    }

    fn approval(&mut self, a: &ast::Approval) {
        for r in &a.rules {
            if r.count > limits::MAX_APPROVERS {
                self.out_of_range(
                    r.count_span,
                    "the number of approvers",
                    &format!(
                        "an approval rule requires at most {} approvers",
                        limits::MAX_APPROVERS
                    ),
                );
            }
            if r.count == 0 {
                self.err(
                    Diagnostic::error(
                        Code::InvalidValue,
                        "an approval rule needs at least one approver",
                    )
                    .at(r.count_span, "zero approvers")
                    .help("write `require 1 from \"group\" for …` or remove the rule"),
                );
            }
            if !r.owner && r.group.trim().is_empty() {
                self.err(
                    Diagnostic::error(Code::InvalidValue, "an approval rule names no group")
                        .at(r.group_span, "empty group")
                        .help("name the approvers' group, as listed in the server config"),
                );
            }
            let mut kinds = Vec::new();
            for n in &r.kinds.names {
                match ChangeKind::ALL.iter().find(|k| k.name() == n.name) {
                    Some(k) => kinds.push(*k),
                    None => {
                        let names: Vec<&str> = ChangeKind::ALL.iter().map(|k| k.name()).collect();
                        let help = suggest(&n.name, names.iter().copied())
                            .unwrap_or_else(|| format!("change kinds are: {}", names.join(", ")));
                        self.err(
                            Diagnostic::error(
                                Code::UnknownName,
                                format!("unknown change kind `{}`", n.name),
                            )
                            .at(n.span, "not a change kind")
                            .help(help),
                        );
                    }
                }
            }
            if r.owner {
                self.facts.owner_rules.push(r.span);
            }
            self.g.approvals.push(ApprovalRule {
                count: r.count,
                group: r.group.clone(),
                owner: r.owner,
                kinds,
            });
        }
    }
}

fn list_items(p: &Property) -> Vec<&Value> {
    match p.args.values() {
        [v] => match &v.kind {
            ValueKind::List(items) => items.iter().collect(),
            _ => vec![v],
        },
        vs => vs.iter().collect(),
    }
}

pub(crate) fn ty_article(ty: Ty) -> String {
    match ty {
        Ty::Count => "a count".into(),
        Ty::Duration => "a duration".into(),
        Ty::Size => "a size".into(),
        Ty::Percent => "a percentage".into(),
        Ty::Rate => "a rate".into(),
        Ty::TimeOfDay => "a time of day".into(),
        t => format!("a {}", t.short()),
    }
}
