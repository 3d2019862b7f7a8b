//! The validation of requests, case by case.

use super::*;
use crate::store::formats::FormatLabel;

fn tensor(name: &str, dtype: pb::Dtype, shape: &[u64], nbytes: u64) -> pb::TensorInfo {
    pb::TensorInfo {
        name: name.into(),
        dtype: dtype as i32,
        shape: shape.to_vec(),
        nbytes,
        ..Default::default()
    }
}

/// A U8 tensor of 6 bytes labelled `format`, standing for `weights` weights.
fn labelled(name: &str, format: &str, weights: u64) -> pb::TensorInfo {
    pb::TensorInfo {
        format: format.into(),
        weights,
        ..tensor(name, pb::Dtype::U8, &[6], 0)
    }
}

#[test]
fn each_bad_upload_names_its_field_and_limit() {
    let v = Validation::new(&Limits::default());
    let upload = |tensors: Vec<pb::TensorInfo>| {
        v.begin_upload(pb::BeginUploadRequest {
            name: String::new(),
            tensors,
            ..Default::default()
        })
        .map_err(|e| e.to_string())
    };
    let f32 = pb::Dtype::F32;
    let cases: Vec<(Vec<pb::TensorInfo>, &str)> = vec![
        (vec![], "tensors: 0 entries, at least 1 required"),
        (vec![tensor("", f32, &[1], 0)], "tensors[0].name: required"),
        (
            vec![tensor("a", f32, &[1], 0), tensor("a", f32, &[1], 0)],
            "tensors[1].name: 'a' is declared twice",
        ),
        (
            vec![pb::TensorInfo {
                dtype: 999,
                ..tensor("a", f32, &[1], 0)
            }],
            "tensors[0].dtype: 999 is not a known dtype",
        ),
        (
            vec![tensor("a", f32, &[1; 17], 0)],
            "tensors[0].shape: 17 dimensions, the limit is 16",
        ),
        (
            vec![tensor("a", f32, &[u64::MAX, 2], 0)],
            "tensors[0].shape: [18446744073709551615, 2] overflows",
        ),
        (
            vec![tensor("a", f32, &[2, 3], 4)],
            "tensors[0].nbytes: 4 disagrees with shape [2, 3] of F32 (24 bytes)",
        ),
        (
            vec![pb::TensorInfo {
                coding: pb::Coding::Rans8 as i32,
                ..tensor("a", f32, &[1], 0)
            }],
            "tensors[0].coding: set by the daemon, 0 in BeginUpload: ask for coding in \
             CommitUpload (CommitUploadRequest.coding)",
        ),
        (
            vec![pb::TensorInfo {
                stored_nbytes: 4,
                ..tensor("a", f32, &[1], 0)
            }],
            "tensors[0].stored_nbytes: set by the daemon, 0 in BeginUpload: ask for coding \
             in CommitUpload (CommitUploadRequest.coding)",
        ),
        (
            vec![labelled("a", &"x".repeat(65), 6)],
            "tensors[0].format: 65 bytes, the limit is 64",
        ),
        (
            vec![tensor("a", f32, &[2, 3], 0), labelled("b", "aitk/uint4", 6)],
            "tensors[1].format: byte 4 is '/': a format label is ASCII letters, digits, '.', \
             '_' and '-'",
        ),
        (
            vec![
                labelled("a", "aitk.uint4", 0),
                labelled("b", "aitk.uint4", 0),
            ],
            "tensors[0].format: no tensor labelled 'aitk.uint4' counts its weights: set \
             weights (a layer's out x in) on one tensor of each layer",
        ),
    ];
    let failed: Vec<String> = cases
        .iter()
        .filter_map(|(tensors, want)| {
            let got = upload(tensors.clone());
            (got.as_ref().err().map(String::as_str) != Some(*want))
                .then(|| format!("want {want:?}, got {got:?}"))
        })
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
fn each_bad_state_region_names_its_field_and_limit() {
    let limits = Limits {
        max_state_region_bytes: 8192,
        ..Limits::default()
    };
    let v = Validation::new(&limits);
    let alloc = |session_id: &str, bytes: u64, label: String| {
        v.alloc_state_region(pb::AllocStateRegionRequest {
            session_id: session_id.into(),
            bytes,
            label,
        })
        .map_err(|e| e.to_string())
    };
    assert_eq!(
        alloc("s-1", 0, String::new()),
        Err("bytes: must be more than 0".into())
    );
    assert_eq!(
        alloc("s-1", 8193, String::new()),
        Err("bytes: 8193 is more than limits.max_state_region_bytes = 8192".into())
    );
    assert_eq!(
        alloc("", 1, String::new()),
        Err("session_id: required".into())
    );
    assert_eq!(
        alloc("s-1", 1, "x".repeat(1025)),
        Err("label: 1025 bytes, the limit is 1024".into())
    );
    assert_eq!(
        alloc("s-1", 8192, "adam".into()),
        Ok(ValidAllocStateRegion {
            session_id: "s-1".into(),
            bytes: NonZeroU64::new(8192).unwrap(),
            label: "adam".into(),
        })
    );
    let free = v.free_state_region(pb::FreeStateRegionRequest {
        session_id: "s-1".into(),
        region_id: String::new(),
    });
    assert_eq!(
        free.map_err(|e| e.to_string()),
        Err("region_id: required".into())
    );
}

#[test]
fn an_abort_names_its_upload_id_and_limit() {
    let v = Validation::new(&Limits::default());
    let abort = |upload_id: String| {
        v.abort_upload(pb::AbortUploadRequest { upload_id })
            .map_err(|e| e.to_string())
    };
    assert_eq!(abort(String::new()), Err("upload_id: required".into()));
    assert_eq!(
        abort("u".repeat(257)),
        Err("upload_id: 257 bytes, the limit is 256".into())
    );
    assert_eq!(
        abort("up-1".into()),
        Ok(ValidAbortUpload {
            upload_id: "up-1".into()
        })
    );
}

#[test]
fn a_valid_upload_carries_the_computed_sizes() {
    let v = Validation::new(&Limits::default());
    let valid = v
        .begin_upload(pb::BeginUploadRequest {
            name: "m".into(),
            tensors: vec![tensor("w", pb::Dtype::Bf16, &[4, 8], 0)],
            client_reserves: false,
        })
        .unwrap();
    assert_eq!(
        valid.tensors,
        vec![TensorDecl::plain("w", DType::BF16, vec![4, 8], 64)]
    );
    assert_eq!(valid.pages, UploadPages::Reserved);
    let packed = v
        .begin_upload(pb::BeginUploadRequest {
            name: "m".into(),
            tensors: vec![
                labelled("q", "aitk.uint4", 12),
                labelled("s", "aitk.uint4", 0),
            ],
            client_reserves: false,
        })
        .unwrap();
    let label = |weights| {
        Some(FormatLabel {
            name: "aitk.uint4".into(),
            weights,
        })
    };
    let labels: Vec<_> = packed.tensors.iter().map(|t| t.label.clone()).collect();
    assert_eq!(labels, [label(12), label(0)]);
    let by_client = v.begin_upload(pb::BeginUploadRequest {
        name: "m".into(),
        tensors: vec![tensor("w", pb::Dtype::Bf16, &[4, 8], 0)],
        client_reserves: true,
    });
    assert_eq!(by_client.unwrap().pages, UploadPages::ByUploader);
}

/// LoadModel's `tensors`: each name once, not empty, at most the tensor limit; a set, so the
/// same names in another order are the same selection, and none is every tensor.
#[test]
fn a_load_selection_is_a_set_of_names_within_the_limits() {
    let limits = Limits {
        max_tensors_per_model: 3,
        ..Limits::default()
    };
    let v = Validation::new(&limits);
    let load = |tensors: &[&str]| {
        v.load_model(pb::LoadModelRequest {
            paths: vec!["/m/a.safetensors".into()],
            fd_token: "0".repeat(handoff::SECRET_LEN),
            tensors: tensors.iter().map(|t| t.to_string()).collect(),
            ..Default::default()
        })
        .map(|l| l.tensors)
        .map_err(|e| e.to_string())
    };
    let cases: Vec<(&[&str], &str)> = vec![
        (&["a", "b", "a"], "tensors[2]: 'a' is declared twice"),
        (&["a", ""], "tensors[1]: required"),
        (&["a", "b\0"], "tensors[1]: contains a NUL byte"),
        (&["a", "b", "c", "d"], "tensors: 4 entries, the limit is 3"),
    ];
    let failed: Vec<String> = cases
        .iter()
        .filter_map(|(tensors, want)| {
            let got = load(tensors);
            (got.as_ref().err().map(String::as_str) != Some(*want))
                .then(|| format!("want {want:?}, got {got:?}"))
        })
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert_eq!(load(&[]), Ok(Selection::All));
    let ab = Selection::Only(["a".to_string(), "b".to_string()].into());
    assert_eq!(load(&["b", "a"]), Ok(ab.clone()));
    assert_eq!(load(&["a", "b"]), Ok(ab));
}

/// A coding is CODING_NONE or CODING_RANS8, in a load and in a commit; another value is named.
#[test]
fn a_coding_is_one_the_daemon_knows() {
    let v = Validation::new(&Limits::default());
    let load = |coding: i32| {
        v.load_model(pb::LoadModelRequest {
            paths: vec!["/m/a.safetensors".into()],
            fd_token: "0".repeat(handoff::SECRET_LEN),
            coding,
            ..Default::default()
        })
        .map(|l| l.coding)
        .map_err(|e| e.to_string())
    };
    let commit = |coding: i32| {
        v.commit_upload(pb::CommitUploadRequest {
            upload_id: "up-1".into(),
            coding,
            ..Default::default()
        })
        .map(|c| c.coding)
        .map_err(|e| e.to_string())
    };
    let unknown = "coding: 2 is not a known coding (CODING_NONE = 0, CODING_RANS8 = 1)";
    assert_eq!(load(2), Err(unknown.into()));
    assert_eq!(commit(2), Err(unknown.into()));
    assert_eq!(load(1), Ok(Coding::Rans8));
    assert_eq!(commit(0), Ok(Coding::None));
}
