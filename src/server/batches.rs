//! The OpenAI Files and Batches endpoints, and `/admin/batches`.
//!
//! Files: `POST /v1/files` (multipart, `purpose=batch`) validates every
//! line as it streams in and stores the file only if all are valid (a 400
//! names the first bad line and field); `GET /v1/files[/{id}[/content]]`,
//! `DELETE /v1/files/{id}`. Batches: `POST /v1/batches`,
//! `GET /v1/batches[/{id}]`, `POST /v1/batches/{id}/cancel`.
//!
//! A tenant sees only its own files and batches: another tenant's id is
//! `404`, exactly as an id that does not exist. Admin tokens see every
//! batch through `/admin/batches`.

use super::admin::authorize;
use super::auth::authenticate;
use super::batch_lines::{self as validate, LineError};
use super::batch_plan::{estimate_for_lines, plan_rows};
use super::batch_runner::now_s;
use super::openai::ApiError;
use super::App;
use crate::batch::store::StoreError;
use crate::batch::{parse_window, BatchRow, BatchStatus, FileRow, RequestCounts};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Multipart, Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::sync::Arc;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route(
            "/v1/files",
            post(upload)
                .get(list_files)
                // The upload streams; its own limit is `[batch] max_file_bytes`.
                .layer(DefaultBodyLimit::disable()),
        )
        .route("/v1/files/{id}", get(get_file).delete(delete_file))
        .route("/v1/files/{id}/content", get(file_content))
        .route("/v1/batches", post(create_batch).get(list_batches))
        .route("/v1/batches/{id}", get(get_batch))
        .route("/v1/batches/{id}/cancel", post(cancel_batch))
        .route("/admin/batches", get(admin_list))
        .route("/admin/batches/{id}", get(admin_get))
        .route("/admin/batches/{id}/cancel", post(admin_cancel))
        .with_state(app)
}

fn store_error(e: StoreError) -> ApiError {
    tracing::error!(error = %e, "batch store");
    if e.is_full() {
        // 507 Insufficient Storage: the request was fine, the gateway has
        // no room for it; nothing of it was kept.
        return ApiError::new(
            507,
            "the batch store is full (disk, or `[batch] max_store_bytes`); nothing was stored: try again later or delete old files (DELETE /v1/files/ID)",
        )
        .code("insufficient_storage");
    }
    if e.is_unavailable() {
        // 503 with Retry-After: the database is down, stalled or
        // restarting (each call is bounded by `[batch] store_timeout`).
        // A write whose commit the timeout cut off may have been stored.
        return ApiError::new(
            503,
            format!("the batch store is unavailable for now ({e}); retry after the Retry-After delay (a write cut off by the timeout may still have been stored: list your files or batches before creating one again)"),
        )
        .code("store_unavailable")
        .retry_after(Some(STORE_RETRY_AFTER_S));
    }
    ApiError::new(500, format!("the batch store failed: {e}")).code("store_error")
}

/// Seconds a client is asked to wait when the batch store is unavailable.
const STORE_RETRY_AFTER_S: u64 = 2;

