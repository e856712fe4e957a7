//! What a record of a request (the decision log, explain) keeps of what
//! the client sent: headers by allow-list, tags up to a bound.

use super::BATCH_HEADER;
use crate::graph::{DecisionGraph, Request};
use std::collections::BTreeMap;

/// Headers never copied into the policy's view or the decision log.
pub(in crate::server) fn private_header(name: &str) -> bool {
    matches!(
        name,
        "authorization"
            | "proxy-authorization"
            | "cookie"
            | "x-api-key"
            | "api-key"
            | "host"
            | "content-length"
            | "content-type"
            | "accept"
            | "accept-encoding"
            | "connection"
    ) || (name.starts_with("x-stainless") && name != crate::graph::SDK_RETRY_HEADER)
}

/// Header bytes (names plus values) one record of a request keeps at most,
/// in the decision log and in explain. A client controls its headers:
/// without a bound, a few large `x-kiln-*` headers a request (up to the
/// header caps, about 60 KB) would let any keyed tenant rotate the log's
/// history out. The headers the policy reads come first, so a replay still
/// decides the request as the gateway did unless they alone pass the bound.
pub(in crate::server) const MAX_RECORDED_HEADER_BYTES: usize = 4 * 1024;

/// The headers a record of this request keeps (the decision log and
/// explain): those the deciding policies read (`header("…")` in their
/// classify, route and admit rules) and `x-kiln-*`, never a credential,
/// at most [`MAX_RECORDED_HEADER_BYTES`] of them.
/// Everything else (tokens, cookies, provider keys under any name) stays
/// out: recorded by allow-list, not by a list of secrets.
pub(in crate::server) fn recorded_headers(
    headers: &BTreeMap<String, String>,
    graphs: &[&DecisionGraph],
) -> BTreeMap<String, String> {
    kept_headers(headers, graphs, true)
}

/// What a refused request's record keeps: only the headers the policy
/// reads (so a replay refuses it the same way) and the batch runner's own,
/// none of the client's free-form `x-kiln-*` headers: a refusal costs the
/// log a line, not the client's choice of bytes.
pub(in crate::server) fn refused_headers(
    headers: &BTreeMap<String, String>,
    graphs: &[&DecisionGraph],
) -> BTreeMap<String, String> {
    kept_headers(headers, graphs, false)
}

fn kept_headers(
    headers: &BTreeMap<String, String>,
    graphs: &[&DecisionGraph],
    kiln: bool,
) -> BTreeMap<String, String> {
    if headers.is_empty() {
        return BTreeMap::new();
    }
    let read = |name: &str| {
        graphs.iter().any(|g| {
            g.headers_read()
                .binary_search_by(|h| h.as_str().cmp(name))
                .is_ok()
        })
    };
    let mut kept = BTreeMap::new();
    let mut left = MAX_RECORDED_HEADER_BYTES;
    // The policy's headers (and the runner's batch id) first, then the
    // client's `x-kiln-*`; a header that does not fit in what is left is
    // skipped whole (never cut: a cut value would replay as another one).
    for policy_pass in [true, false] {
        for (k, v) in headers {
            let name = crate::server::decision_log::lowercase(k);
            let name = name.as_ref();
            if crate::server::decision_log::secret_header(name) {
                continue;
            }
            let wanted = if policy_pass {
                // The retry markers too: admission's retry budget reads
                // them, so a replay decides the request as the gateway did,
                // and `kiln report` counts retries from them.
                read(name) || name == BATCH_HEADER || retry_marker(name)
            } else {
                kiln && name.starts_with("x-kiln-")
                    && !read(name)
                    && name != BATCH_HEADER
                    && !retry_marker(name)
            };
            let size = k.len() + v.len();
            if wanted && size <= left {
                left -= size;
                kept.insert(k.clone(), v.clone());
            }
        }
    }
    kept
}

/// The headers that say a request is a retry ([`crate::graph::Retry`]).
fn retry_marker(name: &str) -> bool {
    use crate::graph::{BATCH_TRY_HEADER, RETRY_HEADER, SDK_RETRY_HEADER};
    name == RETRY_HEADER || name == SDK_RETRY_HEADER || name == BATCH_TRY_HEADER
}

/// Bytes of `x-kiln-tags` tags one record keeps at most (the tags a
/// client sends are its own choice of bytes, like its headers).
const MAX_RECORDED_TAG_BYTES: usize = 1024;

/// The request as records keep it: only [`recorded_headers`], and its tags
/// up to [`MAX_RECORDED_TAG_BYTES`].
pub(in crate::server) fn recorded_request(req: &Request, graphs: &[&DecisionGraph]) -> Request {
    let mut left = MAX_RECORDED_TAG_BYTES;
    let tags = req
        .tags
        .iter()
        .take_while(|t| {
            let fits = t.len() <= left;
            left = left.saturating_sub(t.len());
            fits
        })
        .cloned()
        .collect();
    Request {
        headers: recorded_headers(&req.headers, graphs),
        tags,
        api_key: req.api_key.clone(),
        tenant: req.tenant.clone(),
        model: req.model.clone(),
        session: req.session.clone(),
        prompt_tokens: req.prompt_tokens,
        max_tokens: req.max_tokens,
    }
}
