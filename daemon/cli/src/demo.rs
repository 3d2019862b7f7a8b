//! `weightstream demo`: an embedded daemon on a private socket, a synthetic model written as
//! real safetensors, and a client that trains like a trainer would (forward in order, backward
//! in reverse) with a recorded plan. Prints what was streamed next to a plain memcpy.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytesize::ByteSize;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use indicatif::{ProgressBar, ProgressStyle};
use weightstream_client::{Client, SessionOptions, proto};

use weightstream_daemon::config::ConfigFile;
use weightstream_daemon::server::{self, ServerHandle};

use weightstream_daemon::store::quantize::{TensorIn, quantize_all};
use weightstream_daemon::store::safetensors::DType;

use super::{Backend, BoxError, CliResult, human, parse_quantize, saved};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Size of the synthetic model (default: an eighth of available memory, 64 MiB to 2 GiB).
    #[arg(long, env = "WEIGHTSTREAM_DEMO_SIZE")]
    size: Option<ByteSize>,
    /// Training steps to run, 2 to 1000 (the first records the plan).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(2..=1000))]
    steps: u32,
    /// Size of each weight tensor, one group each (default: the model size / 48; kept within
    /// 4 KiB to 256 MiB and the model size).
    #[arg(long)]
    group_size: Option<ByteSize>,
    /// Device budget of the session (default: a quarter of the model; at least one group).
    #[arg(long)]
    budget: Option<ByteSize>,
    /// Which backend the embedded daemon runs: auto picks CUDA when a driver and a device are
    /// present, else host.
    #[arg(long, env = "WEIGHTSTREAM_BACKEND", default_value = "auto")]
    backend: Backend,
    /// Stream the model quantized by the daemon at load: none, fp8 (= fp8_e4m3_block64). The
    /// synthetic weights are then 2-D and finite, and the report says how many bytes that saved.
    #[arg(long, default_value = "none", value_parser = parse_quantize)]
    quantize: proto::Quantization,
}

struct Plan {
    size: u64,
    group: u64,
    groups: usize,
    budget: u64,
}

fn plan(args: &DemoArgs) -> Plan {
    let (_, available) = weightstream_daemon::backend::host::host_memory();
    let default = (available / 8).clamp(64 << 20, 2 << 30);
    let size = args.size.map_or(default, |s| s.as_u64()).max(1 << 20);
    let group = args
        .group_size
        .map_or(size / 48, |g| g.as_u64())
        .clamp(4096, 256 << 20)
        .min(size);
    // Quantized: rows of 4096 bf16 weights, so that each row has 64 scales.
    let group = if args.quantize == proto::Quantization::None {
        group
    } else {
        (group / 8192).max(1) * 8192
    };
    let groups = (size / group).max(2) as usize;
    let size = group * groups as u64;
    let budget = args.budget.map_or(size / 4, |b| b.as_u64()).max(group);
    Plan {
        size,
        group,
        groups,
        budget,
    }
}

fn bar(len: u64, template: &str) -> Result<ProgressBar, indicatif::style::TemplateError> {
    Ok(ProgressBar::new(len)
        .with_style(ProgressStyle::with_template(template)?.progress_chars("=> ")))
}

