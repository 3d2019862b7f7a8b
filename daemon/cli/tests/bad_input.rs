//! Bad input that could take the daemon down: run against `weightstream serve` as its own
//! process, so that its death is observed rather than shared with the test.

#[path = "../../e2e/tests/common/mod.rs"]
mod common;

use common::*;
use weightstream_client::Client;

/// A client that truncates the region of a model it uploaded must not be able to kill the
/// daemon (the next copy from the truncated mapping would be a SIGBUS): the daemon sealed the
/// region against resizing when it made it, so the truncation is refused (EPERM). The daemon
/// runs as its own process here, so that its death is observed rather than shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_an_uploaded_model_does_not_kill_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    let mut daemon = Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_weightstream"))
            .arg("--socket")
            .arg(&socket)
            .args(["serve", "--backend", "host"])
            .env("WEIGHTSTREAM_LOG", "warn")
            .spawn()
            .expect("spawn weightstream serve"),
    );
    eventually("the daemon answers", || async {
        Client::connect(Some(&socket)).await.is_ok()
    })
    .await;
    let mut client = Client::connect(Some(&socket)).await.unwrap();
    let tensors = uniform_model(34, 2, 1 << 20);
    let (manifest, held) = upload_keeping_the_fd(&socket, &tensors).await;
    let refused = held.set_len(0).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(1), "EPERM: {refused}");
    assert_eq!(held.metadata().unwrap().len(), 2 << 20);
    let groups = per_tensor_groups(&manifest);
    if let Ok(session) = client
        .open_session(options(&manifest.model_id, groups, 0, 4 << 20))
        .await
    {
        let _ = within("acquire", session.acquire(0)).await;
    }
    let mut probe = Client::connect(Some(&socket))
        .await
        .expect("the daemon still accepts");
    probe.info().await.expect("the daemon still answers");
    assert!(daemon.0.try_wait().unwrap().is_none(), "the daemon died");
}

/// A socket that accepts connections and never answers (a stuck daemon, or not one) ends every
/// command within its `--timeout`, with an error naming the call it waited for and the wait.
#[test]
fn every_command_gives_up_on_a_socket_that_never_answers() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ws.sock");
    // Never accepted: the kernel completes the connections and queues them, and nothing
    // answers on them.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let commands: [&[&str]; 4] = [
        &["status"],
        &["status", "--json"],
        &["top", "--once"],
        &["release", "m-0123456789abcdef0123456789abcdef"],
    ];
    for args in commands {
        let started = std::time::Instant::now();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_weightstream"))
            .args(["--timeout", "1", "--socket"])
            .arg(&socket)
            .args(args)
            .output()
            .unwrap();
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // release asks for the models first: it takes a name as well as an id.
        let call = if args[0] == "release" {
            "ListModels"
        } else {
            "GetInfo"
        };
        assert_eq!(
            (out.status.code(), stderr.trim_end()),
            (
                Some(1),
                &*format!(
                    "error: no answer from the daemon to {call} within 1 s: it is stuck, or the \
                     socket is not a weightstream daemon's (--timeout / WEIGHTSTREAM_TIMEOUT \
                     sets the wait)"
                )
            ),
            "{args:?}"
        );
        assert!(
            took < std::time::Duration::from_secs(10),
            "{args:?}: {took:?}"
        );
    }
}
