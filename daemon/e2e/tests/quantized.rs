//! 8-bit weights end to end on the host backend: a load or an upload with fp8_e4m3_block64
//! stores, lists and stages exactly what `store::quantize` makes of each weight (data, zero
//! padding, scales), dedupes by source and format, counts the quantized bytes against quotas,
//! and refuses what it cannot quantize with a status that names the tensor and the rule,
//! leaving nothing behind. The row formats (fp8_e4m3_row, int8_row), loaded and uploaded, stage
//! the bytes torch computes (the fixture `tests/data/fp8_vectors.safetensors`).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use rand::{RngCore, SeedableRng};
use safetensors::Dtype;
use weightstream_client::proto::{self, Quantization as Q};
use weightstream_client::{Client, ClientError, Code, TensorData};
use weightstream_daemon::store::quantize::quantize;
use weightstream_daemon::store::safetensors::DType;

const FP8: i32 = Q::Fp8E4m3Block64 as i32;
const NONE: i32 = Q::None as i32;

fn rejected(err: ClientError) -> (Code, String) {
    match err {
        ClientError::Rejected { code, message } => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn daemon_dtype(d: Dtype) -> DType {
    match d {
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        other => panic!("not a float dtype: {other:?}"),
    }
}

/// Random finite floats: random bits with the top exponent bit of each element cleared.
fn finite(seed: u64, name: &str, dtype: Dtype, shape: &[usize]) -> Tensor {
    let size = dtype.bitsize() / 8;
    let mut bytes = vec![0u8; shape.iter().product::<usize>() * size];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    for element in bytes.chunks_mut(size) {
        element[size - 1] &= !0x40;
    }
    Tensor::new(name, dtype, shape, bytes)
}

/// Weights of each float dtype and of several widths (multiples of 64, and not), and tensors a
/// load keeps as they are: a rank-1 weight, a bias, an integer ".weight", a 2-D non-weight.
fn model(seed: u64) -> Vec<Tensor> {
    let mut t = vec![
        finite(seed, "blocks.0.attn.weight", Dtype::BF16, &[64, 128]),
        finite(seed + 1, "blocks.0.mlp.weight", Dtype::F32, &[33, 100]),
        finite(seed + 2, "conv.weight", Dtype::F16, &[8, 4, 3, 3]),
        finite(seed + 3, "blocks.0.norm.weight", Dtype::BF16, &[48]),
        finite(seed + 4, "blocks.0.attn.bias", Dtype::BF16, &[64]),
        finite(seed + 5, "proj", Dtype::BF16, &[16, 64]),
        // Over the 8 MiB a reader thread takes at a time: a load reads it in several pieces.
        finite(seed + 6, "blocks.1.ff.weight", Dtype::F32, &[1024, 2560]),
    ];
    t.extend(random_tensors(seed, &[("ids.weight", Dtype::I64, &[2, 3])]));
    t
}

const QUANTIZED: [&str; 4] = [
    "blocks.0.attn.weight",
    "blocks.0.mlp.weight",
    "conv.weight",
    "blocks.1.ff.weight",
];

/// What the store holds for `t` under fp8: quantized data, padding and scales, or its bytes.
fn stored(t: &Tensor) -> Vec<u8> {
    if !QUANTIZED.contains(&t.name.as_str()) {
        return t.bytes.clone();
    }
    quantize(&t.name, daemon_dtype(t.dtype), &t.dims, &t.bytes)
        .unwrap()
        .to_stored()
}

/// (dtype, quantization, scale_shape, scale_offset, nbytes) of `t` as an fp8 manifest lists it.
fn listed(t: &Tensor) -> (i32, i32, Vec<u64>, u64, u64) {
    if !QUANTIZED.contains(&t.name.as_str()) {
        return (
            pb_dtype(t.dtype) as i32,
            NONE,
            vec![],
            0,
            t.bytes.len() as u64,
        );
    }
    let rows = t.dims[0];
    let cols: u64 = t.dims[1..].iter().product();
    let blocks = if cols.is_multiple_of(64) {
        cols / 64
    } else {
        1
    };
    let offset = (rows * cols).div_ceil(16) * 16;
    let nbytes = offset + 4 * rows * blocks;
    (
        proto::Dtype::F8E4m3 as i32,
        FP8,
        vec![rows, blocks],
        offset,
        nbytes,
    )
}

async fn load_as(client: &mut Client, path: &PathBuf, q: Q) -> proto::ModelManifest {
    let manifest = client
        .load_model(std::slice::from_ref(path), "", q, |_| {})
        .await;
    manifest.unwrap_or_else(|e| panic!("load {path:?} as {q:?}: {e}"))
}

/// Acquires every tensor (one group each) and compares the staged bytes, and the quantized
/// views, with `expected`; checks the placements' fields against the manifest's.
async fn check_staged(
    client: &mut Client,
    manifest: &proto::ModelManifest,
    expected: &BTreeMap<String, Vec<u8>>,
) {
    let groups = per_tensor_groups(manifest);
    let session = client
        .open_session(options(&manifest.model_id, groups, 0, 4 << 20))
        .await
        .unwrap();
    let layout = session.layout().clone();
    for (g, (group, info)) in layout.groups.iter().zip(&manifest.tensors).enumerate() {
        let p = &group.tensors[0];
        assert_eq!(
            (
                p.dtype,
                p.quantization,
                &p.scale_shape,
                p.scale_offset,
                p.nbytes
            ),
            (
                info.dtype,
                info.quantization,
                &info.scale_shape,
                info.scale_offset,
                info.nbytes
            ),
            "{}",
            p.name
        );
        let acquired = session.acquire(g as u32).await.unwrap();
        let want = &expected[&p.name];
        assert_bytes(&p.name, acquired.tensor(0).unwrap(), want);
        match acquired.quantized(0) {
            None => assert_eq!(p.quantization, NONE, "{}", p.name),
            Some(view) => {
                let data = p.shape.iter().product::<u64>() as usize;
                assert_eq!(view.data, &want[..data], "{}", p.name);
                assert_eq!(view.scales, &want[p.scale_offset as usize..], "{}", p.name);
                assert!(want[data..p.scale_offset as usize].iter().all(|&b| b == 0));
            }
        }
    }
    session.close().await.unwrap();
}

/// A load with fp8 quantizes each float weight of rank >= 2, stages exactly what the quantizer
/// makes of the file's tensor (data, zero padding, scales), keeps every other tensor's bytes,
/// and reports progress in the files' bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_with_fp8_stages_the_quantized_bytes_of_each_weight() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let tensors = model(1);
    let path = write_model(dir.path(), "m.safetensors", &tensors);
    let mut client = daemon.client().await;
    let mut totals = Vec::new();
    let manifest = client
        .load_model(std::slice::from_ref(&path), "", Q::Fp8E4m3Block64, |p| {
            totals.push(p.bytes_total)
        })
        .await
        .unwrap();
    let file_bytes: u64 = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    assert!(!totals.is_empty() && totals.iter().all(|&t| t == file_bytes));

    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    assert_eq!(manifest.tensors.len(), tensors.len());
    for info in &manifest.tensors {
        let t = by_name[info.name.as_str()];
        assert_eq!(info.shape, t.dims, "{}", info.name);
        assert_eq!(
            (
                info.dtype,
                info.quantization,
                info.scale_shape.clone(),
                info.scale_offset,
                info.nbytes
            ),
            listed(t),
            "{}",
            info.name
        );
    }
    let total: u64 = tensors.iter().map(|t| listed(t).4).sum();
    assert_eq!(manifest.total_bytes, total);
    assert!(total < file_bytes);
    assert!(
        manifest.phases.is_some(),
        "the load says where its time went"
    );
    let without_phases = proto::ModelManifest {
        phases: None,
        ..manifest.clone()
    };
    assert_eq!(
        model_listed(&mut client, &manifest.model_id).await,
        Some(without_phases),
        "ListModels lists the same manifest (without the load's phases)"
    );

    let expected: BTreeMap<String, Vec<u8>> = tensors
        .iter()
        .map(|t| (t.name.clone(), stored(t)))
        .collect();
    check_staged(&mut client, &manifest, &expected).await;
}

/// The model id covers the files and the format: the same files and format share one model
/// (one more reference), another format is another model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_files_in_the_same_format_share_one_model_and_another_format_does_not() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &model(2));
    let mut client = daemon.client().await;
    let plain = load_as(&mut client, &path, Q::None).await;
    let fp8 = load_as(&mut client, &path, Q::Fp8E4m3Block64).await;
    let again = load_as(&mut client, &path, Q::Fp8E4m3Block64).await;
    assert_ne!(plain.model_id, fp8.model_id);
    assert_eq!(again.model_id, fp8.model_id);
    assert_eq!((plain.refcount, fp8.refcount, again.refcount), (1, 1, 2));
    let listed = client.list_models().await.unwrap();
    assert_eq!(listed.models.len(), 2);
    assert!(plain.tensors.iter().all(|t| t.quantization == NONE));
    assert_eq!(daemon.shm_count("model"), 2, "two host copies, not three");
}

