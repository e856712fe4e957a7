//! API keys: each authenticates as exactly one tenant. A key given to two
//! tenants would otherwise map, silently, to whichever was declared last.

use super::Compiler;
use crate::diag::{Code, Diagnostic};
use crate::source::Span;

impl Compiler<'_> {
    /// Records `key` as `tenant`'s; `Some(key)` unless it was given before
    /// (then the repeat is reported and dropped). Policy keys are literal
    /// strings (the grammar has no env or secret references), so every
    /// repeat is visible here. The key itself is kept out of the message:
    /// the source line shows it, a log of messages need not.
    pub(crate) fn api_key(&mut self, key: &str, tenant: &str, span: Span) -> Option<String> {
        match self.api_keys.get(key) {
            None => {
                self.api_keys
                    .insert(key.to_string(), (tenant.to_string(), span));
                Some(key.to_string())
            }
            Some((first, at)) if first == tenant => {
                let at = *at;
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("tenant `{tenant}` lists the same API key twice"),
                    )
                    .at(span, "listed again here")
                    .also(at, "first given here")
                    .help("remove the repeat: a key is listed once, under the one tenant it authenticates as"),
                );
                None
            }
            Some((first, at)) => {
                let (first, at) = (first.clone(), *at);
                self.err(
                    Diagnostic::error(
                        Code::DuplicateDefinition,
                        format!("one API key is given to two tenants, `{first}` and `{tenant}`"),
                    )
                    .at(span, format!("given to `{tenant}` here"))
                    .also(at, format!("first given here, to `{first}`"))
                    .help(format!(
                        "API keys must be unique per tenant: a key authenticates as exactly one tenant, and this one would silently map to `{tenant}`, the later of the two; give each tenant a key of its own"
                    )),
                );
                None
            }
        }
    }
}
