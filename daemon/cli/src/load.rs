//! `weightstream load`: load safetensors into the daemon's store, with a progress bar.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use weightstream_client::{Client, proto, quantization_name};

use super::{CliResult, human, parse_quantize, saved};

#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Files: one .safetensors, a *.safetensors.index.json, or a directory (relative paths are
    /// made absolute here, since the daemon resolves them).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The model's name (default: the file or directory name).
    #[arg(long, default_value = "")]
    name: String,
    /// Quantize the weights (".weight" tensors of rank >= 2 in BF16/F16/F32) while loading:
    /// none, fp8 (= fp8_e4m3_block64: e4m3fn data, one fp32 scale per 64 inputs of a row).
    /// The store keeps only the quantized copy; the other tensors keep their dtype.
    #[arg(long, env = "WEIGHTSTREAM_QUANTIZE", default_value = "none", value_parser = parse_quantize)]
    quantize: proto::Quantization,
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
    let quantized = args.quantize != proto::Quantization::None;
    bar.set_message(if quantized {
        "loading and quantizing"
    } else {
        "loading"
    });
    let mut file_bytes = 0;
    let manifest = client
        .load_model(&paths, &args.name, args.quantize, |p| {
            file_bytes = p.bytes_total;
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
    if quantized {
        let count = (manifest.tensors.iter())
            .filter(|t| t.quantization != proto::Quantization::None as i32)
            .count();
        println!(
            "{}: {count} of {} tensors quantized, {}",
            quantization_name(args.quantize as i32),
            manifest.tensors.len(),
            saved(file_bytes, manifest.total_bytes)
        );
    }
    Ok(())
}