fn upload<'a>(t: &'a Tensor, q: bool) -> TensorData<'a> {
    let data = t.as_upload();
    if q && QUANTIZED.contains(&t.name.as_str()) {
        data.quantized_at_commit()
    } else {
        data
    }
}

/// An upload quantized at commit holds the bytes the quantizer makes (its region is dropped:
/// only the quantized copy stays, and only it is charged); the same weights uploaded
/// pre-quantized are the same model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_quantized_at_commit_equals_the_same_weights_uploaded_prequantized() {
    let daemon = start_daemon().await;
    let tensors = model(3);
    let mut client = daemon.client().await;
    let data: Vec<TensorData<'_>> = tensors.iter().map(|t| upload(t, true)).collect();
    let (manifest, dedup) = client.upload_model("q", &data).await.unwrap();
    assert!(!dedup);
    for info in &manifest.tensors {
        let t = tensors.iter().find(|t| t.name == info.name).unwrap();
        let want = listed(t);
        assert_eq!(
            (info.dtype, info.quantization, info.scale_shape.clone()),
            (want.0, want.1, want.2),
            "{}",
            info.name
        );
        assert_eq!((info.scale_offset, info.nbytes), (want.3, want.4));
    }
    assert_eq!(
        (daemon.shm_count("upload"), daemon.shm_count("model")),
        (0, 1),
        "the upload region is gone, the quantized arena stays"
    );
    let (uid, _) = (rustix::process::getuid().as_raw(), ());
    let entry = daemon.core.store.get(&manifest.model_id).unwrap();
    assert_eq!(
        daemon.core.store.host_use(uid).uid_bytes,
        entry.model.host_bytes(),
        "charged the quantized arena only"
    );
    let expected: BTreeMap<String, Vec<u8>> = tensors
        .iter()
        .map(|t| (t.name.clone(), stored(t)))
        .collect();
    check_staged(&mut client, &manifest, &expected).await;

    // Pre-quantized: the client writes data, padding and scales.
    let shapes: BTreeMap<&str, Vec<u64>> = tensors
        .iter()
        .map(|t| (t.name.as_str(), listed(t).2))
        .collect();
    let pre: Vec<TensorData<'_>> = tensors
        .iter()
        .map(|t| {
            if !QUANTIZED.contains(&t.name.as_str()) {
                return t.as_upload();
            }
            TensorData {
                dtype: proto::Dtype::F8E4m3,
                bytes: &expected[&t.name],
                quantization: Q::Fp8E4m3Block64,
                scale_shape: &shapes[t.name.as_str()],
                ..t.as_upload()
            }
        })
        .collect();
    let (again, dedup) = client.upload_model("q", &pre).await.unwrap();
    assert!(dedup, "the same tensors in the same format");
    assert_eq!(again.model_id, manifest.model_id);
}

