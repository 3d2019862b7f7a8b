//! `weightstream status`: devices, models and sessions as tables, or JSON for scripts.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::json;
use weightstream_client::Client;
use weightstream_client::proto;
use weightstream_client::quantization_name;

use super::{CliResult, Deadline, human, shown};

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
}

pub async fn run(socket: Option<PathBuf>, args: StatusArgs, deadline: Deadline) -> CliResult {
    let connect = Client::connect(socket.as_deref());
    let mut client = deadline.on("connecting", connect).await?;
    let info = deadline.on("GetInfo", client.info()).await?;
    let models = deadline.on("ListModels", client.list_models()).await?;
    let sessions = deadline.on("ListSessions", client.list_sessions()).await?;
    if args.json {
        out!(
            "{}",
            serde_json::to_string_pretty(&to_json(&info, &models, &sessions))?
        );
    } else {
        print_tables(&info, &models, &sessions);
    }
    Ok(())
}

fn backend_name(info: &proto::GetInfoResponse) -> &'static str {
    match proto::Backend::try_from(info.backend) {
        Ok(proto::Backend::Cuda) => "cuda",
        Ok(proto::Backend::Host) => "host",
        _ => "unknown",
    }
}

/// Fraction of acquires that found their group staged or resident.
pub fn hit_rate(s: &proto::SessionStats) -> f64 {
    if s.acquires == 0 {
        0.0
    } else {
        s.hits as f64 / s.acquires as f64
    }
}

/// The client's measured wait for weights, or "-" from a client that does not report it.
pub fn gpu_wait_text(s: &proto::SessionStats) -> String {
    if s.gpu_wait_reports == 0 {
        "-".into()
    } else {
        format!("{:.3} s", s.gpu_wait_ns as f64 / 1e9)
    }
}

