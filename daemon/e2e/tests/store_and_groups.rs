//! The host store end to end: loading files (single, sharded, directory), uploads, dedup and
//! reference counts, and the bytes every group of a session carries.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use weightstream_client::proto;

/// Splits a model in two shards plus a `*.safetensors.index.json` in `dir`; returns the paths
/// of the shards and of the index.
fn write_sharded(
    dir: &std::path::Path,
    tensors: &[Tensor],
    split: usize,
) -> (Vec<PathBuf>, PathBuf) {
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let shards = vec![
        write_model(dir, names[0], &tensors[..split]),
        write_model(dir, names[1], &tensors[split..]),
    ];
    let weight_map: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let shard = names[usize::from(i >= split)];
            (t.name.clone(), serde_json::Value::from(shard))
        })
        .collect();
    let total: usize = tensors.iter().map(|t| t.bytes.len()).sum();
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
    (shards, index_path)
}

/// Acquires every group of a fresh session on the model (one group per tensor) and checks
/// each against `expected`.
async fn acquire_all(
    client: &mut weightstream_client::Client,
    manifest: &proto::ModelManifest,
    expected: &BTreeMap<String, Tensor>,
) {
    let groups = per_tensor_groups(manifest);
    let order: Vec<u32> = (0..groups.len() as u32).collect();
    let session = client
        .open_session(options(&manifest.model_id, groups, 0, 1 << 20))
        .await
        .expect("open session");
    assert_eq!(
        run_step(&session, &order, expected).await,
        model_bytes(expected)
    );
    session.close().await.expect("close session");
}

