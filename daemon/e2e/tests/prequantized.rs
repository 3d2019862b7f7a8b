//! Pre-quantized files read as published (host backend): musubi-tuner `--fp8_scaled` and
//! ComfyUI scaled-fp8 safetensors (legacy, and mixed precision: `.comfy_quant` markers or a
//! `_quantization_metadata` listing), loaded with quantization none, store each fp8 weight and
//! its scale as one slice (the weight's bytes, zero padding to 16, the scales as
//! fp32) with the format and the file's scale shape; every other tensor keeps its bytes; a
//! scale that breaks the format's rules is refused by name and rule, leaving nothing behind.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use safetensors::Dtype;
use weightstream_client::proto::Quantization as Q;
use weightstream_client::{Client, ClientError, Code};

const MUSUBI: i32 = Q::Fp8ScaledMusubi as i32;
const COMFY: i32 = Q::Fp8ScaledComfy as i32;
const NONE: i32 = Q::None as i32;

fn rejected(err: ClientError) -> (Code, String) {
    match err {
        ClientError::Rejected { code, message } => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// fp8 bytes: every code but the NaNs (0x7F, 0xFF), in a fixed pattern.
fn fp8(name: &str, shape: &[usize], seed: u8) -> Tensor {
    let n: usize = shape.iter().product();
    let bytes = (0..n)
        .map(|i| {
            let b = (i as u8).wrapping_mul(37).wrapping_add(seed);
            if b & 0x7F == 0x7F { b - 1 } else { b }
        })
        .collect();
    Tensor::new(name, Dtype::F8_E4M3, shape, bytes)
}

fn scale(name: &str, dtype: Dtype, shape: &[usize], values: &[f32]) -> Tensor {
    let bytes = values
        .iter()
        .flat_map(|v| match dtype {
            Dtype::F32 => v.to_le_bytes().to_vec(),
            Dtype::BF16 => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
            Dtype::F16 => f16_bits(*v).to_le_bytes().to_vec(),
            other => panic!("{other:?}"),
        })
        .collect();
    Tensor::new(name, dtype, shape, bytes)
}

/// Of the halves these tests use (exact in f16): 2^e * m, m in [1, 2) with 10 bits.
fn f16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xFF) as i32 - 127 + 15;
    assert!(
        (1..31).contains(&exp) && b & 0x1FFF == 0,
        "{v} is not a normal half"
    );
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3FF) as u16
}

fn f32s(dtype: Dtype, bytes: &[u8]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => bytes.to_vec(),
        Dtype::BF16 => bytes
            .chunks(2)
            .flat_map(|c| {
                f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16).to_le_bytes()
            })
            .collect(),
        Dtype::F16 => bytes
            .chunks(2)
            .flat_map(|c| {
                let h = u16::from_le_bytes([c[0], c[1]]);
                let sign = u32::from(h & 0x8000) << 16;
                let exp = u32::from((h >> 10) & 0x1F) + 127 - 15;
                let man = u32::from(h & 0x3FF) << 13;
                f32::from_bits(sign | exp << 23 | man).to_le_bytes()
            })
            .collect(),
        other => panic!("{other:?}"),
    }
}

/// A musubi file: one weight per mode (block, channel, tensor as [] and [1], a rank-3 weight),
/// scales in each float dtype, a bias and a norm kept as they are.
fn musubi() -> Vec<Tensor> {
    vec![
        fp8("blocks.0.attn.weight", &[4, 128], 1),
        scale(
            "blocks.0.attn.scale_weight",
            Dtype::BF16,
            &[4, 2, 1],
            &[0.5, 0.25, 1.5, 2.0, 0.125, 3.0, 0.75, 1.0],
        ),
        fp8("blocks.0.mlp.weight", &[3, 33], 2),
        scale(
            "blocks.0.mlp.scale_weight",
            Dtype::F16,
            &[3, 1],
            &[0.5, 1.25, 2.0],
        ),
        fp8("blocks.0.out.weight", &[5, 7], 3),
        scale("blocks.0.out.scale_weight", Dtype::F32, &[], &[0.0123]),
        fp8("blocks.0.proj.weight", &[2, 8], 4),
        scale("blocks.0.proj.scale_weight", Dtype::F32, &[1], &[1.75]),
        fp8("conv.weight", &[2, 3, 2], 5),
        scale("conv.scale_weight", Dtype::BF16, &[1], &[0.375]),
        random_tensors(7, &[("blocks.0.attn.bias", Dtype::BF16, &[4])]).remove(0),
        random_tensors(8, &[("norm.weight", Dtype::F32, &[6])]).remove(0),
    ]
}

