//! The OpenAI endpoints: `POST /v1/chat/completions`, `POST /v1/completions`
//! (plain and streaming) and `GET /v1/models`.
//!
//! An adapter from axum to the request pipeline ([`super::request`]):
//! authenticate (401), read the body (413 above the limit), parse (400),
//! keep the headers a policy may read, then hand the arrived request to
//! [`super::request::pipeline`], whose answer is the response.

use super::auth::authenticate;
use super::openai::{ApiError, Endpoint, GenerationRequest};
use super::request::headers::private_header;
use super::request::pipeline::run_request;
use super::request::{Arrived, BATCH_HEADER};
use super::App;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(super::surface::list_models))
        .route("/v1/models/{id}", get(super::surface::get_model))
        .with_state(app)
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generate(app, Endpoint::Chat, headers, body).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    generate(app, Endpoint::Completions, headers, body).await
}

async fn generate(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    match generate_inner(app.clone(), endpoint, headers, body).await {
        Ok(r) => r,
        // Refused before it was recorded (its key, its body): explained too.
        Err(e) => super::surface::explain_refusal(&app, endpoint.path(), None, e).into_response(),
    }
}

async fn generate_inner(
    app: Arc<App>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let received = Instant::now();
    let received_ms = crate::clock::unix_ms();
    // Who is asking comes first: an unauthenticated caller learns nothing
    // about the body it sent.
    let policy = app.policy.load_full();
    let tenant = authenticate(&app, &policy.graph, &headers)?;
    let limits = &app.config.limits;
    let limit = limits.max_body_bytes;
    // The body's deadline is `limits::guard`'s, in front of every route: it
    // fails the body itself (`BodyTimeout`), so a second timer here would
    // only cost one more timer a request.
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(e) => return Err(super::limits::body_error(&e, limit, limits.body_timeout())),
    };
    let (greq, raw) = GenerationRequest::parse(endpoint, &bytes)?;
    let big = bytes.len() > limits.blocking_tokenize_bytes;
    drop(bytes);
    let mut hdrs = BTreeMap::new();
    for (k, v) in headers.iter() {
        let name = k.as_str();
        // Only the batch runner says a request is a batch item.
        if private_header(name) || name.starts_with(BATCH_HEADER) {
            continue;
        }
        if let Ok(v) = v.to_str() {
            hdrs.insert(name.to_string(), v.to_string());
        }
    }
    let tags = headers
        .get("x-kiln-tags")
        .and_then(|v| v.to_str().ok())
        .map(|s| {
            s.split(',')
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let session = headers
        .get("x-kiln-session")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let arrived = Arrived {
        received,
        received_ms,
        tenant,
        headers: hdrs,
        tags,
        session,
        window: None,
    };
    // Boxed: the pipeline's future is kilobytes, and every layer above
    // (axum's handler box, the router's services) moves this one by value;
    // inline, it was copied whole several times a request.
    Ok(
        Box::pin(run_request(app, endpoint, greq, raw, big, arrived))
            .await?
            .into_response(),
    )
}

#[cfg(test)]
mod tests {
    /// The size of the future an async fn returns, without calling it.
    fn future_size<F, A, B, C, D, R>(_: &F) -> usize
    where
        F: Fn(A, B, C, D) -> R,
    {
        std::mem::size_of::<R>()
    }

    /// The handler's future is moved by value through axum's layers: with
    /// the pipeline inline it was ~10 KB (in release) and copied whole
    /// several times a request. Boxed, it holds the request's parts only.
    #[test]
    fn the_handlers_future_stays_small() {
        let size = future_size(&super::generate);
        assert!(size <= 2048, "generate's future is {size} bytes");
    }
}
