//! torchao's weights uploaded as torchao holds them (`torchao_float8_rowwise`,
//! `torchao_int8_rowwise`), end to end on the host backend: the store keeps the client's data,
//! zero padding and per-row fp32 scales as written (one byte per weight), lists and stages them
//! with the format, dtype and scale shape, dedupes the same upload; declarations that break the
//! format's rules, non-finite scales and loads asking for a torchao format are refused with a
//! status naming the field or tensor and the rule, leaving nothing behind.

mod common;

use std::collections::BTreeMap;

use common::*;
use rand::{Rng, RngCore, SeedableRng};
use safetensors::Dtype;
use weightstream_client::proto::{self, Quantization as Q};
use weightstream_client::{Client, ClientError, Code, TensorData};

const F8: Q = Q::TorchaoFloat8Rowwise;
const I8: Q = Q::TorchaoInt8Rowwise;

fn rejected(err: ClientError) -> (Code, String) {
    match err {
        ClientError::Rejected { code, message } => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// A torchao weight as a client writes it: `out * inputs` random data bytes, zeros up to 16,
/// `out` positive finite fp32 scales.
struct Written {
    name: String,
    format: Q,
    shape: Vec<u64>,
    scale_shape: Vec<u64>,
    slice: Vec<u8>,
}

impl Written {
    fn new(seed: u64, name: &str, format: Q, out: u64, inputs: u64) -> Written {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let data = (out * inputs) as usize;
        let offset = data.div_ceil(16) * 16;
        let mut slice = vec![0u8; offset + 4 * out as usize];
        rng.fill_bytes(&mut slice[..data]);
        for scale in slice[offset..].chunks_exact_mut(4) {
            scale.copy_from_slice(&rng.random_range(1e-6f32..1.0).to_le_bytes());
        }
        Written {
            name: name.into(),
            format,
            shape: vec![out, inputs],
            scale_shape: vec![out, 1],
            slice,
        }
    }

    fn dtype(&self) -> proto::Dtype {
        if self.format == I8 {
            proto::Dtype::I8
        } else {
            proto::Dtype::F8E4m3
        }
    }

    fn upload(&self) -> TensorData<'_> {
        TensorData {
            name: &self.name,
            dtype: self.dtype(),
            shape: &self.shape,
            bytes: &self.slice,
            quantization: self.format,
            scale_shape: &self.scale_shape,
            format: "",
            weights: 0,
        }
    }

    fn scale_offset(&self) -> u64 {
        (self.shape[0] * self.shape[1]).div_ceil(16) * 16
    }
}

/// Two torchao weights (one of a width that is a multiple of 64, one not, and an odd data size
/// that needs padding) and a bias: the manifest lists each as written, the store holds exactly
/// the bytes written, each placement splits into the data and its scales, and the same upload
/// again is the same model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchao_weights_are_stored_and_staged_as_written() {
    let daemon = start_daemon().await;
    let mut client = daemon.client().await;
    let weights = [
        Written::new(1, "attn.to_q.weight", F8, 48, 128),
        Written::new(2, "ff.net.weight", I8, 33, 100),
    ];
    let bias = random_tensors(3, &[("attn.to_q.bias", Dtype::BF16, &[48])]).remove(0);
    let mut upload: Vec<TensorData<'_>> = weights.iter().map(Written::upload).collect();
    upload.push(bias.as_upload());
    let (manifest, dedup) = client.upload_model("torchao", &upload).await.unwrap();
    assert!(!dedup);

    let listed: Vec<_> = (manifest.tensors.iter())
        .map(|t| {
            let q = Q::try_from(t.quantization).unwrap();
            (
                t.name.as_str(),
                t.dtype,
                q,
                t.shape.clone(),
                t.scale_shape.clone(),
                t.scale_offset,
                t.nbytes,
            )
        })
        .collect();
    let want: Vec<_> = (weights.iter())
        .map(|w| {
            let dtype = w.dtype() as i32;
            let nbytes = w.slice.len() as u64;
            (
                w.name.as_str(),
                dtype,
                w.format,
                w.shape.clone(),
                vec![w.shape[0], 1],
                w.scale_offset(),
                nbytes,
            )
        })
        .chain([(
            "attn.to_q.bias",
            proto::Dtype::Bf16 as i32,
            Q::None,
            vec![48],
            vec![],
            0,
            96,
        )])
        .collect();
    assert_eq!(listed, want);
    assert_eq!(
        (weights[0].scale_offset(), weights[1].scale_offset()),
        (48 * 128, 3312),
        "3300 data bytes padded to 16"
    );
    assert_eq!(
        manifest.total_bytes,
        (48 * 128 + 4 * 48) + (3312 + 4 * 33) + 96,
        "one byte per weight and four per row, no float copy"
    );

    let expected: BTreeMap<&str, &[u8]> = (weights.iter())
        .map(|w| (w.name.as_str(), w.slice.as_slice()))
        .chain([(bias.name.as_str(), bias.bytes.as_slice())])
        .collect();
    let session = client
        .open_session(options(
            &manifest.model_id,
            per_tensor_groups(&manifest),
            0,
            4 << 20,
        ))
        .await
        .unwrap();
    for (g, info) in manifest.tensors.iter().enumerate() {
        let acquired = session.acquire(g as u32).await.unwrap();
        let placed = &acquired.layout().tensors[0];
        assert_eq!(
            (
                placed.dtype,
                placed.quantization,
                &placed.scale_shape,
                placed.scale_offset
            ),
            (
                info.dtype,
                info.quantization,
                &info.scale_shape,
                info.scale_offset
            ),
            "{}",
            info.name
        );
        let want = expected[info.name.as_str()];
        assert_bytes(&info.name, acquired.tensor(0).unwrap(), want);
        match acquired.quantized(0) {
            None => assert_eq!(info.quantization, Q::None as i32, "{}", info.name),
            Some(view) => {
                let data = (info.shape[0] * info.shape[1]) as usize;
                assert_eq!(view.data, &want[..data], "{}", info.name);
                assert_eq!(
                    view.scales,
                    &want[info.scale_offset as usize..],
                    "{}",
                    info.name
                );
                assert_eq!(view.scale_shape, &[info.shape[0], 1]);
            }
        }
    }
    session.close().await.unwrap();

    let (again, dedup) = client.upload_model("torchao", &upload).await.unwrap();
    assert!(dedup, "the same tensors in the same formats");
    assert_eq!(again.model_id, manifest.model_id);
    assert_eq!(
        daemon.shm_total(),
        1,
        "one host copy: the first upload's region"
    );
}

