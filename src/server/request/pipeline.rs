//! Runs one request through the gateway: the gateway's gates, the
//! scheduler (decided, admitted or refused, queued, started), then the
//! backend it started on, and back to the queue when an upstream did not
//! serve it.

use super::gates;
use super::recorder::{self, note, record, tenant_name, End, LeftWhileQueued};
use super::refusal::refusal;
use super::stream::{
    budget_error, serve_scheduled, serve_upstream, Attempt, HttpFail, RESEND_UNSENT,
};
use super::{
    served_substitution, Arrived, CancelGuard, Ctx, Decided, GpuSeconds, Outcome, Started,
    BATCH_HEADER,
};
use crate::backend::Backend;
use crate::graph::{Request, ResponseModel, BATCH_PREEMPTIBLE_HEADER, BATCH_TRY_HEADER};
use crate::sched::{Arrival, Reason};
use crate::server::executor::{Command, Progress};
use crate::server::openai::{ApiError, Endpoint, GenerationRequest};
use crate::server::App;
use axum::response::Response;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Which batch an item belongs to, and what its runner knows of it.
pub(in crate::server) struct BatchItem<'a> {
    pub(in crate::server) batch: &'a str,
    /// Which send of the item this is (1 the first).
    pub(in crate::server) attempt: u32,
    /// Its batch marked its items preemptible (`kiln_preemptible`).
    pub(in crate::server) preemptible: bool,
}

/// One batch item, decided and served like any request of its tenant: the
/// same classify, admission, routing, queues, log and explain. The answer
/// is never a stream; the runner stores its status and body, and bills
/// what [`Outcome::Served`] says it cost.
pub(in crate::server) async fn serve_batch_item(
    app: Arc<App>,
    endpoint: Endpoint,
    tenant: Option<String>,
    item: BatchItem<'_>,
    body: Value,
    window: crate::sched::Micros,
) -> Outcome {
    let BatchItem {
        batch,
        attempt,
        preemptible,
    } = item;
    let received = Instant::now();
    let received_ms = crate::clock::unix_ms();
    let greq = match GenerationRequest::from_value(endpoint, &body) {
        Ok(g) => g,
        Err(e) => return Outcome::Refused(e),
    };
    let arrived = Arrived {
        received,
        received_ms,
        tenant,
        headers: {
            let mut h = BTreeMap::from([(BATCH_HEADER.to_string(), batch.to_string())]);
            // Each send after the first says which try it is: a retry
            // (`kiln_retries_total{reason="batch_item"}`, the decision log).
            if attempt > 1 {
                h.insert(BATCH_TRY_HEADER.to_string(), attempt.to_string());
            }
            // The scheduler reads it; the log keeps it for the replay.
            if preemptible {
                h.insert(BATCH_PREEMPTIBLE_HEADER.to_string(), "true".into());
            }
            h
        },
        tags: vec!["batch".to_string()],
        session: None,
        window: Some(window),
    };
    let big = false;
    match run_request(app, endpoint, greq, body, big, arrived).await {
        Ok(o) => o,
        Err(e) => Outcome::Refused(e),
    }
}

