//! Recorded-traffic input: the JSONL reader (strict and skipping), and the
//! Azure and Mooncake importers on the same bytes.
#![no_main]

use kiln::traffic::import::{azure, mooncake, Mapping};
use kiln::traffic::{ReadOptions, Reader};
use libfuzzer_sys::fuzz_target;
use std::io::Write;

fuzz_target!(|data: &[u8]| {
    for skip in [false, true] {
        let opts = ReadOptions {
            skip_malformed: skip,
        };
        for r in Reader::new(data, "fuzz.jsonl", opts).take(10_000) {
            let _ = r;
        }
    }
    // The importers read files: one scratch file per process.
    let path = std::env::temp_dir().join(format!("kiln-fuzz-traffic-{}", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    for skip in [false, true] {
        let mut map = Mapping::new("m");
        map.skip_malformed = skip;
        let _ = azure(&path, &map);
        let _ = mooncake(&path, &map);
    }
});