/// Nothing is left after a refusal: no model, no upload, no shared memory, no host bytes.
async fn assert_nothing_left(daemon: &TestDaemon, client: &mut Client, case: &str) {
    let listed = client.list_models().await.unwrap();
    assert!(listed.models.is_empty(), "{case}: {:?}", listed.models);
    assert_eq!((daemon.uploads(), daemon.shm_total()), (0, 0), "{case}");
    let uid = rustix::process::getuid().as_raw();
    assert_eq!(daemon.core.store.host_use(uid).total_bytes, 0, "{case}");
}

/// Each declaration that breaks a torchao format's rules gets INVALID_ARGUMENT naming the field
/// and tensor and the rule, as does a non-finite scale at commit and a load asking for a torchao
/// format; nothing is left behind and the daemon goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchao_declarations_that_break_the_rules_are_refused_and_leave_nothing() {
    let daemon = start_daemon().await;
    let mut client = daemon.client().await;
    let f8 = Written::new(4, "w", F8, 4, 8);
    let i8 = Written::new(5, "w", I8, 4, 8);
    let mut infinite = Written::new(6, "w", I8, 4, 8);
    let at = infinite.scale_offset() as usize + 4;
    infinite.slice[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    let three_d = [2u64, 2, 8];
    let cases: Vec<(&str, TensorData<'_>, &str)> = vec![
        (
            "int8 data declared float8",
            TensorData {
                dtype: proto::Dtype::I8,
                ..f8.upload()
            },
            "tensors[0].quantization: tensor 'w': dtype I8: torchao_float8_rowwise data (a \
             torchao Float8Tensor's qdata) is F8_E4M3",
        ),
        (
            "float8 data declared int8",
            TensorData {
                dtype: proto::Dtype::F8E4m3,
                ..i8.upload()
            },
            "tensors[0].quantization: tensor 'w': dtype F8_E4M3: torchao_int8_rowwise data (a \
             torchao Int8Tensor's qdata) is I8",
        ),
        (
            "rank 3",
            TensorData {
                shape: &three_d,
                ..i8.upload()
            },
            "tensors[0].quantization: tensor 'w': shape [2, 2, 8]: torchao_int8_rowwise holds \
             2-D weights [out_features, in_features] (a torchao Int8Tensor of a Linear layer)",
        ),
        (
            "one scale per tensor",
            TensorData {
                scale_shape: &[1, 1],
                ..f8.upload()
            },
            "tensors[0].quantization: tensor 'w': scale shape [1, 1] does not fit shape [4, 8]: \
             torchao_float8_rowwise has one scale per row, [4, 1] (granularity PerRow())",
        ),
        (
            "per-group scales",
            TensorData {
                scale_shape: &[4, 2],
                ..i8.upload()
            },
            "tensors[0].quantization: tensor 'w': scale shape [4, 2] does not fit shape [4, 8]: \
             torchao_int8_rowwise has one scale per row, [4, 1] (granularity PerRow())",
        ),
        (
            "no scales",
            TensorData {
                scale_shape: &[],
                ..f8.upload()
            },
            "tensors[0].quantization: tensor 'w': scale shape [] does not fit shape [4, 8]: \
             torchao_float8_rowwise has one scale per row, [4, 1] (granularity PerRow())",
        ),
        (
            "the data without its scales",
            TensorData {
                bytes: &i8.slice[..32],
                ..i8.upload()
            },
            "tensors[0].nbytes: 32 disagrees with shape [4, 8] of I8 (48 bytes)",
        ),
        (
            "an infinite scale",
            infinite.upload(),
            "tensor 'w': scale +inf at index 1: the scales of 8-bit data must be finite",
        ),
    ];
    let mut failed = Vec::new();
    for (case, tensor, want) in cases {
        let got = match client.upload_model("bad", &[tensor]).await {
            Ok((m, _)) => panic!("{case}: committed as {}", m.model_id),
            Err(e) => rejected(e),
        };
        if got != (Code::InvalidArgument, want.to_string()) {
            failed.push(format!("{case}: want {want:?}, got {got:?}"));
        }
        assert_nothing_left(&daemon, &mut client, case).await;
    }
    assert!(failed.is_empty(), "{failed:#?}");

    // A scale offset other than the layout's (raw: the client sends 0).
    let mut rpc = raw_client(&daemon.socket).await;
    let request = proto::BeginUploadRequest {
        name: String::new(),
        tensors: vec![proto::TensorInfo {
            name: "w".into(),
            dtype: proto::Dtype::I8 as i32,
            shape: vec![4, 8],
            quantization: I8 as i32,
            scale_shape: vec![4, 1],
            scale_offset: 16,
            ..Default::default()
        }],
        client_reserves: false,
    };
    let status = rpc.begin_upload(request).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (
            Code::InvalidArgument,
            "tensors[0].scale_offset: 16 disagrees with the torchao_int8_rowwise layout of \
             tensor 'w' (32)"
        )
    );

    // A load cannot ask for a torchao format: only its client has the tensors.
    let dir = tempfile::tempdir().unwrap();
    let tensors = random_tensors(7, &[("w.weight", Dtype::BF16, &[4, 64])]);
    let path = write_model(dir.path(), "m.safetensors", &tensors);
    for format in [F8, I8] {
        let err = client
            .load_model(std::slice::from_ref(&path), "", format, |_| {})
            .await
            .unwrap_err();
        let name = weightstream_client::quantization_name(format as i32);
        assert_eq!(
            rejected(err),
            (
                Code::InvalidArgument,
                format!(
                    "quantization: {name} is uploaded pre-quantized (BeginUpload with the \
                     weight's data and scales), not made by a load: load with QUANTIZATION_NONE, \
                     QUANTIZATION_FP8_E4M3_BLOCK64, QUANTIZATION_FP8_E4M3_ROW or \
                     QUANTIZATION_INT8_ROW"
                )
            )
        );
    }
    assert_nothing_left(&daemon, &mut client, "load as torchao").await;
    assert_still_serves(&daemon, 8).await;
}
