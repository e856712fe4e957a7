//! The one path from a backend's output to the client. Whatever produces
//! a request's tokens (the scheduler's steps on a simulated or GPU
//! replica, or an OpenAI-compatible upstream), it is turned into a stream
//! of [`Piece`]s, and one function answers from them: a whole JSON body or
//! server-sent events, with the same finish handling, usage chunk,
//! time-to-first-token, accounting and cancellation for every backend.

use super::recorder::{kiln_headers, note, record, with_headers, End};
use super::{CancelGuard, Ctx, Started};
use crate::backend::http::{Upstream, UpstreamError};
use crate::backend::placeholder::{self, Placeholder, Render};
use crate::backend::Backend;
use crate::sched::{Micros, Reason, ReqId};
use crate::server::executor::{Command, Progress};
use crate::server::metrics::Outcome as MetricOutcome;
use crate::server::openai::{ApiError, Endpoint};
use axum::body::{Body, Bytes};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::mpsc;

/// One step of a generation, from whichever backend produced it.
enum Piece {
    /// `n` more tokens the scheduler produced (kiln renders their text),
    /// with the GPU time the sequence has used so far.
    Tokens { n: u32, gpu_seconds: f64 },
    /// A streaming chunk an upstream sent, in OpenAI's shape.
    Chunk(Value),
    /// A non-streaming upstream's whole answer.
    Whole(crate::backend::http::Answer),
    /// The scheduler preempted the sequence (it will resume).
    Preempted(ReqId),
    /// The end: GPU time (and the part of it that recomputed KV lost to
    /// a preemption) and the scheduler-clock finish, where known.
    End {
        gpu_seconds: f64,
        wasted: f64,
        at: Option<Micros>,
    },
    /// A failure; nothing follows.
    Failed {
        err: ApiError,
        outcome: MetricOutcome,
    },
    /// The scheduler refused it after it ran (preempted, and its tier says
    /// `on_preempt reject`); nothing follows.
    Refused {
        reason: Reason,
        status: u16,
        retry_after: Option<Micros>,
        limits: Option<crate::sched::ratelimit::RateLimits>,
    },
}

/// Who produced the pieces, which says who renders text and who must be
/// told the request ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Producer {
    /// The scheduler's own steps: kiln writes the text, the role and the
    /// finish chunks, and the scheduler already knows the request ended.
    Scheduler,
    /// An upstream: its chunks pass through (model name rewritten), and
    /// the scheduler is told how many tokens it produced.
    Upstream,
}

