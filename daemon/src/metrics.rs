//! Prometheus metrics: an opt-in HTTP endpoint (`GET /metrics`, text format 0.0.4).
//!
//! Nothing here is on the copy path: a scrape reads the counters the daemon keeps anyway (the
//! sessions' atomics, the copy scheduler's per-device stats, the store's size), so enabling
//! metrics adds no lock or write per copy.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::header::CONTENT_TYPE;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::core::Daemon;
use crate::session::{KindSnapshot, PassKind};

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics.listen {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Reads the daemon's state at each scrape.
struct DaemonCollector(Arc<Daemon>);

impl std::fmt::Debug for DaemonCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DaemonCollector")
    }
}

fn counter<L: EncodeLabelSet>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: Vec<(L, f64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(name, help, None, ConstCounter::new(0.0).metric_type())?;
    for (labels, v) in rows {
        ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn gauge<L: EncodeLabelSet>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: Vec<(L, f64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(name, help, None, ConstGauge::new(0.0).metric_type())?;
    for (labels, v) in rows {
        ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

const NS: f64 = 1e-9;

/// A metric's name, help, and its value for the i-th device or session.
type Series<'a> = (&'a str, &'a str, &'a dyn Fn(usize) -> f64);

/// A per-kind metric's name, help, and its value from one kind's counters.
type KindSeries<'a> = (&'a str, &'a str, &'a dyn Fn(&KindSnapshot) -> f64);

impl Collector for DaemonCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let d = &self.0;
        let devices = d.backend.devices();
        let (sessions, totals) = d.session_snapshot();
        let backend = d.backend.kind().name();
        let version = env!("CARGO_PKG_VERSION");
        let none = || Vec::<(&str, &str)>::new();
        gauge(
            &mut e,
            "weightstream_build_info",
            "Version and backend of the running daemon (always 1).",
            vec![(vec![("version", version), ("backend", backend)], 1.0)],
        )?;
        gauge(
            &mut e,
            "weightstream_stopping",
            "1 once the daemon has begun shutting down.",
            vec![(none(), if d.is_stopping() { 1.0 } else { 0.0 })],
        )?;
        gauge(
            &mut e,
            "weightstream_store_bytes",
            "Host memory holding loaded models (page-locked on the CUDA backend).",
            vec![(none(), d.store.bytes() as f64)],
        )?;
        gauge(
            &mut e,
            "weightstream_models",
            "Models in the store.",
            vec![(none(), d.store.models().len() as f64)],
        )?;
        gauge(
            &mut e,
            "weightstream_sessions",
            "Open sessions.",
            vec![(none(), sessions.len() as f64)],
        )?;

        // Per device: the copy thread's own stats plus every session's, ended ones included.
        let copy: Vec<_> = (0..devices.len()).map(|i| d.scheduler.stats(i)).collect();
        let per_device = |f: &dyn Fn(usize) -> f64| -> Vec<(Vec<(&str, &str)>, f64)> {
            devices
                .iter()
                .enumerate()
                .map(|(i, dev)| (vec![("device", dev.uuid.as_str())], f(i)))
                .collect()
        };
        let device_counters: [Series; 11] = [
            (
                "weightstream_device_streamed_bytes",
                "Bytes copied host to device (staging and resident copies).",
                &|i| copy[i].bytes as f64,
            ),
            (
                "weightstream_device_copies",
                "Copies the device's copy thread ran.",
                &|i| copy[i].copies as f64,
            ),
            (
                "weightstream_device_copy_busy_seconds",
                "Time the device's copy engine spent copying.",
                &|i| copy[i].busy_ns as f64 * NS,
            ),
            (
                "weightstream_device_copy_throttled_seconds",
                "Time the device's copy thread waited for the device's copy bandwidth limit.",
                &|i| copy[i].throttled_ns as f64 * NS,
            ),
            (
                "weightstream_device_copy_share_throttled_seconds",
                "Time the device's copy thread waited with copies ready that sessions' \
                 copy bandwidth shares held back.",
                &|i| copy[i].share_throttled_ns as f64 * NS,
            ),
            (
                "weightstream_device_acquires",
                "Acquires by the device's sessions.",
                &|i| totals[i].acquires as f64,
            ),
            (
                "weightstream_device_prefetch_hits",
                "Acquires that found their group staged or resident.",
                &|i| totals[i].hits as f64,
            ),
            (
                "weightstream_device_prefetch_misses",
                "Acquires that had to wait for a copy.",
                &|i| totals[i].misses as f64,
            ),
            (
                "weightstream_device_prefetches",
                "Copies queued ahead of the client by the plan.",
                &|i| totals[i].prefetches as f64,
            ),
            (
                "weightstream_device_gpu_wait_seconds",
                "Sum over the device's sessions of the time each client's compute waited for \
                 weights, as the clients measure and report it.",
                &|i| totals[i].gpu_wait_ns as f64 * NS,
            ),
            (
                "weightstream_device_acquire_pending_seconds",
                "Sum over the device's sessions of each one's time with an Acquire (look-ahead \
                 ones included) waiting for its Staged in the daemon.",
                &|i| totals[i].acquire_pending_ns as f64 * NS,
            ),
        ];
        for (name, help, f) in device_counters {
            counter(&mut e, name, help, per_device(f))?;
        }
        let sum_by_device = |f: &dyn Fn(&crate::session::SessionShared) -> u64| {
            per_device(&|i| {
                sessions
                    .iter()
                    .filter(|s| s.device == i)
                    .map(|s| f(s))
                    .sum::<u64>() as f64
            })
        };
        gauge(
            &mut e,
            "weightstream_device_copy_queue_length",
            "Copies waiting for the device's copy thread.",
            per_device(&|i| copy[i].queued as f64),
        )?;
        gauge(
            &mut e,
            "weightstream_device_copy_bandwidth_limit_bytes_per_second",
            "The device's copy bandwidth limit (0: none).",
            per_device(&|i| d.scheduler.limit(i).map_or(0.0, |r| r.get() as f64)),
        )?;
        gauge(
            &mut e,
            "weightstream_device_memory_bytes",
            "The device's memory.",
            per_device(&|i| devices[i].total_memory as f64),
        )?;
        gauge(
            &mut e,
            "weightstream_device_budget_bytes",
            "Sum of the open sessions' VRAM budgets.",
            sum_by_device(&|s| s.vram_budget),
        )?;
        gauge(
            &mut e,
            "weightstream_device_staging_bytes",
            "Device memory held by the open sessions' staging arenas.",
            sum_by_device(&|s| s.staging_bytes),
        )?;

        // Per session, while it is open.
        let labels: Vec<[(&str, &str); 4]> = sessions
            .iter()
            .map(|s| {
                [
                    ("session", s.id.as_str()),
                    ("label", s.label.as_str()),
                    ("model", s.model_id.as_str()),
                    ("device", s.device_uuid.as_str()),
                ]
            })
            .collect();
        let stats: Vec<_> = sessions.iter().map(|s| s.stats.snapshot()).collect();
        let per_session = |f: &dyn Fn(usize) -> f64| -> Vec<([(&str, &str); 4], f64)> {
            labels.iter().enumerate().map(|(i, l)| (*l, f(i))).collect()
        };
        let session_counters: [Series; 9] = [
            (
                "weightstream_session_streamed_bytes",
                "Bytes copied to the device for the session.",
                &|i| stats[i].bytes_copied as f64,
            ),
            (
                "weightstream_session_bytes_from_device",
                "Bytes staged for the session from another session's resident groups, within \
                 the device (not over the link).",
                &|i| stats[i].bytes_from_device as f64,
            ),
            (
                "weightstream_session_copies",
                "Staging copies run for the session.",
                &|i| stats[i].copies as f64,
            ),
            (
                "weightstream_session_acquires",
                "Acquires by the session.",
                &|i| stats[i].acquires as f64,
            ),
            (
                "weightstream_session_prefetch_hits",
                "Acquires that found their group staged or resident.",
                &|i| stats[i].hits as f64,
            ),
            (
                "weightstream_session_prefetch_misses",
                "Acquires that had to wait for a copy.",
                &|i| stats[i].misses as f64,
            ),
            (
                "weightstream_session_prefetches",
                "Copies queued ahead of the client by the plan.",
                &|i| stats[i].prefetches as f64,
            ),
            (
                "weightstream_session_gpu_wait_seconds",
                "Time the client's compute waited for weights, as the client measures and \
                 reports it (0 from a client that does not report).",
                &|i| stats[i].gpu_wait_ns as f64 * NS,
            ),
            (
                "weightstream_session_acquire_pending_seconds",
                "Wall-clock time with at least one Acquire (look-ahead ones included) waiting \
                 for its Staged in the daemon.",
                &|i| stats[i].acquire_pending_ns as f64 * NS,
            ),
        ];
        for (name, help, f) in session_counters {
            counter(&mut e, name, help, per_session(f))?;
        }
        // Per session and pass kind: two series per session at most, whatever the traffic.
        let per_kind = |f: &dyn Fn(&KindSnapshot) -> f64| -> Vec<([(&str, &str); 5], f64)> {
            (labels.iter().zip(&stats))
                .flat_map(|(l, st)| {
                    PassKind::ALL.map(|k| {
                        let [a, b, c, d] = *l;
                        ([a, b, c, d, ("kind", k.name())], f(&st.kinds[k.index()]))
                    })
                })
                .collect()
        };
        let kind_counters: [KindSeries; 5] = [
            (
                "weightstream_session_pass_acquires",
                "Acquires by the session for passes of the kind (Acquire.kind).",
                &|k| k.acquires as f64,
            ),
            (
                "weightstream_session_pass_prefetch_hits",
                "Acquires for passes of the kind that found their group staged or resident.",
                &|k| k.hits as f64,
            ),
            (
                "weightstream_session_pass_prefetch_misses",
                "Acquires for passes of the kind that had to wait for a copy.",
                &|k| k.misses as f64,
            ),
            (
                "weightstream_session_pass_streamed_bytes",
                "Bytes copied to the device while passes of the kind ran.",
                &|k| k.bytes_copied as f64,
            ),
            (
                "weightstream_session_pass_gpu_wait_seconds",
                "The client's reported wait for weights while passes of the kind ran.",
                &|k| k.gpu_wait_ns as f64 * NS,
            ),
        ];
        for (name, help, f) in kind_counters {
            counter(&mut e, name, help, per_kind(f))?;
        }
        let state = d.store.state_use();
        let state_bytes = |i: usize| state.get(&sessions[i].id).map_or(0, |u| u.bytes);
        let session_gauges: [Series; 5] = [
            (
                "weightstream_session_budget_bytes",
                "The session's VRAM budget.",
                &|i| sessions[i].vram_budget as f64,
            ),
            (
                "weightstream_session_staging_bytes",
                "The session's staging arena.",
                &|i| sessions[i].staging_bytes as f64,
            ),
            (
                "weightstream_session_copy_bandwidth_limit_bytes_per_second",
                "The session's share of its device's copy bandwidth (0: none of its own).",
                &|i| {
                    let s = &sessions[i];
                    d.scheduler
                        .share(s.device, s.number)
                        .map_or(0.0, |r| r.get() as f64)
                },
            ),
            (
                "weightstream_session_resident_bytes",
                "Groups kept on the device for the session (shared regions count in each).",
                &|i| sessions[i].resident_bytes as f64,
            ),
            (
                "weightstream_session_state_bytes",
                "Host memory of the session's state regions (AllocStateRegion).",
                &|i| state_bytes(i) as f64,
            ),
        ];
        for (name, help, f) in session_gauges {
            gauge(&mut e, name, help, per_session(f))?;
        }
        Ok(())
    }
}

/// The metrics in Prometheus text format, as a scrape gets them.
pub fn render(daemon: &Arc<Daemon>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(DaemonCollector(daemon.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail; an Err could only come from our collector's encoder.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        tracing::error!(error = %e, "encoding metrics failed");
    }
    out
}

/// The running endpoint.
pub struct MetricsServer {
    pub addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl MetricsServer {
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Binds `addr` and serves `/metrics` until stopped.
pub async fn serve(addr: SocketAddr, daemon: Arc<Daemon>) -> Result<MetricsServer, MetricsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let d = daemon.clone();
            async move {
                (
                    [(
                        CONTENT_TYPE,
                        prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                    )],
                    render(&d),
                )
            }
        }),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "metrics endpoint failed");
        }
    });
    tracing::info!(%addr, "metrics at http://{addr}/metrics");
    Ok(MetricsServer { addr, stop, task })
}