/// A per-uid host quota that holds the quantized model but not the bf16 one: the fp8 load
/// passes, the plain one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_count_the_quantized_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = vec![finite(4, "w.weight", Dtype::BF16, &[512, 1024])];
    let path = write_model(dir.path(), "big.safetensors", &tensors);
    // bf16: 1 MiB; fp8: 512 KiB of data and 32 KiB of scales, plus the description.
    let daemon = start_daemon_with(|c| c.quotas.per_uid_host_bytes = 600 << 10).await;
    let mut client = daemon.client().await;
    let fp8 = load_as(&mut client, &path, Q::Fp8E4m3Block64).await;
    assert_eq!(fp8.total_bytes, (512 << 10) + (32 << 10));
    client.release_model(&fp8.model_id).await.unwrap();
    let err = client
        .load_model(std::slice::from_ref(&path), "", Q::None, |_| {})
        .await
        .unwrap_err();
    let (code, message) = rejected(err);
    assert_eq!(code, Code::ResourceExhausted, "{message}");
    assert!(
        message.starts_with("quotas.per_uid_host_bytes = 614400 exceeded"),
        "{message}"
    );
}

/// Nothing is left after a refusal: no model, no upload, no shared memory, no host bytes.
async fn assert_nothing_left(daemon: &TestDaemon, client: &mut Client, case: &str) {
    let listed = client.list_models().await.unwrap();
    assert!(listed.models.is_empty(), "{case}: {:?}", listed.models);
    assert_eq!(listed.store_bytes, 0, "{case}");
    assert_eq!((daemon.uploads(), daemon.shm_total()), (0, 0), "{case}");
    let uid = rustix::process::getuid().as_raw();
    assert_eq!(daemon.core.store.host_use(uid).total_bytes, 0, "{case}");
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Each request the daemon cannot quantize gets INVALID_ARGUMENT with a message that names the
/// tensor (or field) and the rule, and leaves nothing; the daemon goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_quantized_is_refused_by_name_and_leaves_nothing() {
    let daemon = start_daemon().await;
    let mut client = daemon.client().await;
    let mut nan = vec![0.5f32; 4 * 128];
    nan[3 * 128 + 5] = f32::NAN;
    let nan = f32_bytes(&nan);
    let ok = f32_bytes(&[1.0; 4 * 128]);
    let mut nan_scale = quantize("w", DType::F32, &[4, 128], &ok)
        .unwrap()
        .to_stored();
    nan_scale[512 + 4..512 + 8].copy_from_slice(&f32::INFINITY.to_le_bytes());
    let ints = [0u8; 4 * 8 * 4];
    let fp8 = proto::Dtype::F8E4m3;
    let t = |name, dtype, shape, bytes| TensorData::new(name, dtype, shape, bytes);
    let pre = |scale_shape| TensorData {
        quantization: Q::Fp8E4m3Block64,
        scale_shape,
        ..t("w", fp8, &[4, 128], &nan_scale)
    };
    let unknown = TensorData {
        quantization: Q::None,
        ..t("w", proto::Dtype::F32, &[4, 128], &ok)
    };
    let cases: Vec<(&str, Vec<TensorData<'_>>, String)> = vec![
        (
            "NaN weight, quantized at commit",
            vec![t("w", proto::Dtype::F32, &[4, 128], &nan).quantized_at_commit()],
            "tensor 'w': NaN at index 389: cannot quantize".into(),
        ),
        (
            "integer dtype",
            vec![t("ids", proto::Dtype::I32, &[4, 8], &ints).quantized_at_commit()],
            "tensors[0].quantization: tensor 'ids' has dtype I32: only BF16, F16 and F32 can be \
             quantized"
                .into(),
        ),
        (
            "rank 1",
            vec![t("norm", proto::Dtype::F32, &[128], &ok[..512]).quantized_at_commit()],
            "tensors[0].quantization: tensor 'norm' has rank 1: fp8_e4m3_block64 quantizes only \
             rank ≥ 2 weights"
                .into(),
        ),
        (
            "fp8 without scales",
            vec![pre(&[])],
            "tensors[0].scale_shape: tensor 'w' declares fp8 data without scales: pre-quantized \
             fp8_e4m3_block64 needs scale_shape [4, 2]"
                .into(),
        ),
        (
            "scale shape mismatch",
            vec![pre(&[4, 1])],
            "tensors[0].scale_shape: tensor 'w': scale shape [4, 1] does not match [4, 2], the \
             scales of fp8_e4m3_block64 of shape [4, 128]"
                .into(),
        ),
        (
            "an infinite scale",
            vec![pre(&[4, 2])],
            "tensor 'w': scale +inf at index 1: the scales of 8-bit data must be finite".into(),
        ),
        (
            "scales without quantization",
            vec![TensorData {
                scale_shape: &[4, 2],
                ..unknown
            }],
            "tensors[0].scale_shape: given for tensor 'w', which is not quantized".into(),
        ),
    ];
    let mut failed = Vec::new();
    for (case, tensors, want) in &cases {
        let got = match client.upload_model("bad", tensors).await {
            Ok((m, _)) => panic!("{case}: committed as {}", m.model_id),
            Err(e) => rejected(e),
        };
        if got != (Code::InvalidArgument, want.clone()) {
            failed.push(format!("{case}: want {want:?}, got {got:?}"));
        }
        assert_nothing_left(&daemon, &mut client, case).await;
    }
    assert!(failed.is_empty(), "{failed:#?}");

    // An unknown quantization, in BeginUpload and in LoadModel (raw: the clients send only
    // values they know).
    let mut rpc = raw_client(&daemon.socket).await;
    let request = proto::BeginUploadRequest {
        name: String::new(),
        tensors: vec![proto::TensorInfo {
            name: "w".into(),
            dtype: proto::Dtype::F32 as i32,
            shape: vec![4, 128],
            quantization: 8,
            ..Default::default()
        }],
        client_reserves: false,
    };
    let status = rpc.begin_upload(request).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (
            Code::InvalidArgument,
            "tensors[0].quantization: 8 is not a known quantization (QUANTIZATION_NONE = 0, \
             QUANTIZATION_FP8_E4M3_BLOCK64 = 1, QUANTIZATION_FP8_E4M3_ROW = 6, \
             QUANTIZATION_INT8_ROW = 7; in BeginUpload also \
             QUANTIZATION_TORCHAO_FLOAT8_ROWWISE = 4, QUANTIZATION_TORCHAO_INT8_ROWWISE = 5)"
        )
    );
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &model(5));
    let files = vec![std::fs::File::open(&path).unwrap()];
    let fd_token = put_files(&daemon.socket, files).await.unwrap();
    let request = proto::LoadModelRequest {
        paths: vec![path.display().to_string()],
        fd_token,
        quantization: 9,
        ..Default::default()
    };
    let status = rpc.load_model(request).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (
            Code::InvalidArgument,
            "quantization: 9 is not a known quantization (QUANTIZATION_NONE = 0, \
             QUANTIZATION_FP8_E4M3_BLOCK64 = 1, QUANTIZATION_FP8_E4M3_ROW = 6, \
             QUANTIZATION_INT8_ROW = 7; in BeginUpload also \
             QUANTIZATION_TORCHAO_FLOAT8_ROWWISE = 4, QUANTIZATION_TORCHAO_INT8_ROWWISE = 5)"
        )
    );
    assert_nothing_left(&daemon, &mut client, "unknown quantization").await;

    // A NaN in a file's weight: the load names the tensor, the value and its index.
    let mut tensors = model(6);
    let w = &mut tensors[1]; // blocks.0.mlp.weight, F32 [33, 100]
    let at = 20 * 100 + 7;
    w.bytes[at * 4..at * 4 + 4].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes());
    let bad = write_model(dir.path(), "bad.safetensors", &tensors);
    let err = client
        .load_model(std::slice::from_ref(&bad), "", Q::Fp8E4m3Block64, |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        rejected(err),
        (
            Code::InvalidArgument,
            "tensor 'blocks.0.mlp.weight': -inf at index 2007: cannot quantize".to_string()
        )
    );
    assert_nothing_left(&daemon, &mut client, "NaN in a file").await;
    // The same file without quantization loads: infinities are fine as bf16/f32 bytes.
    load_as(&mut client, &bad, Q::None).await;
    assert_still_serves(&daemon, 7).await;
}

