//! Soak and load: 32 trainers on their own connections drive random traffic (acquires held
//! and released out of order, plans sent and abandoned, sessions closed and reopened) against
//! one `weightstream serve` process on the host backend. Every acquired byte is checked, every
//! request must succeed, and the daemon's sessions, models, shared-memory files and fds must
//! be what they were before. Reports requests per second and acquire-to-staged latency.
//!
//! CI runs it for `DEFAULT_SECS`; for the figures in `tests/bench/results/soak.md`:
//! `WEIGHTSTREAM_SOAK_SECS=300 WEIGHTSTREAM_SOAK_OUT=tests/bench/results/soak.json \
//!  cargo test --release -p weightstream-cli --test soak -- --nocapture`

#[path = "../../e2e/tests/common/mod.rs"]
mod common;
mod served;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use served::*;
use weightstream_client::{Client, Session, proto};

const CLIENTS: usize = 32;
/// Bytes of each layer; groups are one or two layers, so every arena holds whole groups of
/// one size and never fragments (a refused acquire is then always a bug).
const LAYER: usize = 64 << 10;
const LAYERS: u32 = 16;
const DEFAULT_SECS: u64 = 10;
/// How much the daemon's RSS may be above its level before the load once every client is gone.
const RSS_SLACK_KIB: u64 = 16 << 10;

/// What the daemon holds, as counted before and after the load.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
struct Resources {
    sessions: usize,
    /// (id, refcount, sessions)
    models: Vec<(String, u32, u32)>,
    /// The kinds of the daemon's memfds (its shared memory).
    memfds: Vec<String>,
    fds: usize,
}

async fn resources(client: &mut Client, served: &Served) -> Resources {
    let models = client.list_models().await.unwrap().models;
    Resources {
        sessions: client.list_sessions().await.unwrap().len(),
        models: models
            .into_iter()
            .map(|m| (m.model_id, m.refcount, m.sessions))
            .collect(),
        memfds: served.memfds(),
        fds: served.fds(),
    }
}

#[derive(Default)]
struct Report {
    acquires: u64,
    releases: u64,
    plans: u64,
    opens: u64,
    /// Acquire sent to Staged received, in microseconds.
    latencies_us: Vec<u32>,
    bytes_checked: u64,
    hits: u64,
    errors: Vec<String>,
}

impl Report {
    fn add(&mut self, other: Report) {
        self.acquires += other.acquires;
        self.releases += other.releases;
        self.plans += other.plans;
        self.opens += other.opens;
        self.latencies_us.extend(other.latencies_us);
        self.bytes_checked += other.bytes_checked;
        self.hits += other.hits;
        self.errors.extend(other.errors);
    }
}

/// A session of random shape: one or two layers per group, staging of 3–5 groups, and 0–2
/// groups' worth of resident budget.
fn random_options(
    rng: &mut StdRng,
    manifest: &proto::ModelManifest,
) -> (weightstream_client::SessionOptions, u64) {
    let names: Vec<&str> = manifest.tensors.iter().map(|t| t.name.as_str()).collect();
    let per = if rng.random_bool(0.25) { 2 } else { 1 };
    let groups: Vec<proto::GroupSpec> = names
        .chunks(per)
        .enumerate()
        .map(|(i, c)| group(&format!("g{i}"), c))
        .collect();
    let size = (per * LAYER) as u64;
    let staging = rng.random_range(3..=5u64);
    let budget = staging + rng.random_range(0..=2u64);
    (
        options(&manifest.model_id, groups, staging * size, budget * size),
        staging,
    )
}

