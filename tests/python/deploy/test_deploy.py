"""The deployment files say what the README says: the Kubernetes manifests share the host IPC
namespace and the socket's hostPath between the daemon and trainers, and the unit is a notify
service with the memlock limit the CUDA backend needs. (`systemd-analyze verify` runs in
tests/run.sh.)"""

from __future__ import annotations

import yaml

from tests.daemon import ROOT

DEPLOY = ROOT / "deploy"


def test_daemonset_and_trainer_share_ipc_and_the_socket():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "DaemonSet"]
    pod = docs[1]["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True
    assert pod["runtimeClassName"] == "nvidia"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["socket"]["hostPath"]["path"] == "/run/weightstream"
    [container] = pod["containers"]
    assert {"name": "socket", "mountPath": "/run/weightstream"} in container["volumeMounts"]
    config = docs[0]["data"]["config.toml"]
    assert 'socket = "/run/weightstream/weightstream.sock"' in config

    trainer = yaml.safe_load((DEPLOY / "kubernetes" / "trainer-pod.yaml").read_text())["spec"]
    assert trainer["hostIPC"] is True
    assert trainer["securityContext"]["supplementalGroups"] == [pod["securityContext"]["fsGroup"]]
    assert trainer["volumes"][0]["hostPath"]["path"] == "/run/weightstream"
    env = {e["name"]: e["value"] for e in trainer["containers"][0]["env"]}
    assert env["WEIGHTSTREAM_SOCKET"] == "/run/weightstream/weightstream.sock"


def test_unit_is_a_notify_service_with_its_runtime_directory():
    lines = {
        line.split("=", 1)[0]: line.split("=", 1)[1]
        for line in (DEPLOY / "weightstream.service").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    }
    assert lines["Type"] == "notify"
    assert lines["RuntimeDirectory"] == "weightstream"
    assert lines["LimitMEMLOCK"] == "infinity"
    assert lines["Restart"] == "on-failure"
    assert lines["User"] == lines["Group"] == "weightstream"
    assert "PrivateDevices" not in lines and "PrivateIPC" not in lines
