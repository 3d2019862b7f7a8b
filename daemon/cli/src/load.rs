//! `weightstream load`: load safetensors into the daemon's store, with a progress bar, and
//! say where the time went (the daemon's phases: allocating, reading, page-locking).
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use weightstream_client::{
    Client, LoadedFrom, coding_name, proto, quantization_name, resolve_sources,
};

use super::{CliResult, Deadline, human, parse_coding, parse_quantize, saved, shown};

/// The longest a load may go without a progress report: a phase reports once when it begins
/// (page-locking a large model takes a while), however short `--timeout` is.
const LOAD_SILENCE: Duration = Duration::from_secs(600);

#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Files: one .safetensors, a *.safetensors.index.json (its shards), or a directory (its
    /// *.safetensors). This command opens each file itself, with your rights, and passes the
    /// open files to the daemon, which never opens a path a client names; the model records
    /// the absolute paths (relative ones are taken from the current directory).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The model's name. Default: the file or directory name.
    #[arg(long)]
    name: Option<String>,
    /// Quantize the weights (".weight" tensors of rank >= 2 in BF16/F16/F32) while loading:
    /// none, fp8 (= fp8_e4m3_block64: e4m3fn data, one fp32 scale per 64 inputs of a row),
    /// fp8_e4m3_row (e4m3fn data, one fp32 scale per row), int8_row (int8 data, one fp32
    /// scale per row).
    /// The store keeps only the quantized copy; the other tensors keep their dtype.
    #[arg(long, env = "WEIGHTSTREAM_QUANTIZE", default_value = "none", value_parser = parse_quantize)]
    quantize: proto::Quantization,
    /// Hold the model coded: none, or rans8 (the 8-bit tensors of 1 MiB or more coded
    /// losslessly, where that saves at least 1/32 of their bytes: fewer bytes to hold and to
    /// copy to the device; the Python client decodes them on the device after each copy).
    #[arg(long, env = "WEIGHTSTREAM_CODING", default_value = "none", value_parser = parse_coding)]
    coding: proto::Coding,
    /// Print the result as one JSON object (model, bytes, the daemon's phases in seconds, and
    /// the command's own wall time) instead of text; no progress bar.
    #[arg(long)]
    json: bool,
    /// Pin the model: the daemon never evicts it to make room, until `weightstream release`
    /// gives the reference back. Without it the model stays after this command exits, as a
    /// cache entry the daemon evicts (least recently used first) when a load or an upload
    /// needs the memory and no session uses it.
    #[arg(long)]
    pin: bool,
    /// Load only these tensors (comma-separated names as the files spell them); the daemon
    /// reads, holds and charges those alone and refuses a name no file holds. Default: every
    /// tensor. The same files and names, in any order, give the same model id.
    #[arg(long, value_delimiter = ',')]
    tensors: Vec<String>,
    /// As --tensors, the names read from FILE, one per line (blank lines skipped).
    #[arg(long, value_name = "FILE", conflicts_with = "tensors")]
    tensors_file: Option<PathBuf>,
}

/// The names `--tensors` or `--tensors-file` give (none: every tensor).
fn tensor_names(args: &LoadArgs) -> Result<Vec<String>, String> {
    let Some(file) = &args.tensors_file else {
        return Ok(args.tensors.clone());
    };
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("--tensors-file {}: {e}", file.display()))?;
    let names: Vec<String> = (text.lines().map(str::trim))
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if names.is_empty() {
        return Err(format!(
            "--tensors-file {} names no tensor: give one name per line, or leave the \
             option out to load every tensor",
            file.display()
        ));
    }
    Ok(names)
}

pub async fn run(socket: Option<PathBuf>, args: LoadArgs, deadline: Deadline) -> CliResult {
    let paths = args
        .files
        .iter()
        .map(std::path::absolute)
        .collect::<Result<Vec<_>, _>>()?;
    // A missing or unusable file is said as such, before the daemon is asked.
    resolve_sources(&paths)?;
    let tensors = tensor_names(&args)?;
    let retention = if args.pin {
        proto::Retention::Pinned
    } else {
        proto::Retention::Cached
    };
    let client = deadline
        .on("connecting", Client::connect(socket.as_deref()))
        .await?;
    let mut client = client.with_retention(retention);
    let name = args.name.as_deref().unwrap_or_default();
    let started = Instant::now();
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    let bar = bar.with_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )?
        .progress_chars("=> "),
    );
    let quantized = args.quantize != proto::Quantization::None;
    let verb = if quantized {
        "loading and quantizing"
    } else {
        "loading"
    };
    bar.set_message(verb);
    let mut file_bytes = 0;
    // The daemon takes the files within the deadline, then reports as it goes.
    let silence = deadline.0.max(LOAD_SILENCE);
    let heard = Cell::new(Instant::now() + deadline.0);
    let manifest = {
        let from = LoadedFrom {
            paths: paths.clone(),
            quantization: args.quantize,
            coding: args.coding,
            tensors,
        };
        let load = client.load_model_from(&from, name, |p| {
            heard.set(Instant::now() + silence);
            file_bytes = p.bytes_total;
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
            // The daemon names its phases where it names the file it reads.
            let phase = !p.current_file.starts_with('/');
            bar.set_message(if phase {
                shown(&p.current_file)
            } else {
                verb.into()
            });
        });
        tokio::pin!(load);
        loop {
            let until = tokio::time::Instant::from_std(heard.get());
            tokio::select! {
                manifest = &mut load => break manifest,
                () = tokio::time::sleep_until(until) => {
                    if heard.get() <= Instant::now() {
                        bar.finish_and_clear();
                        return Err(deadline.missed("LoadModel").into());
                    }
                }
            }
        }
    };
    bar.finish_and_clear();
    let manifest = manifest?;
    let wall = started.elapsed().as_secs_f64();
    if args.json {
        out!("{}", to_json(&manifest, args.quantize, file_bytes, wall));
        return Ok(());
    }
    out!(
        "{}  {}  {} tensors  {}  (references: {}{})",
        shown(&manifest.model_id),
        shown(&manifest.name),
        manifest.tensors.len(),
        human(manifest.total_bytes),
        manifest.refcount,
        if manifest.pinned > 0 { ", pinned" } else { "" }
    );
    if quantized {
        let count = (manifest.tensors.iter())
            .filter(|t| t.quantization != proto::Quantization::None as i32)
            .count();
        out!(
            "{}: {count} of {} tensors quantized, {}",
            quantization_name(args.quantize as i32),
            manifest.tensors.len(),
            saved(file_bytes, manifest.total_bytes)
        );
    }
    if args.coding != proto::Coding::None {
        let coded: Vec<_> = (manifest.tensors.iter())
            .filter(|t| t.coding != proto::Coding::None as i32)
            .collect();
        let decoded: u64 = coded.iter().map(|t| t.nbytes).sum();
        let stored: u64 = coded.iter().map(|t| t.stored_nbytes).sum();
        out!(
            "{}: {} of {} tensors coded, {} held as {}",
            coding_name(args.coding as i32),
            coded.len(),
            manifest.tensors.len(),
            human(decoded),
            human(stored)
        );
    }
    if let Some(p) = &manifest.phases {
        out!("{}", phases_line(p, wall, quantized));
    }
    Ok(())
}

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

