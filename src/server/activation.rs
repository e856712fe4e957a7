//! Policy activation, the gateway's one service for changing the policy in
//! force: compile and validate an upload and plan its deployment
//! ([`compile_upload`]), swap it into the executor between two events
//! ([`activate_here`]), announce it to the fleet ([`activate`]), and follow
//! the versions other replicas announce ([`spawn_sync`], [`follow`]).
//!
//! Its callers are adapters: `POST /admin/policy` ([`super::admin`]),
//! governance's rollouts and rollbacks ([`super::governance`]) and the
//! fleet's policy sync. It depends on the executor and the fleet's store,
//! never on them.

use super::fleet::Fleet;
use super::{App, Policy};
use crate::compile;
use crate::governance::activation::{Activation, ActivationError};
use crate::source::SourceMap;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How often a replica looks for a policy epoch it missed (a lost
/// announcement, or a reconnect after Redis was down).
const POLICY_POLL: Duration = Duration::from_millis(500);

/// The compiler's errors, for the answer to a policy that does not compile.
fn refusal(c: &compile::Compiled) -> ActivationError {
    let errors = || {
        c.diagnostics
            .items
            .iter()
            .filter(|d| d.severity == crate::diag::Severity::Error)
    };
    ActivationError::Invalid {
        diagnostics: errors()
            .map(|d| crate::diag::to_json(d, &c.sources))
            .collect(),
        rendered: errors()
            .map(|d| crate::diag::render(d, &c.sources, false))
            .collect(),
    }
}

/// Compiles and validates a policy upload, and plans its deployment under
/// this gateway's config. Nothing changes.
pub fn compile_upload(
    app: &App,
    files: &BTreeMap<String, String>,
) -> Result<(Policy, crate::sched::plan::Plan, Vec<String>), ActivationError> {
    let mut sources = SourceMap::new();
    for (name, text) in files {
        sources.add(name.clone(), text.clone());
    }
    let compiled = compile::compile(sources);
    if compiled.has_errors() {
        return Err(refusal(&compiled));
    }
    let compile::Compiled { sources, graph, .. } = compiled;
    let Some(graph) = graph else {
        return Err(ActivationError::NoGraph);
    };
    if let Some(clash) = app.config.key_clash(&graph) {
        return Err(ActivationError::KeyClash(clash));
    }
    crate::backend::deploy::servable_caches(&graph, app.embedder.is_some())
        .map_err(ActivationError::Deploy)?;
    let policy = Policy::new(graph, sources);
    let (plan, notes) = crate::backend::deploy::replan(
        &policy.graph,
        &app.config.pools,
        app.calibration.as_ref(),
        &app.backends,
    )
    .map_err(ActivationError::Deploy)?;
    Ok((policy, plan, notes))
}

/// Compiles, validates and swaps in a policy. On failure nothing changes.
/// In a fleet sharing state, the new version is announced to every
/// replica ([`super::fleet`]).
pub async fn activate(
    app: &App,
    files: BTreeMap<String, String>,
) -> Result<Activation, ActivationError> {
    let a = activate_here(app, files).await?;
    if let (true, Some(fleet)) = (a.changed, app.fleet.as_ref()) {
        let policy = app.policy.load_full();
        announce(fleet, &policy).await;
    }
    Ok(a)
}

/// [`activate`] on this replica only (a version the fleet announced).
pub async fn activate_here(
    app: &App,
    files: BTreeMap<String, String>,
) -> Result<Activation, ActivationError> {
    let (policy, plan, notes) = match compile_upload(app, &files) {
        Ok(x) => x,
        Err(e) => {
            app.metrics.policy_swap(false);
            return Err(e);
        }
    };
    let _one_at_a_time = app.swap_lock.lock().await;
    let previous = app.policy.load().version.clone();
    if previous == policy.version {
        return Ok(Activation {
            version: policy.version.to_string(),
            previous: previous.to_string(),
            changed: false,
            redecided: 0,
            notes: Vec::new(),
        });
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let policy = Arc::new(policy);
    if !app.exec.send(super::executor::Command::Swap {
        graph: policy.graph.clone(),
        plan,
        version: policy.version.clone(),
        done: tx,
    }) {
        app.metrics.policy_swap(false);
        return Err(ActivationError::SchedulerDown);
    }
    let redecided = rx.await.unwrap_or_default();
    app.remember(policy.clone());
    app.policy.store(policy.clone());
    app.metrics.policy_swap(true);
    app.metrics.set_policy_version(&policy.version);
    tracing::info!(version = %policy.version, previous = %previous, "policy activated");
    Ok(Activation {
        version: policy.version.to_string(),
        previous: previous.to_string(),
        changed: true,
        redecided: redecided.len(),
        notes,
    })
}

/// The answer to a refused activation, as `POST /admin/policy` gives it.
pub fn activation_refused(e: &ActivationError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY);
    let r = (status, axum::Json(e.body())).into_response();
    match e {
        ActivationError::Shared(s) => retry_after(r, s.retry_after_s()),
        _ => r,
    }
}

/// A refusal that a retry may pass in `secs`: `Retry-After` says when.
pub(super) fn retry_after(mut r: Response, secs: u64) -> Response {
    if let Ok(v) = axum::http::HeaderValue::from_str(&secs.to_string()) {
        r.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
    }
    r
}

/// Starts following the fleet's policy epoch ([`policy_sync`]).
pub fn spawn_sync(app: Arc<App>, fleet: Arc<Fleet>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move { policy_sync(app, fleet).await })
}

