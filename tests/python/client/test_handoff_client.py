"""``weightstream.Client`` (the native client) over the handoff socket, against a fake daemon in
this process (a grpcio servicer and a handoff listener that keep fds as the daemon
does): loads pass the opened files with a token, uploads write through the fd and unmap before
the commit (the fake seals the memfd against writes there, as the daemon does), host regions map
the fd read-only, lists are paged, and paths that do not resolve are refused before anything is
sent. Needs no daemon binary. (The handoff wire and the path rules themselves: client-rs's
``handoff.rs`` and ``sources.rs`` unit tests.)

The fake's gRPC stubs are generated from ``proto/`` into a temporary directory (grpcio-tools):
the package itself has none, its protocol being client-rs's."""

from __future__ import annotations

import fcntl
import importlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import pytest
import torch
import weightstream

grpc = pytest.importorskip("grpc")
protoc = pytest.importorskip("grpc_tools.protoc")

pytestmark = pytest.mark.no_daemon

PROTO = Path(__file__).resolve().parents[3] / "proto" / "weightstream" / "v1" / "weightstream.proto"


def _stubs():
    """``(pb, rpc)`` generated from the proto under another module name (``fake_ws``), so that
    they do not shadow the ``weightstream`` package."""
    out = tempfile.mkdtemp(prefix="ws-fake-stubs-")
    shutil.copy(PROTO, os.path.join(out, "fake_ws.proto"))
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = ["protoc", f"-I{out}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
    assert protoc.main([*args, "fake_ws.proto"]) == 0, "grpc_tools.protoc failed"
    sys.path.insert(0, out)
    try:
        return importlib.import_module("fake_ws_pb2"), importlib.import_module("fake_ws_pb2_grpc")
    finally:
        sys.path.remove(out)


pb, rpc = _stubs()


class Handoff:
    """The daemon's half of the handoff socket, enough for the client: PUT keeps the fds under
    a token, GET passes the fd a secret names."""

    def __init__(self, path: str):
        self.drops: dict[str, list[int]] = {}
        self.objects: dict[str, int] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                line, fds, _, _ = socket.recv_fds(conn, 4096, 253)
                if line == b"PUT\n":
                    token = secrets.token_hex(16)
                    self.drops[token] = fds
                    conn.sendall(f"OK {token}\n".encode())
                elif line.startswith(b"GET ") and line[4:-1].decode() in self.objects:
                    fd = self.objects[line[4:-1].decode()]
                    socket.send_fds(conn, [f"OK {os.fstat(fd).st_size}\n".encode()], [fd])
                else:
                    conn.sendall(b"ERR no such secret\n")

    def share(self, fd: int) -> str:
        secret = secrets.token_hex(16)
        self.objects[secret] = fd
        return secret

    def close(self):
        self.listener.close()


def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, len(data))
    os.pwrite(fd, data, 0)
    return fd


class FakeDaemon(rpc.WeightStreamServicer):
    REGION = bytes(range(256)) * 16

    def __init__(self, handoff: Handoff):
        self.handoff = handoff
        self.loads: list = []
        self.uploads: dict[str, int] = {}
        self.committed: bytes | None = None
        self.models = [pb.ModelManifest(model_id=f"m-{i}") for i in range(5)]

    def LoadModel(self, request, context):
        fds = self.handoff.drops.pop(request.fd_token, None)
        if fds is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fd_token: unknown")
        contents = []
        for fd in fds:
            contents.append(os.pread(fd, 1 << 16, 0))
            os.close(fd)
        self.loads.append((list(request.paths), contents))
        yield pb.LoadModelEvent(manifest=pb.ModelManifest(model_id="m-load", name=request.name))

    def BeginUpload(self, request, context):
        slots, offset = [], 0
        for t in request.tensors:
            nbytes = 4 * max(1, int(torch.tensor(list(t.shape)).prod()))
            slots.append(pb.UploadTensor(name=t.name, offset=offset, nbytes=nbytes))
            offset += nbytes
        fd = memfd("ws-test-upload", bytes(offset))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.uploads["up-1"] = fd
        secret = self.handoff.share(fd)
        return pb.BeginUploadResponse(
            upload_id="up-1", size=offset, tensors=slots, fd_secret=secret
        )

    def CommitUpload(self, request, context):
        fd = self.uploads.pop(request.upload_id)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        except OSError:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"upload_id '{request.upload_id}': the upload region is still mapped writable "
                "by the client: unmap it before CommitUpload",
            )
        self.committed = os.pread(fd, 1 << 16, 0)
        return pb.CommitUploadResponse(manifest=pb.ModelManifest(model_id="m-up"))

    def ListModels(self, request, context):
        start = int(request.page_token or 0)
        end = start + 2
        token = str(end) if end < len(self.models) else ""
        return pb.ListModelsResponse(
            models=self.models[start:end], store_bytes=7, next_page_token=token
        )

    def OpenSession(self, request, context):
        n = len(self.REGION)
        secret = self.handoff.share(memfd("ws-test-region", self.REGION))
        layout = pb.GroupLayout(
            group=0,
            name="w",
            nbytes=n,
            tensors=[pb.TensorPlacement(name="w", dtype=pb.DTYPE_U8, shape=[n], nbytes=n)],
        )
        return pb.OpenSessionResponse(
            session_id="s-1",
            regions=[pb.Region(index=0, size=n, fd_secret=secret)],
            groups=[layout],
        )

    def Run(self, request_iterator, context):
        for msg in request_iterator:
            if msg.HasField("attach"):
                yield pb.ServerMessage(attached=pb.Attached(session_id=msg.attach.session_id))
            elif msg.HasField("acquire"):
                yield pb.ServerMessage(staged=pb.Staged(ticket=msg.acquire.ticket))

    def CloseSession(self, request, context):
        return pb.CloseSessionResponse()


