//! The OpenAI request body as the gateway reads it (chat and completions),
//! and the prompt-token count it takes for admission.
#![no_main]

use kiln::server::openai::{Endpoint, GenerationRequest, Tokenizer};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static TOKENIZER: OnceLock<Option<Tokenizer>> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let tok = TOKENIZER.get_or_init(|| Tokenizer::new().ok());
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        if let Ok((req, _raw)) = GenerationRequest::parse(endpoint, data) {
            if let Some(t) = tok {
                let _ = t.prompt_tokens(&req);
            }
            let _ = req.requested_max_tokens();
            let _ = req.streaming();
            let _ = req.include_usage();
        }
    }
});