/// A count with thousands separators (50,000).
fn grouped(n: u64) -> String {
    let d = n.to_string();
    let mut out = String::new();
    for (i, c) in d.chars().enumerate() {
        if i > 0 && (d.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The code of the reader's error when the worker stopped taking lines:
/// the worker's own error then says why.
const WORKER_STOPPED: &str = "upload_stopped";

fn not_found(what: &str, id: &str) -> ApiError {
    ApiError::new(404, format!("No such {what}: '{id}'")).code("not_found")
}

/// The caller's tenant (`None`: anonymous, where allowed).
fn caller(app: &App, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let p = app.policy.load();
    authenticate(app, &p.graph, headers)
}

fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

// ---- files ---------------------------------------------------------------

/// What the line worker is told.
enum Msg {
    /// Physical lines (1-based numbers) of the file part, in order: the
    /// lines of one piece of the body go together (one hand-over, not one
    /// per line).
    Lines(Vec<(u64, String)>),
    /// The upload ended: store it under these.
    Finish {
        purpose: Option<String>,
        filename: String,
        bytes: u64,
    },
}

/// Why an upload was refused.
enum UploadError {
    Line(LineError),
    Api(ApiError),
}

impl From<StoreError> for UploadError {
    fn from(e: StoreError) -> Self {
        UploadError::Api(store_error(e))
    }
}

async fn upload(State(app): State<Arc<App>>, headers: HeaderMap, multipart: Multipart) -> Response {
    respond(upload_inner(app, headers, multipart).await)
}

async fn upload_inner(
    app: Arc<App>,
    headers: HeaderMap,
    mut multipart: Multipart,
) -> Result<Response, ApiError> {
    let owner = caller(&app, &headers)?;
    let cfg = app.config.batch.clone();
    let max_line = app.config.limits.max_body_bytes;
    let policy = app.policy.load_full();
    let models: HashSet<String> = policy.graph.models.iter().map(|m| m.name.clone()).collect();
    let target = upload_target(&app).await;
    let id = crate::batch::new_id("file-");
    // Lines are checked and written on a blocking thread, a page per short
    // transaction; the reader hands them over through a short queue, so
    // neither side holds the file, and the async side only ever awaits.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Msg>(256);
    let store = app.batches.store.clone();
    let fid = id.clone();
    let owner2 = owner.clone();
    let max_requests = cfg.max_requests;
    let worker = tokio::task::spawn_blocking(move || -> Result<FileRow, UploadError> {
        let known = |m: &str| models.contains(m);
        let mut up = store.upload(&fid);
        let dup = |up: &crate::batch::store::Upload<'_>, n: u64, cid: String| -> UploadError {
            let first = up.first_use(&cid).ok().flatten().map_or(0, |i| i + 1);
            UploadError::Line(LineError {
                line: n,
                field: "custom_id",
                message: format!(
                    "`{cid}` is already the custom_id of request {first} (each line needs its own)"
                ),
            })
        };
        let mut items = 0u64;
        let mut endpoint: Option<validate::Valid> = None;
        let mut first_line_of_endpoint = 0;
        while let Some(msg) = rx.blocking_recv() {
            match msg {
                Msg::Lines(lines) => {
                    for (n, text) in lines {
                        let v = validate::line_for(&text, n, &known, &target)
                            .map_err(UploadError::Line)?;
                        match &endpoint {
                            None => {
                                endpoint = Some(v.clone());
                                first_line_of_endpoint = n;
                            }
                            Some(e) if e.endpoint != v.endpoint => {
                                return Err(UploadError::Line(LineError {
                                line: n,
                                field: "url",
                                message: format!(
                                    "`{}` differs from line {first_line_of_endpoint}'s `{}`: a batch file calls one endpoint",
                                    v.endpoint.path(),
                                    e.endpoint.path()
                                ),
                            }));
                            }
                            Some(_) => {}
                        }
                        if items >= max_requests {
                            return Err(UploadError::Api(
                            ApiError::new(
                                413,
                                format!(
                                    "line {n}: a batch file holds at most {} lines (requests), and this one has more (`[batch] max_requests`); split it into several batches",
                                    grouped(max_requests)
                                ),
                            )
                            .code("too_many_lines"),
                        ));
                        }
                        if let Some((n, cid)) = up.line(items, n, &v.custom_id, &text)? {
                            return Err(dup(&up, n, cid));
                        }
                        items += 1;
                    }
                }
                Msg::Finish {
                    purpose,
                    filename,
                    bytes,
                } => {
                    match purpose.as_deref() {
                        Some("batch") => {}
                        Some(p) => {
                            return Err(UploadError::Api(ApiError::bad_request(
                                format!("kiln stores files for batches only: `purpose` must be \"batch\", not \"{p}\""),
                                Some("purpose"),
                            )))
                        }
                        None => {
                            return Err(UploadError::Api(ApiError::bad_request(
                                "the form needs a `purpose` field (\"batch\")".into(),
                                Some("purpose"),
                            )))
                        }
                    }
                    if items == 0 {
                        return Err(UploadError::Api(ApiError::bad_request(
                            "the file holds no requests: give one JSON request per line".into(),
                            Some("file"),
                        )));
                    }
                    let row = FileRow {
                        id: fid.clone(),
                        owner: owner2.clone(),
                        purpose: "batch".into(),
                        filename,
                        bytes,
                        created_at: now_s(),
                        lines: items,
                        endpoint: endpoint.map(|e| e.endpoint.path().to_string()),
                        batch_id: None,
                        ok: None,
                    };
                    if let Some((n, cid)) = up.commit(&row)? {
                        return Err(dup(&up, n, cid));
                    }
                    return Ok(row);
                }
            }
        }
        // The reader stopped without finishing: nothing is stored.
        Err(UploadError::Api(ApiError::new(
            400,
            "the upload ended early",
        )))
    });
    let timeout = app.config.limits.body_timeout();
    let read = read_form(&mut multipart, &tx, cfg.max_file_bytes, max_line, timeout).await;
    match read {
        Ok(finish) => {
            // The worker may have stopped at a bad line already.
            let _ = tx.send(finish).await;
        }
        Err(e) => {
            drop(tx);
            // What the worker stopped at (a bad line, too many lines, a
            // full store) explains better than the read's error, which is
            // then only "the worker stopped".
            match worker.await {
                Ok(Err(UploadError::Line(l))) => return Err(line_error(&l)),
                Ok(Err(UploadError::Api(w))) if e.code.as_deref() == Some(WORKER_STOPPED) => {
                    return Err(w)
                }
                _ => return Err(e),
            }
        }
    }
    drop(tx);
    match worker.await {
        Ok(Ok(row)) => Ok(axum::Json(row.to_json()).into_response()),
        Ok(Err(UploadError::Line(l))) => Err(line_error(&l)),
        Ok(Err(UploadError::Api(e))) => Err(e),
        Err(e) => Err(ApiError::new(500, format!("the upload failed: {e}"))),
    }
}

/// What the gateway's backends can serve, for the checks at upload: the
/// fields a backend cannot honour (where none passes fields through, as
/// the request path refuses them) and each model's longest sequence.
async fn upload_target(app: &App) -> validate::Target {
    use crate::backend::Backend;
    let backend = (!app.backends.iter().any(|b| matches!(b, Backend::Http(_)))).then(|| {
        app.backends
            .first()
            .map_or_else(|| "sim".to_string(), Backend::name)
    });
    let mut max_sequence = std::collections::HashMap::new();
    if let Some(s) = app.exec.snapshot().await {
        for r in &s.replicas {
            if r.kv_capacity_tokens > 0 {
                let e = max_sequence.entry(r.model.clone()).or_insert(0u64);
                *e = (*e).max(r.kv_capacity_tokens);
            }
        }
    }
    let tok = app.tokenizer;
    validate::Target {
        backend,
        max_sequence,
        prompt_tokens: Some(Box::new(move |g| tok.prompt_tokens(g))),
    }
}

fn line_error(l: &LineError) -> ApiError {
    ApiError::bad_request(format!("{l}"), Some(l.field)).code("invalid_batch_line")
}

/// Adds one line (1-based number `n`) to what goes to the worker next;
/// blank lines are skipped, as is a UTF-8 byte-order mark before the
/// first.
fn push_line(out: &mut Vec<(u64, String)>, n: u64, raw: &[u8]) -> Result<(), ApiError> {
    let raw = if n == 1 {
        raw.strip_prefix(b"\xef\xbb\xbf").unwrap_or(raw)
    } else {
        raw
    };
    let text = std::str::from_utf8(raw).map_err(|_| {
        line_error(&LineError {
            line: n,
            field: "line",
            message: "is not UTF-8 text".into(),
        })
    })?;
    let text = text.trim();
    if text.is_empty() {
        return Ok(());
    }
    out.push((n, text.to_string()));
    Ok(())
}

/// Hands the lines gathered so far to the worker.
async fn send_lines(
    tx: &tokio::sync::mpsc::Sender<Msg>,
    lines: &mut Vec<(u64, String)>,
) -> Result<(), ApiError> {
    if lines.is_empty() {
        return Ok(());
    }
    tx.send(Msg::Lines(std::mem::take(lines)))
        .await
        .map_err(|_| ApiError::new(400, "the upload was refused").code(WORKER_STOPPED))
}

/// Reads the form: `purpose`, and the `file` part split into lines for the
/// worker. Returns the worker's closing message. The body may take as long
/// as it needs while it keeps coming: only a pause of `idle` between two
/// pieces ends it (408).
async fn read_form(
    multipart: &mut Multipart,
    tx: &tokio::sync::mpsc::Sender<Msg>,
    max_bytes: u64,
    max_line: usize,
    idle: std::time::Duration,
) -> Result<Msg, ApiError> {
    let mut purpose = None;
    let mut filename = None;
    let mut bytes = 0u64;
    let bad_form = |e: axum::extract::multipart::MultipartError| {
        ApiError::bad_request(format!("the multipart form could not be read: {e}"), None)
    };
    let stalled = || {
        ApiError::new(408, format!("the upload stopped: no data for {idle:?}"))
            .code("request_timeout")
    };
    loop {
        let next = tokio::time::timeout(idle, multipart.next_field())
            .await
            .map_err(|_| stalled())?;
        let Some(mut field) = next.map_err(bad_form)? else {
            break;
        };
        match field.name() {
            Some("purpose") => {
                let t = tokio::time::timeout(idle, field.text())
                    .await
                    .map_err(|_| stalled())?
                    .map_err(bad_form)?;
                if t.len() > 64 {
                    return Err(ApiError::bad_request(
                        "`purpose` is too long".into(),
                        Some("purpose"),
                    ));
                }
                purpose = Some(t.trim().to_string());
            }
            Some("file") => {
                if filename.is_some() {
                    return Err(ApiError::bad_request(
                        "send one `file` per upload".into(),
                        Some("file"),
                    ));
                }
                filename = Some(
                    field
                        .file_name()
                        .unwrap_or("upload.jsonl")
                        .chars()
                        .take(255)
                        .collect::<String>(),
                );
                let mut buf: Vec<u8> = Vec::new();
                let mut n = 0u64;
                // Once the worker has stopped (a full store, too many
                // lines), the rest of the body is read and dropped before
                // the answer: a client still sending would otherwise see a
                // reset connection instead of the error (and SDKs send the
                // whole upload again).
                let mut stopped: Option<ApiError> = None;
                loop {
                    let chunk = tokio::time::timeout(idle, field.chunk())
                        .await
                        .map_err(|_| stalled())?
                        .map_err(bad_form)?;
                    let Some(chunk) = chunk else { break };
                    bytes += chunk.len() as u64;
                    if bytes > max_bytes {
                        return Err(ApiError::new(
                            413,
                            format!("the file is larger than {max_bytes} bytes, the most one batch file may be; split it into several batches"),
                        )
                        .code("file_too_large"));
                    }
                    if stopped.is_some() {
                        continue;
                    }
                    let mut rest: &[u8] = &chunk;
                    let mut lines = Vec::new();
                    // A line that is not text ends the upload, after the
                    // lines before it (the worker may find an earlier fault).
                    let mut bad = None;
                    while let Some(i) = memchr::memchr(b'\n', rest) {
                        n += 1;
                        let pushed = if buf.is_empty() {
                            push_line(&mut lines, n, &rest[..i])
                        } else {
                            buf.extend_from_slice(&rest[..i]);
                            let r = push_line(&mut lines, n, &buf);
                            buf.clear();
                            r
                        };
                        rest = &rest[i + 1..];
                        if let Err(e) = pushed {
                            bad = Some(e);
                            break;
                        }
                    }
                    match send_lines(tx, &mut lines).await {
                        Ok(()) => {}
                        Err(e) if e.code.as_deref() == Some(WORKER_STOPPED) => {
                            stopped = Some(e);
                        }
                        Err(e) => return Err(e),
                    }
                    if let Some(e) = bad {
                        return Err(e);
                    }
                    if stopped.is_some() {
                        buf.clear();
                        continue;
                    }
                    buf.extend_from_slice(rest);
                    if buf.len() > max_line {
                        return Err(line_error(&LineError {
                            line: n + 1,
                            field: "line",
                            message: format!("is longer than {max_line} bytes, the largest request body this gateway accepts"),
                        }));
                    }
                }
                if let Some(e) = stopped {
                    return Err(e);
                }
                if !buf.is_empty() {
                    let mut last = Vec::new();
                    push_line(&mut last, n + 1, &buf)?;
                    send_lines(tx, &mut last).await?;
                }
            }
            _ => {
                // Other fields are ignored, but read to their end.
                while tokio::time::timeout(idle, field.chunk())
                    .await
                    .map_err(|_| stalled())?
                    .map_err(bad_form)?
                    .is_some()
                {}
            }
        }
    }
    let Some(filename) = filename else {
        return Err(ApiError::bad_request(
            "the form needs a `file` part".into(),
            Some("file"),
        ));
    };
    Ok(Msg::Finish {
        purpose,
        filename,
        bytes,
    })
}

#[derive(Debug, Default, Deserialize)]
struct Page {
    after: Option<String>,
    limit: Option<usize>,
    purpose: Option<String>,
}

impl Page {
    fn limit(&self, default: usize) -> usize {
        self.limit.unwrap_or(default).clamp(1, 10_000)
    }
}

fn list_body(data: Vec<Value>, has_more: bool) -> Value {
    let first = data
        .first()
        .and_then(|v| v["id"].as_str().map(str::to_string));
    let last = data
        .last()
        .and_then(|v| v["id"].as_str().map(str::to_string));
    json!({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more})
}

async fn list_files(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<Page>,
) -> Response {
    respond(
        async {
            let owner = caller(&app, &headers)?;
            let limit = q.limit(10_000);
            let rows = app
                .batches
                .store
                .run(move |s| {
                    s.files(
                        Some(owner.as_deref()),
                        q.purpose.as_deref(),
                        q.after.as_deref(),
                        limit + 1,
                    )
                })
                .await
                .map_err(store_error)?;
            let more = rows.len() > limit;
            let data = rows.iter().take(limit).map(FileRow::to_json).collect();
            Ok(axum::Json(list_body(data, more)).into_response())
        }
        .await,
    )
}

/// What the store holds under `id`, if the caller owns it: another
/// tenant's is a 404, the same as an id that never existed.
async fn owned<T: Send + 'static>(
    app: &App,
    headers: &HeaderMap,
    id: &str,
    what: &str,
    fetch: fn(&crate::batch::store::Store, &str) -> Result<Option<T>, StoreError>,
    owner_of: fn(&T) -> &Option<String>,
) -> Result<T, ApiError> {
    let owner = caller(app, headers)?;
    let key = id.to_string();
    let found = app
        .batches
        .store
        .run(move |s| fetch(s, &key))
        .await
        .map_err(store_error)?;
    match found {
        Some(x) if *owner_of(&x) == owner => Ok(x),
        _ => Err(not_found(what, id)),
    }
}

/// The caller's file; an output or error file past its batch's
/// `output_expires_after` is deleted here and is `404`, as one that never
/// was. Its `expires_at`, if it has one.
async fn owned_file_expiry(
    app: &App,
    headers: &HeaderMap,
    id: &str,
) -> Result<(FileRow, Option<i64>), ApiError> {
    let f = owned(app, headers, id, "file", |s, k| s.file(k), |f| &f.owner).await?;
    let Some(batch) = f.batch_id.clone() else {
        return Ok((f, None));
    };
    let x = app
        .batches
        .store
        .run(move |s| s.extras(&batch))
        .await
        .map_err(store_error)?;
    let Some(secs) = x.and_then(|x| x.output_expires_s) else {
        return Ok((f, None));
    };
    let expires = f.created_at as f64 + secs;
    if crate::clock::unix_ms() / 1000.0 >= expires {
        let fid = f.id.clone();
        app.batches
            .store
            .run(move |s| s.delete_file(&fid))
            .await
            .map_err(store_error)?;
        return Err(not_found("file", id));
    }
    Ok((f, Some(expires.ceil() as i64)))
}

async fn owned_file(app: &App, headers: &HeaderMap, id: &str) -> Result<FileRow, ApiError> {
    owned_file_expiry(app, headers, id).await.map(|(f, _)| f)
}

async fn get_file(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        owned_file_expiry(&app, &headers, &id)
            .await
            .map(|(f, expires)| {
                let mut v = f.to_json();
                v["expires_at"] = json!(expires);
                axum::Json(v).into_response()
            }),
    )
}

