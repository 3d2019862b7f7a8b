"""Connection to the daemon: models, uploads, sessions.

The gRPC channel is created lazily in each process (channels do not survive ``fork``, and
DataLoader workers fork), and every call fails fast with ``DaemonUnavailable`` when the daemon
is not there.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping

import grpc
import torch

from weightstream import _dtypes, _handoff, _sources
from weightstream.errors import DaemonUnavailable, RequestRejected, WeightstreamError
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as rpc

DEFAULT_SOCKET = "/run/weightstream/weightstream.sock"
SOCKET_ENV = "WEIGHTSTREAM_SOCKET"
#: Unary calls give up after this many seconds (loads and uploads have none).
CALL_TIMEOUT = 60.0
#: How often ``Client.reconnect`` asks again while no daemon answers.
RECONNECT_INTERVAL = 0.05


def socket_path(socket: str | None = None) -> str:
    """``socket``, else ``$WEIGHTSTREAM_SOCKET``, else the default."""
    return socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def rpc_error(socket: str, e: grpc.RpcError) -> Exception:
    """The exception for a failed call: unavailable daemons apart from refused requests."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, None):
        return DaemonUnavailable(
            f"cannot reach the weightstream daemon at {socket}: {details} "
            f"(is `weightstream serve` running? {SOCKET_ENV} names another socket)"
        )
    return RequestRejected(code.name, details)


