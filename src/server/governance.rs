//! The gateway's governance wiring: the admin API over
//! [`crate::governance`], the rollout runner task, and [`Gateway`] for [`App`] (how
//! governance swaps policies, through [`super::activation::activate`] so a
//! refused activation leaves the last good policy serving, and starts and
//! ends canaries in the executor). Handlers authenticate, parse, call
//! governance and answer; governance decides.
//!
//! Endpoints (all need an admin token; with approvers configured, a named
//! one):
//!
//! | | |
//! | --- | --- |
//! | `POST /admin/proposals` | propose a policy (body as `POST /admin/policy`) |
//! | `GET /admin/proposals`, `GET /admin/proposals/{id}` | list, show |
//! | `PUT /admin/proposals/{id}` | replace its text (voids its approvals) |
//! | `DELETE /admin/proposals/{id}` | withdraw it |
//! | `POST /admin/proposals/{id}/approvals` | a signed approval |
//! | `GET /admin/status` | active version, rollout, open proposals, overrides |
//! | `POST /admin/rollback` | abort the rollout, or return to the previous version |
//! | `POST /admin/overrides`, `DELETE /admin/overrides/{scope}/{name}` | pause or throttle a tier or tenant, lift it |
//! | `GET /admin/audit` | the audit log's head and recent entries |

use super::activation::{self, retry_after};
use super::admin::{self, identify};
use super::config::ServerConfig;
use super::openai::ApiError;
use super::{App, Policy};
use crate::backend::cost::Calibration;
use crate::governance::actions::{ActionError, OverrideRequest, RollbackOutcome};
use crate::governance::activation::{Activation, ActivationError};
use crate::governance::approval::Approver;
use crate::governance::gateway::Gateway;
use crate::governance::keys::SignedApproval;
use crate::governance::runner::TICK;
use crate::graph::{DecisionGraph, Signals};
use crate::sched::canary::Canary;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use crate::governance::gov::{Gov, GovConfig, GovError};

/// Governance's settings from `kiln.toml`; `speed` is the simulator's.
pub fn gov_config(cfg: &ServerConfig, speed: f64) -> GovConfig {
    let approvers = cfg
        .approvers
        .iter()
        .filter_map(|a| {
            crate::governance::keys::parse_public(&a.public_key)
                .ok()
                .map(|key| Approver {
                    name: a.name.clone(),
                    person: a.person().to_string(),
                    groups: a.groups.clone(),
                    key,
                })
        })
        .collect();
    let g = &cfg.governance;
    GovConfig {
        enabled: cfg.governance_enabled(),
        approvers,
        audit: cfg.audit.as_ref().map(|a| a.path.clone()),
        state: g.state.clone(),
        speed,
        window_ms: g.window_ms(),
        min_samples: g.min_samples,
        approval_ttl_s: g.approval_ttl_s(),
        watch_ms: g.watch_ms(),
        default_canary_ms: g.default_canary_ms(),
        dry_run_records: g.dry_run_records,
        max_override_ms: g.max_override_ms(),
        withdraw_groups: g.withdraw_groups.clone(),
        // Set by `start`, which opens the fleet's store.
        shared: None,
    }
}

impl Gateway for App {
    fn active(&self) -> Arc<Policy> {
        self.policy.load_full()
    }

    fn compile(&self, files: &BTreeMap<String, String>) -> Result<Policy, ActivationError> {
        activation::compile_upload(self, files).map(|(p, _, _)| p)
    }

    async fn activate(
        &self,
        files: BTreeMap<String, String>,
    ) -> Result<Activation, ActivationError> {
        activation::activate(self, files).await
    }

    async fn set_canary(&self, canary: Option<(Canary, Arc<str>)>) -> bool {
        self.exec.set_canary(canary).await
    }

    async fn signals(&self) -> Option<(Arc<DecisionGraph>, Signals)> {
        self.exec.signals().await
    }

    fn remember(&self, policy: Arc<Policy>) {
        App::remember(self, policy)
    }

    async fn decision_log(&self) -> Option<PathBuf> {
        let l = self.config.log.as_ref()?;
        self.log.flush().await;
        Some(l.path.clone())
    }

    fn calibration(&self) -> Option<Calibration> {
        self.calibration.clone()
    }

    fn count_rollback(&self, trigger: &str) {
        self.metrics.rollback(trigger);
    }

    fn count_approval(&self, result: &str) {
        self.metrics.approval(result);
    }

    fn count_stage(&self, version: &str, stage: &str) {
        self.metrics.rollout_stage(version, stage);
    }
}

/// Starts the rollout runner: every [`TICK`], expire overrides, advance the
/// rollout, and start the next approved proposal.
pub fn spawn_runner(app: Arc<App>) -> tokio::task::JoinHandle<()> {
    app.gov.settle_restored(app.as_ref());
    tokio::spawn(async move {
        let mut t = tokio::time::interval(TICK);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            t.tick().await;
            app.gov.advance(app.as_ref()).await;
        }
    })
}

// --- the admin API -----------------------------------------------------

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/admin/proposals", post(propose).get(list))
        .route(
            "/admin/proposals/{id}",
            get(show).put(revise).delete(withdraw),
        )
        .route("/admin/proposals/{id}/approvals", post(approve))
        .route("/admin/status", get(status))
        .route("/admin/rollback", post(rollback))
        .route("/admin/overrides", post(add_override).get(list_overrides))
        .route("/admin/overrides/{scope}/{name}", delete(lift_override))
        .route("/admin/audit", get(audit))
        .with_state(app)
}