async fn delete_file(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        async {
            let f = owned_file(&app, &headers, &id).await?;
            let fid = f.id.clone();
            let gone = app
                .batches
                .store
                .run(move |s| s.delete_file(&fid))
                .await
                .map_err(store_error)?;
            if !gone {
                return Err(ApiError::new(
                    409,
                    format!("file {id} is the input of a batch still running; cancel it or wait"),
                )
                .code("file_in_use"));
            }
            Ok(axum::Json(json!({"id": f.id, "object": "file", "deleted": true})).into_response())
        }
        .await,
    )
}

/// Streams a file's lines a page at a time: an input file as uploaded
/// (one request per line), an output or error file from the results.
async fn file_content(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        async {
            let f = owned_file(&app, &headers, &id).await?;
            let store = app.batches.store.clone();
            let stream = futures_util::stream::unfold(Some(0u64), move |from| {
                let store = store.clone();
                let f = f.clone();
                async move {
                    let from = from?;
                    let page = store
                        .run(move |s| match (&f.batch_id, f.ok) {
                            (Some(b), Some(ok)) => s.results(b, ok, from, 1000),
                            _ => s.lines(&f.id, from, 1000),
                        })
                        .await;
                    match page {
                        Ok(rows) if rows.is_empty() => None,
                        Ok(rows) => {
                            let next = rows.last().map(|(n, _)| n + 1);
                            let mut out = Vec::new();
                            for (_, t) in &rows {
                                out.extend_from_slice(t.as_bytes());
                                out.push(b'\n');
                            }
                            Some((Ok::<Bytes, std::io::Error>(Bytes::from(out)), next))
                        }
                        Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
                    }
                }
            });
            let mut resp = Body::from_stream(stream).into_response();
            resp.headers_mut().insert(
                "content-type",
                axum::http::HeaderValue::from_static("application/jsonl"),
            );
            Ok(resp)
        }
        .await,
    )
}

