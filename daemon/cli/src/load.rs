//! `weightstream load`: load safetensors into the daemon's store, with a progress bar.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use weightstream_client::Client;

use super::{CliResult, human};

#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Files: one .safetensors, a *.safetensors.index.json, or a directory (relative paths are
    /// made absolute here, since the daemon resolves them).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The model's name (default: the file or directory name).
    #[arg(long, default_value = "")]
    name: String,
}

pub async fn run(socket: Option<PathBuf>, args: LoadArgs) -> CliResult {
    let mut client = Client::connect(socket.as_deref()).await?;
    let paths = args
        .files
        .iter()
        .map(std::path::absolute)
        .collect::<Result<Vec<_>, _>>()?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )?
        .progress_chars("=> "),
    );
    bar.set_message("loading");
    let manifest = client
        .load_model(&paths, &args.name, |p| {
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
        })
        .await;
    bar.finish_and_clear();
    let manifest = manifest?;
    println!(
        "{}  {}  {} tensors  {}  (references: {})",
        manifest.model_id,
        manifest.name,
        manifest.tensors.len(),
        human(manifest.total_bytes),
        manifest.refcount
    );
    Ok(())
}
