//! What `POST /admin/policy` and `kiln propose` do with an uploaded
//! policy before any approval: compile it and plan its deployment on
//! simulated pools. Nothing a policy says may crash the gateway or make it
//! allocate in proportion to a number it contains.
#![no_main]

use kiln::backend::deploy;
use kiln::compile::compile_str;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let c = compile_str("upload.kiln", text);
    if c.has_errors() {
        return;
    }
    let Some(g) = c.graph else { return };
    if let Ok((plan, _)) = deploy::plan(&g, &BTreeMap::new(), None) {
        let _ = plan.replicas.len();
    }
});