// ---- batches -------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBatch {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    #[serde(default)]
    metadata: Option<Value>,
    /// Sent by newer SDKs; kiln keeps results until they are deleted.
    #[serde(default)]
    output_expires_after: Option<Value>,
}

fn check_metadata(m: &Option<Value>) -> Result<(), ApiError> {
    let Some(m) = m else { return Ok(()) };
    if m.is_null() {
        return Ok(());
    }
    let bad = |msg: &str| ApiError::bad_request(msg.into(), Some("metadata"));
    let Some(o) = m.as_object() else {
        return Err(bad("`metadata` must be an object of strings"));
    };
    if o.len() > 16 {
        return Err(bad("`metadata` holds at most 16 keys"));
    }
    for (k, v) in o {
        if k.len() > 64 {
            return Err(bad("`metadata` keys are at most 64 characters"));
        }
        match v.as_str() {
            Some(s) if s.len() <= 512 => {}
            _ => {
                return Err(bad(
                    "`metadata` values are strings of at most 512 characters",
                ))
            }
        }
    }
    Ok(())
}

/// The windows a batch of `tier` may ask for, in seconds: the tier's
/// `completion_windows`, by default `24h` only.
fn allowed_windows(graph: &crate::graph::DecisionGraph, tier: Option<&str>) -> Vec<f64> {
    match tier
        .and_then(|t| graph.tier_id(t))
        .and_then(|t| graph.tiers.get(t as usize))
    {
        Some(t) if !t.completion_windows.is_empty() => {
            t.completion_windows.iter().map(|ms| ms / 1000.0).collect()
        }
        _ => vec![86_400.0],
    }
}