/// Every tensor of a multi-dtype model comes back with the file's bytes, through one group per
/// tensor (staged only, with evictions) and through multi-tensor groups, both staged and
/// resident.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_group_carries_the_files_bytes() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let written = mixed_model(1);
    let path = write_model(dir.path(), "mixed.safetensors", &written);
    let expected = read_model(std::slice::from_ref(&path));
    // What the safetensors crate reads back is what was written.
    let by_name: BTreeMap<String, Tensor> =
        written.into_iter().map(|t| (t.name.clone(), t)).collect();
    assert_eq!(expected, by_name);

    let mut client = daemon.client().await;
    let info = client.info().await.unwrap();
    assert_eq!(info.backend, proto::Backend::Host as i32);
    assert_eq!(info.alignment, 256);
    let manifest = load(&mut client, std::slice::from_ref(&path), &expected).await;
    assert_eq!(manifest.name, "mixed");
    assert_eq!(manifest.source, "file");
    assert_eq!((manifest.refcount, manifest.sessions), (1, 0));

    // One group per tensor, an arena of three of the largest group and no resident bytes: every
    // group is copied in, most of them over evicted ones.
    let groups = per_tensor_groups(&manifest);
    let count = groups.len() as u32;
    let largest = manifest
        .tensors
        .iter()
        .map(|t| t.nbytes.div_ceil(256) * 256)
        .max()
        .unwrap();
    let session = client
        .open_session(options(
            &manifest.model_id,
            groups,
            3 * largest,
            3 * largest,
        ))
        .await
        .unwrap();
    let layout = session.layout().clone();
    assert_eq!(layout.regions.len(), 1, "staging only");
    assert_eq!(
        (layout.staging_bytes, layout.resident_bytes),
        (3 * largest, 0)
    );
    assert_eq!(layout.groups.len(), manifest.tensors.len());
    for (g, t) in layout.groups.iter().zip(&manifest.tensors) {
        assert!(!g.resident, "{}", g.name);
        assert_eq!(g.name, t.name);
        assert_eq!(g.tensors.len(), 1);
        assert_eq!(g.tensors[0].offset, 0);
    }
    let order: Vec<u32> = (0..count).collect();
    for _ in 0..2 {
        assert_eq!(
            run_step(&session, &order, &expected).await,
            model_bytes(&expected)
        );
        session.end_step();
    }
    let reverse: Vec<u32> = (0..count).rev().collect();
    assert_eq!(
        run_step(&session, &reverse, &expected).await,
        model_bytes(&expected)
    );
    let st = stats(&mut client, session.id()).await;
    assert_eq!(st.acquires, 3 * u64::from(count));
    assert_eq!(st.resident_hits, 0);
    session.close().await.unwrap();

    // Multi-tensor groups.
    let multi = vec![
        group("embed", &["embed.weight", "logit_scale", "attention_mask"]),
        group(
            "attn",
            &[
                "layers.0.attn.q.weight",
                "layers.0.empty",
                "layers.0.attn.q.bias",
            ],
        ),
        group(
            "mlp",
            &[
                "layers.0.mlp.experts",
                "layers.0.fp8.weight",
                "layers.0.norm.weight",
            ],
        ),
        group("head", &["lm_head.weight", "position_ids"]),
    ];
    let order: Vec<u32> = (0..multi.len() as u32).collect();
    // A budget far above the model: every group is resident.
    let resident = client
        .open_session(options(&manifest.model_id, multi.clone(), 0, 1 << 20))
        .await
        .unwrap();
    let layout = resident.layout().clone();
    assert_eq!(
        layout.regions.len(),
        1 + multi.len(),
        "staging and a resident region per group"
    );
    for (g, spec) in layout.groups.iter().zip(&multi) {
        assert!(g.resident, "{}", g.name);
        assert_eq!(g.name, spec.name);
        let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, spec.tensors, "tensors keep the declared order");
        for pair in g.tensors.windows(2) {
            assert!(
                pair[0].offset + pair[0].nbytes <= pair[1].offset,
                "{}",
                g.name
            );
        }
        assert_eq!(g.nbytes % 256, 0);
    }
    assert_eq!(
        run_step(&resident, &order, &expected).await,
        model_bytes(&expected)
    );
    let st = stats(&mut client, resident.id()).await;
    assert_eq!((st.acquires, st.resident_hits, st.misses), (4, 4, 0));

    // The same groups with a budget of exactly the largest group: all staged, one at a time.
    let largest_group = layout.groups.iter().map(|g| g.nbytes).max().unwrap();
    let staged = client
        .open_session(options(&manifest.model_id, multi, 0, largest_group))
        .await
        .unwrap();
    assert_eq!(staged.layout().regions.len(), 1);
    assert_eq!(staged.layout().staging_bytes, largest_group);
    assert!(staged.layout().groups.iter().all(|g| !g.resident));
    for _ in 0..2 {
        assert_eq!(
            run_step(&staged, &order, &expected).await,
            model_bytes(&expected)
        );
        staged.end_step();
    }
    let st = stats(&mut client, staged.id()).await;
    assert_eq!((st.acquires, st.resident_hits), (8, 0));
    resident.close().await.unwrap();
    staged.close().await.unwrap();
    daemon_is_clean_after_release(&daemon, &mut client, &manifest.model_id).await;
}

async fn daemon_is_clean_after_release(
    daemon: &TestDaemon,
    client: &mut weightstream_client::Client,
    model_id: &str,
) {
    assert_eq!(client.release_model(model_id).await.unwrap(), 0);
    assert!(model_listed(client, model_id).await.is_none());
    assert_eq!(daemon.shm_total(), 0);
}

