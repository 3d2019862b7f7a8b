//! Bad input end to end: malformed files, bad paths, bad session requests, bad hot-path
//! messages, oversized messages and bad uploads each get the precise gRPC code (or fault) and
//! a message naming the field and the values, and the daemon keeps serving afterwards.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use safetensors::Dtype;
use tonic::Code;
use weightstream_client::proto::client_message::Msg;
use weightstream_client::{Client, ClientError, TensorData, proto};

/// A safetensors file from a header and a data section of `data_len` zero bytes.
fn raw_file(json: &str, data_len: usize) -> Vec<u8> {
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.resize(bytes.len() + data_len, 0);
    bytes
}

/// A file whose 8-byte length prefix says `header_len`, followed by `rest`.
fn with_prefix(header_len: u64, rest: &[u8]) -> Vec<u8> {
    let mut bytes = header_len.to_le_bytes().to_vec();
    bytes.extend_from_slice(rest);
    bytes
}

fn rejected(err: ClientError) -> (Code, String) {
    match err {
        ClientError::Rejected { code, message } => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

async fn load_error(client: &mut Client, paths: &[PathBuf]) -> (Code, String) {
    match client
        .load_model(
            paths,
            "",
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await
    {
        Ok(m) => panic!("{paths:?} loaded as {}", m.model_id),
        Err(e) => rejected(e),
    }
}

async fn open_error(
    client: &mut Client,
    opts: weightstream_client::SessionOptions,
) -> (Code, String) {
    match client.open_session(opts).await {
        Ok(s) => panic!("session {} opened", s.id()),
        Err(e) => rejected(e),
    }
}

async fn upload_error(client: &mut Client, tensors: &[TensorData<'_>]) -> (Code, String) {
    match client.upload_model("bad", tensors).await {
        Ok((m, _)) => panic!("upload committed as {}", m.model_id),
        Err(e) => rejected(e),
    }
}

/// What a malformed file must be refused with: the exact message, or fragments of a message
/// that quotes the JSON parser.
enum Expect {
    Exact(&'static str),
    Contains(&'static [&'static str]),
}

/// Malformed safetensors files are refused with INVALID_ARGUMENT naming the file and what is
/// wrong with it (the header parser's messages), and leave no shared memory behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_files_are_refused_precisely() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    // A real file, cut 10 bytes short of its data.
    let whole = write_model(
        dir.path(),
        "whole.safetensors",
        &random_tensors(20, &[("w", Dtype::F32, &[4, 4])]),
    );
    let mut truncated = std::fs::read(&whole).unwrap();
    truncated.truncate(truncated.len() - 10);

    let u8_at = |name: &str, begin: u64, end: u64| {
        format!(
            r#""{name}":{{"dtype":"U8","shape":[{}],"data_offsets":[{begin},{end}]}}"#,
            end - begin
        )
    };
    let overlap = format!("{{{},{}}}", u8_at("a", 0, 8), u8_at("b", 4, 12));
    let gap = format!("{{{},{}}}", u8_at("a", 0, 4), u8_at("b", 8, 12));
    let duplicate = format!("{{{},{}}}", u8_at("x", 0, 4), u8_at("x", 4, 8));
    let cases: Vec<(&str, Vec<u8>, Expect)> = vec![
        (
            "truncated",
            truncated,
            Expect::Exact("tensor 'w': data_offsets end 64 is beyond the data section of 54 bytes"),
        ),
        (
            "too_short",
            vec![5, 0, 0],
            Expect::Exact("file is 3 bytes, shorter than the 8-byte header length"),
        ),
        (
            "header_past_end",
            with_prefix(100, b"{}"),
            Expect::Exact("not a safetensors file: the header length is not plausible"),
        ),
        (
            "huge_header",
            with_prefix(u64::MAX, b"{}"),
            Expect::Exact("not a safetensors file: the header length is not plausible"),
        ),
        (
            "private_text",
            b"password=hunter2\nand more of a file that is no model".to_vec(),
            Expect::Exact("not a safetensors file: the header length is not plausible"),
        ),
        (
            "overlap",
            raw_file(&overlap, 12),
            Expect::Exact("tensors 'a' and 'b' overlap: [0, 8] and [4, 12]"),
        ),
        (
            "out_of_range",
            raw_file(
                r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#,
                8,
            ),
            Expect::Exact("tensor 'x': data_offsets end 12 is beyond the data section of 8 bytes"),
        ),
        (
            "reversed",
            raw_file(
                r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}}"#,
                8,
            ),
            Expect::Exact("tensor 'x': data_offsets [8, 4] end before they begin"),
        ),
        (
            "unknown_dtype",
            raw_file(
                r#"{"x":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            ),
            Expect::Exact(
                "tensor 'x': unknown dtype (not one of BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, \
                 U16, F16, BF16, I32, U32, F32, F64, I64, U64)",
            ),
        ),
        (
            "size_mismatch",
            raw_file(
                r#"{"x":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}}"#,
                10,
            ),
            Expect::Exact(
                "tensor 'x': shape [2, 3] of BF16 is 12 bytes but data_offsets span 10 bytes",
            ),
        ),
        (
            "shape_overflow",
            raw_file(
                r#"{"x":{"dtype":"BF16","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#,
                0,
            ),
            Expect::Exact(
                "tensor 'x': shape [4294967296, 4294967296] of BF16 is more than 18446744073709551615 bytes",
            ),
        ),
        (
            "gap",
            raw_file(&gap, 12),
            Expect::Exact(
                "data section bytes [4, 8) after tensor 'a' are not covered by any tensor \
                 (the format requires every byte to belong to a tensor)",
            ),
        ),
        (
            "duplicate",
            raw_file(&duplicate, 8),
            Expect::Exact("duplicate tensor name 'x'"),
        ),
        (
            "not_json",
            raw_file(r#"{"a" 1}"#, 0),
            Expect::Contains(&["invalid header: ", "expected `:`"]),
        ),
        (
            "not_utf8",
            with_prefix(4, &[b'{', 0xff, 0xfe, b'}']),
            Expect::Contains(&["invalid header: not valid UTF-8"]),
        ),
        (
            "not_an_object",
            raw_file("[]", 0),
            Expect::Contains(&["invalid header: ", "invalid type"]),
        ),
        (
            "missing_field",
            raw_file(r#"{"w":{"shape":[1],"data_offsets":[0,1]}}"#, 1),
            Expect::Contains(&["invalid header: ", "tensor 'w': missing field 'dtype'"]),
        ),
    ];

    let mut client = daemon.client().await;
    for (name, bytes, expect) in &cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        let (code, message) = load_error(&mut client, std::slice::from_ref(&path)).await;
        assert_eq!(code, Code::InvalidArgument, "{name}: {message}");
        let prefix = format!("{}: ", path.display());
        assert!(message.starts_with(&prefix), "{name}: {message}");
        match expect {
            Expect::Exact(text) => assert_eq!(&message[prefix.len()..], *text, "{name}"),
            Expect::Contains(parts) => {
                for part in *parts {
                    assert!(message.contains(part), "{name}: {message:?} lacks {part:?}");
                }
            }
        }
    }
    // A tensor in two shards of one model.
    let shards = tempfile::tempdir().unwrap();
    let one = random_tensors(21, &[("a", Dtype::U8, &[4])]);
    let first = write_model(shards.path(), "a.safetensors", &one);
    let second = write_model(shards.path(), "b.safetensors", &one);
    let (code, message) = load_error(&mut client, &[shards.path().to_path_buf()]).await;
    assert_eq!(code, Code::InvalidArgument);
    assert_eq!(
        message,
        format!(
            "tensor 'a' is in both {} and {}",
            first.display(),
            second.display()
        )
    );

    let listed = client.list_models().await.unwrap();
    assert!(listed.models.is_empty());
    assert_eq!(listed.store_bytes, 0);
    assert_eq!(daemon.shm_total(), 0, "no arena is left");
    assert_still_serves(&daemon, 22).await;
}

/// Paths that name no model: relative, missing, not safetensors, an empty directory, an index
/// naming a missing shard or escaping its directory, none at all. The client resolves them now
/// (the daemon never opens a path) and refuses them with the codes and messages the daemon
/// gave when it resolved them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_are_refused_precisely() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("notes.txt"), b"not a model").unwrap();
    std::fs::write(
        d.join("missing.safetensors.index.json"),
        r#"{"weight_map": {"x": "gone.safetensors"}}"#,
    )
    .unwrap();
    std::fs::write(
        d.join("evil.safetensors.index.json"),
        r#"{"weight_map": {"x": "../etc/passwd"}}"#,
    )
    .unwrap();
    let show = |p: &Path| p.display().to_string();
    let cases: Vec<(PathBuf, Code, String)> = vec![
        (
            PathBuf::from("model.safetensors"),
            Code::InvalidArgument,
            "paths: model.safetensors: a relative path (give an absolute one: the model records where its files are)".into(),
        ),
        (
            d.join("nope.safetensors"),
            Code::NotFound,
            format!("paths: no such file: {}", show(&d.join("nope.safetensors"))),
        ),
        (
            d.to_path_buf(),
            Code::InvalidArgument,
            format!("paths: {}: directory holds no .safetensors file", show(d)),
        ),
        (
            d.join("notes.txt"),
            Code::InvalidArgument,
            format!(
                "paths: {}: not a .safetensors file, a *.safetensors.index.json or a directory",
                show(&d.join("notes.txt"))
            ),
        ),
        (
            d.join("missing.safetensors.index.json"),
            Code::NotFound,
            format!("paths: no such file: {}", show(&d.join("gone.safetensors"))),
        ),
        (
            d.join("evil.safetensors.index.json"),
            Code::InvalidArgument,
            format!(
                "paths: {}: invalid index: weight_map[\"x\"] = \"../etc/passwd\" leaves the \
                 index's directory",
                show(&d.join("evil.safetensors.index.json"))
            ),
        ),
    ];
    let mut client = daemon.client().await;
    for (path, code, message) in &cases {
        let got = load_error(&mut client, std::slice::from_ref(path)).await;
        assert_eq!(got, (*code, message.clone()), "{}", path.display());
    }
    let got = load_error(&mut client, &[]).await;
    assert_eq!(got, (Code::InvalidArgument, "paths: no file given".into()));
    assert!(client.list_models().await.unwrap().models.is_empty());
    assert_still_serves(&daemon, 23).await;
}

/// OpenSession requests that cannot be served: unknown model or device, unknown or doubled
/// tensors, empty groups, budgets that cannot hold the largest group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_session_requests_are_refused_precisely() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &mixed_model(24));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let id = manifest.model_id.as_str();
    let groups = per_tensor_groups(&manifest);
    // embed.weight: BF16 [64, 48], the largest tensor.
    let largest = 64 * 48 * 2;
    assert_eq!(
        manifest.tensors.iter().map(|t| t.nbytes).max(),
        Some(largest)
    );
    let opts = |groups: Vec<proto::GroupSpec>, staging: u64, budget: u64| {
        options(id, groups, staging, budget)
    };
    let mut unknown_device = opts(groups.clone(), 0, 1 << 20);
    unknown_device.device_uuid = "GPU-00000000-0000".into();

    let cases: Vec<(&str, weightstream_client::SessionOptions, Code, String)> = vec![
        (
            "unknown model",
            options("m-0123456789abcdef", groups.clone(), 0, 1 << 20),
            Code::NotFound,
            "unknown model_id 'm-0123456789abcdef'".into(),
        ),
        (
            "unknown tensor",
            opts(vec![group("g0", &["embed.weight", "nope"])], 0, 1 << 20),
            Code::InvalidArgument,
            "groups[0] ('g0'): tensor 'nope' is not in the model".into(),
        ),
        (
            "unknown tensor in a later group",
            opts(
                vec![
                    group("a", &["embed.weight"]),
                    group("b", &["logit_scale"]),
                    group("late", &["layers.9.weight"]),
                ],
                0,
                1 << 20,
            ),
            Code::InvalidArgument,
            "groups[2] ('late'): tensor 'layers.9.weight' is not in the model".into(),
        ),
        (
            "tensor in two groups",
            opts(
                vec![
                    group("a", &["embed.weight"]),
                    group("b", &["logit_scale", "embed.weight"]),
                ],
                0,
                1 << 20,
            ),
            Code::InvalidArgument,
            "groups[1] ('b'): tensor 'embed.weight' is already in group 'a'".into(),
        ),
        (
            "group without tensors",
            opts(
                vec![group("a", &["embed.weight"]), group("empty", &[])],
                0,
                1 << 20,
            ),
            Code::InvalidArgument,
            "groups[1].tensors: 0 entries, at least 1 required".into(),
        ),
        (
            "no groups",
            opts(vec![], 0, 1 << 20),
            Code::InvalidArgument,
            "groups: 0 entries, at least 1 required".into(),
        ),
        (
            "zero budget",
            opts(groups.clone(), 0, 0),
            Code::InvalidArgument,
            "vram_budget: must be more than 0".into(),
        ),
        (
            "budget below the largest group",
            opts(groups.clone(), 0, 1000),
            Code::InvalidArgument,
            format!(
                "vram_budget 1000 is smaller than the largest group 'embed.weight' ({largest} bytes, aligned)"
            ),
        ),
        (
            "budget one byte short",
            opts(groups.clone(), 0, largest - 1),
            Code::InvalidArgument,
            format!(
                "vram_budget {} is smaller than the largest group 'embed.weight' ({largest} bytes, aligned)",
                largest - 1
            ),
        ),
        (
            "staging below the largest group",
            opts(groups.clone(), 100, 1 << 20),
            Code::InvalidArgument,
            format!(
                "staging_bytes 100 is smaller than the largest group 'embed.weight' ({largest} bytes)"
            ),
        ),
        (
            "staging over budget",
            opts(groups.clone(), 20_000, 10_000),
            Code::InvalidArgument,
            "staging_bytes 20000 exceeds vram_budget 10000".into(),
        ),
        (
            "a share below 100 MB/s",
            weightstream_client::SessionOptions {
                copy_bandwidth_limit: 99_999_999,
                ..opts(groups.clone(), 0, 1 << 20)
            },
            Code::InvalidArgument,
            "copy_bandwidth_limit: 99999999B/s is below the least the daemon accepts, 100MB/s \
             (0: none)"
                .into(),
        ),
        (
            "unknown device",
            unknown_device,
            Code::NotFound,
            "device_uuid 'GPU-00000000-0000' is not a device of this daemon".into(),
        ),
    ];
    for (what, opts, code, message) in cases {
        let got = open_error(&mut client, opts).await;
        assert_eq!(got, (code, message), "{what}");
    }
    // Nothing was left half-open: no session, no session count on the model, no staging.
    assert_eq!(client.list_sessions().await.unwrap(), vec![]);
    let model = model_listed(&mut client, id).await.unwrap();
    assert_eq!((model.refcount, model.sessions), (1, 0));
    assert_eq!(
        daemon.shm_count("staging") + daemon.shm_count("resident"),
        0
    );
    // The exact largest group is enough.
    let session = client.open_session(opts(groups, 0, largest)).await.unwrap();
    assert_eq!(session.layout().staging_bytes, largest);
    session.close().await.unwrap();
    assert_still_serves(&daemon, 25).await;
}

/// Faults on the hot path: the session stays usable after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_run_messages_fault_and_the_session_goes_on() {
    let daemon = start_daemon().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &mixed_model(26));
    let expected = read_model(std::slice::from_ref(&path));
    let mut client = daemon.client().await;
    let manifest = load(&mut client, &[path], &expected).await;
    let groups = per_tensor_groups(&manifest);
    let n = groups.len() as u32;

    // Through the client: an acquire of a group the session does not have.
    let mut opts = options(&manifest.model_id, groups.clone(), 0, 1 << 20);
    opts.record_plan = false;
    let session = client.open_session(opts).await.unwrap();
    match within("bad acquire", session.acquire(n + 89)).await {
        Err(ClientError::Fault {
            ticket,
            code,
            message,
        }) => {
            assert_eq!(code, proto::FaultCode::FaultInvalidArgument);
            assert_ne!(ticket, 0);
            assert_eq!(
                message,
                format!(
                    "acquire.group {} is out of range: the session has {n} groups",
                    n + 89
                )
            );
        }
        Err(other) => panic!("expected a fault, got {other:?}"),
        Ok(_) => panic!("group {} was staged", n + 89),
    }
    let all: Vec<u32> = (0..n).collect();
    assert_eq!(
        run_step(&session, &all, &expected).await,
        model_bytes(&expected)
    );

    // Raw messages the client never sends, on a session of a raw connection.
    let mut rpc = raw_client(&daemon.socket).await;
    let opened = rpc
        .open_session(proto::OpenSessionRequest {
            model_id: manifest.model_id.clone(),
            vram_budget: 1 << 20,
            groups: groups.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let sid = opened.session_id.clone();
    let mut run = RawRun::attach(&mut rpc, &sid).await.unwrap();
    let fault = |ticket, code: proto::FaultCode, message: String| proto::Fault {
        ticket,
        code: code as i32,
        message,
    };
    use proto::FaultCode::*;

    run.release(777);
    let want = fault(
        777,
        FaultNotFound,
        "release.ticket 777 is not a live ticket".into(),
    );
    assert_eq!(run.fault().await, want);

    run.acquire(0, 0);
    let want = fault(
        0,
        FaultInvalidArgument,
        "acquire.ticket: 0 is reserved".into(),
    );
    assert_eq!(run.fault().await, want);

    run.acquire(0, 5);
    let staged = run.staged(5).await;
    run.acquire(1, 5);
    let want = fault(
        5,
        FaultInvalidArgument,
        "acquire.ticket 5 is already live".into(),
    );
    assert_eq!(run.fault().await, want);
    // Ticket 5 still holds group 0's bytes.
    let layout = &opened.groups[0];
    let region = region_bytes(&daemon.socket, &opened.regions[staged.region as usize]).await;
    let at = (staged.offset + layout.tensors[0].offset) as usize;
    let want_bytes = &expected[&layout.tensors[0].name].bytes;
    assert_bytes(
        "raw group 0",
        &region[at..at + want_bytes.len()],
        want_bytes,
    );
    run.release(5);
    run.release(5);
    let want = fault(
        5,
        FaultNotFound,
        "release.ticket 5 is not a live ticket".into(),
    );
    assert_eq!(run.fault().await, want);

    run.send(Msg::Plan(proto::Plan {
        groups: vec![0, n + 2, 1],
        ..Default::default()
    }));
    let want = fault(
        0,
        FaultInvalidArgument,
        format!(
            "plan.groups[1] = {} is out of range: the session has {n} groups",
            n + 2
        ),
    );
    assert_eq!(run.fault().await, want);

    run.send(Msg::Attach(proto::Attach {
        session_id: sid.clone(),
    }));
    let want = fault(
        0,
        FaultFailedPrecondition,
        "attach: the stream is already attached".into(),
    );
    assert_eq!(run.fault().await, want);

    // After all that, the session serves.
    run.acquire(2, 6);
    run.staged(6).await;
    run.release(6);
    let info = session_info(&mut client, &sid).await.unwrap();
    assert_eq!(
        info.stats.unwrap().acquires,
        2,
        "faulted acquires are not counted"
    );

    // Run streams the daemon refuses outright.
    let mut other = raw_client(&daemon.socket).await;
    let status = RawRun::attach(&mut other, "s-999").await.err().unwrap();
    assert_eq!(
        (status.code(), status.message()),
        (Code::NotFound, "unknown session_id 's-999'")
    );
    let status = RawRun::attach(&mut other, &sid).await.err().unwrap();
    let denied = format!("session_id '{sid}' belongs to another connection");
    assert_eq!(
        (status.code(), status.message()),
        (Code::PermissionDenied, denied.as_str())
    );
    let status = RawRun::attach(&mut other, session.id())
        .await
        .err()
        .unwrap();
    let denied_client = format!(
        "session_id '{}' belongs to another connection",
        session.id()
    );
    assert_eq!(
        (status.code(), status.message()),
        (Code::PermissionDenied, denied_client.as_str())
    );
    let status = other
        .close_session(proto::CloseSessionRequest {
            session_id: sid.clone(),
        })
        .await
        .err()
        .unwrap();
    assert_eq!(
        (status.code(), status.message()),
        (Code::PermissionDenied, denied.as_str())
    );
    let status = RawRun::start(
        &mut other,
        Msg::Acquire(proto::Acquire {
            group: 0,
            ticket: 1,
            ..Default::default()
        }),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(
        (status.code(), status.message()),
        (
            Code::FailedPrecondition,
            "Run: the first message must be attach{session_id}"
        )
    );
    // A second stream on the owner's connection.
    let status = RawRun::attach(&mut rpc, &sid).await.err().unwrap();
    let twice = format!("session_id '{sid}' is already attached to a Run stream");
    assert_eq!(
        (status.code(), status.message()),
        (Code::FailedPrecondition, twice.as_str())
    );

    // Both sessions still serve their owners.
    run.acquire(3, 7);
    run.staged(7).await;
    run.release(7);
    assert_eq!(
        run_step(&session, &all, &expected).await,
        model_bytes(&expected)
    );
    session.close().await.unwrap();
    rpc.close_session(proto::CloseSessionRequest {
        session_id: sid.clone(),
    })
    .await
    .unwrap();
    assert_eq!(client.list_sessions().await.unwrap(), vec![]);
    assert_still_serves(&daemon, 27).await;
}

/// A request larger than `limits.max_message_bytes` is refused before it is decoded, and the
/// daemon (and the connection) keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused() {
    const LIMIT: u64 = 64 << 10;
    let daemon = start_daemon_with(|c| c.limits.max_message_bytes = LIMIT).await;
    let mut client = daemon.client().await;
    let info = client.info().await.unwrap();
    assert_eq!(info.limits.unwrap().max_message_bytes, LIMIT);

    // tonic refuses a request over its decoding limit with OUT_OF_RANGE (other gRPC stacks
    // say RESOURCE_EXHAUSTED); the message names the size and the limit.
    let check = |(code, message): (Code, String)| {
        assert_eq!(code, Code::OutOfRange, "{message}");
        assert!(message.contains("message length too large"), "{message}");
        assert!(
            message.contains(&format!("the limit is: {LIMIT} bytes")),
            "{message}"
        );
    };
    let names: Vec<String> = (0..3000)
        .map(|i| format!("tensor.with.a.long.name.{i:06}"))
        .collect();
    let byte = [7u8];
    let tensors: Vec<TensorData<'_>> = names
        .iter()
        .map(|name| TensorData::new(name.as_str(), proto::Dtype::U8, &[1], &byte))
        .collect();
    check(upload_error(&mut client, &tensors).await);
    assert_eq!(daemon.shm_count("upload"), 0);

    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "m.safetensors", &mixed_model(28));
    let expected = read_model(std::slice::from_ref(&path));
    let manifest = load(&mut client, &[path], &expected).await;
    let groups: Vec<proto::GroupSpec> = names.iter().map(|n| group(n, &["embed.weight"])).collect();
    check(open_error(&mut client, options(&manifest.model_id, groups, 0, 1 << 20)).await);
    assert_eq!(client.list_sessions().await.unwrap(), vec![]);

    // An oversized message on the Run stream cannot be skipped: the session ends (the stream
    // is torn down; the client only sees that it ended) and the daemon goes on.
    let groups = per_tensor_groups(&manifest);
    let n = groups.len() as u32;
    let mut opts = options(&manifest.model_id, groups, 0, 1 << 20);
    opts.record_plan = false;
    let session = client.open_session(opts).await.unwrap();
    run_step(&session, &[0], &expected).await;
    session.send_plan(vec![1; 70_000]);
    let err = within("acquire after an oversized plan", session.acquire(0))
        .await
        .err()
        .unwrap();
    assert!(matches!(err, ClientError::SessionEnded(_)), "{err:?}");
    let sid = session.id().to_string();
    eventually("the session of the broken stream is gone", || {
        let mut client = client.clone();
        let sid = sid.clone();
        async move { session_info(&mut client, &sid).await.is_none() }
    })
    .await;
    assert_eq!(daemon.shm_count("staging"), 0);
    // A plan just under the limit is taken.
    let mut opts = options(&manifest.model_id, per_tensor_groups(&manifest), 0, 1 << 20);
    opts.record_plan = false;
    let session = client.open_session(opts).await.unwrap();
    let plan: Vec<u32> = (0..30_000).map(|i| i % n).collect();
    session.send_plan(plan);
    run_step(&session, &[0, 1], &expected).await;
    let info = session_info(&mut client, session.id()).await.unwrap();
    assert_eq!(info.plan_length, 30_000);
    session.close().await.unwrap();

    // Just under the limit is fine.
    let (small, dedup) = client.upload_model("small", &tensors[..100]).await.unwrap();
    assert!(!dedup);
    assert_eq!(small.tensors.len(), 100);
    assert_still_serves(&daemon, 29).await;
}