/// A ComfyUI file: the `scaled_fp8` marker, scalar fp32 scales, a `scale_input` kept as a
/// tensor, an fp8 weight without a scale kept as it is.
fn comfy() -> Vec<Tensor> {
    vec![
        Tensor::new(
            "model.diffusion_model.scaled_fp8",
            Dtype::F8_E4M3,
            &[0],
            vec![],
        ),
        fp8("model.diffusion_model.a.weight", &[6, 64], 9),
        scale(
            "model.diffusion_model.a.scale_weight",
            Dtype::F32,
            &[],
            &[0.03125],
        ),
        scale(
            "model.diffusion_model.a.scale_input",
            Dtype::F32,
            &[],
            &[1.0],
        ),
        fp8("model.diffusion_model.b.weight", &[3, 5], 10),
        scale(
            "model.diffusion_model.b.scale_weight",
            Dtype::F32,
            &[],
            &[1.0e-3],
        ),
        fp8("model.diffusion_model.c.weight", &[2, 2], 11),
    ]
}

/// `{"format": "float8_e4m3fn"}`, as a ComfyUI mixed-precision file marks a layer.
fn marker(layer: &str) -> Tensor {
    let json = br#"{"format": "float8_e4m3fn"}"#.to_vec();
    Tensor::new(
        &format!("{layer}.comfy_quant"),
        Dtype::U8,
        &[json.len()],
        json,
    )
}

/// A ComfyUI mixed-precision file: a layer marked by its `.comfy_quant` (scale []), one listed
/// in the header (scale [1]), an `input_scale` and the markers kept as tensors, an unquantized
/// bf16 weight with a `weight_scale`-like name that no marker names, kept as it is.
fn comfy_mixed() -> (Vec<Tensor>, std::collections::HashMap<String, String>) {
    let tensors = vec![
        fp8("diffusion_model.a.weight", &[6, 64], 12),
        scale(
            "diffusion_model.a.weight_scale",
            Dtype::F32,
            &[],
            &[0.03125],
        ),
        scale("diffusion_model.a.input_scale", Dtype::F32, &[], &[1.0]),
        marker("diffusion_model.a"),
        fp8("diffusion_model.b.weight", &[3, 5], 13),
        scale(
            "diffusion_model.b.weight_scale",
            Dtype::F32,
            &[1],
            &[1.0e-3],
        ),
        random_tensors(14, &[("diffusion_model.c.weight", Dtype::BF16, &[2, 2])]).remove(0),
        scale("diffusion_model.c.weight_scale", Dtype::F32, &[], &[2.0]),
    ];
    let listing = r#"{"format_version": "1.0", "layers": {"diffusion_model.b": {"format": "float8_e4m3fn"}}}"#;
    let metadata = [("_quantization_metadata".to_string(), listing.to_string())];
    (tensors, metadata.into_iter().collect())
}

/// (quantization, scale_shape, scale_offset, nbytes, stored bytes) of each tensor of the model.
type Want = BTreeMap<String, (i32, Vec<u64>, u64, u64, Vec<u8>)>;

/// What a load of `tensors` stores: each weight whose layer's scale (`<layer><scale_suffix>`)
/// is among `tensors` and is one of `scaled` layers (None: any) as one slice, the rest as is.
fn expected_with(
    tensors: &[Tensor],
    format: i32,
    scale_suffix: &str,
    scaled: Option<&[&str]>,
) -> Want {
    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let is_scaled = |layer: &str| scaled.is_none_or(|layers| layers.contains(&layer));
    let mut want = Want::new();
    for t in tensors {
        if (t.name.strip_suffix(scale_suffix)).is_some_and(is_scaled) {
            continue;
        }
        let scale_name = (t.name.strip_suffix(".weight"))
            .filter(|l| is_scaled(l))
            .map(|l| format!("{l}{scale_suffix}"));
        match scale_name.as_deref().and_then(|s| by_name.get(s)) {
            None => {
                want.insert(
                    t.name.clone(),
                    (NONE, vec![], 0, t.bytes.len() as u64, t.bytes.clone()),
                );
            }
            Some(s) => {
                let offset = t.bytes.len().div_ceil(16) as u64 * 16;
                let mut bytes = t.bytes.clone();
                bytes.resize(offset as usize, 0);
                bytes.extend(f32s(s.dtype, &s.bytes));
                want.insert(
                    t.name.clone(),
                    (format, s.dims.clone(), offset, bytes.len() as u64, bytes),
                );
            }
        }
    }
    want
}