/// What the store holds of each weight, by tensor name.
type StoredBytes = BTreeMap<String, Vec<u8>>;

/// The fixture's row cases (torch's quantization, `gen_fp8_vectors.py`): each input as a
/// `<case>.weight` tensor, and per row format what the store holds of it, built from torch's
/// data and scales (data, zero padding to 16, scales).
fn row_cases() -> (Vec<Tensor>, Vec<(Q, StoredBytes)>) {
    let fixture: &[u8] = include_bytes!("data/fp8_vectors.safetensors");
    let st = safetensors::SafeTensors::deserialize(fixture).unwrap();
    let mut cases: Vec<&str> = (st.names().into_iter())
        .filter_map(|n| n.strip_suffix(".rw"))
        .collect();
    cases.sort_unstable();
    let tensors: Vec<Tensor> = (cases.iter())
        .map(|case| {
            let w = st.tensor(&format!("{case}.rw")).unwrap();
            let name = format!("{case}.weight");
            Tensor::new(&name, w.dtype(), w.shape(), w.data().to_vec())
        })
        .collect();
    let formats = [(Q::Fp8E4m3Row, "fp8_row"), (Q::Int8Row, "int8_row")];
    let expected = (formats.into_iter())
        .map(|(q, suffix)| {
            let stored = (cases.iter())
                .map(|case| {
                    let data = st.tensor(&format!("{case}.{suffix}")).unwrap().data();
                    let scales = st.tensor(&format!("{case}.{suffix}_scale")).unwrap().data();
                    let mut bytes = data.to_vec();
                    bytes.resize(data.len().div_ceil(16) * 16, 0);
                    bytes.extend_from_slice(scales);
                    (format!("{case}.weight"), bytes)
                })
                .collect();
            (q, stored)
        })
        .collect();
    (tensors, expected)
}