/// Loading the same file twice gives one model with two references and one host copy; two
/// releases remove it and its shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_is_idempotent_and_release_frees_the_copy() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "twice.safetensors", &mixed_model(2));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let first = load(&mut client, std::slice::from_ref(&path), &expected).await;
    assert_eq!(first.refcount, 1);
    assert_eq!(daemon.shm_count("model"), 1);
    let mut other = daemon.client().await;
    let second = load(&mut other, std::slice::from_ref(&path), &expected).await;
    assert_eq!(second.model_id, first.model_id);
    assert_eq!(second.refcount, 2);

    let listed = client.list_models().await.unwrap();
    assert_eq!(listed.models.len(), 1);
    assert_eq!(listed.models[0].model_id, first.model_id);
    assert_eq!(listed.models[0].refcount, 2);
    assert_eq!(listed.store_bytes, model_bytes(&expected), "one host copy");
    assert_eq!(daemon.shm_count("model"), 1, "one arena");

    assert_eq!(client.release_model(&first.model_id).await.unwrap(), 1);
    let still = model_listed(&mut client, &first.model_id)
        .await
        .expect("one ref left");
    assert_eq!(still.refcount, 1);
    assert_eq!(daemon.shm_count("model"), 1);
    assert_eq!(other.release_model(&first.model_id).await.unwrap(), 0);
    let listed = client.list_models().await.unwrap();
    assert!(listed.models.is_empty(), "{:?}", listed.models);
    assert_eq!(listed.store_bytes, 0);
    assert_eq!(daemon.shm_total(), 0, "the arena is gone");

    // A third release names a model that is gone: the uid holds no reference to it.
    let err = client.release_model(&first.model_id).await.unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::NotFound), "{err}");
    let uid = rustix::process::getuid().as_raw();
    assert_eq!(
        err.to_string(),
        format!(
            "NotFound: uid {uid} holds no reference to model_id '{}': only a uid that loaded \
             or uploaded it may release it",
            first.model_id
        )
    );
    // Loading it again makes a fresh copy under the same id (the same bytes).
    let again = load(&mut client, &[path], &expected).await;
    assert_eq!(
        (again.model_id.as_str(), again.refcount),
        (first.model_id.as_str(), 1)
    );
    acquire_all(&mut client, &again, &expected).await;
}

/// A sharded index and the directory of its shards load the same model (one id, one copy),
/// with the same tensors, dtypes, shapes and bytes as the single file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_index_and_directory_match_the_single_file() {
    let daemon = start_daemon().await;
    let tensors = mixed_model(3);
    let single_dir = tempfile::tempdir().unwrap();
    let single = write_model(single_dir.path(), "single.safetensors", &tensors);
    let shard_dir = tempfile::tempdir().unwrap();
    let (shards, index) = write_sharded(shard_dir.path(), &tensors, 4);
    let expected = read_model(std::slice::from_ref(&single));
    assert_eq!(
        read_model(&shards),
        expected,
        "the shards hold the same tensors"
    );

    let mut client = daemon.client().await;
    let from_single = load(&mut client, &[single], &expected).await;
    let from_index = load(&mut client, &[index], &expected).await;
    let from_dir = load(&mut client, &[shard_dir.path().to_path_buf()], &expected).await;
    assert_ne!(from_index.model_id, from_single.model_id);
    assert_eq!(
        from_dir.model_id, from_index.model_id,
        "same files, same model"
    );
    assert_eq!(from_dir.refcount, 2);
    let shard_dir_name = shard_dir.path().file_name().unwrap().to_string_lossy();
    assert_eq!(
        from_dir.name, shard_dir_name,
        "a multi-file model is named after its directory"
    );

    let listed = client.list_models().await.unwrap();
    assert_eq!(listed.models.len(), 2);
    assert_eq!(listed.store_bytes, 2 * model_bytes(&expected));

    for manifest in [&from_single, &from_index] {
        acquire_all(&mut client, manifest, &expected).await;
    }
    // Loading the shards by name is the same model again.
    let by_files = load(&mut client, &shards, &expected).await;
    assert_eq!(by_files.model_id, from_index.model_id);
    assert_eq!(by_files.refcount, 3);
}

