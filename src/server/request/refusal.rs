//! The answer to a refused request: status, code, message (in the
//! policy's words where it has them) and a bounded Retry-After.

use super::recorder::decided_names;
use super::{Ctx, Decided};
use crate::backend::Backend;
use crate::sched::ratelimit::RateLimits;
use crate::sched::{Reason, SEC};
use crate::server::openai::ApiError;
use crate::server::App;

/// The answer to a request an operator's override refuses.
pub(in crate::server) fn override_error(
    app: &App,
    r: &crate::governance::overrides::Refused,
) -> ApiError {
    let secs = ((r.retry_after_ms / 1000.0 / app.speed).ceil() as u64).max(1);
    ApiError::new(r.status, r.message.clone())
        .code(r.code)
        .retry_after(Some(secs))
}

fn secs_ceil(app: &App, micros: crate::sched::Micros) -> u64 {
    ((micros as f64 / SEC as f64 / app.speed).ceil() as u64).max(1)
}

/// The error a refusal answers with, in the policy's words where it has
/// them.
pub(in crate::server) fn refusal(
    ctx: &Ctx,
    d: Option<&Decided>,
    reason: Reason,
    status: u16,
    retry_after: Option<crate::sched::Micros>,
    limits: Option<&RateLimits>,
) -> ApiError {
    let app = &ctx.app;
    // The quota that refused, in words, and the binding quotas' headers.
    let g = d.map_or_else(|| app.policy.load().graph.clone(), |d| d.graph.clone());
    let hit = limits
        .and_then(|l| l.hit.as_ref())
        .map(|h| super::ratelimit::describe(&g, h, app.speed));
    let rl_headers = limits.map_or_else(Vec::new, |l| super::ratelimit::headers(&g, l, app.speed));
    let (tier, tenant) = decided_names(d);
    let mut route: Option<(String, Option<String>)> = None;
    let (policy_msg, policy_reason) = d.map_or((None, None), |d| {
        let g = &d.policy_graph;
        let dec = g.decide(&ctx.req, &d.policy_signals);
        route = dec.target.map(|t| {
            let pool = t
                .pool
                .and_then(|p| g.pools.get(p as usize))
                .map(|p| p.name.clone());
            (g.variant_name(t.model, t.variant), pool)
        });
        let v = g.view(&dec);
        (v.message, v.reason)
    });
    // No capacity refusal is a 429 when the route's upstreams are all down:
    // that is an outage, and its wait estimate is unbounded (it was
    // answered `429 overload` with Retry-After 2^62 µs).
    let capacity = matches!(
        reason,
        Reason::Overload
            | Reason::Fairness
            | Reason::Deadline
            | Reason::Saturation
            | Reason::Gang
            | Reason::Timeout
    ) && matches!(status, 429 | 503);
    if let (true, Some((variant, pool))) = (capacity, &route) {
        if let Some(secs) = outage_retry(app, variant, pool.as_deref()) {
            return ApiError::new(
                503,
                format!(
                    "every upstream serving `{variant}` is down (its circuit breakers are open); the first may take requests again in about {secs} s"
                ),
            )
            .code("upstream_unavailable")
            .retry_after(Some(secs));
        }
    }
    let not_allowed = policy_reason.as_deref() == Some("model-not-allowed");
    let msg = match reason {
        // Not found (or not for this tier): which model was asked for, and
        // which this tenant may use.
        Reason::Policy if status == 404 || not_allowed => {
            let tenant = ctx.req.tenant.as_deref().unwrap_or("none");
            let g = d.map_or_else(|| app.policy.load().graph.clone(), |d| d.graph.clone());
            let usable = crate::server::surface::usable_models(&g, ctx.req.tenant.as_deref());
            format!(
                "{}: the model `{}` does not exist or tier `{tier}` may not use it; models available to tenant {tenant}: {} (GET /v1/models lists them)",
                policy_msg.unwrap_or_else(|| "not found".into()),
                ctx.client_model.chars().take(100).collect::<String>(),
                crate::server::surface::list_or_none(&usable),
            )
        }
        Reason::Policy => policy_msg.unwrap_or_else(|| "the policy refused this request".into()),
        Reason::Quota | Reason::TierQuota | Reason::ModelQuota | Reason::Concurrency
            if hit.is_some() =>
        {
            format!("refused by {}", hit.unwrap_or_default())
        }
        Reason::Quota => format!("tenant {tenant} is over its token or request quota"),
        Reason::TierQuota => format!(
            "tier {tier} is over its quota (tokens, requests, concurrent requests or GPU-seconds its requests share)"
        ),
        Reason::ModelQuota => format!(
            "model `{}` is over its quota (tokens, requests, concurrent requests or GPU-seconds its requests share)",
            ctx.client_model
        ),
        Reason::Concurrency => format!("tenant {tenant} has as many requests in flight as its quota allows"),
        Reason::Overload => format!("the estimated wait exceeds tier {tier}'s time-to-first-token SLO; retry later"),
        Reason::Deadline => format!("tier {tier}'s completion window cannot be met at the current backlog"),
        Reason::Infeasible => format!(
            "the prompt's prefill alone takes longer than tier {tier}'s time-to-first-token SLO, even on an idle replica: shorten the prompt or use a tier with a longer SLO"
        ),
        Reason::Held => format!("tier {tier}'s work is held by the policy and its queue bound passed; retry later"),
        Reason::Saturation if status == 413 => {
            "the prompt plus max_tokens is larger than any replica of the routed model can hold".into()
        }
        Reason::Saturation | Reason::Gang => "no replica can serve this route now".into(),
        Reason::Timeout => format!(
            "waited longer than its queue bound (tier {tier}'s `queue max_wait`, or `[limits] default_queue_bound` where the policy sets none)"
        ),
        Reason::RetryBudget => format!("tenant {tenant} has spent its retry budget"),
        Reason::SessionBudget => "this agent session has used all the steps its tenant allows".into(),
        Reason::PolicyChanged => "the policy changed while this request waited; retry".into(),
        Reason::Preempted => format!(
            "preempted to make room for a higher tier; tier {tier} declares `on_preempt reject`: retry later"
        ),
        other => format!("refused: {}", other.name()),
    };
    let retry = match (status, retry_after) {
        // A wait estimate is a guess: never one past the hour.
        (429 | 503, Some(r)) if capacity => Some(secs_ceil(app, r).min(MAX_CAPACITY_RETRY_S)),
        (429 | 503, Some(r)) => Some(secs_ceil(app, r)),
        (429 | 503, None) => Some(1),
        _ => None,
    };
    // The policy's own reason where it gives one (`model-not-allowed`,
    // `pool-fenced`), as a code.
    let code = match (status, reason, policy_reason) {
        (404, _, _) => "model_not_found".to_string(),
        (_, Reason::Policy, Some(r)) => r.replace('-', "_"),
        _ => reason.name().to_string(),
    };
    ApiError::new(status, msg)
        .code(code)
        .retry_after(retry)
        .with_headers(rl_headers)
}