/// The caller, for actions that change governance state: with approvals
/// on, only a named admin token's person (never open loopback access, nor
/// an unnamed `token_sha256` token: who proposes must be a known person, so
/// that they never approve their own change).
fn actor(app: &App, headers: &HeaderMap) -> Result<String, ApiError> {
    let who = identify(app, headers)?;
    if app.gov.enabled && who == "loopback" {
        return Err(ApiError::new(
            401,
            "governance actions need `Authorization: Bearer ADMIN-TOKEN`: the proposer must be known",
        )
        .code("unauthorized"));
    }
    if app.gov.enabled && app.auth.load().is_unnamed_token(headers_token(headers)) {
        return Err(ApiError::new(
            403,
            "this admin token names no person ([admin] token_sha256): with approvals required, governance actions need a token from [[admin.tokens]] with a name (and `person`), so that a proposer never approves their own change",
        )
        .code("unnamed_token"));
    }
    Ok(who)
}

fn headers_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().strip_prefix("Bearer ").map(str::trim))
}

/// The answer to a refused governance action.
fn refused(e: &ActionError) -> Response {
    match e {
        ActionError::Invalid(a) => activation::activation_refused(a),
        ActionError::Approval(r) => {
            let help = miette::Diagnostic::help(r).map(|h| h.to_string());
            let status = StatusCode::from_u16(r.status()).unwrap_or(StatusCode::FORBIDDEN);
            (
                status,
                axum::Json(json!({
                    "error": {"message": r.to_string(), "type": "approval_refused", "code": r.code(), "param": null},
                    "help": help,
                })),
            )
                .into_response()
        }
        ActionError::Shared(s) => {
            let mut a = ApiError::new(e.status(), e.to_string());
            a.code = Some(s.error_code().to_string());
            retry_after(a.into_response(), s.retry_after_s())
        }
        _ => {
            let mut a = ApiError::new(e.status(), e.to_string());
            a.code = e.code().map(String::from);
            a.param = e.param();
            a.into_response()
        }
    }
}

/// `200` with the value as JSON, or the refusal.
fn answer<T: serde::Serialize>(r: Result<T, ActionError>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => refused(&e),
    }
}

async fn propose(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let files = match admin::read_upload(&headers, body).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    match app.gov.propose(app.as_ref(), &who, files).await {
        Ok(v) => (StatusCode::CREATED, axum::Json(v)).into_response(),
        Err(e) => refused(&e),
    }
}

async fn list(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    app.gov.refresh().await;
    axum::Json(app.gov.proposal_views()).into_response()
}

async fn show(State(app): State<Arc<App>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    app.gov.refresh().await;
    answer(
        app.gov
            .proposal_view(&id)
            .ok_or(ActionError::NoProposal(id)),
    )
}

async fn revise(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let files = match admin::read_upload(&headers, body).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    answer(app.gov.revise(app.as_ref(), &who, &id, files).await)
}

async fn withdraw(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    answer(app.gov.withdraw(app.as_ref(), &who, &id).await)
}

async fn approve(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let a: SignedApproval = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return ApiError::bad_request(
                format!(
                "expected a signed approval {{approver, hash, issued, expires, signature}}: {e}"
            ),
                None,
            )
            .into_response()
        }
    };
    answer(app.gov.approve(app.as_ref(), &who, &id, &a).await)
}

async fn status(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    axum::Json(app.gov.consistent_status(app.as_ref()).await).into_response()
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RollbackRequest {
    #[serde(default)]
    reason: Option<String>,
}

async fn rollback(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req: RollbackRequest = if body.is_empty() {
        RollbackRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return ApiError::bad_request(format!("expected {{\"reason\": \"…\"}}: {e}"), None)
                    .into_response()
            }
        }
    };
    match app.gov.rollback(app.as_ref(), &who, req.reason).await {
        Ok(RollbackOutcome::Aborted { id, stage, view }) => axum::Json(
            json!({"rolled_back": true, "aborted": id, "stage": stage.name(), "rollback": view}),
        )
        .into_response(),
        Ok(RollbackOutcome::RolledBack(view)) => {
            axum::Json(json!({"rolled_back": true, "rollback": view})).into_response()
        }
        Ok(RollbackOutcome::Proposed(view)) => (
            StatusCode::ACCEPTED,
            axum::Json(json!({"rolled_back": false, "proposal": view})),
        )
            .into_response(),
        Err(e) => refused(&e),
    }
}

async fn add_override(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    let req: OverrideRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(
                format!("expected {{scope, name, action, for, percent?, reason?}}: {e}"),
                None,
            )
            .into_response()
        }
    };
    match app.gov.add_override(app.as_ref(), &who, req).await {
        Ok(o) => (
            StatusCode::CREATED,
            axum::Json(json!({"override": o.view, "replaced": o.replaced})),
        )
            .into_response(),
        Err(e) => refused(&e),
    }
}

async fn list_overrides(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    axum::Json(app.gov.override_views()).into_response()
}

async fn lift_override(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((scope, name)): Path<(String, String)>,
) -> Response {
    let who = match actor(&app, &headers) {
        Ok(w) => w,
        Err(e) => return e.into_response(),
    };
    match app
        .gov
        .lift_override(app.as_ref(), &who, &scope, &name)
        .await
    {
        Ok(ids) => axum::Json(json!({"lifted": ids})).into_response(),
        Err(e) => refused(&e),
    }
}

async fn audit(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = identify(&app, &headers) {
        return e.into_response();
    }
    app.gov.refresh().await;
    axum::Json(app.gov.audit_recent(100)).into_response()
}
