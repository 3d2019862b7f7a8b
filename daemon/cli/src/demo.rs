//! `weightstream demo`: an embedded daemon on a private socket, a synthetic model written as
//! real safetensors, and a client that trains like a trainer would (forward in order, backward
//! in reverse, a simulated compute per group, the next group asked for while it computes) with
//! a recorded plan. Prints how long the client waited for weights, and the copies' rate next to
//! the daemon's own copy of the same bytes (on CUDA: pinned host to device) in the same run.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytesize::ByteSize;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use indicatif::{ProgressBar, ProgressStyle};
use weightstream_client::{Client, SessionOptions, proto};

use weightstream_daemon::backend::CopyJob;
use weightstream_daemon::config::ConfigFile;
use weightstream_daemon::core::Daemon;
use weightstream_daemon::scheduler::{CopyOutcome, CopyRequest, DeviceCopyStats, Priority, Work};
use weightstream_daemon::server::{self, ServerHandle};

use weightstream_daemon::store::quantize::{Quantization, Target, TensorIn, quantize_all};
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
    /// Stream the model quantized by the daemon at load: none, fp8 (= fp8_e4m3_block64),
    /// fp8_e4m3_row, int8_row. The synthetic weights are then 2-D and finite, and the report
    /// says how many bytes that saved.
    #[arg(long, default_value = "none", value_parser = parse_quantize)]
    quantize: proto::Quantization,
    /// Simulated compute per group, in milliseconds: the client sleeps this long with each
    /// group, as a trainer's GPU computes with it (default: twice a group's copy at the
    /// reference rate measured at start; 0: none, the client only reads).
    #[arg(long, value_parser = parse_work_ms)]
    work_ms: Option<f64>,
}

fn parse_work_ms(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(ms) if (0.0..=10_000.0).contains(&ms) => Ok(ms),
        _ => Err(format!(
            "{s:?} is not a number of milliseconds from 0 to 10000"
        )),
    }
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
    say!(
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
    if let Some(target) = target_of(args.quantize) {
        spinner.set_message("quantizing the expected bytes");
        data = expected_quantized(&p, &data, target)?;
    }
    spinner.finish_and_clear();

    let config = ConfigFile {
        socket: Some(dir.path().join("weightstream.sock")),
        backend: args.backend.into(),
        ..ConfigFile::default()
    }
    .validate()?;
    let handle = server::start(config).await?;
    let outcome = drive(&handle, &path, &p, &data, &args).await;
    let shm = handle.daemon.shm.clone();
    handle.stop().await?;
    let report = outcome?;
    say!("{report}");
    let left = shm.total();
    if left == 0 {
        say!("daemon stopped; no shared memory left behind");
        Ok(())
    } else {
        Err(format!("shared memory left behind: {left} segments").into())
    }
}

/// The daemon's format of a quantization the CLI accepts (none: none).
fn target_of(quantize: proto::Quantization) -> Option<Target> {
    Quantization::parse(&weightstream_client::quantization_name(quantize as i32))
        .ok()
        .and_then(Target::of)
}

