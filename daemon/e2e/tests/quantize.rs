//! `store::quantize` against torch, byte for byte: `tests/data/fp8_vectors.safetensors` holds
//! inputs and torch's outputs (written by `tests/python/client/gen_fp8_vectors.py`), of
//! fp8_e4m3_block64 and of the row formats (fp8_e4m3_row, int8_row: 8-bit compute's per-row
//! quantization). Then the errors, word for word, and an ignored throughput bench:
//!
//! ```text
//! cargo test --release -p weightstream-e2e --test quantize -- --ignored --nocapture
//! ```

use std::num::NonZeroUsize;
use std::time::Instant;

use safetensors::{Dtype, SafeTensors};
use weightstream_daemon::store::quantize::{
    QuantizeError, Target, TensorIn, TensorOut, f32_to_e4m3fn, quantize, quantize_all,
    quantize_all_into, quantize_as,
};
use weightstream_daemon::store::safetensors::DType;

const FIXTURE: &[u8] = include_bytes!("data/fp8_vectors.safetensors");

fn dtype(d: Dtype) -> DType {
    match d {
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        other => panic!("the fixture has no {other:?} inputs"),
    }
}

/// Where two byte strings of `width`-byte elements differ: count, and the first element.
fn diff(got: &[u8], want: &[u8], width: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} bytes != {} bytes", got.len(), want.len()));
    }
    let bad: Vec<usize> = (0..got.len() / width)
        .filter(|&i| got[i * width..(i + 1) * width] != want[i * width..(i + 1) * width])
        .collect();
    let &first = bad.first()?;
    let (g, w) = (
        &got[first * width..(first + 1) * width],
        &want[first * width..(first + 1) * width],
    );
    Some(format!(
        "{} of {} differ, first at {first}: {g:02x?} != {w:02x?}",
        bad.len(),
        got.len() / width
    ))
}