class Client:
    def __init__(self, socket: str | None = None):
        self.socket = socket_path(socket)
        self._lock = threading.Lock()
        self._pid = None
        self._channel = None
        self._stub = None
        # The paths each model this client loaded was named by, to open and load them again
        # into a restarted daemon (``Session.reconnect``): same files, same model id.
        self._loaded: dict[str, list[str]] = {}

    @property
    def stub(self) -> rpc.WeightStreamStub:
        """The stub of this process's channel (made on first use, again after a fork)."""
        with self._lock:
            if self._pid != os.getpid():
                self._channel = grpc.insecure_channel(
                    f"unix://{self.socket}",
                    options=[
                        # grpc-core would send the socket path as :authority, which the
                        # daemon's HTTP/2 stack refuses.
                        ("grpc.default_authority", "localhost"),
                        ("grpc.max_receive_message_length", 1 << 30),
                        ("grpc.max_send_message_length", 1 << 30),
                    ],
                )
                self._stub = rpc.WeightStreamStub(self._channel)
                self._pid = os.getpid()
            return self._stub

    def _drop_channel(self):
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._pid = self._channel = self._stub = None

    def reconnect(self, timeout: float = 30.0):
        """Waits until a daemon answers on the socket (one restarted there), making a new
        channel when the current one cannot reach it; raises ``DaemonUnavailable`` after
        ``timeout`` seconds. Sessions are not moved: ``Session.reconnect`` does that."""
        deadline = time.monotonic() + timeout
        try:
            self.call("GetInfo", pb.GetInfoRequest(), timeout=max(0.01, min(timeout, 2.0)))
            return
        except DaemonUnavailable:
            pass
        while True:
            # A fresh channel: the old one may sit in its reconnect backoff for seconds.
            self._drop_channel()
            left = deadline - time.monotonic()
            try:
                self.call("GetInfo", pb.GetInfoRequest(), timeout=max(0.01, min(left, 2.0)))
                return
            except DaemonUnavailable as e:
                last = e
            if time.monotonic() + RECONNECT_INTERVAL >= deadline:
                raise DaemonUnavailable(f"no daemon answered within {timeout} s: {last}")
            time.sleep(RECONNECT_INTERVAL)

    def restore_model(self, model_id: str) -> bool:
        """Loads ``model_id`` again from the files this client loaded it from, if the daemon
        no longer has it (a restarted daemon starts empty). True if it was loaded again."""
        if any(m.model_id == model_id for m in self.list_models().models):
            return False
        paths = self._loaded.get(model_id)
        if paths is None:
            return False  # OpenSession will say NOT_FOUND with the id
        manifest = self.load_model(paths)
        if manifest.model_id != model_id:
            self.release_model(manifest.model_id)
            raise RequestRejected(
                "FAILED_PRECONDITION",
                f"loading {paths} again gave model {manifest.model_id}, not {model_id}: "
                "the files changed",
            )
        return True

    def call(self, method: str, request, timeout: float | None = CALL_TIMEOUT):
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise rpc_error(self.socket, e) from None

    def info(self) -> pb.GetInfoResponse:
        return self.call("GetInfo", pb.GetInfoRequest())

    @property
    def handoff_socket(self) -> str:
        """The daemon's handoff socket, where file descriptors pass (next to its socket)."""
        return _handoff.handoff_path(self.socket)

    def fetch_fd(self, secret: str) -> tuple[int, int]:
        """The fd (the caller closes it) and size of the region an ``fd_secret`` names."""
        return _handoff.get_fd(self.handoff_socket, secret)

    def load_model(
        self,
        paths: Iterable[str],
        name: str = "",
        progress: Callable[[pb.LoadProgress], None] | None = None,
    ) -> pb.ModelManifest:
        """Loads safetensors into the store: files, ``*.safetensors.index.json`` files (their
        shards) or directories (their ``*.safetensors``). This process opens the files, with
        its own rights, and passes them to the daemon (at most 253 files per load)."""
        paths = [os.path.abspath(p) for p in paths]
        opened = _sources.open_sources(paths)
        try:
            token = _handoff.put_fds(self.handoff_socket, [fd for _, fd in opened])
        finally:
            for _, fd in opened:
                os.close(fd)
        request = pb.LoadModelRequest(paths=[p for p, _ in opened], name=name, fd_token=token)
        try:
            for event in self.stub.LoadModel(request):
                if event.HasField("manifest"):
                    self._loaded[event.manifest.model_id] = paths
                    return event.manifest
                if progress is not None:
                    progress(event.progress)
        except grpc.RpcError as e:
            raise rpc_error(self.socket, e) from None
        raise DaemonUnavailable("LoadModel ended without a manifest")

    def upload_model(
        self, name: str, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[pb.ModelManifest, bool]:
        """Writes tensors into a shared-memory region the daemon makes (its fd comes from the
        handoff socket; the mapping is closed before the commit, which needs it gone), then
        commits them. Returns the manifest and whether an identical model was already stored."""
        infos = [
            pb.TensorInfo(name=n, dtype=_dtypes.to_wire(t.dtype), shape=list(t.shape))
            for n, t in tensors.items()
        ]
        begun = self.call("BeginUpload", pb.BeginUploadRequest(name=name, tensors=infos))
        fd, _ = self.fetch_fd(begun.fd_secret)
        try:
            m = mmap.mmap(fd, begun.size)
        finally:
            os.close(fd)
        with m:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                region = torch.frombuffer(m, dtype=torch.uint8)
            for slot, t in zip(begun.tensors, tensors.values(), strict=True):
                if slot.nbytes:
                    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                    region[slot.offset : slot.offset + slot.nbytes].copy_(src.cpu())
            del region
        done = self.call(
            "CommitUpload", pb.CommitUploadRequest(upload_id=begun.upload_id), timeout=None
        )
        return done.manifest, done.deduplicated

    def release_model(self, model_id: str) -> int:
        refcount = self.call("ReleaseModel", pb.ReleaseModelRequest(model_id=model_id)).refcount
        if refcount == 0:
            self._loaded.pop(model_id, None)
        return refcount

    def list_models(self) -> pb.ListModelsResponse:
        """Every model in the store (all pages)."""
        models = pb.ListModelsResponse()
        for page in self._pages("ListModels", pb.ListModelsRequest):
            models.models.extend(page.models)
            models.store_bytes = page.store_bytes
        return models

    def list_sessions(self) -> list:
        """Every session (all pages)."""
        return [
            s for page in self._pages("ListSessions", pb.ListSessionsRequest) for s in page.sessions
        ]

    def _pages(self, method: str, request_type):
        token = ""
        while True:
            page = self.call(method, request_type(page_token=token))
            yield page
            if not page.next_page_token:
                return
            if page.next_page_token == token:
                raise WeightstreamError(f"{method} gave the same page token again")
            token = page.next_page_token

    def open_session(
        self,
        model_id: str,
        groups: Iterable[tuple[str, list[str]]],
        vram_budget: int,
        *,
        staging_bytes: int = 0,
        device: torch.device | str | None = None,
        label: str = "",
    ):
        """Opens a session and attaches its stream (see ``weightstream.session.Session``)."""
        from weightstream.session import Session

        return Session(
            self,
            model_id,
            list(groups),
            vram_budget,
            staging_bytes=staging_bytes,
            device=device,
            label=label,
        )


def connect(socket: str | None = None) -> Client:
    """A client of the daemon at ``socket`` (default: ``$WEIGHTSTREAM_SOCKET`` or
    ``/run/weightstream/weightstream.sock``). Connects lazily; a call to a daemon that is not
    there raises ``DaemonUnavailable`` at once."""
    return Client(socket)
