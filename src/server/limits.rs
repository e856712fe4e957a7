//! What one request may cost the gateway before any handler runs: header
//! count and size (431 with an OpenAI error body above `[limits]`), and how
//! long its body may take to arrive (408).

use super::config::Limits;
use super::openai::ApiError;
use super::App;
use axum::body::Body;
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::future::Future as _;
use std::time::Duration;

/// Checks a request's headers against the limits.
pub fn check_headers(h: &HeaderMap, l: &Limits) -> Result<(), ApiError> {
    let too_large = |what: String| {
        ApiError::new(431, format!("request headers too large: {what}"))
            .code("request_header_fields_too_large")
    };
    if h.len() > l.max_header_count {
        return Err(too_large(format!(
            "{} headers, at most {} accepted",
            h.len(),
            l.max_header_count
        )));
    }
    let mut total = 0usize;
    for (k, v) in h {
        if v.len() > l.max_header_value_bytes {
            return Err(too_large(format!(
                "header `{k}` is {} bytes, at most {} accepted",
                v.len(),
                l.max_header_value_bytes
            )));
        }
        total += k.as_str().len() + v.len();
    }
    if total > l.max_header_bytes {
        return Err(too_large(format!(
            "{total} bytes of headers, at most {} accepted",
            l.max_header_bytes
        )));
    }
    Ok(())
}

/// In front of every route (run by [`super::surface::stamp`], the one
/// middleware, so a request pays for one layer, not two): refuses
/// oversized headers and puts a deadline on reading the body.
pub async fn guard(app: &App, req: Request, next: Next) -> Response {
    if let Err(e) = check_headers(req.headers(), &app.config.limits) {
        return e.into_response();
    }
    // A batch file (up to 200 MB) may take longer than a request body:
    // its upload has an idle timeout between pieces instead (see
    // `batches::read_form`), so a slow link still gets it there.
    if req.method() == axum::http::Method::POST && req.uri().path() == "/v1/files" {
        return next.run(req).await;
    }
    let timeout = app.config.limits.body_timeout();
    let req = req.map(|b| Body::new(Timed::new(b, timeout)));
    next.run(req).await
}

/// The body did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimeout(Duration);

/// A request body that fails once its deadline passes.
struct Timed {
    inner: Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl Timed {
    fn new(inner: Body, timeout: Duration) -> Timed {
        Timed {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
        }
    }
}

impl http_body::Body for Timed {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let std::task::Poll::Ready(f) = std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            return std::task::Poll::Ready(f);
        }
        match this.deadline.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => {
                std::task::Poll::Ready(Some(Err(axum::Error::new(BodyTimeout(this.timeout)))))
            }
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The answer to a body that could not be read: too large (413), too slow
/// (408) or cut off (400).
pub fn body_error(e: &axum::Error, limit: usize, timeout: Duration) -> ApiError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut text = String::new();
    while let Some(s) = src {
        if s.downcast_ref::<BodyTimeout>().is_some() {
            return body_timeout_error(timeout);
        }
        text.push_str(&s.to_string());
        text.push(' ');
        src = s.source();
    }
    if text.contains("length limit") {
        return ApiError::new(
            413,
            format!("the request body is larger than this gateway accepts ({limit} bytes)"),
        )
        .code("request_too_large");
    }
    ApiError::new(400, "the request body could not be read in full").code("incomplete_body")
}

fn body_timeout_error(timeout: Duration) -> ApiError {
    ApiError::new(
        408,
        format!(
            "the request body did not arrive within {} s",
            timeout.as_secs_f64()
        ),
    )
    .code("request_timeout")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn headers_are_capped_in_count_value_and_total() {
        let l = Limits::default();
        let mut h = HeaderMap::new();
        h.insert("x-a", HeaderValue::from_static("ok"));
        assert!(check_headers(&h, &l).is_ok());
        let big = HeaderValue::from_str(&"v".repeat(l.max_header_value_bytes + 1)).unwrap();
        h.insert("x-big", big);
        let e = check_headers(&h, &l).unwrap_err();
        assert_eq!(e.status, 431);
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        let mut h = HeaderMap::new();
        for i in 0..=l.max_header_count {
            h.insert(
                axum::http::HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            );
        }
        assert_eq!(check_headers(&h, &l).unwrap_err().status, 431);
        let mut h = HeaderMap::new();
        let v = HeaderValue::from_str(&"v".repeat(l.max_header_value_bytes)).unwrap();
        for i in 0..5 {
            h.insert(
                axum::http::HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                v.clone(),
            );
        }
        let e = check_headers(&h, &l).unwrap_err();
        assert!(e.message.contains("bytes of headers"), "{}", e.message);
    }
}