#[test]
fn quantization_equals_torch_byte_for_byte_on_every_case() {
    let st = SafeTensors::deserialize(FIXTURE).expect("the fixture parses");
    let mut cases: Vec<&str> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_suffix(".w"))
        .collect();
    cases.sort_unstable();
    assert!(
        cases.len() >= 30,
        "only {} cases in the fixture",
        cases.len()
    );
    let mut failures = Vec::new();
    for case in &cases {
        let w = st.tensor(&format!("{case}.w")).unwrap();
        let q = st.tensor(&format!("{case}.q")).unwrap();
        let s = st.tensor(&format!("{case}.scale")).unwrap();
        let shape: Vec<u64> = w.shape().iter().map(|&d| d as u64).collect();
        let got = match quantize(case, dtype(w.dtype()), &shape, w.data()) {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{case}: {e}"));
                continue;
            }
        };
        let scale_shape: Vec<u64> = s.shape().iter().map(|&d| d as u64).collect();
        if got.scale_shape[..] != scale_shape[..] {
            failures.push(format!(
                "{case}: scale shape {:?} != {scale_shape:?}",
                got.scale_shape
            ));
        }
        if let Some(d) = diff(&got.scales, s.data(), 4) {
            failures.push(format!("{case}: scales: {d}"));
        }
        if let Some(d) = diff(&got.data, q.data(), 1) {
            failures.push(format!("{case}: q: {d}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from torch:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn row_quantizations_equal_compute8_byte_for_byte_on_every_case() {
    let st = SafeTensors::deserialize(FIXTURE).expect("the fixture parses");
    let mut cases: Vec<&str> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_suffix(".rw"))
        .collect();
    cases.sort_unstable();
    assert!(cases.len() >= 30, "only {} row cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let w = st.tensor(&format!("{case}.rw")).unwrap();
        let shape: Vec<u64> = w.shape().iter().map(|&d| d as u64).collect();
        for (target, suffix) in [(Target::Fp8Row, "fp8_row"), (Target::Int8Row, "int8_row")] {
            let q = st.tensor(&format!("{case}.{suffix}")).unwrap();
            let s = st.tensor(&format!("{case}.{suffix}_scale")).unwrap();
            let got = match quantize_as(target, case, dtype(w.dtype()), &shape, w.data()) {
                Ok(got) => got,
                Err(e) => {
                    failures.push(format!("{case} {suffix}: {e}"));
                    continue;
                }
            };
            let scale_shape: Vec<u64> = s.shape().iter().map(|&d| d as u64).collect();
            if got.scale_shape[..] != scale_shape[..] || scale_shape != [shape[0], 1] {
                failures.push(format!(
                    "{case} {suffix}: scale shape {:?} != {scale_shape:?}",
                    got.scale_shape
                ));
            }
            if let Some(d) = diff(&got.scales, s.data(), 4) {
                failures.push(format!("{case} {suffix}: scales: {d}"));
            }
            if let Some(d) = diff(&got.data, q.data(), 1) {
                failures.push(format!("{case} {suffix}: q: {d}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} differ from torch:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn row_formats_refuse_what_block64_refuses_naming_the_tensor() {
    let nan = bf16_bytes(&with(100, 42, f32::NAN));
    let inf = f32_bytes(&with(128, 127, f32::NEG_INFINITY));
    let norm = bf16_bytes(&[1.0; 64]);
    for target in [Target::Fp8Row, Target::Int8Row] {
        let name = target.name();
        let e = quantize_as(target, "a.weight", DType::BF16, &[2, 50], &nan).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor 'a.weight': NaN at index 42: cannot quantize"
        );
        let e = quantize_as(target, "b", DType::F32, &[1, 128], &inf).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor 'b': -inf at index 127: cannot quantize"
        );
        let e = quantize_as(target, "norm.weight", DType::BF16, &[64], &norm).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("tensor 'norm.weight' has rank 1: {name} quantizes only rank ≥ 2 weights")
        );
        let e = quantize_as(target, "ids", DType::I64, &[2, 2], &[0; 32]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor 'ids' has dtype I64: only BF16, F16 and F32 can be quantized"
        );
    }
}

#[test]
fn all_cases_at_once_on_several_threads_equal_one_by_one() {
    let st = SafeTensors::deserialize(FIXTURE).unwrap();
    let views: Vec<(String, Vec<u64>, safetensors::tensor::TensorView<'_>)> = st
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".w"))
        .map(|n| {
            let v = st.tensor(n).unwrap();
            let shape = v.shape().iter().map(|&d| d as u64).collect();
            (n.to_owned(), shape, v)
        })
        .collect();
    let tensors: Vec<TensorIn<'_>> = views
        .iter()
        .map(|(name, shape, v)| TensorIn {
            target: Target::Fp8Block64,
            name,
            dtype: dtype(v.dtype()),
            shape,
            bytes: v.data(),
        })
        .collect();
    let together = quantize_all(&tensors, NonZeroUsize::new(3).unwrap()).unwrap();
    for (t, got) in tensors.iter().zip(&together) {
        let alone = quantize(t.name, t.dtype, t.shape, t.bytes).unwrap();
        assert_eq!(&alone, got, "{}", t.name);
    }
}

#[test]
fn bare_conversion_equals_torch_including_past_448_and_nan() {
    let st = SafeTensors::deserialize(FIXTURE).unwrap();
    let x = st.tensor("convert.x").unwrap();
    let q = st.tensor("convert.q").unwrap();
    let bad: Vec<String> = x
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .zip(q.data())
        .filter(|&(x, &want)| f32_to_e4m3fn(x) != want)
        .map(|(x, want)| format!("{x:e}: {:#04x} != torch {want:#04x}", f32_to_e4m3fn(x)))
        .collect();
    assert!(q.data().len() > 1000);
    assert!(bad.is_empty(), "{} differ:\n{}", bad.len(), bad.join("\n"));
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    // Truncation is exact for the values used here.
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn with(len: usize, at: usize, value: f32) -> Vec<f32> {
    let mut v: Vec<f32> = (0..len).map(|i| i as f32 / 8.0).collect();
    v[at] = value;
    v
}

#[test]
fn errors_name_the_tensor_and_the_rule() {
    let nan17 = bf16_bytes(&with(128, 17, f32::NAN));
    let inf = f32_bytes(&with(100, 99, f32::INFINITY));
    let neg_inf = f32_bytes(&with(128, 70, f32::NEG_INFINITY));
    let mut h = vec![0x3C00u16; 64]; // 1.0 in f16
    h[40] = 0x7E00; // NaN
    let f16_nan = f16_bytes(&h);
    let norm = bf16_bytes(&[1.0; 64]);
    let ids = vec![0u8; 8 * 4];
    let fp8 = vec![0u8; 64];
    // (tensor, dtype, shape, bytes, message)
    type Case<'a> = (&'a str, DType, &'a [u64], &'a [u8], &'a str);
    let cases: [Case<'_>; 9] = [
        (
            "blocks.0.w",
            DType::BF16,
            &[2, 64],
            &nan17,
            "tensor 'blocks.0.w': NaN at index 17: cannot quantize",
        ),
        (
            "proj",
            DType::F32,
            &[1, 100],
            &inf,
            "tensor 'proj': +inf at index 99: cannot quantize",
        ),
        (
            "proj",
            DType::F32,
            &[2, 64],
            &neg_inf,
            "tensor 'proj': -inf at index 70: cannot quantize",
        ),
        (
            "half",
            DType::F16,
            &[1, 64],
            &f16_nan,
            "tensor 'half': NaN at index 40: cannot quantize",
        ),
        (
            "norm.weight",
            DType::BF16,
            &[64],
            &norm,
            "tensor 'norm.weight' has rank 1: fp8_e4m3_block64 quantizes only rank ≥ 2 weights",
        ),
        (
            "scalar",
            DType::F32,
            &[],
            &[0; 4],
            "tensor 'scalar' has rank 0: fp8_e4m3_block64 quantizes only rank ≥ 2 weights",
        ),
        (
            "ids",
            DType::I64,
            &[2, 2],
            &ids,
            "tensor 'ids' has dtype I64: only BF16, F16 and F32 can be quantized",
        ),
        (
            "w8",
            DType::F8E4M3,
            &[1, 64],
            &fp8,
            "tensor 'w8' has dtype F8_E4M3: only BF16, F16 and F32 can be quantized",
        ),
        (
            "short",
            DType::BF16,
            &[2, 64],
            &norm,
            "tensor 'short' has 128 bytes, but BF16 of shape [2, 64] needs 256",
        ),
    ];
    let bad: Vec<String> = cases
        .iter()
        .filter_map(|&(name, dtype, shape, bytes, want)| {
            let got = match quantize(name, dtype, shape, bytes) {
                Ok(_) => "Ok".to_owned(),
                Err(e) => e.to_string(),
            };
            (got != want).then(|| format!("{name}:\n  got  {got}\n  want {want}"))
        })
        .collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_first_non_finite_in_input_order_is_reported_whatever_the_threads() {
    // Tensor "a" is large (several jobs) with NaNs far apart; "b" has one early; "c" is fine.
    let rows = 8192;
    let mut a: Vec<f32> = (0..rows * 128).map(|i| (i % 97) as f32).collect();
    a[rows * 128 - 5] = f32::NAN;
    a[600_000] = f32::NEG_INFINITY;
    let b = with(128, 3, f32::NAN);
    let c = with(128, 0, 1.0);
    let (a, b, c) = (f32_bytes(&a), f32_bytes(&b), f32_bytes(&c));
    let a_shape = [rows as u64, 128];
    let t = |name, shape, bytes| TensorIn {
        target: Target::Fp8Block64,
        name,
        dtype: DType::F32,
        shape,
        bytes,
    };
    for threads in [1, 2, 5] {
        let threads = NonZeroUsize::new(threads).unwrap();
        let tensors = [
            t("c", &[1, 128], &c),
            t("a", &a_shape, &a),
            t("b", &[1, 128], &b),
        ];
        let e = quantize_all(&tensors, threads).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor 'a': -inf at index 600000: cannot quantize",
            "{threads} threads"
        );
    }
}

#[test]
fn outputs_of_the_wrong_size_are_refused() {
    let w = bf16_bytes(&[1.0; 128]);
    let (mut data, mut scales) = (vec![0u8; 128], vec![0u8; 4]);
    let work = vec![(
        TensorIn {
            target: Target::Fp8Block64,
            name: "w",
            dtype: DType::BF16,
            shape: &[1, 128],
            bytes: &w,
        },
        TensorOut {
            data: &mut data,
            scales: &mut scales,
        },
    )];
    let e = quantize_all_into(work, NonZeroUsize::MIN).unwrap_err();
    assert_eq!(
        e,
        QuantizeError::OutputSize {
            name: "w".into(),
            what: "scales",
            expected: 8,
            actual: 4
        }
    );
}

/// Throughput on bf16 weights shaped like a diffusion transformer's, one thread and all.
#[test]
#[ignore = "a benchmark: run in release with --ignored --nocapture"]
fn bench_bf16_throughput() {
    let shapes: Vec<[u64; 2]> = (0..12)
        .map(|_| [3072, 3072])
        .chain((0..4).map(|_| [12288, 3072]))
        .chain([[3072, 3000]])
        .collect();
    let mut x = 0x9E37_79B9u32;
    let bytes: Vec<Vec<u8>> = shapes
        .iter()
        .map(|s| {
            (0..s[0] * s[1])
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    // A bf16 of sign, exponent around 2^-6 and random mantissa.
                    (((x & 0x807F) | 0x3C00) as u16).to_le_bytes()
                })
                .collect()
        })
        .collect();
    let tensors: Vec<TensorIn<'_>> = shapes
        .iter()
        .zip(&bytes)
        .map(|(s, b)| TensorIn {
            target: Target::Fp8Block64,
            name: "w",
            dtype: DType::BF16,
            shape: s,
            bytes: b,
        })
        .collect();
    let total: usize = bytes.iter().map(Vec::len).sum();
    let gb = total as f64 / 1e9;
    let cores = std::thread::available_parallelism().unwrap();
    // Fresh outputs (page faults included, as a load into a new arena has them), then outputs
    // reused (the arithmetic alone).
    let mut reused: Vec<(Vec<u8>, Vec<u8>)> = quantize_all(&tensors, cores)
        .unwrap()
        .into_iter()
        .map(|q| (q.data, q.scales))
        .collect();
    let mut counts: Vec<usize> = (0..)
        .map(|k| 1 << k)
        .take_while(|&n| n < cores.get())
        .collect();
    counts.push(cores.get());
    for threads in counts.into_iter().filter_map(NonZeroUsize::new) {
        for fresh in [true, false] {
            let (mut wall, mut cpu) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..5 {
                let (t, c) = (Instant::now(), cpu_seconds());
                if fresh {
                    drop(quantize_all(&tensors, threads).unwrap());
                } else {
                    let work = tensors
                        .iter()
                        .zip(&mut reused)
                        .map(|(t, (data, scales))| (*t, TensorOut { data, scales }))
                        .collect();
                    quantize_all_into(work, threads).unwrap();
                }
                wall = wall.min(t.elapsed().as_secs_f64());
                cpu = cpu.min(cpu_seconds() - c);
            }
            println!(
                "quantize bf16, {gb:.2} GB, {} outputs, {threads} threads: {:.2} GB/s \
                 ({wall:.3} s); {:.2} GB per CPU-second ({cpu:.2} s: what a busy machine \
                 does not change)",
                if fresh { "fresh" } else { "reused" },
                gb / wall,
                gb / cpu,
            );
        }
    }
}

/// CPU time of this process (user + system, every thread), from /proc/self/stat, in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the parenthesised command: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0 // USER_HZ: 100 on every Linux ABI this runs on
}
