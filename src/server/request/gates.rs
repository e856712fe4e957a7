//! The gateway's own admission checks, as an ordered list of gates like
//! the scheduler's (`sched::admit`): each lets the request through or
//! refuses it with its reason code and a message ([`Refused`]). The
//! scheduler's gates decide everything that needs its state (the policy's
//! admission, quotas, capacity, SLOs); these check what only the gateway
//! knows (an operator's overrides, which fields its backends honour, the
//! fleet's shared quota). Each runs at the first point of the request's
//! life where what it checks is known ([`At`]), and the first refusal wins.

use super::recorder::LeftWhileQueued;
use super::refusal::override_error;
use super::{Ctx, Decided};
use crate::backend::Backend;
use crate::governance::overrides::Scope;
use crate::graph::Request;
use crate::sched::Reason;
use crate::server::config::OnUnavailable;
use crate::server::fleet::Gate as Claim;
use crate::server::openai::ApiError;
use crate::server::App;

/// A gate's refusal: its reason code (as metrics and the decision log
/// name it) and the answer.
pub(in crate::server) struct Refused {
    pub(in crate::server) reason: &'static str,
    pub(in crate::server) err: ApiError,
}

/// Where in the request's life a gate checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum At {
    /// Authenticated and parsed, before it is recorded (a refusal here is
    /// explained, not logged).
    Arrival,
    /// Recorded, before the scheduler sees it.
    BeforeScheduler,
    /// The policy decided its tier, before it starts.
    Decided,
    /// It started on a replica, before the replica is asked.
    Started,
}

/// The gateway's gates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum Gate {
    /// An operator paused or throttled the tenant (`kiln override`).
    TenantOverride,
    /// No backend of this gateway passes fields through, and the request
    /// has one none of them honours.
    UnsupportedField,
    /// The tenant's quota across the fleet (`[state]`), or the fleet's
    /// store being unreachable under `on_unavailable = "refuse"`.
    FleetQuota,
    /// An operator paused or throttled the decided tier.
    TierOverride,
    /// The replica it started on (simulated or GPU) cannot honour a field.
    ReplicaField,
}

/// The gates in order, each with where it checks and the reason codes it
/// refuses with (see the module docs).
pub(in crate::server) const GATES: &[(Gate, At, &[&str])] = &[
    (Gate::TenantOverride, At::Arrival, &["paused", "throttled"]),
    (
        Gate::UnsupportedField,
        At::BeforeScheduler,
        &["unsupported_parameter"],
    ),
    (
        Gate::FleetQuota,
        At::BeforeScheduler,
        &["quota", "concurrency", "shared-state-unavailable"],
    ),
    (Gate::TierOverride, At::Decided, &["paused", "throttled"]),
    (Gate::ReplicaField, At::Started, &["unsupported_parameter"]),
];

/// The gates that check at `at`, in order.
fn gates_at(at: At) -> impl Iterator<Item = Gate> {
    GATES.iter().filter(move |g| g.1 == at).map(|g| g.0)
}

/// The gates at arrival: the request is not recorded yet (its refusal is
/// explained by the caller, like a bad key's).
pub(in crate::server) fn on_arrival(app: &App, req: &Request) -> Result<(), ApiError> {
    for gate in gates_at(At::Arrival) {
        if gate == Gate::TenantOverride {
            // Incident controls: a paused or throttled tenant is refused here.
            if let Some(r) = app.gov.check_override(Scope::Tenant, req.tenant.as_deref()) {
                app.metrics.override_refusal(
                    r.action.name(),
                    "tenant",
                    req.tenant.as_deref().unwrap_or("none"),
                );
                return Err(override_error(app, &r));
            }
        }
    }
    Ok(())
}

/// The gates before the scheduler; a request that passes the fleet's
/// quota holds its claim (`ctx.claim`).
pub(in crate::server) async fn before_scheduler(
    ctx: &mut Ctx,
    max_tokens: u64,
    prompt_tokens: u64,
) -> Result<(), Box<Refused>> {
    for gate in gates_at(At::BeforeScheduler) {
        match gate {
            Gate::UnsupportedField => unsupported_field(ctx)?,
            Gate::FleetQuota => fleet_quota(ctx, max_tokens, prompt_tokens).await?,
            _ => {}
        }
    }
    Ok(())
}

