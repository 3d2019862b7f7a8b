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

use super::{Backend, BoxError, CliResult, human};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Size of the synthetic model (default: an eighth of available memory, 64 MiB to 2 GiB).
    #[arg(long, env = "WEIGHTSTREAM_DEMO_SIZE")]
    size: Option<ByteSize>,
    /// Training steps to run (the first records the plan).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(2..=1000))]
    steps: u32,
    /// Size of each weight tensor, one group each (default: the model size / 48).
    #[arg(long)]
    group_size: Option<ByteSize>,
    /// Device budget of the session (default: a quarter of the model).
    #[arg(long)]
    budget: Option<ByteSize>,
    #[arg(long, env = "WEIGHTSTREAM_BACKEND", default_value = "auto")]
    backend: Backend,
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

fn write_model(dir: &std::path::Path, p: &Plan) -> Result<(PathBuf, Vec<Vec<u8>>), BoxError> {
    let elems = p.group / 2;
    let data: Vec<Vec<u8>> = (0..p.groups)
        .map(|i| {
            let mut v = vec![0u8; (elems * 2) as usize];
            fill(i as u64 + 1, &mut v);
            v
        })
        .collect();
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
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::BF16,
                    vec![elems as usize],
                    d,
                )?,
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
    let (path, data) = write_model(dir.path(), &p)?;
    spinner.finish_and_clear();

    let config = ConfigFile {
        socket: dir.path().join("weightstream.sock"),
        backend: args.backend.into(),
        ..ConfigFile::default()
    }
    .validate()?;
    let handle = server::start(config).await?;
    let outcome = drive(&handle, &path, &p, &data, args.steps).await;
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

/// Steps' numbers, taken after the plan is in place (steps 2..N).
struct Measured {
    bytes: u64,
    elapsed: Duration,
    stats: proto::SessionStats,
}

async fn drive(
    server: &ServerHandle,
    path: &std::path::Path,
    p: &Plan,
    data: &[Vec<u8>],
    steps: u32,
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
        .load_model(&[path.to_path_buf()], "demo", |x| {
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
                    return Err(format!("group {g}: staged bytes differ from the file").into());
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
    t
}
