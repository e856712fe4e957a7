//! Policy text through everything a `kiln check`/`lint`/`fmt` run does:
//! parse, compile, lint, format; formatting must be idempotent and must
//! not change what compiles.
#![no_main]

use kiln::compile::{compile_str, lint};
use kiln::lang::{format::format_file, parse};
use kiln::source::FileId;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let c = compile_str("fuzz.kiln", text);
    if !c.has_errors() {
        let _ = lint(&c);
    }
    if let Ok(file) = parse(FileId(0), text) {
        let once = format_file(&file, text);
        if let Ok(again) = parse(FileId(0), &once) {
            let twice = format_file(&again, &once);
            assert_eq!(once, twice, "fmt is not idempotent");
        }
    }
});