/// Where no backend passes fields through, a field none can honour is
/// refused before the request waits in a queue.
fn unsupported_field(ctx: &Ctx) -> Result<(), Box<Refused>> {
    let app = &ctx.app;
    if !app.backends.iter().any(|b| matches!(b, Backend::Http(_))) {
        let name = app
            .backends
            .first()
            .map_or_else(|| "sim".to_string(), Backend::name);
        if let Some(err) = crate::server::surface::unsupported_field(ctx.endpoint, &ctx.body, &name)
        {
            return Err(Box::new(Refused {
                reason: "unsupported_parameter",
                err,
            }));
        }
    }
    Ok(())
}

/// The fleet's claim on the tenant's shared quota (where there is a
/// fleet).
async fn fleet_quota(
    ctx: &mut Ctx,
    max_tokens: u64,
    prompt_tokens: u64,
) -> Result<(), Box<Refused>> {
    let app = ctx.app.clone();
    let Some(fleet) = app.fleet.clone() else {
        return Ok(());
    };
    // A client that leaves while the fleet's store is consulted is
    // recorded as cancelled, like one that leaves while queued.
    let mut left = LeftWhileQueued {
        ctx,
        decided: None,
        armed: true,
    };
    fleet.wait_for_version().await;
    let need = prompt_tokens as f64 + max_tokens as f64;
    // Today's limits: an exception's quota grant holds over the fleet.
    let graph = fleet.graph_today(&app.policy.load().graph);
    let gate = fleet
        .claim(&graph, &ctx.req, &ctx.rid, need, prompt_tokens as f64)
        .await;
    left.armed = false;
    drop(left);
    match gate {
        Claim::Claimed(c) => ctx.claim = Some(c),
        Claim::Free => {}
        Claim::Refused {
            reason,
            message: msg,
            retry_ms,
        } => {
            let secs = ((retry_ms as f64 / 1000.0 / app.speed).ceil() as u64).max(1);
            let err = ApiError::new(429, msg)
                .code(reason.name())
                .retry_after(Some(secs));
            return Err(Box::new(Refused {
                reason: reason.name(),
                err,
            }));
        }
        Claim::Unavailable => match fleet.on_unavailable {
            OnUnavailable::Local => app.metrics.shared_unclaimed("local"),
            OnUnavailable::Refuse => {
                app.metrics.shared_unclaimed("refused");
                let err = ApiError::new(
                    503,
                    "the gateway's shared state (Redis) is unreachable and this fleet refuses requests until it answers (`[state] on_unavailable = \"refuse\"`)",
                )
                .code(Reason::SharedState.name())
                .retry_after(Some(1));
                return Err(Box::new(Refused {
                    reason: Reason::SharedState.name(),
                    err,
                }));
            }
        },
    }
    Ok(())
}

/// The gates once the policy decided the request's tier. An override's
/// refusal is counted here; the caller records it.
pub(in crate::server) fn on_decision(
    ctx: &Ctx,
    d: &Decided,
) -> Result<(), Box<(crate::governance::overrides::Refused, ApiError)>> {
    for gate in gates_at(At::Decided) {
        if gate == Gate::TierOverride {
            let tname = d
                .graph
                .tiers
                .get(d.tier as usize)
                .map(|t| t.name.as_str())
                .unwrap_or("?");
            // Incident controls: a paused or throttled tier.
            if let Some(r) = ctx.app.gov.check_override(Scope::Tier, Some(tname)) {
                ctx.app
                    .metrics
                    .override_refusal(r.action.name(), "tier", tname);
                let err = override_error(&ctx.app, &r);
                return Err(Box::new((r, err)));
            }
        }
    }
    Ok(())
}

/// The gates once it started on a replica that is not an HTTP upstream
/// (one passes fields through as sent): a field that backend cannot
/// honour is refused.
pub(in crate::server) fn on_start(ctx: &Ctx, backend: &str) -> Result<(), Box<Refused>> {
    for gate in gates_at(At::Started) {
        if gate == Gate::ReplicaField {
            if let Some(err) =
                crate::server::surface::unsupported_field(ctx.endpoint, &ctx.body, backend)
            {
                return Err(Box::new(Refused {
                    reason: "unsupported_parameter",
                    err,
                }));
            }
        }
    }
    Ok(())
}