/// One trainer: sessions opened and closed until `deadline`, random traffic on each.
async fn trainer(
    socket: std::path::PathBuf,
    manifest: proto::ModelManifest,
    expected: Arc<BTreeMap<String, Tensor>>,
    seed: u64,
    deadline: Instant,
) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = Report::default();
    let mut client = match Client::connect(Some(&socket)).await {
        Ok(c) => c,
        Err(e) => {
            report.errors.push(format!("connect: {e}"));
            return report;
        }
    };
    while Instant::now() < deadline {
        let (opts, staging) = random_options(&mut rng, &manifest);
        let session = match client.open_session(opts).await {
            Ok(s) => s,
            Err(e) => {
                report.errors.push(format!("open: {e}"));
                continue;
            }
        };
        report.opens += 1;
        let acquires_before = report.acquires;
        drive(
            &session,
            staging as usize - 1,
            &mut rng,
            &mut report,
            &expected,
            deadline,
        )
        .await;
        // Every acquire this session made was counted by the daemon (Staged came back).
        match session_info(&mut client, session.id()).await {
            Some(info) => {
                let s = info.stats.unwrap_or_default();
                if s.acquires != report.acquires - acquires_before {
                    report.errors.push(format!(
                        "session {}: the daemon counted {} acquires, the client made {}",
                        session.id(),
                        s.acquires,
                        report.acquires - acquires_before
                    ));
                }
                report.hits += s.hits;
            }
            None => report
                .errors
                .push(format!("session {} is not listed", session.id())),
        }
        if let Err(e) = session.close().await {
            report.errors.push(format!("close: {e}"));
        }
    }
    report
}

/// Random acquires (along a forward/backward order or anywhere), releases in any order,
/// plans, until the deadline or a 1 % chance per operation of moving to a new session.
async fn drive(
    session: &Session,
    max_held: usize,
    rng: &mut StdRng,
    report: &mut Report,
    expected: &BTreeMap<String, Tensor>,
    deadline: Instant,
) {
    let n = session.group_count();
    let order: Vec<u32> = (0..n).chain((0..n).rev()).collect();
    let mut cursor = 0;
    let mut held = VecDeque::new();
    while Instant::now() < deadline {
        let r: f64 = rng.random();
        if r < 0.6 {
            let g = if rng.random_bool(0.7) {
                cursor = (cursor + 1) % order.len();
                order[cursor]
            } else {
                rng.random_range(0..n)
            };
            if held.len() >= max_held {
                held.pop_front();
                report.releases += 1;
            }
            let started = Instant::now();
            match session.acquire(g).await {
                Ok(acquired) => {
                    let us = started.elapsed().as_micros().min(u32::MAX as u128) as u32;
                    report.latencies_us.push(us);
                    report.acquires += 1;
                    report.bytes_checked += check_acquired(&acquired, expected);
                    held.push_back(acquired);
                }
                Err(e) => report.errors.push(format!("acquire {g}: {e}")),
            }
        } else if r < 0.9 {
            if !held.is_empty() {
                let i = rng.random_range(0..held.len());
                held.remove(i);
                report.releases += 1;
            }
        } else if r < 0.99 {
            let plan = if rng.random_bool(0.5) {
                order.clone()
            } else {
                let len = rng.random_range(1..=2 * n as usize);
                (0..len).map(|_| rng.random_range(0..n)).collect()
            };
            session.send_plan(plan);
            report.plans += 1;
        } else {
            break;
        }
    }
    report.releases += held.len() as u64;
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default()
}

