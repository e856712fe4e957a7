//! The `kiln` command line. Exit codes are stable (see README): 0 clean,
//! 1 findings that fail, 2 usage or I/O error.

/// mimalloc instead of the system allocator: the gateway's hot path
/// allocates per request (bodies, headers, JSON values), and glibc's malloc
/// was about a fifth of its profile (BENCHMARKS.md, issue 27).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    quiet_on_closed_pipe();
    let code = kiln::cli::main();
    std::process::exit(code);
}

/// `kiln fmt --check … | head` closes standard output early; `print!` then
/// panics with "failed printing to stdout: Broken pipe". A command line tool
/// should end there quietly, as one killed by SIGPIPE would (exit 141), not
/// print a panic and a backtrace. Every other panic keeps the default report.
fn quiet_on_closed_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to std") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}