/// Keeps this replica on the fleet's newest policy epoch: a subscription
/// for announcements, and a poll for what it missed.
async fn policy_sync(app: Arc<App>, fleet: Arc<Fleet>) {
    let (bell_tx, mut bell) = tokio::sync::mpsc::unbounded_channel::<u64>();
    {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            loop {
                match fleet.store.subscribe_policy().await {
                    Ok(ps) => {
                        let mut msgs = ps.into_on_message();
                        while let Some(m) = msgs.next().await {
                            let epoch = m.get_payload::<u64>().unwrap_or(0);
                            fleet.seen.fetch_max(epoch, Ordering::AcqRel);
                            if bell_tx.send(epoch).is_err() {
                                return;
                            }
                        }
                    }
                    Err(_) => tokio::time::sleep(POLICY_POLL).await,
                }
            }
        });
    }
    let mut poll = tokio::time::interval(POLICY_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = poll.tick() => {}
            m = bell.recv() => if m.is_none() { return },
        }
        follow(&app, &fleet).await;
    }
}

/// Applies the fleet's policy if it is newer than this replica's, or
/// publishes this replica's when the store has none (a fresh or restarted
/// Redis).
pub async fn follow(app: &Arc<App>, fleet: &Arc<Fleet>) {
    let Ok(epoch) = fleet.store.policy_epoch().await else {
        return;
    };
    fleet.seen.fetch_max(epoch, Ordering::AcqRel);
    if epoch == 0 || fleet.unannounced.swap(false, Ordering::AcqRel) {
        let p = app.policy.load_full();
        match fleet.store.publish_policy(&p.version, &p.files()).await {
            Ok(e) => fleet.set_applied(e),
            Err(_) => fleet.unannounced.store(true, Ordering::Release),
        }
        return;
    }
    if epoch <= fleet.applied_epoch() {
        return;
    }
    let Ok(Some(shared)) = fleet.store.policy().await else {
        return;
    };
    if shared.version.as_str() == app.policy.load().version.as_ref() {
        fleet.set_applied(shared.epoch);
        return;
    }
    match activate_here(app, shared.files).await {
        Ok(a) => {
            tracing::info!(version = %a.version, epoch = shared.epoch, "policy applied from the fleet");
            fleet.set_applied(shared.epoch);
        }
        Err(e) => {
            // A version this replica cannot run (its backends differ, say):
            // it keeps its own and says so; `kiln status` shows the split.
            tracing::error!(version = %shared.version, epoch = shared.epoch, error = %e, "cannot apply the fleet's policy here; keeping the active one");
            fleet.set_applied(shared.epoch);
        }
    }
}

/// Announces a policy this replica just activated.
pub async fn announce(fleet: &Fleet, policy: &Policy) {
    match fleet
        .store
        .publish_policy(&policy.version, &policy.files())
        .await
    {
        Ok(e) => fleet.set_applied(e),
        Err(e) => {
            fleet.unannounced.store(true, Ordering::Release);
            tracing::error!(version = %policy.version, error = %e, "activated here but not yet announced to the fleet: Redis is unreachable; it is announced when Redis answers");
        }
    }
}
