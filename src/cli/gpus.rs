//! `kiln gpus`: the GPUs the CUDA driver sees, and whether a policy's pool
//! fits them.

use super::*;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A policy whose pool (--pool) to check against the devices.
    #[arg(long)]
    pub policy: Vec<PathBuf>,
    /// Check this pool of --policy: no more GPUs, and no more memory per
    /// GPU, than the devices have (exit 1 when it asks for more).
    #[arg(long, requires = "policy")]
    pub pool: Option<String>,
    #[arg(long, value_enum, default_value_t = Format::Human)]
    pub format: Format,
}

/// What `kiln gpus` and `kiln calibrate --backend cuda` say in a binary
/// built without the feature.
#[cfg(not(feature = "cuda"))]
pub(crate) const NO_FEATURE: &str =
    "this kiln binary was built without `--features cuda`, so it cannot use GPUs; \
     rebuild with `cargo build --release --features cuda` (no CUDA toolkit needed to build), \
     or use the sim or http backend";

#[cfg(not(feature = "cuda"))]
pub fn run(a: Args) -> i32 {
    let _ = a;
    usage_error(NO_FEATURE)
}

#[cfg(feature = "cuda")]
pub fn run(a: Args) -> i32 {
    use crate::backend::cuda::device::{check_pool, describe};
    let devices = match crate::backend::cuda::devices() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_USAGE;
        }
    };
    match a.format {
        Format::Human => {
            for d in &devices {
                println!("{}", describe(d));
            }
        }
        Format::Json => match serde_json::to_string_pretty(&devices) {
            Ok(s) => println!("{s}"),
            Err(e) => return usage_error(&e.to_string()),
        },
    }
    let Some(name) = a.pool else {
        return EXIT_OK;
    };
    let g = match compile_one(&a.policy) {
        Ok((_, g)) => g,
        Err(code) => return code,
    };
    let Some(pool) = g.pools.iter().find(|p| p.name == name) else {
        let known: Vec<&str> = g.pools.iter().map(|p| p.name.as_str()).collect();
        return usage_error(&format!(
            "the policy has no pool `{name}`; its pools: {}",
            known.join(", ")
        ));
    };
    match check_pool(pool, &devices) {
        Ok(()) => {
            eprintln!(
                "pool `{name}`: {} GPUs of {:.0} GB fit the devices",
                pool.gpus,
                pool.gpu_memory / 1e9
            );
            EXIT_OK
        }
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            EXIT_FINDINGS
        }
    }
}
