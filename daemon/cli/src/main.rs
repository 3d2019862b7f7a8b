//! The `weightstream` binary: serve, status, top, load, release, demo. Every flag also reads an
//! environment variable, sizes take human units (`64MiB`, `2GiB`), and `serve` reads a TOML
//! config file that flags override.
#![forbid(unsafe_code)]

/// `println!` for a command's output. A reader that closed stdout (`weightstream status | head
/// -1`) wanted no more: the command ends there with status 0 instead of panicking on the
/// broken pipe; another write error ends it with status 1 and a message.
macro_rules! out {
    ($($arg:tt)*) => { $crate::write_out(format_args!($($arg)*), true, true) };
}

/// `print!` as `out!` does it.
macro_rules! out_part {
    ($($arg:tt)*) => { $crate::write_out(format_args!($($arg)*), false, true) };
}

/// `println!` for `demo`, whose daemon must still be stopped: write errors are ignored.
macro_rules! say {
    ($($arg:tt)*) => { $crate::write_out(format_args!($($arg)*), true, false) };
}

mod demo;
mod load;
mod release;
mod serve;
mod status;
mod top;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use weightstream_daemon::config::BackendChoice;
use weightstream_daemon::terminal::escape_controls;

#[derive(Debug, Parser)]
#[command(
    name = "weightstream",
    version,
    about = "Streams frozen model weights from pinned host memory to the GPU for trainers"
)]
struct Cli {
    /// The daemon's Unix socket. Default: a client uses /run/weightstream/weightstream.sock if
    /// it exists (the service's), else the user's socket; `serve` listens on the former as
    /// root, else on the user's: $XDG_RUNTIME_DIR/weightstream.sock, or
    /// /tmp/weightstream-<uid>/weightstream.sock without XDG_RUNTIME_DIR. (`demo` runs its own
    /// daemon on a private socket.)
    #[arg(long, global = true, env = "WEIGHTSTREAM_SOCKET")]
    socket: Option<PathBuf>,
    /// Log line format (the filter is WEIGHTSTREAM_LOG, e.g. `info,weightstream_daemon=debug`).
    #[arg(
        long,
        global = true,
        env = "WEIGHTSTREAM_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    /// Seconds a command waits for each answer from the daemon (connecting, each call; `load`:
    /// taking the files, then each progress report, at least 10 minutes apart). A daemon that
    /// is stuck, or a socket that accepts and never answers, ends the command with an error.
    #[arg(long, global = true, env = "WEIGHTSTREAM_TIMEOUT", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon.
    Serve(serve::ServeArgs),
    /// Show the daemon's devices, models and sessions.
    Status(status::StatusArgs),
    /// Live view of devices and sessions: GB/s, stall %, hit rate, budget use, history.
    Top(top::TopArgs),
    /// Load safetensors files (a file, a *.safetensors.index.json, or a directory) into the store.
    Load(load::LoadArgs),
    /// Give back this uid's reference to a model, or (`--all`, as root or the daemon's user) every uid's.
    Release(release::ReleaseArgs),
    /// Run an embedded daemon and a training-like client on a synthetic model, then report.
    Demo(demo::DemoArgs),
}

/// `--backend`: the config's [`BackendChoice`] with clap's names and help.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// CUDA when a driver and a device are present, else host.
    Auto,
    /// Shared memory and memcpy: no GPU needed.
    Host,
    /// NVIDIA GPUs through the CUDA driver.
    Cuda,
}

impl From<Backend> for BackendChoice {
    fn from(b: Backend) -> BackendChoice {
        match b {
            Backend::Auto => BackendChoice::Auto,
            Backend::Host => BackendChoice::Host,
            Backend::Cuda => BackendChoice::Cuda,
        }
    }
}

fn init_logging(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WEIGHTSTREAM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: journald and log files get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.fmt_fields(escaped_fields()).init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Text log fields as the default format writes them (`name=value`, the message bare), each
/// value escaped for the terminal: names from other users (models, files, labels) reach log
/// lines, and journald or a tail prints them as they are. JSON lines stay exact.
fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let text = escape_controls(&text);
        match field.name() {
            "message" => write!(writer, "{text}"),
            name => write!(writer, "{name}={text}"),
        }
    })
    .delimited(" ")
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

