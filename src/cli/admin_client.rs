//! The admin API client the governance commands share: `--server` and
//! `--token` (or `KILN_SERVER` and `KILN_ADMIN_TOKEN`), one request, and
//! errors printed the same way everywhere.

use super::{EXIT_FINDINGS, EXIT_USAGE};
use serde_json::Value;

#[derive(clap::Args, Debug, Clone)]
pub struct ServerArgs {
    /// The gateway's base URL (default: $KILN_SERVER, else http://127.0.0.1:8080).
    #[arg(long)]
    pub server: Option<String>,
    /// Admin bearer token (default: $KILN_ADMIN_TOKEN).
    #[arg(long)]
    pub token: Option<String>,
}

impl ServerArgs {
    fn base(&self) -> String {
        self.server
            .clone()
            .or_else(|| std::env::var("KILN_SERVER").ok())
            .unwrap_or_else(|| "http://127.0.0.1:8080".into())
            .trim_end_matches('/')
            .to_string()
    }

    fn token(&self) -> Option<String> {
        self.token
            .clone()
            .or_else(|| std::env::var("KILN_ADMIN_TOKEN").ok())
            .filter(|t| !t.is_empty())
    }
}

pub enum Method {
    Get,
    Post,
    Put,
    Delete,
}

/// One admin call. `Ok((status, body))` for any HTTP answer; `Err(code)`
/// when the gateway could not be reached (reported on stderr).
pub fn call(
    args: &ServerArgs,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), i32> {
    let base = args.base();
    let url = format!("{base}{path}");
    let loopback = reqwest::Url::parse(&base)
        .ok()
        .and_then(|u| u.host_str().map(str::to_string))
        .is_some_and(|h| h == "localhost" || h.starts_with("127.") || h == "[::1]");
    let mut b = reqwest::Client::builder().timeout(std::time::Duration::from_secs(120));
    if loopback {
        b = b.no_proxy();
    }
    let client = b
        .build()
        .map_err(|e| super::usage_error(&format!("cannot build the HTTP client: {e}")))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| super::usage_error(&format!("cannot start the async runtime: {e}")))?;
    let token = args.token();
    rt.block_on(async move {
        let mut req = match method {
            Method::Get => client.get(&url),
            Method::Post => client.post(&url),
            Method::Put => client.put(&url),
            Method::Delete => client.delete(&url),
        };
        if let Some(t) = &token {
            req = req.bearer_auth(t);
        }
        if let Some(v) = body {
            req = req.json(v);
        }
        let resp = req.send().await.map_err(|e| {
            eprintln!("error: cannot reach the gateway at {base}: {e}");
            eprintln!("help: check --server (or KILN_SERVER) and that `kiln serve` runs there");
            EXIT_USAGE
        })?;
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, v))
    })
}

/// Prints an error answer (message, code, help, rendered diagnostics) and
/// returns exit code 1.
pub fn report_error(status: u16, v: &Value) -> i32 {
    let msg = v["error"]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| v.to_string());
    let code = v["error"]["code"].as_str().unwrap_or("");
    if code.is_empty() {
        eprintln!("error ({status}): {msg}");
    } else {
        eprintln!("error ({status} {code}): {msg}");
    }
    if let Some(r) = v["rendered"].as_str() {
        eprint!("{r}");
    }
    if let Some(h) = v["help"].as_str() {
        eprintln!("help: {h}");
    }
    if status == 401 || status == 403 && code == "forbidden" {
        eprintln!("help: pass an admin token with --token or KILN_ADMIN_TOKEN");
    }
    EXIT_FINDINGS
}

/// Parses a successful answer into `T`, or reports why not.
pub fn parse<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, i32> {
    serde_json::from_value(v).map_err(|e| {
        eprintln!("error: unexpected answer from the gateway: {e}");
        EXIT_USAGE
    })
}

pub fn print_json(v: &Value) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("error: {e}"),
    }
}
