"""Connection to the daemon: models, uploads, sessions.

The protocol is the native client's (``weightstream._native``, a PyO3 layer over client-rs):
one tokio runtime per process, made again in a forked child (DataLoader workers fork), a
connection made on first use in each process, the GIL released while a call waits, and every
call failing fast with ``DaemonUnavailable`` when the daemon is not there. This module keeps the
Python API and turns torch tensors into what the native client writes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from weightstream import _native
from weightstream.errors import RequestRejected
from weightstream.protocol import (
    BeginUploadResponse,
    GetInfoResponse,
    ListModelsResponse,
    LoadProgress,
    ModelManifest,
    SessionInfo,
)

if TYPE_CHECKING:
    import torch

    from weightstream.quantize import Fp8Weight
    from weightstream.regions import StateRegion
    from weightstream.session import Session

SYSTEM_SOCKET = _native.SYSTEM_SOCKET
SOCKET_ENV = _native.SOCKET_ENV

#: How long a model reference (``load_model``, ``upload_model``, ``commit_upload``) lasts:
#: ``"cached"`` (the default) stays after this process exits, as a cache entry the daemon evicts
#: (least recently used first) when a load or upload needs the memory and no session, pin or
#: live process holds the model; ``"connection"`` is given back when this process's connection
#: closes (it exits); ``"pinned"`` stays, never evicted, until ``release_model``.
RETENTIONS = ("cached", "connection", "pinned")


def socket_path(socket: str | os.PathLike[str] | None = None) -> str:
    """The daemon's socket, as every weightstream program finds it: ``socket``, else
    ``$WEIGHTSTREAM_SOCKET``, else the system socket (``SYSTEM_SOCKET``, the service's) if it
    exists, else the user's own: ``$XDG_RUNTIME_DIR/weightstream.sock``, or
    ``/tmp/weightstream-<uid>/weightstream.sock`` without ``XDG_RUNTIME_DIR``."""
    return os.fspath(_native.socket_path(socket or None))


class Client:
    def __init__(self, socket: str | None = None):
        self._native = _native.Client(socket or None)
        self.socket = os.fspath(self._native.socket)

    @property
    def _loaded(self) -> dict[str, list[str]]:
        """The paths each model this client loaded was named by (``Session.reconnect`` loads
        them again into a restarted daemon: same files, same model id)."""
        return {k: [str(p) for p in v] for k, v in self._native.loaded.items()}

    def reconnect(self, timeout: float = 30.0):
        """Waits until a daemon answers on the socket (one restarted there); raises
        ``DaemonUnavailable`` ("no daemon answered") after ``timeout`` seconds. Sessions are not
        moved: ``Session.reconnect`` does that."""
        self._native.reconnect(timeout)

    def restore_model(self, model_id: str) -> bool:
        """Loads ``model_id`` again from the files this client loaded it from, if the daemon
        no longer has it (a restarted daemon starts empty). True if it was loaded again."""
        return self._native.restore_model(model_id)

    def info(self) -> GetInfoResponse:
        return self._native.info()

    @property
    def handoff_socket(self) -> str:
        """The daemon's handoff socket, where file descriptors pass (next to its socket)."""
        return str(self._native.handoff_socket)

    def fetch_fd(self, secret: str) -> tuple[int, int]:
        """The fd (the caller closes it) and size of the region an ``fd_secret`` names."""
        return self._native.fetch_fd(secret)

    def load_model(
        self,
        paths: Iterable[str],
        name: str = "",
        progress: Callable[[LoadProgress], None] | None = None,
        quantize: str | None = None,
        *,
        retention: str = "cached",
        tensors: Iterable[str] | None = None,
        coding: str = "none",
    ) -> ModelManifest:
        """Loads safetensors into the store: files, ``*.safetensors.index.json`` files (their
        shards) or directories (their ``*.safetensors``). This process opens the files, with
        its own rights, and passes them to the daemon (at most 253 files per load).

        ``quantize="fp8"`` (or ``"fp8_e4m3_block64"``): the daemon quantizes each ``.weight``
        of rank >= 2 in BF16/F16/F32 while loading and keeps only that copy; the manifest's
        tensors say ``quantization``, ``scale_shape`` and ``scale_offset``.

        ``retention``: how long the reference this load takes lasts (see ``RETENTIONS``).

        ``tensors``: the tensors to load, by their names in the files (order does not matter;
        each once); ``None`` or empty: every tensor. The daemon reads, holds and charges only
        these, and refuses a name none of the files holds (``InvalidArgument``). The model id
        covers the selection: the same files and names give the same model, other names
        another one; the manifest lists only the tensors loaded.

        ``coding="rans8"``: the daemon holds the 8-bit tensors (quantized weights and other
        one-byte tensors) of 1 MiB or more coded losslessly where that saves at least 1/32 of
        their bytes, so fewer bytes are held and copied to the device; a session decodes them
        on the device after each copy (``Session``), bit for bit. ``"none"``: as they are. The
        model id covers the coding."""
        paths = [os.path.abspath(p) for p in paths]
        names = [] if tensors is None else list(tensors)
        return self._native.load_model(paths, name, progress, quantize, retention, names, coding)

    def upload_model(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor | Fp8Weight],
        quantize: Iterable[str] = (),
        *,
        phases: dict | None = None,
        retention: str = "cached",
        quantize_on: str = "auto",
        labels: Mapping[str, tuple[str, int]] | None = None,
        coding: str = "none",
    ) -> tuple[ModelManifest, bool]:
        """Writes tensors into a shared-memory region the daemon makes (the native client
        fetches its fd from the handoff socket, copies each tensor's bytes in with the GIL
        released, and unmaps it before the commit), then commits them. The tensors named in
        ``quantize`` are kept in fp8_e4m3_block64 only. An ``Fp8Weight`` is written
        pre-quantized in its format (data, zero padding to 16 bytes, scales: torchao's weights,
        ``weightstream.torch.torchao_weights``). Returns the manifest and whether an identical
        model was already stored.

        ``quantize_on``: where the tensors named in ``quantize`` are quantized. ``"daemon"``: the
        daemon quantizes them at commit, on every core, into a new arena. ``"client"``: this
        process quantizes each on its device as it is copied (``quantize_fp8_block64``, the
        daemon's bytes), in chunks of rows, and writes it in 8 bits: half the bytes of bf16 to
        reserve and write, and nothing to quantize at commit. ``"auto"`` (the default): the
        client for tensors on a CUDA device, the daemon for those in host memory. Either way
        the model (and its id) is the same; a non-finite weight is refused with the same
        ``RequestRejected``, naming the tensor and the index of its first non-finite value.
        A tensor that cannot be quantized (its dtype or rank) is left to the daemon, which
        refuses it.

        ``retention``: how long the reference this upload takes lasts (see ``RETENTIONS``).

        ``labels``: name -> (format, weights) for raw tensors that are parts of a packed format
        the daemon cannot name (``weightstream.torch.packed``: the form's name on each of a
        layer's inner tensors, its out x in weights on the first, 0 on the others). The
        manifest's ``formats`` then counts their bytes and bits per weight under that name.
        Labels are metadata: the same bytes uploaded with other labels (or none) are the same
        model, which keeps the labels of the upload that stored it.

        ``coding``: how the daemon holds the model, as ``load_model`` says (coded at commit,
        after quantizing).

        Whatever raises between the daemon's begin and its commit (a device out of memory
        while quantizing, a tensor whose bytes differ from its declaration, a refused commit,
        ``KeyboardInterrupt``) aborts the upload (``abort_upload``) before it propagates, as it
        was: nothing stays charged to the uid, and the same process can upload again.

        ``phases``: a dict this fills with where the time went, in seconds: ``total_s`` (the
        call) and the daemon's side of the commit, ``daemon_seal_s``, ``daemon_quantize_s``,
        ``daemon_hash_s`` and ``daemon_pin_s`` (those two at once), ``daemon_total_s``,
        ``daemon_input_bytes`` (``daemon_phases``); for tensors on a GPU (or quantized here)
        also the client's: ``begin_s`` (BeginUpload and the region's fd; the daemon reserves
        the region's pages there unless the writer page-locks), ``write_wall_s`` (writing the
        region), within it ``write_populate_s`` (faulting the region's pages in, window by
        window, on the registering threads, when the writer page-locks), ``write_register_s`` and
        ``write_unregister_s`` (page-locking the windows, summed over the threads that do it),
        ``write_wait_register_s`` (the copies waiting for a window) and ``write_copy_s``
        (issuing the copies), within that ``write_quantize_s`` (issuing the quantization of the
        ``write_quantized_tensors`` quantized here; on the CPU, doing it) and
        ``write_quantize_device_s`` (the devices' time quantizing), ``write_bytes``,
        ``write_windows``, ``write_threads``, and ``commit_s`` (CommitUpload as this process
        waits for it)."""
        from weightstream import _upload
        from weightstream.quantize import Fp8Weight

        started = time.monotonic()
        quantize = list(quantize)
        tensors = _upload.quantized_here(tensors, quantize, quantize_on)
        here = [n for n, t in tensors.items() if isinstance(t, _upload.QuantizeAtCopy)]
        quantize = [n for n in quantize if n not in here]
        on_cuda = any(_upload._located(t).type == "cuda" for t in tensors.values())
        labels = dict(labels or {})
        if on_cuda or here or any(isinstance(t, Fp8Weight) for t in tensors.values()):
            out = self._upload_by_copy(
                name,
                tensors,
                quantize,
                pin=on_cuda,
                phases=phases,
                retention=retention,
                labels=labels,
                coding=coding,
            )
        else:
            out = self._upload_native(name, tensors, quantize, retention, labels, coding)
        if phases is not None:
            phases.update(daemon_phases(out[0].phases))
            phases["total_s"] = round(time.monotonic() - started, 4)
        return out

    def _upload_native(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        quantize: Iterable[str],
        retention: str,
        labels: dict[str, tuple[str, int]],
        coding: str = "none",
    ) -> tuple[ModelManifest, bool]:
        """``upload_model`` through the native client's memcpy path (tensors in host memory)."""
        from weightstream import _dtypes

        held, payload = [], []
        for n, t in tensors.items():
            src = t.detach()
            if src.device.type != "cpu":
                src = src.cpu()
            src = src.contiguous()
            held.append(src)  # alive, and unchanged by us, until the call returns
            data = (src.data_ptr(), src.nbytes)
            payload.append((n, _dtypes.to_wire(t.dtype), list(t.shape), data))
        result = self._native.upload_model(name, payload, list(quantize), retention, labels, coding)
        del held
        return result

    def _upload_by_copy(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor | Fp8Weight],
        quantize: Iterable[str] = (),
        *,
        pin: bool,
        phases: dict | None = None,
        retention: str = "cached",
        labels: dict[str, tuple[str, int]] | None = None,
        coding: str = "none",
    ) -> tuple[ModelManifest, bool]:
        """``upload_model`` by tensor copies into the mapped region (``_upload``): for tensors on
        a CUDA device, page-locked a window at a time (``pin``) so that each copy is one DMA at
        link speed; pre-quantized weights (and those quantized here) from anywhere. A progress
        line goes to stderr when it takes more than 2 s."""
        from weightstream import _upload

        t = time.monotonic()
        progress = _upload.ProgressLine(f"weightstream: uploading {name!r}")
        # Page-locking each window faults its pages in (_upload.populate first): the daemon
        # need not reserve them before answering, and the reservation overlaps the copies.
        reserves = pin and _upload.CLIENT_RESERVES
        begun = self.begin_upload(name, tensors, quantize, client_reserves=reserves, labels=labels)
        try:
            at = {t.name: t for t in begun.tensors}
            fd, size = self.fetch_fd(begun.fd_secret)
            begin_s = time.monotonic() - t
            written = _upload.write_by_copy(
                fd,
                size,
                [at[n] for n in tensors],
                list(tensors.values()),
                pin=pin,
                progress=progress,
                reserve=reserves,
            )
            t = time.monotonic()
            quantizes = "quantizes, " if quantize else ""
            quantizes += "codes, " if coding != "none" else ""
            progress.phase(f"committing: the daemon {quantizes}seals, hashes and page-locks it")
            try:
                out = self.commit_upload(begun.upload_id, retention=retention, coding=coding)
            except RequestRejected as e:
                # A non-finite weight quantized here made a non-finite scale, which the commit
                # refuses (dropping the upload): the error the daemon gives when it quantizes.
                bad = _upload.first_non_finite(tensors)
                if bad is None:
                    raise
                raise RequestRejected("INVALID_ARGUMENT", bad) from e
        except BaseException as e:
            # Whatever ended the upload early (a device out of memory while quantizing, a
            # tensor that does not match its declaration, KeyboardInterrupt) leaves nothing
            # charged in the daemon; the caller gets that error, not the abort's.
            progress.end(ok=False)
            self._abort_after_failure(begun.upload_id, e)
            raise
        progress.end()
        if phases is not None:
            phases["begin_s"] = round(begin_s, 4)
            phases.update({f"write_{k}": v for k, v in written.as_dict().items()})
            phases["commit_s"] = round(time.monotonic() - t, 4)
        return out

    def begin_upload(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor | Fp8Weight],
        quantize: Iterable[str] = (),
        *,
        client_reserves: bool = False,
        labels: Mapping[str, tuple[str, int]] | None = None,
    ) -> BeginUploadResponse:
        """The first step of ``upload_model`` alone: declares ``tensors``' names, dtypes and
        shapes and returns the region to write them into (its fd from
        ``fetch_fd(begun.fd_secret)``, each tensor at ``begun.tensors[i].offset``). Unmap it
        before ``commit_upload``; ``abort_upload`` drops one that will not be committed (the
        daemon drops one neither committed nor aborted when this process's connection goes).
        Those named in ``quantize`` are written as they are and quantized (fp8_e4m3_block64) at
        commit; an ``Fp8Weight`` is declared pre-quantized in its format (its data's dtype and
        shape, its scales' shape), and so is a weight the writer quantizes as it copies
        (``_upload.QuantizeAtCopy``: from its shape alone). With ``client_reserves`` the daemon
        answers without reserving the region's pages (seconds for tens of GB): the writer
        faults each part in itself before writing it (``MADV_POPULATE_WRITE``, or page-locking
        it), where a plain write into a full tmpfs would be a SIGBUS. ``labels`` as in
        ``upload_model``."""
        from weightstream import _dtypes, _upload
        from weightstream.quantize import Fp8Weight

        specs = [
            (n, _dtypes.to_wire(_data(t).dtype), list(_data(t).shape)) for n, t in tensors.items()
        ]
        prequantized = {
            n: (t.format, list(t.scale.shape))
            for n, t in tensors.items()
            if isinstance(t, Fp8Weight)
        }
        prequantized.update(
            (n, (t.format, list(t.scale_shape)))
            for n, t in tensors.items()
            if isinstance(t, _upload.QuantizeAtCopy)
        )
        return self._native.begin_upload(
            name, specs, list(quantize), prequantized, client_reserves, dict(labels or {})
        )

    def commit_upload(
        self, upload_id: str, *, retention: str = "cached", coding: str = "none"
    ) -> tuple[ModelManifest, bool]:
        """The last step of ``upload_model``: the manifest of a filled upload, and whether an
        identical model was already stored. ``retention``: see ``RETENTIONS``; ``coding``: see
        ``load_model``."""
        return self._native.commit_upload(upload_id, retention, coding)

    def abort_upload(self, upload_id: str) -> None:
        """Drops an upload this client began and will not commit (writing it failed): the
        daemon gives its host bytes and its place among the uid's uploads back at once, rather
        than when this process's connection closes; what this process still maps of the region
        stays charged to its uid until unmapped and closed. ``RequestRejected`` (NOT_FOUND)
        for an upload already aborted, committed or dropped. ``upload_model`` calls it itself
        when anything raises between its begin and its commit."""
        self._native.abort_upload(upload_id)

    def _abort_after_failure(self, upload_id: str, error: BaseException) -> None:
        """``abort_upload`` after ``error`` ended an upload early. Its own failure (the upload
        already dropped by a refused commit, the daemon gone) must not hide ``error``: it is
        only noted on it."""
        try:
            self.abort_upload(upload_id)
        except Exception as e:  # noqa: BLE001 - the caller's error is the one to raise
            if not (isinstance(e, RequestRejected) and e.code == "NOT_FOUND"):
                error.add_note(f"weightstream: the upload {upload_id} was not aborted: {e}")

    def release_model(self, model_id: str, *, all_references: bool = False) -> int:
        """Gives back one of this uid's references to the model; returns the references left.
        ``all_references=True`` (root and the daemon's user only) gives back every uid's, pins
        included: the model goes once its sessions end."""
        return self._native.release_model(model_id, all_references)

    def list_models(self) -> ListModelsResponse:
        """Every model in the store (all pages)."""
        return self._native.list_models()

    def list_sessions(self) -> list[SessionInfo]:
        """Every session (all pages)."""
        return self._native.list_sessions()

    def open_session(
        self,
        model_id: str,
        groups: Iterable[tuple[str, list[str]]],
        vram_budget: int,
        *,
        staging_bytes: int = 0,
        device: torch.device | str | None = None,
        label: str = "",
        copy_bandwidth_limit: int = 0,
    ) -> Session:
        """Opens a session and attaches its stream (see ``weightstream.session.Session``).
        ``copy_bandwidth_limit``: this session's share of the device's host-to-device
        bandwidth, bytes per second (0: none; at least 100 MB/s)."""
        from weightstream.session import Session

        return Session(
            self,
            model_id,
            list(groups),
            vram_budget,
            staging_bytes=staging_bytes,
            device=device,
            label=label,
            copy_bandwidth_limit=copy_bandwidth_limit,
        )

    def alloc_state_region(self, session_id: str, nbytes: int, label: str = "") -> StateRegion:
        """A state region of ``nbytes`` (rounded up to whole pages) for session ``session_id``,
        one this client opened, mapped read-write (``weightstream.regions``; usually through
        ``Session.alloc_state_region``). ``label`` names it in the daemon's log."""
        from weightstream.regions import StateRegion

        region_id, size, fd = self._native.alloc_state_region(session_id, nbytes, label)
        return StateRegion(self.free_state_region, session_id, region_id, size, fd, label)

    def free_state_region(self, session_id: str, region_id: str):
        """Frees a state region in the daemon before its session ends (``StateRegion.close``
        does it, after unmapping)."""
        self._native.free_state_region(session_id, region_id)

    def __repr__(self):
        return f"Client(socket={self.socket!r})"


def _data(t: torch.Tensor | Fp8Weight):
    """What an upload entry's dtype and shape are read from (an ``Fp8Weight``'s data, a
    NamedTuple told from a tensor without importing torch here; a ``QuantizeAtCopy`` itself)."""
    return t.data if isinstance(t, tuple) else t


def daemon_phases(p) -> dict:
    """A manifest's ``StorePhases`` (None: no phases) as ``{"daemon_<phase>_s": seconds}`` and
    ``daemon_input_bytes``."""
    if p is None:
        return {}
    names = ("alloc", "read", "seal", "quantize", "hash", "pin", "total")
    out = {f"daemon_{n}_s": round(getattr(p, f"{n}_ns") / 1e9, 4) for n in names}
    out["daemon_input_bytes"] = p.input_bytes
    return out


def connect(socket: str | None = None) -> Client:
    """A client of the daemon at ``socket`` (default: ``socket_path()``'s rules). Connects
    lazily; a call to a daemon that is not there raises ``DaemonUnavailable`` at once, naming
    the places it looked."""
    return Client(socket)