/// The longest Retry-After an outage answers with: a breaker reopens (for
/// its trial) within its `open_for`, but an upstream's own Retry-After may
/// hold it open longer; clients should look again within a minute.
const MAX_OUTAGE_RETRY_S: u64 = 60;

/// The longest Retry-After of a capacity refusal (`overload`, `fairness`,
/// …), whose estimate may be unbounded.
const MAX_CAPACITY_RETRY_S: u64 = 3600;

/// When the route (`model.variant`, on `pool` if it names one) is served
/// by HTTP upstreams and every one is down (breaker open, or its half-open
/// trial taken): the seconds until the first may take a request again,
/// from 1 to [`MAX_OUTAGE_RETRY_S`]. `None` when one is ready, or when no
/// upstream serves the route (a simulated or GPU replica does).
fn outage_retry(app: &App, variant: &str, pool: Option<&str>) -> Option<u64> {
    use crate::backend::http::BreakerState;
    let now = std::time::Instant::now();
    let mut earliest: Option<std::time::Duration> = None;
    for b in app.backends.iter() {
        let Backend::Http(u) = b else { continue };
        // Named `pool/model.variant#i` by the deployment.
        let Some((p, rest)) = u.name().split_once('/') else {
            continue;
        };
        let Some((mv, _)) = rest.rsplit_once('#') else {
            continue;
        };
        if mv != variant || pool.is_some_and(|want| want != p) {
            continue;
        }
        if u.ready() {
            return None;
        }
        let wait = match u.state() {
            BreakerState::Open { until } => until.saturating_duration_since(now),
            _ => std::time::Duration::ZERO,
        };
        earliest = Some(earliest.map_or(wait, |e| e.min(wait)));
    }
    earliest.map(|w| (w.as_secs_f64().ceil() as u64).clamp(1, MAX_OUTAGE_RETRY_S))
}