fn main() -> ExitCode {
    // The matches say where each value came from: `serve` lets only the flags and variables
    // the user set override its config file, not clap's defaults.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The daemon logs at info; the interactive commands only warn, so their output stays clean.
    let default = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    init_logging(cli.log_format, default);
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let socket = cli.socket;
    let deadline = Deadline(std::time::Duration::from_secs(cli.timeout));
    let result = rt.block_on(async move {
        match cli.command {
            Command::Serve(args) => {
                let given = serve::Given::new(matches.subcommand_matches("serve"));
                serve::run(socket, args, given).await
            }
            Command::Status(args) => status::run(socket, args, deadline).await,
            Command::Top(args) => top::run(socket, args, deadline).await,
            Command::Load(args) => load::run(socket, args, deadline).await,
            Command::Release(args) => release::run(socket, args, deadline).await,
            Command::Demo(args) => demo::run(args).await,
        }
    });
    // Dropping the runtime would wait for every blocking task, and one stuck in a read (a
    // load the stop gave up on, and named) would keep the process alive: wait briefly instead.
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A daemon's message may name another user's model.
            eprintln!("error: {}", escape_controls(&said(&*e)));
            if e.is::<UsageError>() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// An error as the user reads it: a daemon's refusal by its message alone (which names the
/// field and the limit), without the gRPC code (`NotFound`, `InvalidArgument`) before it.
fn said(e: &(dyn std::error::Error + 'static)) -> String {
    match e.downcast_ref::<weightstream_client::ClientError>() {
        Some(weightstream_client::ClientError::Rejected { message, .. }) => message.clone(),
        _ => e.to_string(),
    }
}

/// A command used where it cannot work: exits 2, as clap's usage errors do.
#[derive(Debug)]
struct UsageError(String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// How long a command waits for each answer from the daemon (`--timeout`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline(std::time::Duration);

impl Deadline {
    /// `call`'s answer, or, past the deadline, an error that names `what` and the wait.
    pub(crate) async fn on<T, E: Into<BoxError>>(
        self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> CliResult<T> {
        match tokio::time::timeout(self.0, call).await {
            Ok(answer) => answer.map_err(Into::into),
            Err(_) => Err(self.missed(what).into()),
        }
    }

    pub(crate) fn missed(self, what: &str) -> String {
        format!(
            "no answer from the daemon to {what} within {} s: it is stuck, or the socket is \
             not a weightstream daemon's (--timeout / WEIGHTSTREAM_TIMEOUT sets the wait)",
            self.0.as_secs()
        )
    }
}

/// How long the runtime waits, at exit, for tasks still running (see `main`).
const RUNTIME_SHUTDOWN: std::time::Duration = std::time::Duration::from_millis(250);

/// The CLI's error: a message for the user.
type BoxError = Box<dyn std::error::Error + Send + Sync>;
type CliResult<T = ()> = Result<T, BoxError>;

/// `--quantize`: none, fp8_e4m3_block64, fp8 (its alias), fp8_e4m3_row, int8_row.
fn parse_coding(value: &str) -> Result<weightstream_client::proto::Coding, String> {
    weightstream_client::parse_coding(value).ok_or_else(|| {
        format!(
            "'{value}': the accepted values are {}",
            weightstream_client::CODINGS
        )
    })
}

fn parse_quantize(value: &str) -> Result<weightstream_client::proto::Quantization, String> {
    weightstream_client::parse_quantization(value).ok_or_else(|| {
        format!(
            "'{value}': the accepted values are {}",
            weightstream_client::QUANTIZATIONS
        )
    })
}

/// Bytes before and after quantization, as `load` and `demo` print them.
fn saved(before: u64, after: u64) -> String {
    let pct = if before == 0 {
        0.0
    } else {
        100.0 * before.saturating_sub(after) as f64 / before as f64
    };
    format!("{} -> {} ({pct:.1} % saved)", human(before), human(after))
}

/// A string from the daemon (a name another user chose, often) as a table or line shows it:
/// escaped for the terminal ([`escape_controls`]).
fn shown(text: &str) -> String {
    escape_controls(text).into_owned()
}

/// Bytes as people read them.
fn human(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

/// Writes a command's output to stdout (see `out!`); `exit_on_error`: a closed or failing
/// stdout ends the process.
pub(crate) fn write_out(args: std::fmt::Arguments, newline: bool, exit_on_error: bool) {
    let mut stdout = std::io::stdout().lock();
    let written = stdout
        .write_fmt(args)
        .and_then(|()| {
            if newline {
                stdout.write_all(b"\n")
            } else {
                Ok(())
            }
        })
        .and_then(|()| stdout.flush());
    match written {
        Ok(()) => {}
        Err(_) if !exit_on_error => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("error: writing to stdout: {e}");
            std::process::exit(1);
        }
    }
}