/// What the daemon should stage for each weight quantized: data, padding, scales.
fn expected_quantized(
    p: &Plan,
    data: &[Vec<u8>],
    target: Target,
) -> Result<Vec<Vec<u8>>, BoxError> {
    let shape = shape(p, true);
    let inputs: Vec<TensorIn<'_>> = (data.iter())
        .map(|bytes| TensorIn {
            target,
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
    elapsed: Duration,
    stats: proto::SessionStats,
    /// The copy thread's counters over the steps (bytes, and the time it kept the device busy).
    copy: DeviceCopyStats,
    /// The client's waits for weights over the steps: nanoseconds, and how many.
    waited_ns: u64,
    waits: u64,
    /// The simulated compute per group, and whether it was chosen from the reference rate.
    work: Duration,
    work_default: bool,
    /// The daemon's own copy of the model's bytes, GB/s, and what it is on this backend.
    reference: f64,
    backend: &'static str,
    /// Quantized: the model's bytes in the files and in the store.
    model_bytes: Option<(u64, u64, String)>,
    /// The largest group as stored (what one copy moves).
    group_bytes: u64,
}

/// Runs `job` through the device's copy thread, as a session's copies run, and waits for it.
async fn run_copy(daemon: &Daemon, job: CopyJob) -> Result<CopyOutcome, BoxError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    daemon.scheduler.submit(
        0,
        CopyRequest {
            // No session has this number: the demo's own lane.
            session: u64::MAX,
            tag: 0,
            priority: Priority::Demand,
            work: Work::Copy(job),
            done: Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
        },
    );
    Ok(rx.await?)
}

/// Copies of the model the reference is the best of: a busy machine's noise only slows a copy.
const REFERENCE_PASSES: usize = 3;

/// The reference rate: the daemon's own copy of every tensor of the model from its store into
/// device memory, one job on the device's copy thread, before the session opens, timed as the
/// session's copies are (the copy thread's busy time); the best of [`REFERENCE_PASSES`]. On
/// CUDA the store is page-locked, so this is the pinned host-to-device rate of this machine; on
/// the host backend it is the memcpy the host backend's copies are.
async fn reference_rate(daemon: &Arc<Daemon>, model_id: &str) -> Result<(f64, u64), BoxError> {
    let model = daemon
        .store
        .get(model_id)
        .ok_or("the demo model is not in the store")?
        .model;
    let largest = model.tensors.iter().map(|t| t.nbytes).max().unwrap_or(0);
    let slot = largest.next_multiple_of(daemon.backend.alignment().max(1));
    // Four slots, written in turn: the copies are as large as the session's, the memory small.
    let region = daemon.backend.alloc_region(0, 4 * slot, "demo")?;
    let mut best: f64 = 0.0;
    for _ in 0..REFERENCE_PASSES {
        let spans = (0..model.tensors.len())
            .map(|i| (model.slice(i), (i % 4) as u64 * slot))
            .collect();
        let mut job = CopyJob::copy(Arc::clone(&region), spans);
        job.synchronous = true;
        let before = copy_stats(daemon).await?;
        run_copy(daemon, job).await?.result?;
        let after = copy_stats(daemon).await?;
        let busy = (after.busy_ns - before.busy_ns).max(1);
        best = best.max((after.bytes - before.bytes) as f64 / busy as f64);
    }
    Ok((best, largest))
}

/// The copy thread's counters once every copy queued so far is done and accounted: CUDA
/// copies report their device time when the copy thread next polls, which an empty job makes
/// it do before the job's answer.
async fn copy_stats(daemon: &Arc<Daemon>) -> Result<DeviceCopyStats, BoxError> {
    let backend = daemon.backend.clone();
    tokio::task::spawn_blocking(move || backend.synchronize(0)).await??;
    let region = daemon.backend.alloc_region(0, 1, "demo")?;
    let mut empty = CopyJob::copy(region, Vec::new());
    empty.synchronous = true;
    run_copy(daemon, empty).await?.result?;
    Ok(daemon.scheduler.stats(0))
}

async fn drive(
    server: &ServerHandle,
    path: &std::path::Path,
    p: &Plan,
    data: &[Vec<u8>],
    args: &DemoArgs,
) -> Result<Table, BoxError> {
    let (steps, quantize) = (args.steps, args.quantize);
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
    say!("backend: {backend} ({device})");
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
    let daemon = &server.daemon;
    let (reference, group_bytes) = reference_rate(daemon, &manifest.model_id).await?;
    let work_default = args.work_ms.is_none();
    let work = match args.work_ms {
        Some(ms) => Duration::from_secs_f64(ms / 1e3),
        None => Duration::from_secs_f64(2.0 * group_bytes as f64 / (reference * 1e9)),
    };
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
    // The next acquire is sent while the client computes with the current group, as the
    // PyTorch integration's look-ahead does: its reply then waits for the client, not the
    // other way round.
    let mut ahead = Some(session.submit(order[0])?);
    for step in 0..steps {
        progress.set_message(format!("{}/{steps}", step + 1));
        for (i, &g) in order.iter().enumerate() {
            let current = ahead.take().ok_or("no acquire in flight")?;
            if let Some(&next) = order.get(i + 1) {
                ahead = Some(session.submit(next)?);
            } else {
                // The step's end: its acquisitions become the plan (the first step's) before
                // the next step's first acquire is sent; the measured steps start here.
                session.end_step();
                session.mark_step();
                if step == 0 {
                    let copies = copy_stats(daemon).await?;
                    let waits = session.waits();
                    let stats = stats(&mut client, session.id()).await?;
                    measured_from = Some((Instant::now(), stats, copies, waits));
                }
                if step + 1 < steps {
                    ahead = Some(session.submit(order[0])?);
                }
            }
            let ticket = current.ticket();
            let staged = session.wait(current).await?;
            // The first step checks every byte; later ones touch each page like a reader would.
            // (On CUDA the bytes are in device memory this client does not map; the GPU
            // suite, tests/gpu, checks them there.)
            // The group's one tensor, within its (aligned) group.
            let tensor = &session.layout().groups[g as usize].tensors[0];
            let (start, len) = (tensor.offset as usize, tensor.nbytes as usize);
            let bytes = session
                .check_staged(g, &staged)?
                .map(|b| &b[start..start + len]);
            match bytes {
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
            if !work.is_zero() {
                // The sleep stands for the device computing: it holds no core, as a GPU's
                // kernels hold none of the host's.
                tokio::task::block_in_place(|| std::thread::sleep(work));
            }
            session.release(ticket)?;
            progress.inc(1);
        }
    }
    // On CUDA a group is "staged" once its copy is queued: count the time until the copies
    // are done.
    let copies = copy_stats(daemon).await?;
    progress.finish_and_clear();
    let (from, before, copies_before, waits_before) = measured_from.ok_or("no step ran")?;
    let elapsed = from.elapsed();
    let after = stats(&mut client, session.id()).await?;
    let waits = session.waits();
    let measured = Measured {
        elapsed,
        stats: delta(&before, &after),
        copy: DeviceCopyStats {
            bytes: copies.bytes - copies_before.bytes,
            busy_ns: copies.busy_ns - copies_before.busy_ns,
            copies: copies.copies - copies_before.copies,
            ..DeviceCopyStats::default()
        },
        waited_ns: waits.total_ns - waits_before.total_ns,
        waits: waits.waits - waits_before.waits,
        work,
        work_default,
        reference,
        backend,
        model_bytes: (quantize != proto::Quantization::None).then(|| {
            let format = weightstream_client::quantization_name(quantize as i32);
            (p.size, manifest.total_bytes, format)
        }),
        group_bytes,
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
        acquire_pending_ns: b.acquire_pending_ns - a.acquire_pending_ns,
        resyncs: b.resyncs - a.resyncs,
        releases: b.releases - a.releases,
        evictions: b.evictions - a.evictions,
        ..proto::SessionStats::default()
    }
}

/// What the reference copy is on each backend, as the report names it.
fn reference_name(backend: &str) -> &'static str {
    if backend == "cuda" {
        "reference: pinned host->device GB/s (this run)"
    } else {
        "reference: host backend copy GB/s (a memcpy, this run)"
    }
}

fn report(p: &Plan, steps: u32, m: &Measured) -> Table {
    let secs = m.elapsed.as_secs_f64();
    let s = &m.stats;
    let hit = if s.acquires == 0 {
        0.0
    } else {
        100.0 * s.hits as f64 / s.acquires as f64
    };
    let ms = |d: f64| format!("{:.3} ms", d * 1e3);
    let work = if m.work_default {
        format!(
            "{}: 2 x a group's copy at the reference rate",
            ms(m.work.as_secs_f64())
        )
    } else {
        format!("{} (--work-ms)", ms(m.work.as_secs_f64()))
    };
    let waited = m.waited_ns as f64 / 1e9;
    let copy_rate = if m.copy.busy_ns == 0 {
        "- (nothing copied)".to_string()
    } else {
        let rate = m.copy.bytes as f64 / m.copy.busy_ns as f64;
        format!("{rate:.2} ({:.2} x the reference)", rate / m.reference)
    };
    // A group's copy at the reference rate: the compute per group that hides every copy.
    let hidden = m.group_bytes as f64 / (m.reference * 1e9);
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED).set_header(vec![
        format!("steps 2..{steps} (after the plan)"),
        "value".to_string(),
    ]);
    let rows = [
        ("acquires", s.acquires.to_string()),
        ("bytes streamed", human(m.copy.bytes)),
        ("time", format!("{secs:.3} s")),
        ("client's compute per group (simulated)", work),
        (
            "client waited for weights",
            format!(
                "{waited:.3} s ({:.1} % of the time, {} of {} acquires)",
                100.0 * waited / secs.max(1e-9),
                m.waits,
                s.acquires
            ),
        ),
        ("copy GB/s while copying", copy_rate),
        (reference_name(m.backend), format!("{:.2}", m.reference)),
        (
            "copies stay hidden while compute per group is at least about",
            format!("{} (a group's copy at the reference rate)", ms(hidden)),
        ),
        ("prefetch hit rate", format!("{hit:.1} %")),
        ("reuses (no copy)", s.reuses.to_string()),
        ("misses", s.misses.to_string()),
    ];
    for (k, v) in rows {
        t.add_row(vec![k.to_string(), v]);
    }
    if let Some((file, stored, format)) = &m.model_bytes {
        let (file, stored) = (*file, *stored);
        // Each copy moves one group, which is one weight.
        let per_group = stored / p.groups as u64;
        let streamed_bf16 = s.copies * p.group;
        t.add_row(vec![
            format!("model, bf16 -> {format}"),
            saved(file, stored),
        ]);
        t.add_row(vec![
            format!("bytes copied, bf16 -> {format}"),
            saved(streamed_bf16, s.copies * per_group),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(waited_ns: u64, busy_ns: u64) -> Measured {
        Measured {
            elapsed: Duration::from_secs(2),
            stats: proto::SessionStats {
                acquires: 40,
                hits: 40,
                ..Default::default()
            },
            copy: DeviceCopyStats {
                bytes: 4_000_000_000,
                busy_ns,
                copies: 40,
                ..Default::default()
            },
            waited_ns,
            waits: 2,
            work: Duration::from_micros(1500),
            work_default: true,
            reference: 50.0,
            backend: "cuda",
            model_bytes: None,
            group_bytes: 40_000_000,
        }
    }

    fn rows(t: &Table) -> Vec<(String, String)> {
        t.row_iter()
            .map(|r| {
                let mut cells = r.cell_iter().map(|c| c.content());
                (cells.next().unwrap(), cells.next().unwrap())
            })
            .collect()
    }

    fn value(t: &Table, key: &str) -> String {
        let all = rows(t);
        all.iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no row {key:?} in {all:#?}"))
    }

    /// The figures a user acts on: the client's own wait (not the daemon's pending time), the
    /// copies' rate against the reference, and the compute per group that hides the copies.
    #[test]
    fn the_report_says_what_the_client_waited_and_what_the_link_gave() {
        let p = Plan {
            size: 0,
            group: 0,
            groups: 1,
            budget: 0,
        };
        let t = report(&p, 6, &measured(50_000_000, 100_000_000));
        assert_eq!(
            value(&t, "client waited for weights"),
            "0.050 s (2.5 % of the time, 2 of 40 acquires)"
        );
        assert_eq!(
            value(&t, "copy GB/s while copying"),
            "40.00 (0.80 x the reference)"
        );
        assert_eq!(
            value(&t, "reference: pinned host->device GB/s (this run)"),
            "50.00"
        );
        assert_eq!(
            value(
                &t,
                "copies stay hidden while compute per group is at least about"
            ),
            "0.800 ms (a group's copy at the reference rate)"
        );
        assert_eq!(
            value(&t, "client's compute per group (simulated)"),
            "1.500 ms: 2 x a group's copy at the reference rate"
        );
        assert_eq!(value(&t, "prefetch hit rate"), "100.0 %");
        let host = Measured {
            backend: "host",
            ..measured(0, 0)
        };
        let t = report(&p, 6, &host);
        assert_eq!(
            value(&t, "reference: host backend copy GB/s (a memcpy, this run)"),
            "50.00"
        );
        assert_eq!(value(&t, "copy GB/s while copying"), "- (nothing copied)");
    }
}