fn window_text(secs: f64) -> String {
    if secs % 86_400.0 == 0.0 {
        format!("{}d", secs / 86_400.0)
    } else if secs % 3600.0 == 0.0 {
        format!("{}h", secs / 3600.0)
    } else if secs % 60.0 == 0.0 {
        format!("{}m", secs / 60.0)
    } else {
        format!("{secs}s")
    }
}

/// The batch object: [`BatchRow::to_json`] with OpenAI's `model` and
/// `usage` (the tokens of its finished items, summed as they finish).
async fn batch_json(app: &App, b: &BatchRow) -> Value {
    let mut v = b.to_json(rate_of(app, b.owner.as_deref()));
    let id = b.id.clone();
    if let Ok(Some(x)) = app.batches.store.run(move |s| s.extras(&id)).await {
        v["model"] = json!(x.model);
        v["usage"] = json!({
            "input_tokens": x.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": x.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": x.input_tokens + x.output_tokens,
        });
    }
    v
}

/// `output_expires_after`: `{"anchor": "created_at", "seconds": N}`, N
/// from one hour to 30 days, as OpenAI's; wall seconds (the simulator's
/// speed applied, as for windows).
fn output_expiry(v: &Option<Value>, speed: f64) -> Result<Option<f64>, ApiError> {
    let Some(v) = v.as_ref().filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |m: &str| ApiError::bad_request(m.into(), Some("output_expires_after"));
    if v.get("anchor").and_then(Value::as_str) != Some("created_at") {
        return Err(bad("`output_expires_after.anchor` must be \"created_at\""));
    }
    match v.get("seconds").and_then(Value::as_u64) {
        Some(s) if (3600..=2_592_000).contains(&s) => Ok(Some(s as f64 / speed.max(1e-9))),
        _ => Err(bad(
            "`output_expires_after.seconds` must be a whole number of seconds from 3600 (1 hour) to 2592000 (30 days)",
        )),
    }
}