/// Serves a request started on a simulated or GPU replica.
pub(in crate::server) async fn serve_scheduled(
    ctx: Ctx,
    guard: CancelGuard,
    rx: mpsc::UnboundedReceiver<Progress>,
    s: Started,
    backend: &str,
) -> Response {
    let headers = kiln_headers(&ctx, &s, backend);
    let pieces = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
        .filter_map(|p| async move {
            match p {
                Progress::Tokens { n, gpu_seconds } => Some(Piece::Tokens { n, gpu_seconds }),
                Progress::Finished {
                    gpu_seconds,
                    wasted_gpu_seconds,
                    at,
                } => Some(Piece::End {
                    gpu_seconds,
                    wasted: wasted_gpu_seconds,
                    at: Some(at),
                }),
                Progress::Preempted { by } => Some(Piece::Preempted(by)),
                Progress::Rejected {
                    reason,
                    status,
                    retry_after,
                    limits,
                } => Some(Piece::Refused {
                    reason,
                    status,
                    retry_after,
                    limits,
                }),
                _ => None,
            }
        })
        // The channel closing before the end means the scheduler stopped.
        .chain(stream::once(async {
            Piece::Failed {
                err: ApiError::new(503, "the scheduler stopped"),
                outcome: MetricOutcome::UpstreamError,
            }
        }))
        .boxed();
    respond(ctx, guard, s, headers, pieces, Producer::Scheduler, None)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// How many times a request no upstream received is queued again.
/// Enough for a dead upstream's breaker to open (5 failures by default)
/// and the request to reach a live one; refused connections fail at once.
pub(in crate::server) const RESEND_UNSENT: u32 = 8;

/// What a call to an upstream may still do if it fails before any byte
/// reached the client.
pub(in crate::server) struct Attempt {
    /// Go back to the queue if the upstream never received it.
    pub(in crate::server) may_resend: bool,
    /// Go back to the queue, for another replica, after an upstream
    /// failure (5xx, 429, timeout, broken connection, protocol error).
    pub(in crate::server) may_retry: bool,
    /// When the request's upstream budget runs out.
    pub(in crate::server) deadline: tokio::time::Instant,
    /// The budget, for messages.
    pub(in crate::server) budget: std::time::Duration,
}

pub(in crate::server) enum HttpFail {
    Fatal(ApiError),
    /// The upstream never saw the request (`Unsent`), or failed before any
    /// byte reached the client (`Failed`): it may go to another replica.
    /// The error is what to answer if none serves it in time.
    Unsent(Box<Ctx>, ApiError),
    Failed(Box<Ctx>, ApiError),
    /// The scheduler preempted it before any byte reached the client: the
    /// upstream's request was dropped (so the upstream aborts it and frees
    /// its slot), and the scheduler holds it again, queued or refused as
    /// its tier's `on_preempt` says; its progress keeps coming on `rx`.
    Preempted(Box<Requeued>),
}

/// A request preempted off an upstream, still the scheduler's.
pub(in crate::server) struct Requeued {
    pub(in crate::server) ctx: Ctx,
    pub(in crate::server) rx: mpsc::UnboundedReceiver<Progress>,
    pub(in crate::server) guard: CancelGuard,
    pub(in crate::server) started: Started,
    pub(in crate::server) by: ReqId,
}

/// Resolves when the scheduler announces that it preempted this request;
/// other progress is skipped, and a closed channel never resolves.
async fn preemption(rx: &mut mpsc::UnboundedReceiver<Progress>) -> ReqId {
    loop {
        match rx.recv().await {
            Some(Progress::Preempted { by }) => return by,
            Some(_) => {}
            None => std::future::pending::<()>().await,
        }
    }
}

/// An upstream call, or the preemption that cut it short.
enum Raced<T> {
    Done(T),
    Preempted(ReqId),
}

/// The error event that ends a stream whose request was preempted after
/// its answer began.
fn preempted_error(rid: &str, by: ReqId) -> ApiError {
    ApiError::new(
        503,
        format!(
            "request {rid} was preempted by request {by} of a higher tier after its stream began; the upstream's generation was cancelled and this stream ends here: send the request again"
        ),
    )
    .code("preempted")
    .retry_after(Some(1))
}

/// How a call failed before the answer began.
enum Before {
    Upstream(UpstreamError),
    /// The upstream budget ran out.
    Budget,
}

/// Serves a request started on an HTTP upstream. Until the first byte of
/// the answer, a failure may send it back to the queue (per `attempt`);
/// the whole exchange ends by `attempt.deadline`.
pub(in crate::server) async fn serve_upstream(
    ctx: Ctx,
    guard: CancelGuard,
    mut rx: mpsc::UnboundedReceiver<Progress>,
    s: Started,
    up: Arc<Upstream>,
    attempt: Attempt,
) -> Result<Response, HttpFail> {
    // The slot is held from here: its GPU time is charged to the request.
    let mut hold = up.hold();
    let headers = kiln_headers(&ctx, &s, &format!("http:{}", up.name()));
    let path = ctx.endpoint.path();
    let payload = up.payload(
        &ctx.body,
        ctx.stream,
        crate::backend::http::StreamOptions::UsageOnly,
    );
    // W3C trace context: the client's trace (or the one the gateway
    // started for it) continued, kiln's span (stamped on arrival) as the
    // parent.
    let traceparent = Some(
        ctx.req
            .headers
            .get("traceparent")
            .and_then(|v| crate::backend::http::trace::TraceParent::parse(v))
            .unwrap_or_else(|| crate::backend::http::trace::TraceParent::child_of(None))
            .to_string(),
    );
    let rid = ctx.rid.clone();
    let deadline = attempt.deadline;
    let budget = attempt.budget;
    // Until the answer begins, a preemption drops the call (the upstream
    // sees the disconnect and aborts) and hands the request back to the
    // scheduler's queue.
    let pieces = if ctx.stream {
        let open = async {
            let call = async {
                match payload {
                    Ok(p) => up.stream_payload(path, p, traceparent).await,
                    Err(e) => Err(e),
                }
            };
            let opened = match tokio::time::timeout_at(deadline, call).await {
                Ok(Ok(chunks)) => Ok(Box::pin(chunks)),
                Ok(Err(e)) => Err(Before::Upstream(e)),
                Err(_) => Err(Before::Budget),
            };
            // The first chunk is awaited before the answer begins, so a
            // stream that fails at once can still go to another replica.
            match opened {
                Ok(mut chunks) => match tokio::time::timeout_at(deadline, chunks.next()).await {
                    Ok(Some(Ok(v))) => Ok((Some(v), chunks)),
                    Ok(None) => Ok((None, chunks)),
                    Ok(Some(Err(e))) => Err(Before::Upstream(e)),
                    Err(_) => Err(Before::Budget),
                },
                Err(e) => Err(e),
            }
        };
        let left = LeftBeforeAnswer::new(&ctx, &s);
        let raced = tokio::select! {
            first = open => Raced::Done(first),
            by = preemption(&mut rx) => Raced::Preempted(by),
        };
        left.disarm();
        let first = match raced {
            Raced::Done(first) => first,
            Raced::Preempted(by) => return Err(requeued(ctx, guard, rx, s, by, &mut hold)),
        };
        match first {
            Ok((first, chunks)) => {
                // After the answer began, a preemption ends the stream with
                // an error event (the chunks' drop cancels the upstream).
                let rest = stream::unfold(Some((chunks, rx)), move |state| {
                    let rid = rid.clone();
                    async move {
                        let (mut chunks, mut rx) = state?;
                        let raced = tokio::select! {
                            c = tokio::time::timeout_at(deadline, chunks.next()) => Raced::Done(c),
                            by = preemption(&mut rx) => Raced::Preempted(by),
                        };
                        let next = match raced {
                            Raced::Done(c) => c,
                            Raced::Preempted(by) => {
                                return Some((
                                    Piece::Failed {
                                        err: preempted_error(&rid, by),
                                        outcome: MetricOutcome::Preempted,
                                    },
                                    None,
                                ))
                            }
                        };
                        match next {
                            Ok(Some(Ok(v))) => Some((Piece::Chunk(v), Some((chunks, rx)))),
                            Ok(Some(Err(e))) => Some((upstream_failure(&rid, &e), None)),
                            Ok(None) => Some((
                                Piece::End {
                                    gpu_seconds: 0.0,
                                    wasted: 0.0,
                                    at: None,
                                },
                                None,
                            )),
                            Err(_) => Some((
                                Piece::Failed {
                                    err: budget_error(&rid, budget),
                                    outcome: MetricOutcome::Timeout,
                                },
                                None,
                            )),
                        }
                    }
                });
                stream::iter(first.map(Piece::Chunk)).chain(rest).boxed()
            }
            Err(e) => return Err(before_answer(ctx, guard, (&s, &mut hold), &up, &attempt, e)),
        }
    } else {
        // A batch item (it has a window) calls as a batch: its 5xx
        // answers do not count against the breaker.
        let class = if ctx.window.is_some() {
            crate::backend::http::CallClass::Batch
        } else {
            crate::backend::http::CallClass::Online
        };
        let call = async {
            match payload {
                Ok(p) => up.complete_payload(path, p, class, traceparent).await,
                Err(e) => Err(e),
            }
        };
        let call = tokio::time::timeout_at(deadline, call);
        let left = LeftBeforeAnswer::new(&ctx, &s);
        let raced = tokio::select! {
            r = call => Raced::Done(r),
            by = preemption(&mut rx) => Raced::Preempted(by),
        };
        left.disarm();
        let answer = match raced {
            Raced::Done(r) => r,
            Raced::Preempted(by) => return Err(requeued(ctx, guard, rx, s, by, &mut hold)),
        };
        drop(rx);
        match answer {
            Ok(Ok(v)) => stream::iter([
                Piece::Whole(v),
                Piece::End {
                    gpu_seconds: 0.0,
                    wasted: 0.0,
                    at: None,
                },
            ])
            .boxed(),
            Ok(Err(e)) => {
                return Err(before_answer(
                    ctx,
                    guard,
                    (&s, &mut hold),
                    &up,
                    &attempt,
                    Before::Upstream(e),
                ))
            }
            Err(_) => {
                return Err(before_answer(
                    ctx,
                    guard,
                    (&s, &mut hold),
                    &up,
                    &attempt,
                    Before::Budget,
                ))
            }
        }
    };
    // Boxed: the answer's future is kilobytes (see `run`).
    Box::pin(respond(
        ctx,
        guard,
        s,
        headers,
        pieces,
        Producer::Upstream,
        Some(hold),
    ))
    .await
    .map_err(HttpFail::Fatal)
}

/// Records a request whose client went away while its upstream call had
/// not answered yet (the handler, and this with it, is dropped mid-wait):
/// cancelled, with nothing produced. The request's [`CancelGuard`], dropped
/// just after, cancels it in the scheduler (which charges the prompt).
struct LeftBeforeAnswer<'a> {
    ctx: &'a Ctx,
    s: &'a Started,
    armed: bool,
}

