//! The `weightstream` binary as a user runs it.

use std::process::Command;

#[path = "../../e2e/tests/common/mod.rs"]
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
    // The client's own wait, the copies against the reference the backend has, and no
    // daemon-side "stall" that counts acquires sent ahead of need.
    for line in [
        "client waited for weights",
        "client's compute per group (simulated)",
        "copy GB/s while copying",
        "reference: host backend copy GB/s (a memcpy, this run)",
        "copies stay hidden while compute per group is at least about",
        "prefetch hit rate",
        "no shared memory left behind",
    ] {
        assert!(stdout.contains(line), "{line:?} missing:\n{stdout}");
    }
    assert!(!stdout.contains("stall"), "{stdout}");
    assert!(!stdout.contains("plain memcpy"), "{stdout}");
}

/// `WEIGHTSTREAM_LOG=weightstream::timeline=debug` traces each session event, one line each;
/// the default filter writes none of them.
#[test]
fn the_timeline_target_traces_acquires_releases_and_copies() {
    let demo = |log: Option<&str>| {
        let mut cmd = weightstream();
        cmd.args([
            "demo",
            "--size",
            "8MiB",
            "--steps",
            "2",
            "--backend",
            "host",
        ]);
        cmd.env_remove("WEIGHTSTREAM_LOG");
        if let Some(filter) = log {
            cmd.env("WEIGHTSTREAM_LOG", filter);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let traced = demo(Some("warn,weightstream::timeline=debug"));
    for event in [
        "acquire session=1 group=",
        "staged session=1 group=",
        "release session=1 group=",
        "copy submitted session=1 group=",
        "copy dispatched session=1 group=",
        "copy queued session=1 group=",
    ] {
        let lines = traced.lines().filter(|l| l.contains(event)).count();
        assert!(lines > 0, "no {event:?} line:\n{traced}");
    }
    assert!(!demo(None).contains("weightstream::timeline"));
}

/// Without a daemon, every command that needs one fails at once with one line that names the
/// socket and says what to do; `load` of a missing file says so before asking any daemon;
/// `top` without a terminal says to use --once and exits 2.
#[test]
fn every_command_without_a_daemon_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let shown = socket.display().to_string();
    let model = dir.path().join("m.safetensors");
    std::fs::write(&model, b"not read: no daemon to pass it to").unwrap();
    let unreachable = format!(
        "error: cannot reach the weightstream daemon at {shown}: no such socket (named by \
         --socket or WEIGHTSTREAM_SOCKET). Start the daemon there with `weightstream serve \
         --socket {shown}`\n"
    );
    let terminal = "error: weightstream top needs a terminal; use `weightstream top --once` for \
                    plain output\n";
    let model = model.display().to_string();
    let cases: Vec<(Vec<&str>, i32, String)> = vec![
        (vec!["status"], 1, unreachable.clone()),
        (vec!["status", "--json"], 1, unreachable.clone()),
        (
            vec!["release", "m-0123456789abcdef"],
            1,
            unreachable.clone(),
        ),
        (vec!["load", &model], 1, unreachable.clone()),
        (
            vec!["top", "--once", "--interval-ms", "100"],
            1,
            unreachable.clone(),
        ),
        (vec!["top"], 2, terminal.to_string()),
        (
            vec!["load", "/nonexistent/x"],
            1,
            "error: no such file: /nonexistent/x\n".to_string(),
        ),
    ];
    let mut failures = Vec::new();
    for (args, code, want) in &cases {
        // The same through --socket and through WEIGHTSTREAM_SOCKET.
        for by_env in [false, true] {
            let mut command = weightstream();
            command.args(args).env_remove("WEIGHTSTREAM_SOCKET");
            if by_env {
                command.env("WEIGHTSTREAM_SOCKET", &socket);
            } else {
                command.arg("--socket").arg(&socket);
            }
            let out = command.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            if out.status.code() != Some(*code) || stderr != *want || !out.stdout.is_empty() {
                failures.push(format!(
                    "{args:?} (env: {by_env}): exit {:?}, stderr {stderr:?}, stdout {:?}",
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// With no --socket and no WEIGHTSTREAM_SOCKET, a client looks for the system socket, then
/// the user's in XDG_RUNTIME_DIR, and names both when neither is there.
#[test]
fn a_client_with_no_socket_named_says_where_it_looked() {
    let system = std::path::Path::new(weightstream_client::SYSTEM_SOCKET);
    if system.exists() {
        // This machine runs the service: the client would reach it, rightly.
        eprintln!(
            "{} exists: the search's failure cannot be shown here",
            system.display()
        );
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let user = runtime.path().join("weightstream.sock");
    let out = weightstream()
        .arg("status")
        .env_remove("WEIGHTSTREAM_SOCKET")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "error: cannot reach the weightstream daemon at {user}: no such socket (tried \
             /run/weightstream/weightstream.sock, {user}). Start the daemon with `weightstream \
             serve`, or pass --socket (or set WEIGHTSTREAM_SOCKET) to name another socket\n",
            user = user.display()
        )
    );
}

/// A user's daemon and its clients meet at $XDG_RUNTIME_DIR/weightstream.sock with no socket
/// named on either side (as root, `serve` would take the system socket: the test names the
/// socket to `serve` through the same variable the clients read, and checks the client side).
#[test]
fn a_client_finds_the_daemon_in_xdg_runtime_dir() {
    let system = std::path::Path::new(weightstream_client::SYSTEM_SOCKET);
    if system.exists() {
        eprintln!("{} exists: a client would take it first", system.display());
        return;
    }
    let runtime = tempfile::tempdir().unwrap();
    let socket = runtime.path().join("weightstream.sock");
    let _daemon = Reaped(
        weightstream()
            .args(["serve", "--backend", "host", "--socket"])
            .arg(&socket)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("the daemon's socket", || socket.exists());
    let out = weightstream()
        .args(["status", "--json"])
        .env_remove("WEIGHTSTREAM_SOCKET")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["backend"], "host");
}

/// `serve` run by a user other than root, with no socket named, listens on that user's socket
/// in XDG_RUNTIME_DIR, where the user's clients look; told to listen where the user may not
/// write, it says what to do. Needs root, to run as another uid (`nobody`); skipped without
/// it unless WEIGHTSTREAM_REQUIRE_ROOT=1 (tests/run.sh), which fails the test instead.
#[test]
fn serve_as_a_user_listens_on_the_user_s_own_socket() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !rustix::process::geteuid().is_root() {
        let required = std::env::var("WEIGHTSTREAM_REQUIRE_ROOT").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "WEIGHTSTREAM_REQUIRE_ROOT=1: run the tests as root"
        );
        eprintln!("skipped: running as another uid needs root");
        return;
    }
    let nobody = 65534;
    // The binary and the user's runtime directory, where that user may reach them.
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.path().join("weightstream");
    std::fs::copy(env!("CARGO_BIN_EXE_weightstream"), &exe).unwrap();
    let runtime = dir.path().join("run-user");
    std::fs::create_dir(&runtime).unwrap();
    std::os::unix::fs::chown(&runtime, Some(nobody), Some(nobody)).unwrap();
    let as_nobody = |args: &[&str]| {
        let mut command = Command::new(&exe);
        command
            .args(args)
            .uid(nobody)
            .gid(nobody)
            .current_dir("/")
            .env_remove("WEIGHTSTREAM_SOCKET")
            .env("XDG_RUNTIME_DIR", &runtime);
        command
    };
    let _daemon = Reaped(
        as_nobody(&["serve", "--backend", "host"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let socket = runtime.join("weightstream.sock");
    wait_until("the user's socket", || socket.exists());
    if !std::path::Path::new(weightstream_client::SYSTEM_SOCKET).exists() {
        let out = as_nobody(&["status", "--json"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
    }
    // A directory only root may write to.
    let closed = tempfile::tempdir().unwrap();
    std::fs::set_permissions(closed.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let refused = closed.path().join("ws.sock");
    let out = as_nobody(&["serve", "--backend", "host", "--socket"])
        .arg(&refused)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "error: {}.lock: Permission denied (os error 13) (this user may not write there: \
             name a socket in a directory you may write to, or leave --socket out to listen on \
             your own, $XDG_RUNTIME_DIR/weightstream.sock or \
             /tmp/weightstream-<uid>/weightstream.sock)\n",
            refused.display()
        )
    );
}

/// A bad value, and `shm_dir` (no longer a key: shared memory is memfds), are refused at
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

/// `weightstream serve --backend host` on `socket`, answering (both sockets there).
fn serve_host(socket: &std::path::Path) -> Reaped {
    let daemon = Reaped(
        weightstream()
            .args(["serve", "--backend", "host", "--socket"])
            .arg(socket)
            .spawn()
            .unwrap(),
    );
    let handoff = socket.with_extension("sock.fd");
    wait_until("the sockets", || socket.exists() && handoff.exists());
    daemon
}

/// `weightstream ARGS --socket SOCKET`: its exit code, stdout and stderr.
fn run_cli(socket: &std::path::Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = weightstream()
        .args(args)
        .arg("--socket")
        .arg(socket)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
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

/// A reader that closed the pipe (`weightstream status | head -1`) ends the command with
/// status 0 and nothing on stderr, not a panic about printing to stdout.
#[test]
fn output_into_a_closed_pipe_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    let mut daemon = Reaped(
        weightstream()
            .args(["serve", "--backend", "host", "--socket"])
            .arg(&socket)
            .spawn()
            .unwrap(),
    );
    wait_until("the sockets", || {
        socket.exists() && dir.path().join("ws.sock.fd").exists()
    });
    for args in [&["status"][..], &["status", "--json"], &["top", "--once"]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader); // no reader: every write fails with EPIPE
        let out = weightstream()
            .args(args)
            .arg("--socket")
            .arg(&socket)
            .stdout(writer)
            .output()
            .unwrap();
        assert_eq!(
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).as_ref()
            ),
            (Some(0), ""),
            "{args:?}"
        );
    }
    let kill = Command::new("kill")
        .args(["-TERM", &daemon.0.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert!(daemon.0.wait().unwrap().success());
}

/// `release` takes a model's name as well as its id, and an error says which: an unknown name
/// is not called an id, two models of one name are listed by id, and a daemon's refusal is
/// its message without a gRPC code (`InvalidArgument:`, `NotFound:`).
#[test]
fn release_by_name_and_errors_in_plain_words() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    let data: Vec<u8> = (0..256u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![16, 16], &data).unwrap();
    let model = dir.path().join("m.safetensors");
    safetensors::serialize_to_file(vec![("w", view)], None, &model).unwrap();
    let _daemon = serve_host(&socket);
    let run = |args: &[&str]| run_cli(&socket, args);
    let path = model.display().to_string();
    let (code, loaded, _) = run(&["load", "--json", "--name", "flux", &path]);
    assert_eq!(code, Some(0));
    let id = serde_json::from_str::<serde_json::Value>(&loaded).unwrap()["model_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(id.len(), 2 + 32, "{id}: m- and 32 hex digits");
    let (code, out, err) = run(&["release", "flux"]);
    assert_eq!(
        (code, out, err),
        (
            Some(0),
            format!(
                "flux ({id})  released  (references left: 0; no references left: it leaves \
                 the store once no session uses it)\n"
            ),
            String::new()
        )
    );
    let unknown = "error: no model has the id or the name 'flux' (`weightstream status` lists \
                   the models)\n";
    assert_eq!(
        run(&["release", "flux"]),
        (Some(1), String::new(), unknown.into())
    );
    let garbage = dir.path().join("bad.safetensors");
    std::fs::write(&garbage, b"\x08\0\0\0\0\0\0\0not json").unwrap();
    let (code, out, err) = run(&["load", &garbage.display().to_string()]);
    let refused = format!(
        "error: {}: invalid header: expected ident at line 1 column 2\n",
        garbage.display()
    );
    assert_eq!((code, out, err), (Some(1), String::new(), refused));
}

/// `load --tensors` loads the named tensors alone (their bytes, one model id for the same
/// names in any order); a name no file holds and an empty `--tensors-file` are refused in one
/// line each.
#[test]
fn load_tensors_loads_the_named_tensors_alone() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    let a: Vec<u8> = (0..256u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let b: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let c: Vec<u8> = (0..16u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    fn view(d: &[u8], n: usize) -> safetensors::tensor::TensorView<'_> {
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, n], d).unwrap()
    }
    let model = dir.path().join("m.safetensors");
    let views = vec![("a", view(&a, 16)), ("b", view(&b, 8)), ("c", view(&c, 4))];
    safetensors::serialize_to_file(views, None, &model).unwrap();
    let _daemon = serve_host(&socket);
    let run = |args: &[&str]| run_cli(&socket, args);
    let path = model.display().to_string();
    let loaded = |args: &[&str]| {
        let (code, out, err) = run(args);
        assert_eq!((code, err.as_str()), (Some(0), ""), "{args:?}");
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        let id = json["model_id"].as_str().unwrap().to_string();
        (id, json["tensors"].as_u64(), json["total_bytes"].as_u64())
    };
    let (bc, tensors, bytes) = loaded(&["load", "--json", "--tensors", "b,c", &path]);
    assert_eq!((tensors, bytes), (Some(2), Some(256 + 64)));
    let names = dir.path().join("names.txt");
    std::fs::write(&names, "c\n\nb\n").unwrap();
    let listed = names.display().to_string();
    let (cb, ..) = loaded(&["load", "--json", "--tensors-file", &listed, &path]);
    assert_eq!(cb, bc, "the same names in another order: the same model");
    let (all, tensors, bytes) = loaded(&["load", "--json", &path]);
    assert_eq!((tensors, bytes), (Some(3), Some(1024 + 256 + 64)));
    assert_ne!(all, bc);

    let refused = format!("error: tensors: 'd' is in none of the files ({path})\n");
    assert_eq!(
        run(&["load", "--tensors", "b,d", &path]),
        (Some(1), String::new(), refused)
    );
    std::fs::write(&names, "\n  \n").unwrap();
    let empty = format!(
        "error: --tensors-file {listed} names no tensor: give one name per line, or leave the \
         option out to load every tensor\n"
    );
    assert_eq!(
        run(&["load", "--tensors-file", &listed, &path]),
        (Some(1), String::new(), empty)
    );
}

/// `load --quantize fp8 --coding rans8` says what it coded and how long coding took; the
/// daemon's status counts the model at its coded bytes.
#[test]
fn a_coded_load_says_what_it_coded() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    // A bell of weights (a sum of four draws of a linear congruential stream), 1024 x 1024.
    let mut x = 1u32;
    let data: Vec<u8> = (0..1024 * 1024)
        .flat_map(|_| {
            let mut sum = 0.0f32;
            for _ in 0..4 {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                sum += (x >> 8) as f32 / (1 << 24) as f32 - 0.5;
            }
            (sum * 0.02).to_le_bytes()
        })
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1024, 1024], &data)
            .unwrap();
    let model = dir.path().join("m.safetensors");
    safetensors::serialize_to_file(vec![("l.weight", view)], None, &model).unwrap();
    let _daemon = Reaped(
        weightstream()
            .args(["serve", "--backend", "host", "--socket"])
            .arg(&socket)
            .spawn()
            .unwrap(),
    );
    wait_until("the socket", || socket.exists());
    let load = weightstream()
        .args(["load", "--quantize", "fp8", "--coding", "rans8", "--socket"])
        .arg(&socket)
        .arg(&model)
        .output()
        .unwrap();
    let loaded = String::from_utf8_lossy(&load.stdout);
    assert!(load.status.success(), "{loaded}");
    assert!(
        loaded.contains("rans8: 1 of 1 tensors coded, 1.1 MiB held as 931.1 KiB"),
        "{loaded}"
    );
    assert!(loaded.contains(", coded in "), "{loaded}");
}
