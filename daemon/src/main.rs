//! The `weightstream` binary: serve, status, load, demo.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    weightstream_daemon::cli::main()
}