fn rate_of(app: &App, owner: Option<&str>) -> Option<f64> {
    let p = app.policy.load();
    let t = p.graph.tenant_id(owner?)?;
    p.graph.tenants.get(t as usize)?.cost_per_gpu_hour
}

async fn create_batch(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    respond(create_inner(app, headers, body).await)
}

async fn create_inner(
    app: Arc<App>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let owner = caller(&app, &headers)?;
    if body.len() > 64 * 1024 {
        return Err(ApiError::new(413, "the batch request is too large").code("request_too_large"));
    }
    let req: CreateBatch = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid batch request: {e}"), None))?;
    let expires_after = output_expiry(&req.output_expires_after, app.speed)?;
    check_metadata(&req.metadata)?;
    let job = crate::batch::job::JobSettings::parse(req.metadata.as_ref())
        .map_err(|m| ApiError::bad_request(m, Some("metadata")))?;
    let f = owned_file(&app, &headers, &req.input_file_id)
        .await
        .map_err(|_| {
            ApiError::bad_request(
                format!("No such file: '{}'", req.input_file_id),
                Some("input_file_id"),
            )
            .code("not_found")
        })?;
    if f.purpose != "batch" {
        return Err(ApiError::bad_request(
            format!(
                "file {} has purpose `{}`; a batch reads a `batch` file",
                f.id, f.purpose
            ),
            Some("input_file_id"),
        ));
    }
    let Some(endpoint) = validate::endpoint(&req.endpoint) else {
        if let Some(why) = validate::unserved(&req.endpoint) {
            return Err(ApiError::bad_request(why, Some("endpoint")).code("unsupported_endpoint"));
        }
        return Err(ApiError::bad_request(
            format!(
                "`{}` is not a batch endpoint: use /v1/chat/completions or /v1/completions",
                req.endpoint
            ),
            Some("endpoint"),
        ));
    };
    if f.endpoint.as_deref() != Some(req.endpoint.as_str()) {
        return Err(ApiError::bad_request(
            format!(
                "the file's requests call {}, not {}",
                f.endpoint.as_deref().unwrap_or("nothing"),
                req.endpoint
            ),
            Some("endpoint"),
        ));
    }
    let Some(window) = parse_window(&req.completion_window) else {
        return Err(ApiError::bad_request(
            format!(
                "`{}` is not a completion window (write e.g. `24h`)",
                req.completion_window
            ),
            Some("completion_window"),
        ));
    };
    // The tier the items classify into, and how long they would take now.
    let (fid, lines) = (f.id.clone(), f.lines);
    let sample = app
        .batches
        .store
        .run(move |s| super::batch_plan::sample_lines(s, &fid, lines))
        .await
        .map_err(store_error)?;
    let est = estimate_for_lines(&app, &sample, owner.as_deref(), endpoint, f.lines).await;
    // OpenAI's `model`: the model its requests name (the first line's).
    let model = sample.first().and_then(|l| {
        let v: Value = serde_json::from_str(l).ok()?;
        Some(v.get("body")?.get("model")?.as_str()?.to_string())
    });
    let tier = est.as_ref().map(|e| e.tier.clone());
    let policy = app.policy.load_full();
    let allowed = allowed_windows(&policy.graph, tier.as_deref());
    if !allowed.iter().any(|w| (w - window).abs() < 0.5) {
        let list: Vec<String> = allowed.iter().map(|w| window_text(*w)).collect();
        return Err(ApiError::bad_request(
            format!(
                "completion_window `{}` is not one tier `{}` accepts; it accepts {} (the tier's `completion_windows`)",
                req.completion_window,
                tier.as_deref().unwrap_or("?"),
                list.join(", ")
            ),
            Some("completion_window"),
        ));
    }
    // Its own settings, within its tier's bounds.
    if let Some(t) = tier
        .as_deref()
        .and_then(|t| policy.graph.tier_id(t))
        .and_then(|t| policy.graph.tiers.get(t as usize))
    {
        job.check(t)
            .map_err(|m| ApiError::bad_request(m, Some("metadata")))?;
    }
    let speed = app.speed;
    let created = now_s();
    let window_s = window / speed;
    // A batch's own cap on items at once bounds its pace.
    let cap = job.max_in_flight;
    let mut row = BatchRow {
        id: crate::batch::new_id("batch_"),
        owner: owner.clone(),
        input_file_id: f.id.clone(),
        endpoint: req.endpoint.clone(),
        completion_window: req.completion_window.clone(),
        window_s,
        status: BatchStatus::Validating,
        created_at: created,
        expires_at: created + window_s.ceil() as i64,
        in_progress_at: None,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        counts: RequestCounts {
            total: f.lines,
            completed: 0,
            failed: 0,
        },
        metadata: req.metadata.filter(|m| !m.is_null()),
        errors: None,
        output_file_id: None,
        error_file_id: None,
        tier,
        predicted_finish: est.as_ref().map(|e| created as f64 + e.secs(f.lines, cap)),
        gpu_seconds: 0.0,
        deadline_misses: 0,
        promise: Default::default(),
    };
    // The promise: this batch planned after every batch accepted before
    // it (in its group's run order), on its tenant's share of the tier.
    if let Some(e) = &est {
        let mut rows = app
            .batches
            .store
            .run(|s| s.active())
            .await
            .map_err(store_error)?;
        rows.push(row.clone());
        if let Some(p) = plan_rows(&app, &rows, Some((&row.id, e)))
            .await
            .get(&row.id)
        {
            row.predicted_finish = Some(p.plan.finish);
            row.promise.rank = Some(p.plan.rank as u64);
            row.promise.pace_ratio = p.pace_ratio;
        }
        // The promise, stored with the batch (a restart keeps it).
        row.promise.on_time = Some(!row.predicted_miss());
        row.promise.finish = row.predicted_finish;
    }
    if row.predicted_miss()
        && app.config.batch.on_predicted_miss == super::batch_config::OnPredictedMiss::Refuse
    {
        let finish = row.predicted_finish.unwrap_or(0.0);
        return Err(ApiError::bad_request(
            format!(
                "this batch cannot finish inside its {} window: with the batches accepted before it, it is predicted to finish at {} (unix seconds), {:.0} s after the window ends at {}; try a longer window or later (`[batch] on_predicted_miss = \"refuse\"`)",
                req.completion_window,
                finish.round() as i64,
                (finish - row.expires_at as f64).max(0.0),
                row.expires_at
            ),
            Some("completion_window"),
        )
        .code("completion_window_unmeetable"));
    }
    let r = row.clone();
    let stored = app
        .batches
        .store
        .run(move |s| s.insert_batch(&r))
        .await
        .map_err(store_error)?;
    if !stored {
        return Err(ApiError::bad_request(
            format!("No such file: '{}' (it was deleted)", row.input_file_id),
            Some("input_file_id"),
        )
        .code("not_found"));
    }
    let (bid, model) = (row.id.clone(), model);
    app.batches
        .store
        .run(move |s| s.set_extras(&bid, model.as_deref(), expires_after))
        .await
        .map_err(store_error)?;
    app.batches.wake.notify_one();
    if row.predicted_miss() {
        tracing::warn!(batch = %row.id, "batch predicted to miss its completion window at the current load");
    }
    Ok(axum::Json(batch_json(&app, &row).await).into_response())
}