fn to_json(
    info: &proto::GetInfoResponse,
    models: &proto::ListModelsResponse,
    sessions: &[proto::SessionInfo],
) -> serde_json::Value {
    json!({
        "version": info.version,
        "backend": backend_name(info),
        "devices": info.devices.iter().map(|d| json!({
            "uuid": d.uuid, "name": d.name, "total_memory": d.total_memory,
            "free_memory": d.free_memory, "pci_bus_id": d.pci_bus_id,
            "copy_bandwidth_limit": d.copy_bandwidth_limit,
        })).collect::<Vec<_>>(),
        "quotas": info.quotas.as_ref().map(|q| json!({
            "per_uid_sessions": q.per_uid_sessions, "per_uid_device_bytes": q.per_uid_device_bytes,
            "per_uid_host_bytes": q.per_uid_host_bytes, "per_uid_uploads": q.per_uid_uploads,
            "max_host_bytes": q.max_host_bytes, "max_device_bytes": q.max_device_bytes,
        })),
        "usage": info.usage.as_ref().map(|u| json!({
            "uid": u.uid, "sessions": u.sessions, "device_bytes": u.device_bytes,
            "host_bytes": u.host_bytes, "uploads": u.uploads,
            "daemon_sessions": u.daemon_sessions, "daemon_host_bytes": u.daemon_host_bytes,
            "daemon_uploads": u.daemon_uploads, "daemon_device_bytes": u.daemon_device_bytes,
            "state_bytes": u.state_bytes, "daemon_state_bytes": u.daemon_state_bytes,
        })),
        "store_bytes": models.store_bytes,
        "models": models.models.iter().map(|m| json!({
            "model_id": m.model_id, "name": m.name, "tensors": m.tensors.len(),
            "total_bytes": m.total_bytes, "refcount": m.refcount, "sessions": m.sessions,
            "pinned": m.pinned, "cached": m.cached,
            "source": m.source, "format": model_format(m),
            "formats": m.formats.iter().map(|f| json!({
                "format": f.format, "tensors": f.tensors, "bytes": f.bytes,
                "weights": f.weights, "bits_per_weight": bits_per_weight(f),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "sessions": sessions.iter().map(|s| {
            let st = s.stats.clone().unwrap_or_default();
            json!({
                "session_id": s.session_id, "model_id": s.model_id, "label": s.label,
                "device_uuid": s.device_uuid, "peer": {"uid": s.peer_uid, "gid": s.peer_gid, "pid": s.peer_pid},
                "vram_budget": s.vram_budget, "staging_bytes": s.staging_bytes,
                "resident_bytes": s.resident_bytes, "attached": s.attached,
                "plan_length": s.plan_length, "live_tickets": s.live_tickets, "age_ms": s.age_ms,
                "state_bytes": s.state_bytes, "state_regions": s.state_regions,
                "stats": {
                    "acquires": st.acquires, "hits": st.hits, "reuses": st.reuses,
                    "misses": st.misses, "resident_hits": st.resident_hits,
                    "bytes_copied": st.bytes_copied, "copies": st.copies,
                    "prefetches": st.prefetches, "resyncs": st.resyncs,
                    "releases": st.releases, "evictions": st.evictions,
                    "hit_rate": hit_rate(&st),
                    "gpu_wait_ns": st.gpu_wait_ns, "gpu_waits": st.gpu_waits,
                    "gpu_wait_reports": st.gpu_wait_reports,
                    "acquire_pending_ns": st.acquire_pending_ns,
                },
                "group_gpu_wait_ns": s.group_gpu_wait_ns,
                "group_acquire_pending_ns": s.group_acquire_pending_ns,
            })
        }).collect::<Vec<_>>(),
    })
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED)
        .set_header(header.to_vec());
    t
}

fn print_tables(
    info: &proto::GetInfoResponse,
    models: &proto::ListModelsResponse,
    sessions: &[proto::SessionInfo],
) {
    out!(
        "weightstream {} — backend {}",
        shown(&info.version),
        backend_name(info)
    );
    let mut devices = table(&["device", "name", "memory", "free", "pci", "copy limit"]);
    for d in &info.devices {
        devices.add_row(vec![
            shown(&d.uuid),
            shown(&d.name),
            human(d.total_memory),
            human(d.free_memory),
            shown(&d.pci_bus_id),
            match d.copy_bandwidth_limit {
                0 => "none".to_string(),
                rate => format!("{:.1} GB/s", rate as f64 / 1e9),
            },
        ]);
    }
    out!("{devices}");
    if let Some(q) = quota_table(info) {
        out!("{q}");
    }
    let mut m = table(&[
        "model", "name", "tensors", "bytes", "refs", "sessions", "kept", "source", "format",
    ]);
    for x in &models.models {
        m.add_row(vec![
            shown(&x.model_id),
            shown(&x.name),
            x.tensors.len().to_string(),
            human(x.total_bytes),
            x.refcount.to_string(),
            x.sessions.to_string(),
            kept(x).to_string(),
            shown(&x.source),
            model_format(x),
        ]);
    }
    out!("models (store: {})\n{m}", human(models.store_bytes));
    out!("{}", formats_table(models));
    let mut s = table(&[
        "session",
        "label",
        "model",
        "pid",
        "budget",
        "staging",
        "resident",
        "state",
        "acquires",
        "hit rate",
        "copied",
        "GPU wait",
        "acquire pending",
    ]);
    for x in sessions {
        let st = x.stats.clone().unwrap_or_default();
        s.add_row(vec![
            shown(&x.session_id),
            shown(&x.label),
            shown(&x.model_id),
            x.peer_pid.to_string(),
            human(x.vram_budget),
            human(x.staging_bytes),
            human(x.resident_bytes),
            human(x.state_bytes),
            st.acquires.to_string(),
            format!("{:.1} %", 100.0 * hit_rate(&st)),
            human(st.bytes_copied),
            gpu_wait_text(&st),
            format!("{:.3} s", st.acquire_pending_ns as f64 / 1e9),
        ]);
    }
    out!("sessions\n{s}");
}

/// The quotas against what the caller's uid and the daemon hold (a daemon that predates
/// quotas in GetInfo: none).
fn quota_table(info: &proto::GetInfoResponse) -> Option<String> {
    let (q, u) = (info.quotas.as_ref()?, info.usage.as_ref()?);
    let limit = |n: u64, show: fn(u64) -> String| {
        if n == 0 {
            "no limit".to_string()
        } else {
            show(n)
        }
    };
    let count = |n: u64| n.to_string();
    let (max_sessions, max_uploads) = info
        .limits
        .map_or((0, 0), |l| (l.max_sessions, l.max_uploads));
    let mut t = table(&["quota", "yours", "your limit", "the daemon's", "its limit"]);
    t.add_row(vec![
        "sessions".to_string(),
        u.sessions.to_string(),
        limit(q.per_uid_sessions.into(), count),
        u.daemon_sessions.to_string(),
        limit(max_sessions.into(), count),
    ]);
    t.add_row(vec![
        "host bytes".to_string(),
        human(u.host_bytes),
        limit(q.per_uid_host_bytes, human),
        human(u.daemon_host_bytes),
        limit(q.max_host_bytes, human),
    ]);
    t.add_row(vec![
        "  of them state regions".to_string(),
        human(u.state_bytes),
        String::new(),
        human(u.daemon_state_bytes),
        String::new(),
    ]);
    t.add_row(vec![
        "uploads in progress".to_string(),
        u.uploads.to_string(),
        limit(q.per_uid_uploads.into(), count),
        u.daemon_uploads.to_string(),
        limit(max_uploads.into(), count),
    ]);
    t.add_row(vec![
        "device bytes".to_string(),
        human(u.device_bytes),
        limit(q.per_uid_device_bytes, human),
        String::new(),
        String::new(),
    ]);
    for (i, d) in info.devices.iter().enumerate() {
        t.add_row(vec![
            format!("  on {}", shown(&d.uuid)),
            String::new(),
            String::new(),
            human(u.daemon_device_bytes.get(i).copied().unwrap_or(0)),
            limit(q.max_device_bytes.get(i).copied().unwrap_or(0), human),
        ]);
    }
    Some(format!("quotas (uid {})\n{t}", u.uid))
}

/// Whether the daemon may evict a model to make room: "pinned" (never), "cached" (only closed
/// connections' references hold it: evicted first when room is needed), "in use" (a session
/// or an open connection holds it).
fn kept(m: &proto::ModelManifest) -> &'static str {
    if m.pinned > 0 {
        "pinned"
    } else if m.cached {
        "cached"
    } else {
        "in use"
    }
}

/// Each model's formats, a row each (`ModelManifest.formats`: the most bytes first), with
/// their bytes and bits per weight.
fn formats_table(models: &proto::ListModelsResponse) -> String {
    let mut t = table(&["model", "format", "tensors", "bytes", "bits/weight"]);
    for m in &models.models {
        for f in &m.formats {
            t.add_row(vec![
                shown(&m.model_id),
                shown(&f.format),
                f.tensors.to_string(),
                human(f.bytes),
                bits_per_weight(f).map_or_else(|| "-".into(), |b| format!("{b:.3}")),
            ]);
        }
    }
    format!("formats\n{t}")
}

/// A format's bits per weight (scales and packing included); none where it counts no weights.
fn bits_per_weight(f: &proto::FormatUse) -> Option<f64> {
    (f.weights > 0).then(|| 8.0 * f.bytes as f64 / f.weights as f64)
}

/// A model's format: the quantization of its quantized tensors ("fp8_e4m3_block64"), or "none".
fn model_format(m: &proto::ModelManifest) -> String {
    (m.tensors.iter())
        .find(|t| t.quantization != proto::Quantization::None as i32)
        .map_or_else(|| "none".into(), |t| quantization_name(t.quantization))
}