/// Deterministic bytes that differ per tensor (xorshift), so a misplaced group is caught.
fn fill(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// The shape of each synthetic weight: 1-D, or 2-D (rows of 4096, 64 or 1) to be quantized.
fn shape(p: &Plan, quantize: bool) -> Vec<u64> {
    let elems = p.group / 2;
    if !quantize {
        return vec![elems];
    }
    let cols = [4096, 64, 1]
        .into_iter()
        .find(|c| elems.is_multiple_of(*c))
        .unwrap_or(1);
    vec![elems / cols, cols]
}

/// The synthetic model: one bf16 weight per group. Weights to quantize are made finite (the
/// top exponent bit cleared: |w| < 2), since the quantizer refuses NaN and infinities.
fn write_model(
    dir: &std::path::Path,
    p: &Plan,
    quantize: bool,
) -> Result<(PathBuf, Vec<Vec<u8>>), BoxError> {
    let elems = p.group / 2;
    let data: Vec<Vec<u8>> = (0..p.groups)
        .map(|i| {
            let mut v = vec![0u8; (elems * 2) as usize];
            fill(i as u64 + 1, &mut v);
            if quantize {
                for hi in v.iter_mut().skip(1).step_by(2) {
                    *hi &= !0x40;
                }
            }
            v
        })
        .collect();
    let dims: Vec<usize> = shape(p, quantize).iter().map(|&d| d as usize).collect();
    // Zero-padded so that the file's (sorted) order is the numeric order.
    let names: Vec<String> = (0..p.groups)
        .map(|i| format!("blocks.{i:05}.weight"))
        .collect();
    let views = names
        .iter()
        .zip(&data)
        .map(|(n, d)| {
            Ok((
                n.as_str(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, dims.clone(), d)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let path = dir.join("demo-model.safetensors");
    safetensors::serialize_to_file(views, None, &path)?;
    Ok((path, data))
}

pub async fn run(args: DemoArgs) -> CliResult {
    let p = plan(&args);
    let dir = tempfile::Builder::new()
        .prefix("weightstream-demo-")
        .tempdir()?;
    println!(
        "weightstream demo: a {} model in {} tensors of {}, session budget {}",
        human(p.size),
        p.groups,
        human(p.group),
        human(p.budget)
    );
    let spinner =
        ProgressBar::new_spinner().with_message("writing the synthetic model as safetensors");
    spinner.enable_steady_tick(Duration::from_millis(100));
    let quantize = args.quantize != proto::Quantization::None;
    let (path, mut data) = write_model(dir.path(), &p, quantize)?;
    if quantize {
        spinner.set_message("quantizing the expected bytes");
        data = expected_fp8(&p, &data)?;
    }
    spinner.finish_and_clear();

    let config = ConfigFile {
        socket: Some(dir.path().join("weightstream.sock")),
        backend: args.backend.into(),
        ..ConfigFile::default()
    }
    .validate()?;
    let handle = server::start(config).await?;
    let outcome = drive(&handle, &path, &p, &data, args.steps, args.quantize).await;
    let shm = handle.daemon.shm.clone();
    handle.stop().await?;
    let report = outcome?;
    println!("{report}");
    let left = shm.total();
    if left == 0 {
        println!("daemon stopped; no shared memory left behind");
        Ok(())
    } else {
        Err(format!("shared memory left behind: {left} segments").into())
    }
}

/// What the daemon should stage for each weight quantized: data, padding, scales.
fn expected_fp8(p: &Plan, data: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, BoxError> {
    let shape = shape(p, true);
    let inputs: Vec<TensorIn<'_>> = (data.iter())
        .map(|bytes| TensorIn {
            name: "demo",
            dtype: DType::BF16,
            shape: &shape,
            bytes,
        })
        .collect();
    let threads = std::thread::available_parallelism()?;
    let quantized = quantize_all(&inputs, threads)?;
    Ok(quantized.iter().map(|q| q.to_stored()).collect())
}

/// Steps' numbers, taken after the plan is in place (steps 2..N).
struct Measured {
    bytes: u64,
    elapsed: Duration,
    stats: proto::SessionStats,
    /// Quantized: the model's bytes in the files and in the store.
    model_bytes: Option<(u64, u64)>,
}

async fn drive(
    server: &ServerHandle,
    path: &std::path::Path,
    p: &Plan,
    data: &[Vec<u8>],
    steps: u32,
    quantize: proto::Quantization,
) -> Result<Table, BoxError> {
    let mut client = Client::connect(Some(&server.socket)).await?;
    let info = client.info().await?;
    let backend = if info.backend == proto::Backend::Cuda as i32 {
        "cuda"
    } else {
        "host"
    };
    let device = info
        .devices
        .first()
        .map_or(String::new(), |d| d.name.clone());
    println!("backend: {backend} ({device})");
    let load = bar(
        p.size,
        "loading   [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}",
    )?;
    let manifest = client
        .load_model(&[path.to_path_buf()], "demo", quantize, |x| {
            load.set_length(x.bytes_total);
            load.set_position(x.bytes_done);
        })
        .await?;
    load.finish_and_clear();
    let groups = SessionOptions::one_group_per_tensor(&manifest);
    let mut options = SessionOptions::new(&manifest.model_id, p.budget, groups);
    options.label = "demo".into();
    let session = client.open_session(options).await?;
    let order: Vec<u32> = (0..p.groups as u32)
        .chain((0..p.groups as u32).rev())
        .collect();
    let progress = bar(
        u64::from(steps) * order.len() as u64,
        "training  [{bar:40}] {pos}/{len} acquires, step {msg}",
    )?;
    let mut measured_from = None;
    for step in 0..steps {
        progress.set_message(format!("{}/{steps}", step + 1));
        for &g in &order {
            let acquired = session.acquire(g).await?;
            // The first step checks every byte; later ones touch each page like a reader would.
            // (On CUDA the bytes are in device memory this client does not map; the GPU
            // suite, tests/gpu, checks them there.)
            match acquired.tensor(0) {
                Some(bytes) if step == 0 && bytes != data[g as usize].as_slice() => {
                    return Err(format!(
                        "group {g}: staged bytes differ from the file's{}",
                        if quantize == proto::Quantization::None {
                            ""
                        } else {
                            " quantized"
                        }
                    )
                    .into());
                }
                Some(bytes) => {
                    std::hint::black_box(bytes.iter().step_by(4096).fold(0u8, |a, b| a ^ b));
                }
                None => {}
            }
            drop(acquired);
            progress.inc(1);
        }
        session.end_step();
        if step == 0 {
            measured_from = Some((Instant::now(), stats(&mut client, session.id()).await?));
        }
    }
    // On CUDA a group is "staged" once its copy is queued (the client orders its reads with
    // the ready event; this one reads nothing): count the time until the copies are done.
    let backend = server.daemon.backend.clone();
    tokio::task::spawn_blocking(move || backend.synchronize(0)).await??;
    progress.finish_and_clear();
    let (from, before) = measured_from.ok_or("no step ran")?;
    let after = stats(&mut client, session.id()).await?;
    let measured = Measured {
        bytes: after.bytes_copied - before.bytes_copied,
        elapsed: from.elapsed(),
        stats: delta(&before, &after),
        model_bytes: (quantize != proto::Quantization::None)
            .then_some((p.size, manifest.total_bytes)),
    };
    session.close().await?;
    client.release_model(&manifest.model_id).await?;
    Ok(report(p, steps, &measured))
}

async fn stats(client: &mut Client, id: &str) -> Result<proto::SessionStats, BoxError> {
    let sessions = client.list_sessions().await?;
    let s = sessions
        .into_iter()
        .find(|s| s.session_id == id)
        .ok_or("session vanished")?;
    Ok(s.stats.unwrap_or_default())
}

fn delta(a: &proto::SessionStats, b: &proto::SessionStats) -> proto::SessionStats {
    proto::SessionStats {
        acquires: b.acquires - a.acquires,
        hits: b.hits - a.hits,
        reuses: b.reuses - a.reuses,
        misses: b.misses - a.misses,
        resident_hits: b.resident_hits - a.resident_hits,
        bytes_copied: b.bytes_copied - a.bytes_copied,
        copies: b.copies - a.copies,
        prefetches: b.prefetches - a.prefetches,
        stall_ns: b.stall_ns - a.stall_ns,
        resyncs: b.resyncs - a.resyncs,
        releases: b.releases - a.releases,
        evictions: b.evictions - a.evictions,
    }
}

/// A plain memcpy of the same number of bytes, in group-sized pieces from a model-sized source
/// (so the source is not in cache, as the store's is not) into a few staging-sized slots.
fn memcpy_rate(bytes: u64, p: &Plan) -> f64 {
    let group = p.group as usize;
    let mut src = vec![0u8; p.size as usize];
    fill(7, &mut src);
    let mut dst = vec![0u8; group * 4];
    let rounds = bytes.div_ceil(p.group).max(1) as usize;
    let t = Instant::now();
    for i in 0..rounds {
        let from = &src[(i % p.groups) * group..][..group];
        dst[(i % 4) * group..][..group].copy_from_slice(std::hint::black_box(from));
        std::hint::black_box(&mut dst);
    }
    (rounds * group) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn report(p: &Plan, steps: u32, m: &Measured) -> Table {
    let secs = m.elapsed.as_secs_f64();
    let rate = m.bytes as f64 / secs / 1e9;
    let s = &m.stats;
    let hit = if s.acquires == 0 {
        0.0
    } else {
        100.0 * s.hits as f64 / s.acquires as f64
    };
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED).set_header(vec![
        format!("steps 2..{steps} (after the plan)"),
        "value".to_string(),
    ]);
    let rows = [
        ("acquires", s.acquires.to_string()),
        ("bytes streamed", human(m.bytes)),
        ("time", format!("{secs:.3} s")),
        (
            "streamed GB/s (copies done, client read)",
            format!("{rate:.2}"),
        ),
        (
            "plain memcpy GB/s, same bytes",
            format!("{:.2}", memcpy_rate(m.bytes, p)),
        ),
        ("prefetch hit rate", format!("{hit:.1} %")),
        ("reuses (no copy)", s.reuses.to_string()),
        ("misses", s.misses.to_string()),
        ("stall time", format!("{:.3} s", s.stall_ns as f64 / 1e9)),
    ];
    for (k, v) in rows {
        t.add_row(vec![k.to_string(), v]);
    }
    if let Some((file, stored)) = m.model_bytes {
        // Each copy moves one group, which is one weight.
        let per_group = stored / p.groups as u64;
        let streamed_bf16 = s.copies * p.group;
        t.add_row(vec![
            "model, bf16 -> fp8_e4m3_block64".to_string(),
            saved(file, stored),
        ]);
        t.add_row(vec![
            "bytes copied, bf16 -> fp8_e4m3_block64".to_string(),
            saved(streamed_bf16, s.copies * per_group),
        ]);
    }
    t
}