fn expected(tensors: &[Tensor], format: i32) -> Want {
    expected_with(tensors, format, ".scale_weight", None)
}

async fn load(client: &mut Client, path: &PathBuf) -> weightstream_client::proto::ModelManifest {
    (client
        .load_model(std::slice::from_ref(path), "", Q::None, |_| {})
        .await)
        .unwrap_or_else(|e| panic!("load {path:?}: {e}"))
}

/// The manifest lists, and a session stages, exactly `want`.
async fn check(client: &mut Client, path: &PathBuf, want: &Want) {
    let manifest = load(client, path).await;
    let listed: Vec<&str> = manifest.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut names: Vec<&str> = want.keys().map(String::as_str).collect();
    let mut sorted = listed.clone();
    sorted.sort();
    names.sort();
    assert_eq!(sorted, names);
    for t in &manifest.tensors {
        let w = &want[&t.name];
        assert_eq!(
            (
                t.quantization,
                t.scale_shape.clone(),
                t.scale_offset,
                t.nbytes
            ),
            (w.0, w.1.clone(), w.2, w.3),
            "{}",
            t.name
        );
        if w.0 != NONE {
            assert_eq!(t.dtype, proto_f8(), "{}", t.name);
        }
    }
    let groups = per_tensor_groups(&manifest);
    let session = client
        .open_session(options(&manifest.model_id, groups, 0, 1 << 20))
        .await
        .unwrap();
    let layout = session.layout().clone();
    for (g, group) in layout.groups.iter().enumerate() {
        let p = &group.tensors[0];
        let w = &want[&p.name];
        assert_eq!(
            (p.quantization, p.scale_shape.clone(), p.scale_offset),
            (w.0, w.1.clone(), w.2),
            "{}",
            p.name
        );
        let acquired = session.acquire(g as u32).await.unwrap();
        assert_bytes(&p.name, acquired.tensor(0).unwrap(), &w.4);
        if let Some(view) = acquired.quantized(0) {
            assert_eq!(view.scales, &w.4[w.2 as usize..], "{}", p.name);
        }
    }
    session.close().await.unwrap();
}