impl<'a> LeftBeforeAnswer<'a> {
    fn new(ctx: &'a Ctx, s: &'a Started) -> Self {
        LeftBeforeAnswer {
            ctx,
            s,
            armed: true,
        }
    }

    /// The wait ended some other way: whoever handles that records it.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for LeftBeforeAnswer<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        note(
            self.ctx,
            "the client went away before the upstream answered: cancelled",
            Some("client_disconnected"),
        );
        record(
            self.ctx,
            End::Ran {
                s: self.s,
                output_tokens: 0,
                ttft_s: None,
                outcome: MetricOutcome::Cancelled,
                // Its earlier attempts' (this one's slot is released
                // uncharged when the call is dropped).
                gpu_seconds: self.ctx.spent_gpu_seconds,
                wasted_gpu_seconds: self.ctx.spent_gpu_seconds,
                status: None,
            },
        );
    }
}

/// A call cut short by a preemption before the answer began: the call
/// is already dropped; the request is the scheduler's again.
fn requeued(
    mut ctx: Ctx,
    guard: CancelGuard,
    rx: mpsc::UnboundedReceiver<Progress>,
    started: Started,
    by: ReqId,
    hold: &mut crate::backend::http::Hold,
) -> HttpFail {
    ctx.spent_gpu_seconds += hold.release();
    ctx.spent_on = Some(started.route.clone());
    HttpFail::Preempted(Box::new(Requeued {
        ctx,
        rx,
        guard,
        started,
        by,
    }))
}