/// The daemon's CPU time (user + system) in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // Fields after the command name (which is in parentheses); utime and stime are 14 and 15.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_32_clients_random_traffic() {
    let secs: u64 = std::env::var("WEIGHTSTREAM_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_SECS);
    let dir = tempfile::tempdir().unwrap();
    let served = Served::start(dir.path());
    let path = write_model(
        dir.path(),
        "m.safetensors",
        &uniform_model(61, LAYERS as usize, LAYER),
    );
    let expected = Arc::new(read_model(std::slice::from_ref(&path)));
    let mut admin = Client::connect(Some(&served.socket)).await.unwrap();
    let manifest = load(&mut admin, std::slice::from_ref(&path), &expected).await;
    let before = resources(&mut admin, &served).await;
    assert_eq!(before.sessions, 0);
    let rss_before = served.rss_kib();
    let cpu_before = cpu_seconds(served.pid());

    // RSS sampled while the load runs (a reading, not a synchronisation).
    let sampling = Arc::new(AtomicBool::new(true));
    let peak_rss = Arc::new(AtomicU64::new(rss_before));
    let sampler = {
        let (sampling, peak, pid) = (sampling.clone(), peak_rss.clone(), served.pid());
        tokio::spawn(async move {
            let status = format!("/proc/{pid}/status");
            while sampling.load(Ordering::Relaxed) {
                if let Some(kib) = std::fs::read_to_string(&status).ok().and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("VmRSS:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                }) {
                    peak.fetch_max(kib, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (socket, manifest, expected) =
                (served.socket.clone(), manifest.clone(), expected.clone());
            tokio::spawn(trainer(
                socket,
                manifest,
                expected,
                1000 + c as u64,
                deadline,
            ))
        })
        .collect();
    let mut total = Report::default();
    let mut per_client = Vec::new();
    for task in tasks {
        let report = tokio::time::timeout(Duration::from_secs(secs + 60), task)
            .await
            .expect("a trainer hung past the deadline")
            .expect("a trainer panicked (wrong bytes?)");
        per_client.push(report.acquires);
        total.add(report);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(served.pid()) - cpu_before;
    sampling.store(false, Ordering::Relaxed);
    sampler.await.unwrap();

    // Everything goes back to where it was.
    eventually("every session of the load is gone", || {
        let mut admin = admin.clone();
        async move { admin.list_sessions().await.unwrap().is_empty() }
    })
    .await;
    let mut after = resources(&mut admin, &served).await;
    let settle = Instant::now() + DEADLINE;
    while after != before && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = resources(&mut admin, &served).await;
    }
    let rss_after = served.rss_kib();

    let mut lat = std::mem::take(&mut total.latencies_us);
    lat.sort_unstable();
    let requests = total.acquires + total.releases + total.plans + 2 * total.opens;
    let figures = serde_json::json!({
        "command": format!(
            "WEIGHTSTREAM_SOAK_SECS={secs} cargo test {}-p weightstream-cli --test soak -- --nocapture",
            if cfg!(debug_assertions) { "" } else { "--release " }
        ),
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "machine": { "cpu": cpu_model(), "cores": std::thread::available_parallelism().map_or(0, |n| n.get()) },
        "backend": "host",
        "clients": CLIENTS,
        "model": { "groups_of": "1 or 2 layers", "layers": LAYERS, "layer_bytes": LAYER },
        "seconds": elapsed,
        "requests": requests,
        "requests_per_second": requests as f64 / elapsed,
        "acquires": total.acquires,
        "acquires_per_second": total.acquires as f64 / elapsed,
        "releases": total.releases,
        "plans": total.plans,
        "sessions_opened": total.opens,
        "hit_rate": if total.acquires > 0 { total.hits as f64 / total.acquires as f64 } else { 0.0 },
        "bytes_checked": total.bytes_checked,
        "acquire_to_staged_us": {
            "p50": percentile(&lat, 50.0),
            "p90": percentile(&lat, 90.0),
            "p99": percentile(&lat, 99.0),
            "p999": percentile(&lat, 99.9),
            "max": lat.last().copied().unwrap_or(0),
        },
        "acquires_per_client": { "min": per_client.iter().min(), "max": per_client.iter().max() },
        "errors": total.errors.len(),
        "daemon": {
            "cpu_seconds": cpu,
            "rss_kib": { "before": rss_before, "peak": peak_rss.load(Ordering::Relaxed), "after": rss_after },
        },
        "resources_before": before,
        "resources_after": after,
    });
    eprintln!("{}", serde_json::to_string_pretty(&figures).unwrap());
    if let Ok(out) = std::env::var("WEIGHTSTREAM_SOAK_OUT") {
        // cargo runs tests in the package's directory: a relative path is from the workspace.
        let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(out);
        let json = serde_json::to_string_pretty(&figures).unwrap() + "\n";
        std::fs::write(&out, json).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    }

    assert_eq!(
        total.errors,
        Vec::<String>::new(),
        "requests failed under load"
    );
    assert_eq!(after, before, "the daemon's resources after the load");
    assert!(
        rss_after <= rss_before + RSS_SLACK_KIB,
        "daemon RSS {rss_before} KiB before, {rss_after} KiB after"
    );
    // The traffic really was mixed, and every trainer took part.
    assert!(per_client.iter().all(|&a| a >= 10), "{per_client:?}");
    assert!(total.plans > 0 && total.opens > CLIENTS as u64 && total.releases > 0);
    assert_eq!(lat.len() as u64, total.acquires);

    assert_eq!(admin.release_model(&manifest.model_id).await.unwrap(), 0);
    eventually("the model's memory is released", || async {
        served.memfds().is_empty()
    })
    .await;
}
