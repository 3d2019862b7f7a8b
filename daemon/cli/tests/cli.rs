//! The `weightstream` binary as a user runs it.

use std::process::Command;

#[path = "../../tests/common/mod.rs"]
mod common;

use common::Reaped;

fn weightstream() -> Command {
    Command::new(env!("CARGO_BIN_EXE_weightstream"))
}

#[test]
fn demo_runs_to_completion_and_leaves_no_shared_memory() {
    let out = weightstream()
        .args([
            "demo",
            "--size",
            "8MiB",
            "--steps",
            "3",
            "--backend",
            "host",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("prefetch hit rate"), "{stdout}");
    assert!(stdout.contains("no shared memory left behind"), "{stdout}");
}

#[test]
fn status_against_a_missing_daemon_fails_fast_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let out = weightstream()
        .arg("status")
        .arg("--socket")
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot reach the weightstream daemon at") && stderr.contains("none.sock"),
        "{stderr}"
    );
}

/// A bad value, and `shm_dir` (gone with issue 17: shared memory is memfds), are refused at
/// start with the key named; so is the old `--shm-dir` flag.
#[test]
fn serve_refuses_a_bad_config_with_the_key_named() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "prefetch_depth = 0\n",
            "prefetch_depth = 0 is out of range: 1 to 1024",
        ),
        (
            "shm_dir = \"/dev/shm\"\n",
            "line 1: unknown field `shm_dir`, expected one of `socket`",
        ),
    ];
    for (text, want) in cases {
        let config = dir.path().join("bad.toml");
        std::fs::write(&config, text).unwrap();
        let out = weightstream()
            .args(["serve", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{text}: {stderr}");
    }
    let out = weightstream()
        .args(["serve", "--shm-dir", "/dev/shm"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unexpected argument '--shm-dir'"),
        "{stderr}"
    );
}

/// The memfds among the fds of process `pid` (its shared memory).
fn memfds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("/memfd:weightstream-"))
        .count()
}

/// Polls `done` until it holds or the deadline passes (a condition, not a fixed sleep).
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn serve_load_status_then_sigterm_exits_zero_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    // A real safetensors file written by the safetensors crate.
    let data: Vec<u8> = (0..4096u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![64, 64], &data).unwrap();
    let model = dir.path().join("m.safetensors");
    safetensors::serialize_to_file(vec![("w", view)], None, &model).unwrap();

    let mut daemon = Reaped(
        weightstream()
            .args(["serve", "--backend", "host", "--socket"])
            .arg(&socket)
            .spawn()
            .unwrap(),
    );
    let handoff = dir.path().join("ws.sock.fd");
    wait_until("the sockets", || socket.exists() && handoff.exists());
    let load = weightstream()
        .arg("load")
        .arg(&model)
        .arg("--socket")
        .arg(&socket)
        .output()
        .unwrap();
    let loaded = String::from_utf8_lossy(&load.stdout);
    assert!(load.status.success(), "{loaded}");
    assert!(
        loaded.contains("1 tensors") && loaded.contains("16.0 KiB"),
        "{loaded}"
    );
    assert!(
        loaded.contains("ready in ") && loaded.contains("read 16.0 KiB"),
        "{loaded}"
    );
    // Again, for scripts: the same model (one more reference), its phases in seconds.
    let again = weightstream()
        .args(["load", "--json", "--socket"])
        .arg(&socket)
        .arg(&model)
        .output()
        .unwrap();
    assert!(again.status.success());
    let json: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(
        (json["refcount"].as_u64(), json["tensors"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(
        json["phases"]["read_s"], 0.0,
        "found in the store: nothing read"
    );
    assert!(json["phases"]["total_s"].as_f64().unwrap() > 0.0, "{json}");
    let status = weightstream()
        .args(["status", "--json", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert!(status.status.success());
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["backend"], "host");
    assert_eq!(json["models"][0]["tensors"], 1);
    assert_eq!(json["models"][0]["total_bytes"], 16384);
    assert_eq!(json["store_bytes"], 16384);
    let uid = rustix::process::getuid().as_raw();
    assert_eq!(
        (&json["usage"]["uid"], &json["usage"]["daemon_sessions"]),
        (&serde_json::json!(uid), &serde_json::json!(0))
    );
    assert_eq!(json["quotas"]["per_uid_sessions"], 32, "the default");
    assert_eq!(memfds_of(daemon.0.id()), 1, "the model's arena");

    let kill = Command::new("kill")
        .args(["-TERM", &daemon.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let exit = daemon.0.wait().unwrap();
    assert!(exit.success(), "daemon exited with {exit:?}");
    assert!(!socket.exists(), "socket left behind");
    assert!(!handoff.exists(), "handoff socket left behind");
}

/// Names reach no terminal raw: a model named with an escape sequence (a window title, then a
/// bell) shows escaped in `load`, in `status`'s table and in the daemon's log lines, and as it
/// is in `status --json`.
#[test]
fn names_reach_no_terminal_raw() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    let data = vec![1u8; 64];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![64], &data).unwrap();
    let model = dir.path().join("m.safetensors");
    safetensors::serialize_to_file(vec![("w", view)], None, &model).unwrap();
    let mut daemon = Reaped(
        weightstream()
            .args(["serve", "--backend", "host", "--socket"])
            .arg(&socket)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_until("the sockets", || {
        socket.exists() && dir.path().join("ws.sock.fd").exists()
    });
    let name = "\x1b]0;PWNED\x07";
    let shown = "\\u{1b}]0;PWNED\\u{7}";
    let run = |args: &[&str]| {
        let out = weightstream()
            .args(args)
            .arg("--socket")
            .arg(&socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let loaded = run(&["load", "--name", name, model.to_str().unwrap()]);
    let table = run(&["status"]);
    let json = run(&["status", "--json"]);
    let kill = Command::new("kill")
        .args(["-TERM", &daemon.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let mut log = String::new();
    std::io::Read::read_to_string(daemon.0.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(daemon.0.wait().unwrap().success());
    for (what, text) in [("load", &loaded), ("status", &table), ("the log", &log)] {
        assert!(
            !text.contains('\x1b') && !text.contains('\x07'),
            "{what}: {text:?}"
        );
        assert!(text.contains(shown), "{what}: {text}");
    }
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["models"][0]["name"], name, "JSON keeps the name exact");
}
