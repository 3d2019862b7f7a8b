//! `weightstream status`: devices, models and sessions as tables, or JSON for scripts.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::json;
use weightstream_client::Client;
use weightstream_client::proto;
use weightstream_client::quantization_name;

use super::{CliResult, human};

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
}

pub async fn run(socket: Option<PathBuf>, args: StatusArgs) -> CliResult {
    let mut client = Client::connect(socket.as_deref()).await?;
    let info = client.info().await?;
    let models = client.list_models().await?;
    let sessions = client.list_sessions().await?;
    if args.json {
        println!(
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
        })).collect::<Vec<_>>(),
        "store_bytes": models.store_bytes,
        "models": models.models.iter().map(|m| json!({
            "model_id": m.model_id, "name": m.name, "tensors": m.tensors.len(),
            "total_bytes": m.total_bytes, "refcount": m.refcount, "sessions": m.sessions,
            "source": m.source, "format": model_format(m),
        })).collect::<Vec<_>>(),
        "sessions": sessions.iter().map(|s| {
            let st = s.stats.unwrap_or_default();
            json!({
                "session_id": s.session_id, "model_id": s.model_id, "label": s.label,
                "device_uuid": s.device_uuid, "peer": {"uid": s.peer_uid, "gid": s.peer_gid, "pid": s.peer_pid},
                "vram_budget": s.vram_budget, "staging_bytes": s.staging_bytes,
                "resident_bytes": s.resident_bytes, "attached": s.attached,
                "plan_length": s.plan_length, "live_tickets": s.live_tickets, "age_ms": s.age_ms,
                "stats": {
                    "acquires": st.acquires, "hits": st.hits, "reuses": st.reuses,
                    "misses": st.misses, "resident_hits": st.resident_hits,
                    "bytes_copied": st.bytes_copied, "copies": st.copies,
                    "prefetches": st.prefetches, "stall_ns": st.stall_ns, "resyncs": st.resyncs,
                    "releases": st.releases, "evictions": st.evictions,
                    "hit_rate": hit_rate(&st),
                },
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
    println!(
        "weightstream {} — backend {}",
        info.version,
        backend_name(info)
    );
    let mut devices = table(&["device", "name", "memory", "free", "pci"]);
    for d in &info.devices {
        devices.add_row(vec![
            d.uuid.clone(),
            d.name.clone(),
            human(d.total_memory),
            human(d.free_memory),
            d.pci_bus_id.clone(),
        ]);
    }
    println!("{devices}");
    let mut m = table(&[
        "model", "name", "tensors", "bytes", "refs", "sessions", "source", "format",
    ]);
    for x in &models.models {
        m.add_row(vec![
            x.model_id.clone(),
            x.name.clone(),
            x.tensors.len().to_string(),
            human(x.total_bytes),
            x.refcount.to_string(),
            x.sessions.to_string(),
            x.source.clone(),
            model_format(x),
        ]);
    }
    println!("models (store: {})\n{m}", human(models.store_bytes));
    let mut s = table(&[
        "session", "label", "model", "pid", "budget", "staging", "resident", "acquires",
        "hit rate", "copied", "stall",
    ]);
    for x in sessions {
        let st = x.stats.unwrap_or_default();
        s.add_row(vec![
            x.session_id.clone(),
            x.label.clone(),
            x.model_id.clone(),
            x.peer_pid.to_string(),
            human(x.vram_budget),
            human(x.staging_bytes),
            human(x.resident_bytes),
            st.acquires.to_string(),
            format!("{:.1} %", 100.0 * hit_rate(&st)),
            human(st.bytes_copied),
            format!("{:.3} s", st.stall_ns as f64 / 1e9),
        ]);
    }
    println!("sessions\n{s}");
}

/// A model's format: the quantization of its quantized tensors ("fp8_e4m3_block64"), or "none".
fn model_format(m: &proto::ModelManifest) -> String {
    (m.tensors.iter())
        .find(|t| t.quantization != proto::Quantization::None as i32)
        .map_or_else(|| "none".into(), |t| quantization_name(t.quantization))
}