/// Runs an arrived request through the pipeline: counts its prompt, the
/// gateway's gates, the scheduler, the backend it starts on. `Err` is a
/// refusal before the request was recorded (its prompt could not be
/// counted, an operator paused its tenant): its adapter explains it.
pub(in crate::server) async fn run_request(
    app: Arc<App>,
    endpoint: Endpoint,
    greq: GenerationRequest,
    raw: Value,
    big: bool,
    arrived: Arrived,
) -> Result<Outcome, ApiError> {
    let Arrived {
        received,
        received_ms,
        tenant,
        headers: hdrs,
        tags,
        session,
        window,
    } = arrived;
    let policy = app.policy.load_full();
    // Counting a large prompt takes milliseconds: on a blocking thread, so
    // that a few large prompts do not stall every other request (and the
    // health checks) on the async workers.
    // The same pass hashes the prompt's leading tokens into prefix blocks
    // (for the prefix cache and prefix-affinity routing, and the log).
    let blocks = crate::server::prefix::MAX_PREFIX_BLOCKS;
    let (greq, prompt) = if big {
        let tok = app.tokenizer;
        tokio::task::spawn_blocking(move || {
            let n = tok.prompt(&greq, blocks);
            (greq, n)
        })
        .await
        .map_err(|e| ApiError::new(500, format!("counting prompt tokens failed: {e}")))?
    } else {
        let n = app.tokenizer.prompt(&greq, blocks);
        (greq, n)
    };
    let prompt_tokens = prompt.count;
    let max_tokens = greq
        .requested_max_tokens()
        .unwrap_or(app.config.limits.default_max_tokens);
    let req = Request {
        tenant,
        api_key: None,
        model: greq.model.clone(),
        headers: hdrs,
        tags,
        session,
        prompt_tokens,
        max_tokens,
    };
    gates::on_arrival(&app, &req)?;
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let rid = format!("{:x}-{id}", app.boot_ms);
    tracing::Span::current().record("request_id", rid.as_str());
    let explain = recorder::arrived(
        &app,
        window.is_some(),
        &rid,
        endpoint,
        received_ms,
        &req,
        &policy.graph,
    );
    let cache_content = crate::server::cache::content(&policy.graph, &raw);
    let semantic_probe =
        crate::server::cache::probe(&app, &policy.graph, &raw, endpoint, cache_content.is_some())
            .await;
    let ctx = Ctx {
        cache_content,
        semantic_probe,
        app: app.clone(),
        endpoint,
        id,
        rid,
        req,
        body: raw,
        client_model: greq.model.clone(),
        stream: greq.streaming(),
        include_usage: greq.include_usage(),
        received,
        received_ms,
        explain,
        requeued: 0,
        spent_gpu_seconds: 0.0,
        spent_on: None,
        prefix_blocks: prompt.prefix_blocks,
        window,
        claim: None,
    };
    // Every refusal from here on names the request, its explain entry and
    // the version that decided it.
    let (rid, entry) = (ctx.rid.clone(), ctx.explain.clone());
    Ok(match admit_and_run(ctx, max_tokens, prompt_tokens).await {
        Ok(o) => o,
        Err(e) => {
            let ms = received.elapsed().as_secs_f64() * 1000.0;
            Outcome::of_error(crate::server::surface::explain_recorded(
                e,
                &rid,
                &entry,
                ms,
                &policy.version,
            ))
        }
    })
}

/// The gateway's gates before the scheduler ([`gates::before_scheduler`]),
/// then [`run`].
async fn admit_and_run(
    mut ctx: Ctx,
    max_tokens: u64,
    prompt_tokens: u64,
) -> Result<Outcome, ApiError> {
    if let Err(r) = gates::before_scheduler(&mut ctx, max_tokens, prompt_tokens).await {
        let r = *r;
        record(
            &ctx,
            End::Refused {
                d: None,
                reason: r.reason,
                err: &r.err,
            },
        );
        return Err(r.err);
    }
    run(ctx, max_tokens).await
}