fn gb_per_s(bytes: u64, ns: u64) -> f64 {
    bytes as f64 / (ns.max(1) as f64)
}

/// "ready in 21.3 s (2.9 GB/s): arena 2.1 s, read 60.0 GiB in 9.8 s (6.6 GB/s), page-locked in
/// 9.4 s (6.8 GB/s)"; `wall`: this command's own time, handoff and all.
fn phases_line(p: &proto::StorePhases, wall: f64, quantized: bool) -> String {
    let mut line = format!(
        "ready in {:.1} s ({:.1} GB/s): arena {:.1} s, {} {} in {:.1} s ({:.1} GB/s)",
        secs(p.total_ns),
        gb_per_s(p.input_bytes, p.total_ns),
        secs(p.alloc_ns),
        if quantized {
            "read and quantized"
        } else {
            "read"
        },
        human(p.input_bytes),
        secs(p.read_ns),
        gb_per_s(p.input_bytes, p.read_ns),
    );
    if p.code_ns > 0 {
        line += &format!(", coded in {:.1} s", secs(p.code_ns));
    }
    if p.hash_ns > 0 {
        line += &format!(
            ", checked against the stored copy in {:.1} s",
            secs(p.hash_ns)
        );
    }
    if p.pin_ns > 0 {
        line += &format!(
            ", page-locked in {:.1} s ({:.1} GB/s)",
            secs(p.pin_ns),
            gb_per_s(p.input_bytes, p.pin_ns)
        );
    }
    line + &format!("; {wall:.1} s for this command")
}

/// The result for scripts: the model, and the daemon's phases in seconds.
fn to_json(
    m: &proto::ModelManifest,
    quantize: proto::Quantization,
    file_bytes: u64,
    wall: f64,
) -> serde_json::Value {
    let p = m.phases.unwrap_or_default();
    json!({
        "model_id": m.model_id,
        "name": m.name,
        "tensors": m.tensors.len(),
        "total_bytes": m.total_bytes,
        "file_bytes": file_bytes,
        "refcount": m.refcount,
        "quantization": quantization_name(quantize as i32),
        "wall_s": wall,
        "phases": {
            "alloc_s": secs(p.alloc_ns),
            "read_s": secs(p.read_ns),
            "code_s": secs(p.code_ns),
            "hash_s": secs(p.hash_ns),
            "pin_s": secs(p.pin_ns),
            "total_s": secs(p.total_ns),
            "input_bytes": p.input_bytes,
            "read_gb_s": gb_per_s(p.input_bytes, p.read_ns),
            "gb_s": gb_per_s(p.input_bytes, p.total_ns),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phases_line_names_each_phase_and_its_rate() {
        let p = proto::StorePhases {
            alloc_ns: 2_000_000_000,
            read_ns: 10_000_000_000,
            pin_ns: 8_000_000_000,
            total_ns: 20_000_000_000,
            input_bytes: 64_000_000_000,
            ..Default::default()
        };
        assert_eq!(
            phases_line(&p, 20.5, false),
            "ready in 20.0 s (3.2 GB/s): arena 2.0 s, read 59.6 GiB in 10.0 s (6.4 GB/s), \
             page-locked in 8.0 s (8.0 GB/s); 20.5 s for this command"
        );
        assert!(phases_line(&p, 20.5, true).contains("read and quantized 59.6 GiB"));
        let coded = proto::StorePhases {
            code_ns: 3_000_000_000,
            ..p
        };
        assert!(phases_line(&coded, 20.5, true).contains("(6.4 GB/s), coded in 3.0 s, page-"));
        let host = proto::StorePhases { pin_ns: 0, ..p };
        assert!(!phases_line(&host, 20.5, false).contains("page-locked"));
    }
}
