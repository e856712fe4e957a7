//! The `kiln` command line. Exit codes are stable (see README): 0 clean,
//! 1 findings that fail, 2 usage or I/O error.

fn main() {
    let code = kiln::cli::main();
    std::process::exit(code);
}