/// Submits (and, after a policy swap that removed its tier, re-submits)
/// until the request starts or is refused, then serves it on the backend
/// it started on.
///
/// On an HTTP upstream the request may go back to the queue: when no
/// upstream received it, and (`limits.upstream_retries` times) when one
/// failed before any byte reached the client while another is ready.
/// From its first start on an upstream, everything (calls, retries, the
/// waits in the queue between them) ends within `limits.upstream_budget`.
async fn run(mut ctx: Ctx, max_tokens: u64) -> Result<Outcome, ApiError> {
    let app = ctx.app.clone();
    let limits = &app.config.limits;
    let mut redecided = 0u32;
    let mut resent = 0u32;
    let mut retried = 0u32;
    // Set at the first start on an upstream; the error to answer if the
    // budget runs out while the request waits for another replica.
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut last_error: Option<ApiError> = None;
    // A request preempted off an upstream is still the scheduler's (queued
    // again, or refused per its tier's `on_preempt`): it is not submitted
    // again, its progress is followed on the same channel.
    let mut preempted: Option<(mpsc::UnboundedReceiver<Progress>, CancelGuard, Decided)> = None;
    loop {
        let (rx, guard, decided) = match preempted.take() {
            Some((rx, guard, d)) => (rx, guard, Some(d)),
            None => {
                let (rx, guard) = submit(&ctx, max_tokens)?;
                (rx, guard, None)
            }
        };
        let may_redecide = redecided < limits.max_redecide;
        let waited = match deadline {
            None => wait_for_start(&ctx, rx, guard, may_redecide, decided).await?,
            Some(at) => {
                let wait = wait_for_start(&ctx, rx, guard, may_redecide, decided);
                match tokio::time::timeout_at(at, wait).await {
                    Ok(waited) => waited?,
                    // Dropping the wait cancels the request in the scheduler.
                    Err(_) => {
                        let err = last_error
                            .take()
                            .unwrap_or_else(|| budget_error(&ctx.rid, limits.upstream_budget));
                        note(
                            &ctx,
                            "the upstream budget ran out while it waited for another replica",
                            Some(Reason::Timeout.name()),
                        );
                        record(
                            &ctx,
                            End::Refused {
                                d: None,
                                reason: Reason::Timeout.name(),
                                err: &err,
                            },
                        );
                        return Err(err);
                    }
                }
            }
        };
        let (started, backend, rx, guard) = match waited {
            Waited::CacheHit {
                d,
                key,
                payload,
                similarity,
            } => {
                return Ok(Outcome::CacheHit {
                    rid: ctx.rid.clone(),
                    response: super::cache::serve_hit(&ctx, d, &key, payload, similarity),
                });
            }
            Waited::Started {
                started,
                backend,
                rx,
                guard,
            } => (started, backend, rx, guard),
            Waited::PolicyChanged => {
                redecided += 1;
                note(
                    &ctx,
                    "re-decided under the new policy version",
                    Some(Reason::PolicyChanged.name()),
                );
                continue;
            }
        };
        // The replica may serve a declared substitute: the upstream is asked
        // for the model it serves, and the body reports what the policy says.
        let sub = served_substitution(&ctx, &started);
        let served_model = started
            .route
            .split_once('.')
            .map_or(ctx.req.model.as_str(), |(m, _)| m)
            .to_string();
        if let Some(o) = ctx.body.as_object_mut() {
            if o.get("model").and_then(Value::as_str) != Some(served_model.as_str()) {
                o.insert("model".into(), Value::String(served_model.clone()));
            }
        }
        if let Some(x) = &sub {
            note(
        &ctx,
        format!(
                    "substituted: `{}` serves this request for `{}` (served_by); the response's `model` is `{}`",
                    x.served,
                    x.asked,
                    match x.response_model {
                        ResponseModel::Served => &x.served,
                        ResponseModel::Requested => &x.asked,
                    }
                ),
                None,
            );
        }
        ctx.client_model = match &sub {
            Some(s) if s.response_model == ResponseModel::Served => s.served.clone(),
            _ => ctx.req.model.clone(),
        };
        match backend {
            Backend::Sim | Backend::Cuda(_) => {
                let name = backend.name();
                // Decided and routed here: a field this backend cannot
                // honour is refused (an HTTP upstream would get it as sent).
                if let Err(r) = gates::on_start(&ctx, &name) {
                    let r = *r;
                    record(
                        &ctx,
                        End::Refused {
                            d: Some(&started.d),
                            reason: r.reason,
                            err: &r.err,
                        },
                    );
                    return Err(r.err);
                }
                let rid = ctx.rid.clone();
                return Ok(served(
                    rid,
                    // Boxed, as below: this loop's future stays small.
                    Box::pin(serve_scheduled(ctx, guard, rx, started, &name)).await,
                ));
            }
            Backend::Http(u) => {
                // Whom a requeue below is counted for (`started` goes to
                // the upstream call).
                let who = (started.d.graph.clone(), started.d.tier, started.d.tenant);
                let at = *deadline
                    .get_or_insert_with(|| tokio::time::Instant::now() + limits.upstream_budget);
                ctx.requeued = resent + retried;
                let attempt = Attempt {
                    may_resend: resent < RESEND_UNSENT,
                    may_retry: retried < limits.upstream_retries,
                    deadline: at,
                    budget: limits.upstream_budget,
                };
                let rid = ctx.rid.clone();
                // Boxed: serving is kilobytes of future; inline, it made
                // this loop's (and every caller's) future as large, copied
                // whole at each level when first polled.
                let (back, err, what) = match Box::pin(serve_upstream(
                    ctx, guard, rx, started, u, attempt,
                ))
                .await
                {
                    Ok(r) => return Ok(served(rid, r)),
                    Err(HttpFail::Fatal(e)) => return Err(e),
                    Err(HttpFail::Preempted(p)) => {
                        let p = *p;
                        ctx = p.ctx;
                        recorder::preempted(&ctx, &p.started.d);
                        note(
        &ctx,
        format!(
                                "preempted by request {} on the upstream: its call there was cancelled; the scheduler holds it again",
                                p.by
                            ),
                            Some(Reason::Preempted.name()),
                        );
                        preempted = Some((p.rx, p.guard, p.started.d));
                        continue;
                    }
                    Err(HttpFail::Unsent(back, err)) => {
                        resent += 1;
                        (
                            back,
                            err,
                            (
                                "upstream_unsent",
                                "the upstream never received it (or closed the connection before answering); queued again",
                            ),
                        )
                    }
                    Err(HttpFail::Failed(back, err)) => {
                        retried += 1;
                        (
                            back,
                            err,
                            (
                                "upstream_failed",
                                "the upstream failed before answering; queued again for another replica",
                            ),
                        )
                    }
                };
                let (retry, what) = what;
                let (graph, tier, tenant) = who;
                let tier = graph
                    .tiers
                    .get(tier as usize)
                    .map_or("none", |t| t.name.as_str());
                app.metrics.retry(tier, &tenant_name(&graph, tenant), retry);
                ctx = *back;
                app.exec.send(Command::CheckHealth);
                // Back off (exponentially, with jitter) before queueing it
                // again, within its budget.
                let pause = crate::backend::http::retry_backoff(resent + retried, ctx.id);
                tokio::time::sleep_until((tokio::time::Instant::now() + pause).min(at)).await;
                note(
                    &ctx,
                    format!("{what} ({} {})", err.status, err.message),
                    Some(Reason::Saturation.name()),
                );
                last_error = Some(err);
            }
        }
    }
}