/// BeginUpload validates each declared tensor and names it; a bad upload leaves nothing
/// behind. Commits are only for the connection that began the upload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_uploads_are_refused_precisely() {
    let daemon = start_daemon().await;
    let mut client = daemon.client().await;
    const FOUR: &[u8] = &[1, 2, 3, 4];
    const TEN: &[u8] = &[0; 10];
    const RANK_17: &[u64] = &[1; 17];
    const TWO_TIB: &[u64] = &[2 << 40];
    let t = |name: &'static str, dtype, shape: &'static [u64], bytes: &'static [u8]| {
        TensorData::new(name, dtype, shape, bytes)
    };
    use proto::Dtype::*;
    let cases: Vec<(&str, Vec<TensorData<'static>>, Code, String)> = vec![
        (
            "duplicate name",
            vec![
                t("a", U8, &[4], FOUR),
                t("b", U8, &[4], FOUR),
                t("a", U8, &[4], FOUR),
            ],
            Code::InvalidArgument,
            "tensors[2].name: 'a' is declared twice".into(),
        ),
        (
            "unspecified dtype",
            vec![t("a", U8, &[4], FOUR), t("b", Unspecified, &[4], FOUR)],
            Code::InvalidArgument,
            "tensors[1].dtype: 0 is not a known dtype".into(),
        ),
        (
            "nbytes against shape",
            vec![t("x", Bf16, &[2, 3], TEN)],
            Code::InvalidArgument,
            "tensors[0].nbytes: 10 disagrees with shape [2, 3] of BF16 (12 bytes)".into(),
        ),
        (
            "empty name",
            vec![t("", U8, &[4], FOUR)],
            Code::InvalidArgument,
            "tensors[0].name: required".into(),
        ),
        (
            "no tensors",
            vec![],
            Code::InvalidArgument,
            "tensors: 0 entries, at least 1 required".into(),
        ),
        (
            "shape overflow",
            vec![t("a", U8, &[4], FOUR), t("x", Bf16, &[u64::MAX], &[])],
            Code::InvalidArgument,
            "tensors[1].shape: [18446744073709551615] overflows".into(),
        ),
        (
            "rank",
            vec![t("x", U8, RANK_17, &[9])],
            Code::InvalidArgument,
            "tensors[0].shape: 17 dimensions, the limit is 16".into(),
        ),
        (
            "larger than max_upload_bytes",
            vec![t("x", U8, TWO_TIB, &[])],
            Code::ResourceExhausted,
            "upload of 2199023255552 bytes exceeds max_upload_bytes = 1099511627776".into(),
        ),
    ];
    for (what, tensors, code, message) in &cases {
        let got = upload_error(&mut client, tensors).await;
        assert_eq!(got, (*code, message.clone()), "{what}");
    }
    assert_eq!(daemon.shm_count("upload"), 0);
    assert_eq!(client.list_models().await.unwrap().store_bytes, 0);

    // Commit belongs to the connection that began the upload.
    let mut owner = raw_client(&daemon.socket).await;
    let begun = owner
        .begin_upload(proto::BeginUploadRequest {
            name: "raw".into(),
            tensors: vec![proto::TensorInfo {
                name: "w".into(),
                dtype: proto::Dtype::F32 as i32,
                shape: vec![2, 2],
                nbytes: 0,
                ..Default::default()
            }],
            client_reserves: false,
        })
        .await
        .unwrap()
        .into_inner();
    let slot = proto::UploadTensor {
        name: "w".into(),
        offset: 0,
        nbytes: 16,
    };
    assert_eq!(begun.tensors, vec![slot]);
    assert!(begun.size >= 16, "{begun:?}");
    assert_eq!(daemon.shm_count("upload"), 1);
    let mut stranger = raw_client(&daemon.socket).await;
    let commit = |id: &str| proto::CommitUploadRequest {
        retention: proto::Retention::Cached as i32,
        upload_id: id.to_string(),
        ..Default::default()
    };
    let status = stranger
        .commit_upload(commit(&begun.upload_id))
        .await
        .err()
        .unwrap();
    let denied = format!(
        "upload_id '{}' belongs to another connection",
        begun.upload_id
    );
    assert_eq!(
        (status.code(), status.message()),
        (Code::PermissionDenied, denied.as_str())
    );
    let status = stranger
        .commit_upload(commit("up-999"))
        .await
        .err()
        .unwrap();
    assert_eq!(
        (status.code(), status.message()),
        (Code::NotFound, "unknown upload_id 'up-999'")
    );
    // The owner's connection goes away: its uncommitted upload goes with it.
    drop(owner);
    eventually("the abandoned upload is dropped", || async {
        daemon.uploads() == 0
    })
    .await;
    let status = stranger
        .commit_upload(commit(&begun.upload_id))
        .await
        .err()
        .unwrap();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(fetch_fd(&daemon.socket, &begun.fd_secret).await.is_err());
    assert_still_serves(&daemon, 30).await;
}