fn proto_f8() -> i32 {
    weightstream_client::proto::Dtype::F8E4m3 as i32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_musubi_file_stages_its_weights_and_scales_as_they_are() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let tensors = musubi();
    let path = write_model(dir.path(), "musubi.safetensors", &tensors);
    let mut client = daemon.client().await;
    check(&mut client, &path, &expected(&tensors, MUSUBI)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_comfy_file_stages_its_weights_and_scales_as_they_are() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let tensors = comfy();
    let path = write_model(dir.path(), "comfy.safetensors", &tensors);
    let mut client = daemon.client().await;
    check(&mut client, &path, &expected(&tensors, COMFY)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_comfy_mixed_precision_file_stages_its_marked_and_listed_layers_as_they_are() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let (tensors, metadata) = comfy_mixed();
    let path = write_model_with(dir.path(), "mixed.safetensors", &tensors, Some(metadata));
    let want = expected_with(
        &tensors,
        COMFY,
        ".weight_scale",
        Some(&["diffusion_model.a", "diffusion_model.b"]),
    );
    assert_eq!(
        (want.iter())
            .filter(|(_, w)| w.0 == COMFY)
            .map(|(name, w)| (name.as_str(), w.1.clone()))
            .collect::<Vec<_>>(),
        [
            ("diffusion_model.a.weight", vec![]),
            ("diffusion_model.b.weight", vec![1])
        ],
        "the marked layer and the listed one"
    );
    let mut client = daemon.client().await;
    check(&mut client, &path, &want).await;
}

async fn assert_nothing_left(daemon: &TestDaemon, client: &mut Client, case: &str) {
    let listed = client.list_models().await.unwrap();
    assert!(listed.models.is_empty(), "{case}: {:?}", listed.models);
    assert_eq!(listed.store_bytes, 0, "{case}");
    assert_eq!(daemon.shm_total(), 0, "{case}");
    let uid = rustix::process::getuid().as_raw();
    assert_eq!(daemon.core.store.host_use(uid).total_bytes, 0, "{case}");
}

/// Each broken rule is refused with a status naming the tensor and the rule; nothing stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_that_breaks_its_format_is_refused_by_name_and_leaves_nothing() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let mut client = daemon.client().await;
    let w = || fp8("l.weight", &[4, 128], 1);
    let cases: Vec<(&str, Vec<Tensor>, String)> =
        vec![
        (
            "block count does not divide in",
            vec![w(), scale("l.scale_weight", Dtype::F32, &[4, 3, 1], &[1.0; 12])],
            "tensor 'l.scale_weight': shape [4, 3, 1] does not fit weight 'l.weight' of shape \
             [4, 128]: fp8_scaled_musubi needs [] or [1] (per tensor), [4, 1] (per channel) or \
             [4, blocks, 1] with blocks dividing 128 (per block)"
                .into(),
        ),
        (
            "rows differ",
            vec![w(), scale("l.scale_weight", Dtype::F32, &[5, 1], &[1.0; 5])],
            "tensor 'l.scale_weight': shape [5, 1] does not fit weight 'l.weight' of shape \
             [4, 128]: fp8_scaled_musubi needs [] or [1] (per tensor), [4, 1] (per channel) or \
             [4, blocks, 1] with blocks dividing 128 (per block)"
                .into(),
        ),
        (
            "comfy scale not scalar",
            vec![
                Tensor::new("scaled_fp8", Dtype::F8_E4M3, &[0], vec![]),
                w(),
                scale("l.scale_weight", Dtype::F32, &[1], &[1.0]),
            ],
            "tensor 'l.scale_weight': shape [1] does not fit weight 'l.weight' of shape \
             [4, 128]: fp8_scaled_comfy needs [] (one scale per weight)"
                .into(),
        ),
        (
            "non-finite scale",
            vec![w(), scale("l.scale_weight", Dtype::F32, &[4, 1], &[1.0, 2.0, f32::NAN, 1.0])],
            "tensor 'l.scale_weight': NaN at index 2: scales must be finite".into(),
        ),
        (
            "infinite bf16 scale",
            vec![w(), scale("l.scale_weight", Dtype::BF16, &[], &[f32::NEG_INFINITY])],
            "tensor 'l.scale_weight': -inf at index 0: scales must be finite".into(),
        ),
        (
            "integer scale",
            vec![w(), Tensor::new("l.scale_weight", Dtype::I32, &[], vec![1, 0, 0, 0])],
            "tensor 'l.scale_weight': dtype I32: fp8_scaled_musubi scales must be F32, BF16 or \
             F16"
            .into(),
        ),
        (
            "bf16 weight",
            vec![
                random_tensors(1, &[("l.weight", Dtype::BF16, &[4, 128])]).remove(0),
                scale("l.scale_weight", Dtype::F32, &[], &[1.0]),
            ],
            "tensor 'l.weight': dtype BF16: a weight with a .scale_weight must be F8_E4M3 \
             (float8_e4m3fn) in fp8_scaled_musubi"
                .into(),
        ),
        (
            "scale without weight",
            vec![scale("l.scale_weight", Dtype::F32, &[], &[1.0])],
            "tensor 'l.scale_weight': no 'l.weight' to scale (fp8_scaled_musubi)".into(),
        ),
        (
            "comfy marked layer without its scale",
            vec![w(), marker("l")],
            "tensor 'l.comfy_quant': no 'l.weight_scale' for this quantized layer \
             (fp8_scaled_comfy)"
                .into(),
        ),
        (
            "comfy marked layer without its weight",
            vec![scale("l.weight_scale", Dtype::F32, &[], &[1.0]), marker("l")],
            "tensor 'l.comfy_quant': no 'l.weight' for this quantized layer (fp8_scaled_comfy)"
                .into(),
        ),
        (
            "comfy nvfp4 layer (packed U8 weight)",
            vec![
                Tensor::new("l.weight", Dtype::U8, &[4, 64], vec![0; 256]),
                scale("l.weight_scale", Dtype::F32, &[], &[1.0]),
                marker("l"),
            ],
            "tensor 'l.weight': dtype U8: a ComfyUI quantized layer is read only as \
             float8_e4m3fn (an F8_E4M3 weight; nvfp4, mxfp8 and int8 layers are not read)"
                .into(),
        ),
        (
            "comfy per-row scale",
            vec![w(), scale("l.weight_scale", Dtype::F32, &[4, 1], &[1.0; 4]), marker("l")],
            "tensor 'l.weight_scale': shape [4, 1] does not fit weight 'l.weight' of shape \
             [4, 128]: fp8_scaled_comfy needs [] or [1] (one scale per weight)"
                .into(),
        ),
        (
            "comfy marker not U8",
            vec![
                w(),
                scale("l.weight_scale", Dtype::F32, &[], &[1.0]),
                scale("l.comfy_quant", Dtype::F32, &[1], &[1.0]),
            ],
            "tensor 'l.comfy_quant': dtype F32 shape [1]: a ComfyUI layer marker is U8 of rank \
             1 (its config as JSON)"
                .into(),
        ),
        (
            "two scales for one weight",
            vec![
                w(),
                scale("l.scale_weight", Dtype::F32, &[], &[1.0]),
                scale("l.weight_scale", Dtype::F32, &[], &[1.0]),
                marker("l"),
            ],
            "tensor 'l.weight': two scales, 'l.scale_weight' and 'l.weight_scale': a weight has \
             one"
            .into(),
        ),
    ];
    for (i, (case, tensors, message)) in cases.into_iter().enumerate() {
        let path = write_model(dir.path(), &format!("bad{i}.safetensors"), &tensors);
        let err = client
            .load_model(std::slice::from_ref(&path), "", Q::None, |_| {})
            .await
            .unwrap_err();
        assert_eq!(rejected(err), (Code::InvalidArgument, message), "{case}");
        assert_nothing_left(&daemon, &mut client, case).await;
    }
    // A header listing that is not ComfyUI's, or that names a layout not read.
    let listings = [
        (
            "not JSON",
            "{",
            "header metadata '_quantization_metadata' is not a ComfyUI layer listing \
             ({\"layers\": {name: {\"format\": ...}}}): EOF while parsing an object at line 1 \
             column 1",
        ),
        (
            "an nvfp4 layer",
            r#"{"layers": {"l": {"format": "nvfp4"}}}"#,
            "layer 'l' is 'nvfp4' in '_quantization_metadata': of ComfyUI's mixed-precision \
             layouts only float8_e4m3fn (one fp32 scale per weight) is read",
        ),
    ];
    for (i, (case, listing, message)) in listings.into_iter().enumerate() {
        let metadata = [("_quantization_metadata".to_string(), listing.to_string())];
        let name = format!("listed{i}.safetensors");
        let tensors = [w(), scale("l.weight_scale", Dtype::F32, &[], &[1.0])];
        let path = write_model_with(dir.path(), &name, &tensors, Some(metadata.into()));
        let err = client
            .load_model(std::slice::from_ref(&path), &name, Q::None, |_| {})
            .await
            .unwrap_err();
        let want = (
            Code::InvalidArgument,
            format!("{}: {message}", path.display()),
        );
        assert_eq!(rejected(err), want, "{case}");
        assert_nothing_left(&daemon, &mut client, case).await;
    }
    // Asking to quantize a pre-quantized file, or for a read-only format, is refused too.
    let path = write_model(dir.path(), "good.safetensors", &musubi());
    let err = client
        .load_model(std::slice::from_ref(&path), "", Q::Fp8E4m3Block64, |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        rejected(err),
        (
            Code::InvalidArgument,
            "tensor 'blocks.0.out.scale_weight': the file is pre-quantized (fp8_scaled_musubi): \
             load it with quantization none"
                .to_string()
        )
    );
    let err = client
        .load_model(std::slice::from_ref(&path), "", Q::Fp8ScaledMusubi, |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        rejected(err),
        (
            Code::InvalidArgument,
            "quantization: fp8_scaled_musubi is read from pre-quantized files as they are: load \
             such a file with QUANTIZATION_NONE"
                .to_string()
        )
    );
    assert_nothing_left(&daemon, &mut client, "quantize a pre-quantized file").await;
    // An upload cannot declare them either: they are read from files only.
    let t = fp8("w", &[2, 16], 1);
    let upload = weightstream_client::TensorData {
        quantization: Q::Fp8ScaledComfy,
        ..t.as_upload()
    };
    let err = client.upload_model("bad", &[upload]).await.unwrap_err();
    assert_eq!(
        rejected(err),
        (
            Code::InvalidArgument,
            "tensors[0].quantization: fp8_scaled_comfy is read from pre-quantized files as they \
             are: load such a file with QUANTIZATION_NONE"
                .to_string()
        )
    );
    assert_nothing_left(&daemon, &mut client, "upload declaring a read-only format").await;
    assert_eq!(daemon.uploads(), 0);
    load(&mut client, &path).await;
}