/// A response from a replica, as the pipeline's outcome.
fn served(rid: String, response: Response) -> Outcome {
    let gpu_seconds = response
        .extensions()
        .get::<GpuSeconds>()
        .map_or(0.0, |g| g.0);
    Outcome::Served {
        rid,
        response,
        gpu_seconds,
    }
}

/// Hands the request to the scheduler; its progress comes back on the
/// channel, and the guard cancels it there if the handler goes away.
fn submit(
    ctx: &Ctx,
    max_tokens: u64,
) -> Result<(mpsc::UnboundedReceiver<Progress>, CancelGuard), ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let arrival = Arrival {
        window: ctx.window,
        id: ctx.id,
        request: ctx.req.clone(),
        output_tokens: max_tokens.min(u64::from(u32::MAX)) as u32,
        prefix_blocks: ctx.prefix_blocks.clone(),
        quota_claimed: ctx.claim.as_ref().is_some_and(|c| !c.is_done()),
        fleet: ctx
            .claim
            .as_ref()
            .filter(|c| !c.is_done())
            .map(|c| c.fleet_claim()),
        cache: ctx.cache_content,
        semantic: ctx.semantic_probe.probe(),
    };
    let mut guard = CancelGuard {
        id: ctx.id,
        app: ctx.app.clone(),
        armed: true,
    };
    if !ctx.app.exec.send(Command::Submit {
        arrival,
        events: tx,
        claim: ctx
            .claim
            .clone()
            .map(|c| c as Arc<dyn crate::server::executor::Settle>),
    }) {
        guard.armed = false;
        return Err(ApiError::new(503, "the gateway is shutting down").retry_after(Some(1)));
    }
    Ok((rx, guard))
}

/// How waiting in the scheduler ended, short of a refusal.
enum Waited {
    Started {
        started: Started,
        backend: Backend,
        rx: mpsc::UnboundedReceiver<Progress>,
        guard: CancelGuard,
    },
    /// A policy swap removed what it was decided for: decide it again
    /// (when `may_redecide`; otherwise that is a refusal like any other).
    PolicyChanged,
    /// Answered from its tier's exact or semantic cache.
    CacheHit {
        d: Decided,
        key: crate::sched::cache::Key,
        payload: Option<Arc<str>>,
        similarity: Option<f32>,
    },
}

/// Follows the request through the scheduler until it starts on a replica
/// (or is refused, or must be decided again).
async fn wait_for_start(
    ctx: &Ctx,
    rx: mpsc::UnboundedReceiver<Progress>,
    guard: CancelGuard,
    may_redecide: bool,
    decided: Option<Decided>,
) -> Result<Waited, ApiError> {
    let mut left = LeftWhileQueued {
        ctx,
        decided,
        armed: true,
    };
    let r = wait_inner(ctx, rx, guard, may_redecide, &mut left.decided).await;
    left.armed = false;
    r
}