/// The configured limits: names, tensors per model, groups per session, sessions, live
/// tickets, plan length, and a staging arena the client holds entirely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_enforced() {
    let daemon = start_daemon_with(|c| {
        c.limits.max_name_bytes = 16;
        c.limits.max_tensors_per_model = 8;
        c.limits.max_groups_per_session = 4;
        c.limits.max_sessions = 2;
        c.limits.max_live_tickets = 3;
        c.limits.max_plan_length = 4;
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let layers = write_model(
        dir.path(),
        "layers.safetensors",
        &uniform_model(31, 6, 4096),
    );
    let expected = read_model(std::slice::from_ref(&layers));
    let mut client = daemon.client().await;

    let long = "a-name-of-17-byte";
    let err = client
        .load_model(
            std::slice::from_ref(&layers),
            long,
            weightstream_client::proto::Quantization::None,
            |_| {},
        )
        .await
        .err()
        .unwrap();
    assert_eq!(
        rejected(err),
        (
            Code::InvalidArgument,
            "name: 17 bytes, the limit is 16".into()
        )
    );
    // Files are held to the limits uploads are, while their header is parsed.
    let many = write_model(dir.path(), "many.safetensors", &uniform_model(32, 9, 256));
    let got = load_error(&mut client, std::slice::from_ref(&many)).await;
    assert_eq!(
        got,
        (
            Code::InvalidArgument,
            format!(
                "{}: the header lists more than 8 tensors: limits.max_tensors_per_model = 8",
                many.display()
            )
        )
    );
    let mixed = write_model(dir.path(), "mixed.safetensors", &mixed_model(32));
    let got = load_error(&mut client, std::slice::from_ref(&mixed)).await;
    assert_eq!(
        got,
        (
            Code::InvalidArgument,
            format!(
                "{}: tensor 1 of the header has a name of 22 bytes: limits.max_name_bytes = 16",
                mixed.display()
            )
        )
    );

    let manifest = load(&mut client, &[layers], &expected).await;
    let groups = per_tensor_groups(&manifest);
    let got = open_error(
        &mut client,
        options(&manifest.model_id, groups.clone(), 0, 1 << 20),
    )
    .await;
    assert_eq!(
        got,
        (
            Code::InvalidArgument,
            "groups: 6 entries, the limit is 4".into()
        )
    );
    let mut opts = options(&manifest.model_id, groups[..4].to_vec(), 2 * 4096, 2 * 4096);
    opts.record_plan = false;
    let mut labelled = opts.clone();
    labelled.label = long.into();
    let got = open_error(&mut client, labelled).await;
    assert_eq!(
        got,
        (
            Code::InvalidArgument,
            "label: 17 bytes, the limit is 16".into()
        )
    );

    let first = client.open_session(opts.clone()).await.unwrap();
    let second = client.open_session(opts.clone()).await.unwrap();
    let got = open_error(&mut client, opts.clone()).await;
    assert_eq!(
        got,
        (
            Code::ResourceExhausted,
            "limits.max_sessions = 2 reached: the daemon has 2 sessions open or opening".into()
        )
    );
    second.close().await.unwrap();

    // Three tickets on one group are fine, a fourth is over max_live_tickets.
    let held: Vec<_> = {
        let mut held = Vec::new();
        for _ in 0..3 {
            let a = within("acquire", first.acquire(0)).await.unwrap();
            check_acquired(&a, &expected);
            held.push(a);
        }
        held
    };
    match within("acquire over the limit", first.acquire(0)).await {
        Err(ClientError::Fault { code, message, .. }) => {
            assert_eq!(code, proto::FaultCode::FaultResourceExhausted);
            assert_eq!(
                message,
                "acquire: 3 live tickets, the limit is max_live_tickets = 3"
            );
        }
        Err(other) => panic!("expected a fault, got {other:?}"),
        Ok(_) => panic!("a fourth ticket was staged"),
    }
    drop(held);

    // The client holds the whole arena (two groups of two): a third group cannot be staged, and
    // waiting would never end, so it is refused.
    let a = within("acquire", first.acquire(0)).await.unwrap();
    let b = within("acquire", first.acquire(1)).await.unwrap();
    match within("acquire into a full arena", first.acquire(2)).await {
        Err(ClientError::Fault { code, message, .. }) => {
            assert_eq!(code, proto::FaultCode::FaultResourceExhausted);
            let want = "acquire: group 'layers.2.weight' cannot be staged (no 4096-byte range of \
                        the staging arena can be freed now: held, copying or sooner-needed blocks \
                        are in the way): the staging arena of 8192 bytes has 8192 bytes held by \
                        live tickets; release tickets before acquiring more, or open the session \
                        with a larger staging_bytes";
            assert_eq!(message, want);
        }
        Err(other) => panic!("expected a fault, got {other:?}"),
        Ok(_) => panic!("a third group fit a two-group arena"),
    }
    drop(a);
    let c = within("acquire after a release", first.acquire(2))
        .await
        .unwrap();
    check_acquired(&c, &expected);
    check_acquired(&b, &expected);
    drop((b, c));

    first.close().await.unwrap();

    // A plan longer than max_plan_length is refused; the session goes on without one.
    let mut rpc = raw_client(&daemon.socket).await;
    let opened = rpc
        .open_session(proto::OpenSessionRequest {
            model_id: manifest.model_id.clone(),
            vram_budget: 1 << 20,
            groups: groups[..4].to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut run = RawRun::attach(&mut rpc, &opened.session_id).await.unwrap();
    run.send(Msg::Plan(proto::Plan {
        groups: vec![0, 1, 2, 3, 0],
        ..Default::default()
    }));
    let fault = run.fault().await;
    assert_eq!(
        (fault.ticket, fault.code, fault.message.as_str()),
        (
            0,
            proto::FaultCode::FaultInvalidArgument as i32,
            "plan.groups: 5 entries, the limit is max_plan_length = 4"
        )
    );
    let info = session_info(&mut client, &opened.session_id).await.unwrap();
    assert_eq!(info.plan_length, 0);
    run.send(Msg::Plan(proto::Plan {
        groups: vec![0, 1, 2, 3],
        ..Default::default()
    }));
    run.acquire(3, 1);
    run.staged(1).await;
    let info = session_info(&mut client, &opened.session_id).await.unwrap();
    assert_eq!(info.plan_length, 4);
}

/// A model's bytes cannot change after it is committed: not even its uploader, writing
/// through the upload region's fd it still holds, may rewrite them under the sessions (its
/// own, or those of a client whose identical upload was deduplicated into it): the daemon
/// sealed the region against writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_uploads_are_immutable() {
    use std::os::unix::fs::FileExt;
    let daemon = start_daemon().await;
    let tensors = uniform_model(33, 2, 4096);
    let expected: std::collections::BTreeMap<String, Tensor> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    let (manifest, held) = upload_keeping_the_fd(&daemon.socket, &tensors).await;
    let data: Vec<_> = tensors.iter().map(Tensor::as_upload).collect();
    let mut other = daemon.client().await;
    let (same, dedup) = other.upload_model("mine", &data).await.unwrap();
    assert!(dedup && same.model_id == manifest.model_id);
    let refused = held.write_all_at(&[0xA5; 64], 0).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(1), "EPERM: {refused}");
    let session = other
        .open_session(options(
            &same.model_id,
            per_tensor_groups(&same),
            0,
            1 << 20,
        ))
        .await
        .unwrap();
    run_step(&session, &[0, 1], &expected).await;
}