/// What a manifest should list of a weight of `shape` in a row format: (dtype, quantization,
/// scale_shape, scale_offset, nbytes).
fn row_listed(q: Q, shape: &[u64]) -> (i32, i32, Vec<u64>, u64, u64) {
    let (scale_shape, offset, nbytes) = weightstream_client::row_layout(shape).unwrap();
    let dtype = match q {
        Q::Int8Row => proto::Dtype::I8,
        _ => proto::Dtype::F8E4m3,
    };
    (dtype as i32, q as i32, scale_shape.to_vec(), offset, nbytes)
}

/// A load with fp8_e4m3_row or int8_row, and an upload quantized at commit into either, stage
/// torch's bytes of every weight (8-bit compute's per-row quantization); the same bytes
/// uploaded pre-quantized are the same model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_row_formats_stage_the_bytes_torch_computes_loaded_or_uploaded() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let (tensors, formats) = row_cases();
    assert!(tensors.len() >= 30, "{} row cases", tensors.len());
    let path = write_model(dir.path(), "rows.safetensors", &tensors);
    let mut client = daemon.client().await;
    let mut ids = Vec::new();
    for (q, expected) in &formats {
        let manifest = load_as(&mut client, &path, *q).await;
        for info in &manifest.tensors {
            assert_eq!(
                (
                    info.dtype,
                    info.quantization,
                    info.scale_shape.clone(),
                    info.scale_offset,
                    info.nbytes
                ),
                row_listed(*q, &info.shape),
                "{}",
                info.name
            );
        }
        check_staged(&mut client, &manifest, expected).await;
        ids.push(manifest.model_id.clone());

        let data: Vec<TensorData<'_>> = (tensors.iter())
            .map(|t| t.as_upload().quantized_at_commit_as(*q))
            .collect();
        let (uploaded, dedup) = client.upload_model("rows", &data).await.unwrap();
        assert!(!dedup);
        check_staged(&mut client, &uploaded, expected).await;

        let dtype = row_listed(*q, &[1, 1]).0;
        let dtype = proto::Dtype::try_from(dtype).unwrap();
        let scale_shapes: Vec<[u64; 2]> = (tensors.iter())
            .map(|t| weightstream_client::row_layout(&t.dims).unwrap().0)
            .collect();
        let prequantized: Vec<TensorData<'_>> = (tensors.iter().zip(&scale_shapes))
            .map(|(t, scale_shape)| TensorData {
                quantization: *q,
                scale_shape,
                ..TensorData::new(&t.name, dtype, &t.dims, &expected[&t.name])
            })
            .collect();
        let (again, dedup) = client.upload_model("rows", &prequantized).await.unwrap();
        assert!(dedup, "{q:?}: pre-quantized equals quantized at commit");
        assert_eq!(again.model_id, uploaded.model_id);
    }
    assert_ne!(ids[0], ids[1], "each format is its own model");
}