/// An upload comes back byte for byte; an identical upload is deduplicated into the same model
/// and costs no second copy, while a one-byte change makes a new model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_round_trips_and_dedupes() {
    let daemon = start_daemon().await;
    let tensors = mixed_model(4);
    let expected: BTreeMap<String, Tensor> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    let data: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();

    let mut client = daemon.client().await;
    let (manifest, dedup) = client.upload_model("uploaded", &data).await.unwrap();
    assert!(!dedup);
    check_manifest(&manifest, &expected);
    assert_eq!(manifest.name, "uploaded");
    assert_eq!(manifest.source, "upload");
    assert_eq!(manifest.refcount, 1);
    acquire_all(&mut client, &manifest, &expected).await;

    let mut other = daemon.client().await;
    let (again, dedup) = other.upload_model("another name", &data).await.unwrap();
    assert!(dedup, "identical content is deduplicated");
    assert_eq!(again.model_id, manifest.model_id);
    assert_eq!(again.refcount, 2);
    assert_eq!(
        again.name, "uploaded",
        "the stored model keeps its first name"
    );
    let listed = client.list_models().await.unwrap();
    assert_eq!(listed.models.len(), 1);
    assert_eq!(listed.store_bytes, model_bytes(&expected), "one host copy");
    assert_eq!(
        (daemon.shm_count("upload"), daemon.shm_count("model")),
        (1, 0),
        "one arena: the first upload's region, sealed"
    );
    assert_eq!(daemon.uploads(), 0, "no upload in progress");
    acquire_all(&mut other, &again, &expected).await;

    // One byte different: a different model.
    let mut changed = tensors.clone();
    changed[3].bytes[5] ^= 0x40;
    let changed_expected: BTreeMap<String, Tensor> = changed
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    let data: Vec<_> = changed.iter().map(Tensor::as_upload).collect();
    let (third, dedup) = client.upload_model("uploaded", &data).await.unwrap();
    assert!(!dedup);
    assert_ne!(third.model_id, manifest.model_id);
    acquire_all(&mut client, &third, &changed_expected).await;
    let listed = client.list_models().await.unwrap();
    assert_eq!(listed.store_bytes, 2 * model_bytes(&expected));
    assert_eq!(daemon.shm_count("upload"), 2);

    assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 1);
    assert_eq!(client.release_model(&manifest.model_id).await.unwrap(), 0);
    assert_eq!(client.release_model(&third.model_id).await.unwrap(), 0);
    assert_eq!(daemon.shm_total(), 0);
}

/// LoadModel streams progress that ends with the whole model done, for a fresh load and for a
/// load the store already holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_progress() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let tensors = mixed_model(5);
    let (shards, _) = write_sharded(dir.path(), &tensors, 6);
    let expected = read_model(&shards);
    let total = model_bytes(&expected);
    let mut client = daemon.client().await;
    for (attempt, refcount) in [("fresh", 1), ("already loaded", 2)] {
        let mut events: Vec<proto::LoadProgress> = Vec::new();
        let manifest = client
            .load_model(
                &[dir.path().to_path_buf()],
                "sharded",
                weightstream_client::proto::Quantization::None,
                |p| events.push(p.clone()),
            )
            .await
            .unwrap();
        check_manifest(&manifest, &expected);
        assert_eq!(manifest.refcount, refcount);
        assert_eq!(manifest.name, "sharded");
        let last = events
            .last()
            .unwrap_or_else(|| panic!("{attempt}: no progress event"));
        assert_eq!(
            (last.bytes_done, last.bytes_total),
            (total, total),
            "{attempt}"
        );
        // The copy reports the file it reads (the daemon may add phases after the copy).
        let last_shard = shards[1].display().to_string();
        assert!(
            events
                .iter()
                .any(|e| e.current_file == last_shard && e.bytes_done == total),
            "{attempt}: {events:?}"
        );
        let mut done = 0;
        for e in &events {
            assert_eq!(e.bytes_total, total, "{attempt}: {events:?}");
            assert!(
                e.bytes_done >= done && e.bytes_done <= total,
                "{attempt}: {events:?}"
            );
            done = e.bytes_done;
        }
    }
}
