//! `weightstream status` shows each model's formats with their bytes and bits per weight: a
//! packed layer's raw tensors under their client's label, a weight the daemon quantized under
//! its quantization, plain tensors under their dtype.

mod served;

use std::process::Command;

use served::Served;
use weightstream_client::{Client, TensorData, proto};

/// The lines of `status`'s output from its `formats` table to the next table.
fn formats_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .skip_while(|l| *l != "formats")
        .take_while(|l| *l != "sessions")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_each_format_with_its_bits_per_weight() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Served::start(dir.path());
    // A 64 x 64 layer packed in 4 bits (2048 code bytes, 128 scale bytes), its bf16 bias, a
    // 64 x 64 f32 weight the daemon quantizes to fp8_e4m3_block64 (4096 bytes of data, 64
    // fp32 scales), and an empty tensor (no weights: no bits per weight).
    let (codes, scales, bias) = (vec![0x21u8; 2048], vec![1u8; 128], vec![0u8; 128]);
    let weight: Vec<u8> = (0..64 * 64)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    let tensors = [
        TensorData::new("l0.codes", proto::Dtype::U8, &[2048], &codes).labelled("aitk.uint4", 4096),
        TensorData::new("l0.scales", proto::Dtype::U8, &[128], &scales).labelled("aitk.uint4", 0),
        TensorData::new("l0.bias", proto::Dtype::Bf16, &[64], &bias),
        TensorData::new("l1.weight", proto::Dtype::F32, &[64, 64], &weight).quantized_at_commit(),
        TensorData::new("empty", proto::Dtype::U8, &[0], &[]),
    ];
    let mut client = Client::connect(Some(&daemon.socket)).await.unwrap();
    // A label the edge refuses, as the gRPC status says it.
    let bad = TensorData::new("l0.codes", proto::Dtype::U8, &[2048], &codes);
    let refused = client
        .begin_upload("bad", vec![bad.labelled("aitk uint4", 4096).info()], false)
        .await
        .unwrap_err();
    assert_eq!(
        refused.to_string(),
        "InvalidArgument: tensors[0].format: byte 4 is ' ': a format label is ASCII letters, \
         digits, '.', '_' and '-'"
    );
    let (manifest, _) = client.upload_model("packed", &tensors).await.unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_weightstream"))
        .arg("status")
        .arg("--socket")
        .arg(&daemon.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let id = &manifest.model_id;
    let want = [
        "formats".to_string(),
        "┌────────────────────────────────────┬──────────────────┬─────────┬─────────┬─────────────┐".into(),
        "│ model                              ┆ format           ┆ tensors ┆ bytes   ┆ bits/weight │".into(),
        "╞════════════════════════════════════╪══════════════════╪═════════╪═════════╪═════════════╡".into(),
        format!("│ {id} ┆ fp8_e4m3_block64 ┆ 1       ┆ 4.2 KiB ┆ 8.500       │"),
        format!("│ {id} ┆ aitk.uint4       ┆ 2       ┆ 2.1 KiB ┆ 4.250       │"),
        format!("│ {id} ┆ bf16             ┆ 1       ┆ 128 B   ┆ 16.000      │"),
        format!("│ {id} ┆ u8               ┆ 1       ┆ 0 B     ┆ -           │"),
        "└────────────────────────────────────┴──────────────────┴─────────┴─────────┴─────────────┘".into(),
    ];
    assert_eq!(formats_lines(&stdout), want, "{stdout}");
    let json = Command::new(env!("CARGO_BIN_EXE_weightstream"))
        .args(["status", "--json", "--socket"])
        .arg(&daemon.socket)
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        json["models"][0]["formats"][1],
        serde_json::json!({"format": "aitk.uint4", "tensors": 2, "bytes": 2176,
                           "weights": 4096, "bits_per_weight": 4.25})
    );
}