async fn owned_batch(app: &App, headers: &HeaderMap, id: &str) -> Result<BatchRow, ApiError> {
    owned(app, headers, id, "batch", |s, k| s.batch(k), |b| &b.owner).await
}

async fn get_batch(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        async {
            let b = owned_batch(&app, &headers, &id).await?;
            Ok(axum::Json(batch_json(&app, &b).await).into_response())
        }
        .await,
    )
}

async fn list_batches(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<Page>,
) -> Response {
    respond(
        async {
            let owner = caller(&app, &headers)?;
            Ok(axum::Json(batch_page(&app, Some(owner), q).await?).into_response())
        }
        .await,
    )
}

/// A page of batches (of `owner`, or all), OpenAI's list shape.
async fn batch_page(app: &App, owner: Option<Option<String>>, q: Page) -> Result<Value, ApiError> {
    let limit = q.limit(20).min(100);
    let rows = app
        .batches
        .store
        .run(move |s| {
            s.batches(
                owner.as_ref().map(|o| o.as_deref()),
                q.after.as_deref(),
                limit + 1,
            )
        })
        .await
        .map_err(store_error)?;
    let more = rows.len() > limit;
    let mut data = Vec::new();
    for b in rows.iter().take(limit) {
        let mut v = batch_json(app, b).await;
        v["kiln"]["in_flight"] = json!(app.batches.in_flight_of(&b.id));
        data.push(v);
    }
    Ok(list_body(data, more))
}