/// A call that failed before any byte reached the client: the request
/// goes back to the queue when it may (never received; or failed while
/// another upstream is ready), else it ends with an explicit error.
fn before_answer(
    mut ctx: Ctx,
    mut guard: CancelGuard,
    (s, hold): (&Started, &mut crate::backend::http::Hold),
    up: &Arc<Upstream>,
    attempt: &Attempt,
    e: Before,
) -> HttpFail {
    guard.armed = false;
    // The slot it held served nothing, whatever comes next.
    ctx.spent_gpu_seconds += hold.release();
    ctx.spent_on = Some(s.route.clone());
    report_output(&ctx, 0);
    let (err, outcome) = match &e {
        Before::Upstream(e) => {
            let err = upstream_error(&ctx.rid, e);
            if attempt.may_resend && e.may_resend() {
                return HttpFail::Unsent(Box::new(ctx), err);
            }
            if attempt.may_retry && e.is_upstream_failure() && another_ready(&ctx, up) {
                return HttpFail::Failed(Box::new(ctx), err);
            }
            let outcome = if e.http_status() == 504 {
                MetricOutcome::Timeout
            } else {
                MetricOutcome::UpstreamError
            };
            (err, outcome)
        }
        Before::Budget => (
            budget_error(&ctx.rid, attempt.budget),
            MetricOutcome::Timeout,
        ),
    };
    record(
        &ctx,
        End::Ran {
            s,
            output_tokens: 0,
            ttft_s: None,
            outcome,
            gpu_seconds: ctx.spent_gpu_seconds,
            wasted_gpu_seconds: ctx.spent_gpu_seconds,
            status: Some(err.status),
        },
    );
    HttpFail::Fatal(err)
}

/// Whether an upstream other than `up` would take a request now.
fn another_ready(ctx: &Ctx, up: &Arc<Upstream>) -> bool {
    ctx.app.backends.iter().any(|b| match b {
        Backend::Http(other) => !Arc::ptr_eq(other, up) && other.ready(),
        _ => false,
    })
}

/// The answer when a request's upstream budget runs out.
pub(in crate::server) fn budget_error(rid: &str, budget: std::time::Duration) -> ApiError {
    ApiError::new(
        504,
        format!(
            "request {rid}: no upstream answered within the upstream budget of {} (`[limits] upstream_budget`)",
            crate::units::duration::format(budget)
        ),
    )
    .code("upstream_budget_exceeded")
}

fn upstream_failure(rid: &str, e: &UpstreamError) -> Piece {
    let outcome = if e.http_status() == 504 {
        MetricOutcome::Timeout
    } else {
        MetricOutcome::UpstreamError
    };
    Piece::Failed {
        err: upstream_error(rid, e),
        outcome,
    }
}

/// Tells the scheduler how many tokens an upstream produced (it ends the
/// request there).
fn report_output(ctx: &Ctx, tokens: u64) {
    ctx.app.exec.send(Command::Complete {
        id: ctx.id,
        output_tokens: saturating_u32(tokens),
    });
}

fn saturating_u32(tokens: u64) -> u32 {
    u32::try_from(tokens).unwrap_or(u32::MAX)
}

/// What has been produced so far, for the usage and the accounting.
struct Tally {
    /// Tokens produced (scheduler tokens, or upstream chunks with text).
    produced: u64,
    /// What the upstream's usage said it produced, when it did.
    usage_completion: Option<u64>,
    /// Seconds from receipt to the first token.
    ttft: Option<f64>,
    /// An upstream produces the tokens: the scheduler learns of the first
    /// one from here (for the tier's TTFT signals).
    upstream: bool,
    /// GPU time the scheduler's replica has spent on it so far.
    gpu_seconds: f64,
    /// Of a served one's, the part that recomputed KV lost to a preemption.
    wasted: f64,
    /// An upstream's slot: what it is charged instead (see
    /// `backend::http::meter`).
    hold: Option<crate::backend::http::Hold>,
}

impl Tally {
    fn output(&self) -> u64 {
        self.usage_completion.unwrap_or(self.produced)
    }

    fn first_token(&mut self, ctx: &Ctx) {
        if self.ttft.is_none() {
            // A whole answer's first token is its last: the scheduler
            // hears of it with the end (`Command::Ended`).
            if self.upstream && ctx.stream {
                ctx.app.exec.send(Command::FirstToken(ctx.id));
            }
            // A stream's first token (a whole answer's is its last) steers
            // an engine-aware upstream's adaptive limit.
            if let (true, Some(hold)) = (ctx.stream, self.hold.as_mut()) {
                hold.first_token();
            }
            self.ttft = Some(ctx.received.elapsed().as_secs_f64());
        }
    }

    /// Takes what an upstream's chunk or answer says it produced.
    fn usage(&mut self, v: &Value) {
        if let Some(u) = v
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64)
        {
            self.usage_completion = Some(u);
        }
    }
}