@pytest.fixture
def fake(tmp_path):
    sock = str(tmp_path / "ws.sock")
    handoff = Handoff(sock + ".fd")
    daemon = FakeDaemon(handoff)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    rpc.add_WeightStreamServicer_to_server(daemon, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    daemon.client = weightstream.connect(sock)
    yield daemon
    server.stop(None)
    handoff.close()


def test_load_passes_the_opened_files_and_their_display_paths(fake, tmp_path):
    (tmp_path / "model").mkdir()
    for name, data in [("b.safetensors", b"second"), ("a.safetensors", b"first")]:
        (tmp_path / "model" / name).write_bytes(data)
    manifest = fake.client.load_model([str(tmp_path / "model")], "m")
    assert manifest.model_id == "m-load"
    paths = [str(tmp_path / "model" / f) for f in ("a.safetensors", "b.safetensors")]
    assert fake.loads == [(paths, [b"first", b"second"])]
    # Session.reconnect loads again from what the user named.
    assert fake.client._loaded["m-load"] == [str(tmp_path / "model")]


def test_upload_writes_through_the_fd_and_unmaps_before_commit(fake):
    tensors = {"a": torch.arange(4, dtype=torch.float32), "b": torch.full((2,), 7.0)}
    manifest, _ = fake.client.upload_model("up", tensors)
    assert manifest.model_id == "m-up"
    want = b"".join(t.numpy().tobytes() for t in tensors.values())
    assert fake.committed == want


def test_host_regions_are_mapped_read_only_from_the_fd(fake):
    session = fake.client.open_session("m-1", [("w", ["w"])], 1 << 20)
    try:
        ticket = session.acquire(0)
        assert bytes(ticket.tensors[0].numpy()) == FakeDaemon.REGION
        with open("/proc/self/maps") as f:
            maps = [line.split() for line in f if "memfd:ws-test-region" in line]
        assert [m[1] for m in maps] == ["r--s"], maps
        session.release(ticket)
    finally:
        session.close()


def test_lists_are_read_page_by_page(fake):
    listed = fake.client.list_models()
    assert [m.model_id for m in listed.models] == [f"m-{i}" for i in range(5)]
    assert listed.store_bytes == 7


def test_paths_that_do_not_resolve_are_refused_before_sending(fake, tmp_path):
    with pytest.raises(weightstream.RequestRejected) as e:
        fake.client.load_model([str(tmp_path / "nope.safetensors")])
    assert e.value.code == "NOT_FOUND"
    assert e.value.message == f"paths: no such file: {tmp_path / 'nope.safetensors'}"
    assert fake.loads == []


def test_the_native_client_names_the_handoff_socket_and_fetches_fds(fake):
    assert fake.client.handoff_socket == fake.client.socket + ".fd"
    secret = fake.handoff.share(memfd("ws-test-fetch", b"fetched"))
    fd, size = fake.client.fetch_fd(secret)
    try:
        assert (os.pread(fd, 16, 0), size) == (b"fetched", 7)
    finally:
        os.close(fd)
    with pytest.raises(weightstream.RequestRejected, match="^no such secret$"):
        fake.client.fetch_fd("0" * 32)