async fn cancel(app: &App, b: BatchRow) -> Result<Response, ApiError> {
    if b.status.terminal() || b.status == BatchStatus::Finalizing {
        return Err(ApiError::new(
            409,
            format!("Cannot cancel a batch with status {}.", b.status.name()),
        )
        .code("batch_not_cancellable"));
    }
    let id = b.id.clone();
    let after = app
        .batches
        .store
        .run(move |s| {
            s.transition(
                &id,
                &[BatchStatus::Validating, BatchStatus::InProgress],
                BatchStatus::Cancelling,
                now_s(),
            )?;
            s.batch(&id)
        })
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("batch", &b.id))?;
    app.batches.wake.notify_one();
    Ok(axum::Json(batch_json(app, &after).await).into_response())
}

async fn cancel_batch(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        async {
            let b = owned_batch(&app, &headers, &id).await?;
            cancel(&app, b).await
        }
        .await,
    )
}

// ---- admin ---------------------------------------------------------------

async fn admin_list(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<Page>,
) -> Response {
    respond(
        async {
            authorize(&app, &headers)?;
            Ok(axum::Json(batch_page(&app, None, q).await?).into_response())
        }
        .await,
    )
}

async fn admin_batch(app: &App, headers: &HeaderMap, id: &str) -> Result<BatchRow, ApiError> {
    authorize(app, headers)?;
    let bid = id.to_string();
    app.batches
        .store
        .run(move |s| s.batch(&bid))
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found("batch", id))
}

async fn admin_get(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        async {
            let b = admin_batch(&app, &headers, &id).await?;
            let mut v = batch_json(&app, &b).await;
            v["kiln"]["in_flight"] = json!(app.batches.in_flight_of(&b.id));
            Ok(axum::Json(v).into_response())
        }
        .await,
    )
}

async fn admin_cancel(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    respond(
        async {
            let b = admin_batch(&app, &headers, &id).await?;
            cancel(&app, b).await
        }
        .await,
    )
}