/// Answers from the pieces: a whole body, or server-sent events. Pieces
/// after the first `End` or `Failed` are not read.
async fn respond(
    ctx: Ctx,
    guard: CancelGuard,
    s: Started,
    headers: Vec<(&'static str, String)>,
    pieces: BoxStream<'static, Piece>,
    producer: Producer,
    hold: Option<crate::backend::http::Hold>,
) -> Result<Response, ApiError> {
    let pieces = pieces
        .scan(false, |ended, p| {
            let next = (!*ended).then(|| {
                *ended = matches!(
                    p,
                    Piece::End { .. } | Piece::Failed { .. } | Piece::Refused { .. }
                );
                p
            });
            std::future::ready(next)
        })
        .boxed();
    let s_cache = s.d.cache;
    let ctx_chat = ctx.endpoint == Endpoint::Chat;
    let ctx_body = if producer == Producer::Scheduler {
        ctx.body.clone()
    } else {
        Value::Null
    };
    let gen = Generation {
        ctx,
        guard,
        s,
        producer,
        tally: Tally {
            produced: 0,
            usage_completion: None,
            ttft: None,
            upstream: producer == Producer::Upstream,
            gpu_seconds: 0.0,
            wasted: 0.0,
            hold,
        },
        created: created(),
        kept: Kept::for_request(&s_cache),
        sim: Render::new(
            // What cannot be planned was refused before it was queued.
            placeholder::plan(ctx_chat, &ctx_body)
                .unwrap_or(Placeholder::Text { stop: Vec::new() }),
        ),
    };
    if gen.ctx.stream {
        Ok(gen.stream(headers, pieces))
    } else {
        gen.whole(headers, pieces).await
    }
}

/// One request's answer in the making.
struct Generation {
    ctx: Ctx,
    /// Cancels the request in the scheduler if the answer is dropped
    /// before it ends (the client went away).
    guard: CancelGuard,
    s: Started,
    producer: Producer,
    tally: Tally,
    created: i64,
    /// A streamed answer of a cacheable miss, gathered to be stored.
    kept: Option<Kept>,
    /// What the scheduler's tokens say (placeholder text, JSON, a tool
    /// call): see [`crate::backend::placeholder`].
    sim: Render,
}

/// A streamed answer gathered for the exact cache, up to its byte bound;
/// given up (`None`) past it, or when it calls tools (a stream's tool
/// calls come in pieces kiln does not reassemble).
struct Kept {
    text: String,
    finish: Option<String>,
}

impl Kept {
    fn for_request(cache: &Option<crate::sched::cache::Key>) -> Option<Kept> {
        cache.map(|_| Kept {
            text: String::new(),
            finish: None,
        })
    }
}

/// Adds text to the gathered answer; drops it past the byte bound.
fn keep(kept: &mut Option<Kept>, text: &str) {
    if let Some(k) = kept.as_mut() {
        if (k.text.len() + text.len()) as u64
            > crate::sched::cache::Bounds::default().max_entry_bytes
        {
            *kept = None;
        } else {
            k.text.push_str(text);
        }
    }
}

impl Generation {
    /// The request ended (served or failed): the guard stands down, the
    /// scheduler hears about an upstream's output, and the request is
    /// measured, logged and explained.
    /// `status` is the one the client got: an error's, or 200 once an
    /// answer (or an event stream's headers) went out.
    /// Returns the GPU-seconds charged (an upstream's slot time).
    fn settle(
        &mut self,
        outcome: MetricOutcome,
        gpu_seconds: f64,
        at: Option<Micros>,
        status: Option<u16>,
    ) -> f64 {
        // An upstream's: its slot time, and its earlier attempts'.
        let spent = self.ctx.spent_gpu_seconds;
        let gpu_seconds = match self.tally.hold.as_mut() {
            Some(hold) => hold.release() + spent,
            None => gpu_seconds + spent,
        };
        self.guard.armed = false;
        if let Some(at) = at {
            super::recorder::finished_at(&self.ctx, at);
        }
        if self.producer == Producer::Upstream {
            // Its output, and a cancel in the same command: a preemption
            // may have crossed the end (the scheduler queued it again just
            // before it heard of the end, or it was cut off mid-stream),
            // and then it must not start again for a client that has its
            // answer.
            self.ctx.app.exec.send(Command::Ended {
                id: self.ctx.id,
                output_tokens: saturating_u32(self.tally.output()),
                first_token: !self.ctx.stream && self.tally.ttft.is_some(),
            });
        }
        let (out, ttft) = (self.tally.output(), self.tally.ttft);
        // A served answer wasted only its recompute and its earlier
        // attempts; any other end, all of it.
        let wasted_gpu_seconds = match outcome {
            MetricOutcome::Ok => (self.tally.wasted + spent).clamp(0.0, gpu_seconds.max(0.0)),
            _ => gpu_seconds,
        };
        record(
            &self.ctx,
            End::Ran {
                s: &self.s,
                output_tokens: out,
                ttft_s: ttft,
                outcome,
                gpu_seconds,
                wasted_gpu_seconds,
                status,
            },
        );
        gpu_seconds
    }

    /// Refused after it ran: answered and recorded as a refusal, charged
    /// the GPU time it used (all of it wasted).
    fn refused(
        &mut self,
        reason: Reason,
        status: u16,
        retry_after: Option<Micros>,
        limits: Option<&crate::sched::ratelimit::RateLimits>,
    ) -> ApiError {
        self.guard.armed = false;
        let used = match self.tally.hold.as_mut() {
            Some(hold) => hold.release(),
            None => self.tally.gpu_seconds,
        };
        self.ctx.spent_gpu_seconds += used;
        self.ctx.spent_on = Some(self.s.route.clone());
        let err = super::refusal::refusal(
            &self.ctx,
            Some(&self.s.d),
            reason,
            status,
            retry_after,
            limits,
        );
        record(
            &self.ctx,
            End::Refused {
                d: Some(&self.s.d),
                reason: reason.name(),
                err: &err,
            },
        );
        err
    }

    fn preempted(&self, by: ReqId) {
        super::recorder::preempted(&self.ctx, &self.s.d);
        note(
            &self.ctx,
            format!("preempted by request {by}"),
            Some(Reason::Preempted.name()),
        );
    }

    fn tokens(&mut self, n: u32, gpu_seconds: f64) {
        if n > 0 {
            self.tally.first_token(&self.ctx);
        }
        self.tally.produced += u64::from(n);
        self.tally.gpu_seconds = self.tally.gpu_seconds.max(gpu_seconds);
    }

    async fn whole(
        mut self,
        mut headers: Vec<(&'static str, String)>,
        mut pieces: BoxStream<'static, Piece>,
    ) -> Result<Response, ApiError> {
        let mut answer: Option<crate::backend::http::Answer> = None;
        while let Some(p) = pieces.next().await {
            match p {
                Piece::Tokens { n, gpu_seconds } => self.tokens(n, gpu_seconds),
                Piece::Chunk(_) => {}
                Piece::Whole(mut v) => {
                    // A whole answer's first token is its last.
                    self.tally.first_token(&self.ctx);
                    self.tally.usage_completion = Some(v.completion_tokens());
                    v.set_model(&self.ctx.client_model);
                    answer = Some(v);
                }
                Piece::Preempted(by) => self.preempted(by),
                Piece::End {
                    gpu_seconds,
                    wasted,
                    at,
                } => {
                    self.tally.wasted = wasted;
                    let gpu_seconds = self.settle(MetricOutcome::Ok, gpu_seconds, at, Some(200));
                    // What the answer cost (the batch runner bills it).
                    if gpu_seconds > 0.0 {
                        headers.push(("x-kiln-gpu-seconds", format!("{gpu_seconds:.6}")));
                    }
                    let body = match answer {
                        // An upstream's answer goes out as it came, its
                        // model rewritten: parsing it whole and printing it
                        // again was a tenth of the gateway's own work.
                        Some(a) => {
                            let bytes = a.to_vec();
                            if self.s.d.cache.is_some() {
                                // The bytes the client gets, parsed once.
                                let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                                super::cache::store(&self.ctx, &self.s.d, &v);
                            }
                            let mut r = Response::new(Body::from(bytes));
                            r.headers_mut().insert(
                                axum::http::header::CONTENT_TYPE,
                                HeaderValue::from_static("application/json"),
                            );
                            r
                        }
                        None => {
                            let n = self.tally.produced;
                            let prompt = self.ctx.req.prompt_tokens;
                            let text = self.sim.token(&sim_text(0, n)) + &self.sim.end();
                            let finish = self.sim.finish_reason();
                            let mut b = full_body(&self.ctx, &text, prompt, n, finish, "kiln-sim");
                            if let Some(calls) = self.sim.tool_calls(&self.ctx.rid, false) {
                                let m = &mut b["choices"][0]["message"];
                                m["content"] = Value::Null;
                                m["tool_calls"] = calls;
                            }
                            super::cache::store(&self.ctx, &self.s.d, &b);
                            axum::Json(b).into_response()
                        }
                    };
                    let mut resp = with_headers(body, headers);
                    resp.extensions_mut().insert(super::GpuSeconds(gpu_seconds));
                    return Ok(resp);
                }
                Piece::Failed { err, outcome } => {
                    self.settle(outcome, 0.0, None, Some(err.status));
                    return Err(err);
                }
                Piece::Refused {
                    reason,
                    status,
                    retry_after,
                    limits,
                } => return Err(self.refused(reason, status, retry_after, limits.as_ref())),
            }
        }
        // Every source ends with `End` or `Failed`.
        self.settle(MetricOutcome::UpstreamError, 0.0, None, Some(503));
        Err(ApiError::new(503, "the scheduler stopped"))
    }

    fn stream(
        mut self,
        headers: Vec<(&'static str, String)>,
        pieces: BoxStream<'static, Piece>,
    ) -> Response {
        // Kiln writes the role chunk for the text it renders itself.
        let opening = match self.producer {
            Producer::Scheduler => {
                let c = chunk(&self.ctx, self.created, Some(""), true, None);
                Some(Ok::<Bytes, std::convert::Infallible>(sse(&c)))
            }
            Producer::Upstream => None,
        };
        // The generation (its guard included) moves into the stream, so a
        // client that goes away drops the guard and cancels the request.
        let events = pieces.filter_map(move |p| std::future::ready(self.frame(p).map(Ok)));
        let body = stream::iter(opening).chain(events);
        sse_response(Body::from_stream(body), headers)
    }

    /// The bytes one piece adds to the event stream, if any.
    fn frame(&mut self, p: Piece) -> Option<Bytes> {
        match p {
            Piece::Tokens { n: 0, .. } => None,
            Piece::Tokens { n, gpu_seconds } => {
                let mut b = Vec::new();
                for i in 0..u64::from(n) {
                    let t = self.sim.token(&sim_text(self.tally.produced + i, 1));
                    if t.is_empty() {
                        continue;
                    }
                    keep(&mut self.kept, &t);
                    let c = chunk(&self.ctx, self.created, Some(&t), false, None);
                    b.extend_from_slice(&sse(&c));
                }
                self.tokens(n, gpu_seconds);
                Some(Bytes::from(b))
            }
            Piece::Chunk(mut v) => {
                self.tally.usage(&v);
                let has_text = v["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                    || v["choices"][0]["text"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty());
                if has_text {
                    self.tally.first_token(&self.ctx);
                    self.tally.produced += 1;
                }
                if self.kept.is_some() {
                    let c = &v["choices"][0];
                    if !c["delta"]["tool_calls"].is_null() || !c["delta"]["function_call"].is_null()
                    {
                        self.kept = None;
                    }
                    let t = c["delta"]["content"].as_str().or(c["text"].as_str());
                    keep(&mut self.kept, t.unwrap_or(""));
                    if let (Some(k), Some(f)) = (self.kept.as_mut(), c["finish_reason"].as_str()) {
                        k.finish = Some(f.to_string());
                    }
                }
                let choices_empty = v["choices"].as_array().is_none_or(|c| c.is_empty());
                let include_usage = self.ctx.include_usage;
                if choices_empty && !include_usage {
                    return None; // the usage chunk kiln asked for, not the client
                }
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("model".into(), json!(self.ctx.client_model));
                    if !include_usage {
                        obj.remove("usage");
                    }
                }
                Some(sse(&v))
            }
            // Only non-streaming calls give whole answers.
            Piece::Whole(v) => Some(sse(&v.to_value())),
            Piece::Preempted(by) => {
                self.preempted(by);
                None
            }
            Piece::End {
                gpu_seconds,
                wasted,
                at,
            } => {
                self.tally.wasted = wasted;
                self.settle(MetricOutcome::Ok, gpu_seconds, at, Some(200));
                // The simulator's rest: text held back, a JSON answer's
                // end, a tool call.
                let mut tail = Vec::new();
                if self.producer == Producer::Scheduler {
                    let rest = self.sim.end();
                    if !rest.is_empty() {
                        keep(&mut self.kept, &rest);
                        let c = chunk(&self.ctx, self.created, Some(&rest), false, None);
                        tail.extend_from_slice(&sse(&c));
                    }
                    if let Some(calls) = self.sim.tool_calls(&self.ctx.rid, true) {
                        self.kept = None;
                        let mut c = chunk(&self.ctx, self.created, None, false, None);
                        c["choices"][0]["delta"]["tool_calls"] = calls;
                        tail.extend_from_slice(&sse(&c));
                    }
                }
                let sim_finish = self.sim.finish_reason();
                if let Some(k) = self.kept.take() {
                    let finish = match (self.producer, &k.finish) {
                        (Producer::Scheduler, _) => sim_finish,
                        (Producer::Upstream, Some(f)) => f.as_str(),
                        (Producer::Upstream, None) => "",
                    };
                    let prompt = self.ctx.req.prompt_tokens;
                    let fingerprint = match self.producer {
                        Producer::Scheduler => "kiln-sim",
                        Producer::Upstream => "",
                    };
                    let body = full_body(
                        &self.ctx,
                        &k.text,
                        prompt,
                        self.tally.output(),
                        finish,
                        fingerprint,
                    );
                    super::cache::store(&self.ctx, &self.s.d, &body);
                }
                let mut b = tail;
                if self.producer == Producer::Scheduler {
                    let c = chunk(&self.ctx, self.created, None, false, Some(sim_finish));
                    b.extend_from_slice(&sse(&c));
                }
                // Upstreams that ignore stream_options (llama.cpp does)
                // send no usage: kiln writes it from its own counts.
                if self.ctx.include_usage && self.tally.usage_completion.is_none() {
                    let prompt = self.ctx.req.prompt_tokens;
                    let u = usage_chunk(&self.ctx, self.created, prompt, self.tally.output());
                    b.extend_from_slice(&sse(&u));
                }
                b.extend_from_slice(&sse_done());
                Some(Bytes::from(b))
            }
            Piece::Failed { err, outcome } => {
                if outcome == MetricOutcome::Preempted {
                    note(
        &self.ctx,
        "preempted after the stream began: the upstream's call was cancelled and the stream ended with a `preempted` error event",
                        Some(Reason::Preempted.name()),
                    );
                }
                // The stream's 200 went out with its headers.
                self.settle(outcome, 0.0, None, Some(200));
                Some(sse(&err.body()))
            }
            Piece::Refused {
                reason,
                status,
                retry_after,
                limits,
            } => {
                let err = self.refused(reason, status, retry_after, limits.as_ref());
                Some(sse(&err.body()))
            }
        }
    }
}

/// The client went away before the answer ended: the response stream (or
/// the handler awaiting a whole answer) was dropped with the generation in
/// it. The request ends here as `cancelled`, charged for the tokens and GPU
/// time it used so far, and is recorded once, through the same
/// [`Generation::settle`] as every other end (metrics, `/admin/costs`,
/// explain, the decision log). Every other end disarms the guard first, so
/// this runs only for a request nothing else ended.
impl Drop for Generation {
    fn drop(&mut self) {
        if !self.guard.armed {
            return;
        }
        note(
            &self.ctx,
            "the client went away before the answer ended: cancelled",
            Some("client_disconnected"),
        );
        // A stream's 200 went out with its headers; a whole answer's never did.
        let status = self.ctx.stream.then_some(200);
        let gpu_seconds = self.tally.gpu_seconds;
        self.settle(MetricOutcome::Cancelled, gpu_seconds, None, status);
        // `settle` disarmed the guard and told an upstream's scheduler entry
        // (it reports the output, then cancels); a scheduled replica's
        // sequence is cancelled here, freeing its slot and memory at once.
        if self.producer == Producer::Scheduler {
            self.ctx.app.exec.send(Command::Cancel(self.ctx.id));
        }
    }
}

/// The client's answer for an upstream error: its status, and for 429
/// and 503 a Retry-After (the upstream's own, or its open breaker's time
/// left, else 1 s for 429 and 5 s for 503).
fn upstream_error(rid: &str, e: &UpstreamError) -> ApiError {
    let status = e.http_status();
    let err = ApiError::new(status, format!("upstream {rid}: {e}"));
    let fallback = match status {
        429 => 1,
        503 => 5,
        _ => return err,
    };
    let secs = e
        .retry_after()
        .map_or(fallback, |d| d.as_secs_f64().ceil().max(1.0) as u64);
    err.retry_after(Some(secs))
}

/// Placeholder text for simulated output: it says what it is.
const SIM_WORDS: [&str; 8] = [
    " simulated",
    " output",
    " from",
    " kiln's",
    " roofline",
    " GPU",
    " model",
    ".",
];

fn sim_text(from: u64, n: u64) -> String {
    (from..from + n)
        .map(|i| SIM_WORDS[(i % 8) as usize])
        .collect()
}

fn completion_id(ctx: &Ctx) -> String {
    match ctx.endpoint {
        Endpoint::Chat => format!("chatcmpl-{}", ctx.rid),
        Endpoint::Completions => format!("cmpl-{}", ctx.rid),
    }
}

fn created() -> i64 {
    (crate::clock::unix_ms() / 1000.0) as i64
}

fn full_body(
    ctx: &Ctx,
    text: &str,
    prompt: u64,
    completion: u64,
    finish: &str,
    fingerprint: &str,
) -> Value {
    let choice = match ctx.endpoint {
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": finish,
        }),
        Endpoint::Completions => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
        }),
    };
    json!({
        "id": completion_id(ctx),
        "object": ctx.endpoint.object(false),
        "created": created(),
        "model": ctx.client_model,
        "system_fingerprint": fingerprint,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    })
}

fn chunk(ctx: &Ctx, created: i64, text: Option<&str>, first: bool, finish: Option<&str>) -> Value {
    let choice = match ctx.endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
        Endpoint::Completions => {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        }
    };
    json!({
        "id": completion_id(ctx),
        "object": ctx.endpoint.object(true),
        "created": created,
        "model": ctx.client_model,
        "system_fingerprint": "kiln-sim",
        "choices": [choice],
    })
}

fn usage_chunk(ctx: &Ctx, created: i64, prompt: u64, completion: u64) -> Value {
    json!({
        "id": completion_id(ctx),
        "object": ctx.endpoint.object(true),
        "created": created,
        "model": ctx.client_model,
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    })
}

fn sse(v: &Value) -> Bytes {
    let mut s = String::with_capacity(256);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

fn sse_response(body: Body, h: Vec<(&'static str, String)>) -> Response {
    let mut resp = Response::new(body);
    let hs = resp.headers_mut();
    hs.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    hs.insert("cache-control", HeaderValue::from_static("no-cache"));
    with_headers(resp, h)
}