async fn wait_inner(
    ctx: &Ctx,
    mut rx: mpsc::UnboundedReceiver<Progress>,
    mut guard: CancelGuard,
    may_redecide: bool,
    decided: &mut Option<Decided>,
) -> Result<Waited, ApiError> {
    let mut preempted = 0u32;
    loop {
        let Some(p) = rx.recv().await else {
            guard.armed = false;
            return Err(ApiError::new(503, "the scheduler stopped").retry_after(Some(1)));
        };
        match p {
            Progress::Decided {
                tier,
                tenant,
                fallback_step,
                version,
                graph,
                signals,
                canary,
                at,
                limits,
            } => {
                let (dversion, pgraph, psignals) = match &canary {
                    Some(c) => (c.version.clone(), c.graph.clone(), c.signals.clone()),
                    None => (version, graph.clone(), signals),
                };
                let d = Decided {
                    tier,
                    tenant,
                    fallback_step,
                    version: dversion,
                    graph,
                    policy_graph: pgraph,
                    policy_signals: psignals,
                    canary: canary.is_some(),
                    cache: None,
                    limits,
                };
                // An override refusal returns here; the guard cancels the
                // request in the scheduler.
                note_decided(ctx, &d, at)?;
                *decided = Some(d);
            }
            Progress::Rejected {
                reason: Reason::PolicyChanged,
                ..
            } if may_redecide => {
                guard.armed = false;
                return Ok(Waited::PolicyChanged);
            }
            Progress::Rejected {
                reason,
                status,
                retry_after,
                limits,
            } => {
                guard.armed = false;
                let err = refusal(
                    ctx,
                    decided.as_ref(),
                    reason,
                    status,
                    retry_after,
                    limits.as_ref(),
                );
                record(
                    ctx,
                    End::Refused {
                        d: decided.as_ref(),
                        reason: reason.name(),
                        err: &err,
                    },
                );
                return Err(err);
            }
            Progress::Preempted { by } => {
                preempted += 1;
                note(
                    ctx,
                    format!("preempted by request {by}; queued again at the head"),
                    Some(Reason::Preempted.name()),
                );
            }
            Progress::Started {
                replica,
                route,
                backend,
                waited_for,
                at,
            } => {
                let Some(d) = decided.take() else {
                    guard.armed = false;
                    return Err(ApiError::new(500, "started before a decision"));
                };
                recorder::started(ctx, replica, &route, waited_for, at);
                let started = Started {
                    d,
                    route,
                    replica,
                    waited_for,
                    queue_s: ctx.received.elapsed().as_secs_f64(),
                    preempted,
                };
                return Ok(Waited::Started {
                    started,
                    backend,
                    rx,
                    guard,
                });
            }
            Progress::CacheMiss { key } => {
                if let Some(d) = decided.as_mut() {
                    d.cache = Some(key);
                    super::cache::missed(ctx, d);
                }
            }
            Progress::CacheHit {
                key,
                payload,
                similarity,
            } => {
                guard.armed = false;
                let Some(d) = decided.take() else {
                    return Err(ApiError::new(500, "answered before a decision"));
                };
                return Ok(Waited::CacheHit {
                    d,
                    key,
                    payload,
                    similarity,
                });
            }
            Progress::Tokens { .. } | Progress::FirstToken | Progress::Finished { .. } => {}
        }
    }
}

/// What a decision means before the request starts: explain records the
/// version that decided, a canary or shadow version counts it, and an
/// operator's override on its tier refuses it.
fn note_decided(ctx: &Ctx, d: &Decided, at: crate::sched::Micros) -> Result<(), ApiError> {
    let app = &ctx.app;
    recorder::decided(ctx, d, at);
    let tname = d
        .graph
        .tiers
        .get(d.tier as usize)
        .map(|t| t.name.as_str())
        .unwrap_or("?");
    if d.canary {
        app.gov.count_canary();
        app.metrics.canary_request(&d.version);
        note(
            ctx,
            format!("decided by the canary version {}", d.version),
            None,
        );
    } else if let Some(sh) = app.gov.shadow() {
        // Without a canary the deciding version and signals are the
        // active ones.
        let differ = crate::governance::shadow::shadow_compare(
            &sh,
            &d.version,
            &ctx.req,
            &d.graph,
            &d.policy_signals,
        );
        if let Some(fields) = differ {
            app.metrics.shadow(&sh.version, &fields);
        }
    }
    if let Err(refused) = gates::on_decision(ctx, d) {
        let (r, err) = *refused;
        record(
            ctx,
            End::Overridden {
                d,
                r: &r,
                err: &err,
            },
        );
        return Err(err);
    }
    note(ctx, format!("decided: tier {tname}"), None);
    if let Some(step) = d.fallback_step {
        let tn = tenant_name(&d.graph, d.tenant);
        app.metrics.fallback(tname, &tn, step.saturating_add(1));
    }
    Ok(())
}
