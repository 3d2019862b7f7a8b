"""GPU suite of the CUDA backend: run by tests/gpu/run.sh on the GPU machine.

Starts a real daemon (the release binary, built where Rust is installed) and checks, with plain
torch + CUDA IPC consumers: every byte of every group under a plan; ordering by the ready
event (with a negative control that must see stale bytes); two consumer processes with one host
copy; a consumer killed mid-step (its device memory comes back, the others go on); and the
daemon's shutdown failing a consumer's next call fast. Prints PASS/FAIL per check and
"N passed, M failed"; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import weightstream
from safetensors.torch import load_file, save_file

from tests.daemon import Daemon
from tests.gpu import wsgpu
from tests.gpu.wsgpu import pb

MiB = 1 << 20


def make_model(path: Path) -> dict:
    """Random tensors of several dtypes and sizes, generated on the GPU (fast), saved as
    safetensors; two 256 MiB tensors serve the ordering check."""
    g = torch.Generator(device="cuda").manual_seed(1234)
    tensors = {}
    for i in range(24):
        rows = 256 * (1 + (i * 7) % 16)
        tensors[f"blocks.{i:02d}.weight"] = torch.randn(
            rows, 3072, generator=g, device="cuda", dtype=torch.bfloat16
        )
        tensors[f"blocks.{i:02d}.bias"] = torch.randn(
            rows, generator=g, device="cuda", dtype=torch.float32
        )
    tensors["embed.int8"] = torch.randint(
        -128, 127, (1000, 333), generator=g, device="cuda", dtype=torch.int8
    )
    tensors["norm.f16"] = torch.randn(4096, generator=g, device="cuda", dtype=torch.float16)
    for name in ("big.a", "big.b"):
        tensors[name] = torch.randn(128 * MiB, generator=g, device="cuda", dtype=torch.bfloat16)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path))
    return tensors


class Suite:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = []
        self.tmp = Path(tempfile.mkdtemp(prefix="ws-gpu-"))
        self.socket = str(self.tmp / "ws.sock")
        self.model_path = str(self.tmp / "model.safetensors")
        self.daemon = None

    def start_daemon(self):
        self.daemon = Daemon(
            self.tmp,
            binary=self.args.bin,
            backend="cuda",
            socket=self.socket,
            log=self.out / "daemon.log",
            log_level="info",
            ready_s=60,
        )
        self.client = self.daemon.client

    def check(self, name, fn):
        started = time.monotonic()
        try:
            detail = fn() or ""
            self.results.append({"check": name, "ok": True, "detail": detail})
            print(f"PASS {name} ({time.monotonic() - started:.1f} s) {detail}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            self.results.append({"check": name, "ok": False, "detail": repr(e)})
            print(f"FAIL {name}: {e!r}", flush=True)
            traceback.print_exc()

    # --- checks -----------------------------------------------------------------------

    def info(self):
        info = self.client.info()
        assert info.backend == pb.BACKEND_CUDA, info.backend
        dev = info.devices[0]
        torch_uuid = str(torch.cuda.get_device_properties(0).uuid)
        assert dev.uuid.removeprefix("GPU-") == torch_uuid.removeprefix("GPU-"), (
            dev.uuid,
            torch_uuid,
        )
        assert dev.pci_bus_id and dev.total_memory > 0
        return f"{dev.name} {dev.uuid} {dev.pci_bus_id}"

    def load_model(self):
        self.manifest = self.client.load_model([self.model_path], "gpu-suite")
        names = [t.name for t in self.manifest.tensors]
        assert set(names) == set(self.expected), "manifest tensors differ from the file"
        return f"{len(names)} tensors, {self.manifest.total_bytes / MiB:.0f} MiB"

    def small_groups(self):
        return [(t.name, [t.name]) for t in self.manifest.tensors if not t.name.startswith("big.")]

    def small_session(self):
        """A session of the small groups with a 96 MiB staging arena and nothing resident, so
        that groups are evicted and copied again."""
        return wsgpu.Session(
            self.client,
            self.manifest.model_id,
            budget=96 * MiB,
            staging=96 * MiB,
            groups=self.small_groups(),
        )

    def run_steps(self, session, steps, send_plan=True):
        """Forward in order, backward in reverse; checks every byte after the ready wait."""
        n = len(session.opened.groups)
        order = list(range(n)) + list(reversed(range(n)))
        mismatches = 0
        for step in range(steps):
            for g in order:
                ticket, staged, view = session.acquire(g)
                session.wait_ready(staged)
                layout = session.opened.groups[g]
                want = self.expected_bytes[layout.tensors[0].name]
                if not torch.equal(view[: want.numel()], want):
                    mismatches += 1
                session.release(ticket, staged)
            if step == 0 and send_plan:
                session.plan(order)
        return mismatches

    def bytes_under_plan(self):
        session = self.small_session()
        first = self.run_steps(session, 1)
        before = session.stats()
        later = self.run_steps(session, 4, send_plan=False)
        after = session.stats()
        session.close()
        hits = after.hits - before.hits
        acquires = after.acquires - before.acquires
        assert first == 0 and later == 0, f"{first} + {later} groups with wrong bytes"
        assert acquires > 0 and hits / acquires >= 0.95, f"hit rate {hits}/{acquires}"
        assert after.bytes_copied > 0 and after.reuses > 0
        return f"hit rate {hits / acquires:.3f}, copied {after.bytes_copied / MiB:.0f} MiB"

    def staged_within_device(self):
        """A session with every small group resident, and the small session beside it: its
        staging copies come from the first's resident regions, within the device (none over
        the link), byte for byte."""
        groups = self.small_groups()
        sizes = {t.name: t.nbytes for t in self.manifest.tensors}
        everything = sum(sizes[g] for g, _ in groups) + 96 * MiB * 2
        holder = wsgpu.Session(
            self.client, self.manifest.model_id, budget=everything, staging=96 * MiB, groups=groups
        )
        try:
            assert all(g.resident for g in holder.opened.groups), "not all resident"
            session = self.small_session()
            wrong = self.run_steps(session, 2)
            stats = session.stats()
            session.close()
        finally:
            holder.close()
        assert wrong == 0, f"{wrong} groups with wrong bytes"
        assert stats.bytes_copied == 0 and stats.bytes_from_device > 0, stats
        return f"{stats.bytes_from_device / MiB:.0f} MiB within the device, {stats.copies} copies"

    def ordering(self):
        big = [t for t in self.manifest.tensors if t.name.startswith("big.")]
        groups = [(t.name, [t.name]) for t in big]
        size = max(t.nbytes for t in big)
        session = wsgpu.Session(
            self.client, self.manifest.model_id, budget=size + MiB, staging=size, groups=groups
        )
        waited_ok, control_stale = 0, 0
        trials = 8
        for i in range(trials):
            session.regions[0].fill_(0xAB)  # poison: stale bytes are recognisable
            torch.cuda.synchronize()
            ticket, staged, view = session.acquire(i % 2)
            want = self.expected_bytes[big[i % 2].name]
            # Negative control: read without waiting on the ready event.
            if not torch.equal(view[: want.numel()], want):
                control_stale += 1
            session.wait_ready(staged)
            if torch.equal(view[: want.numel()], want):
                waited_ok += 1
            session.release(ticket, staged)
            torch.cuda.synchronize()
        session.close()
        assert waited_ok == trials, f"after the wait {waited_ok}/{trials} reads were fresh"
        assert control_stale > 0, "the control never saw stale bytes: the check cannot fail"
        return f"waited: {waited_ok}/{trials} fresh; no wait: {control_stale}/{trials} stale"

    def spawn(self, role, *extra):
        return subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.suite", "--role", role, "--socket", self.socket]
            + ["--model", self.model_path, "--out", str(self.out), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def two_consumers(self):
        barrier = self.tmp / "barrier"
        barrier.mkdir(exist_ok=True)
        procs = [self.spawn("consumer", "--barrier", str(barrier), "--id", str(i)) for i in (0, 1)]
        wsgpu.wait_for(
            "both consumers",
            lambda: (
                len(list(barrier.glob("ready-*"))) == 2 or any(p.poll() is not None for p in procs)
            ),
            120,
        )
        assert all(p.poll() is None for p in procs), "a consumer exited before the barrier"
        sessions = self.client.list_sessions()
        models = self.client.list_models()
        (barrier / "go").touch()
        outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        assert all(o["mismatches"] == 0 for o in outs), outs
        assert outs[0]["model_id"] == outs[1]["model_id"] == self.manifest.model_id, outs
        assert len(sessions) == 2, f"{len(sessions)} sessions open at once"
        assert len(models.models) == 1, f"{len(models.models)} models"
        assert models.store_bytes == self.manifest.total_bytes, (
            models.store_bytes,
            self.manifest.total_bytes,
        )
        return f"2 sessions at once, one host copy of {models.store_bytes / MiB:.0f} MiB"

    def sigkill(self):
        survivor = self.small_session()
        assert self.run_steps(survivor, 1) == 0
        torch.cuda.synchronize()
        baseline = torch.cuda.mem_get_info()[0]
        victim = self.spawn("holder")
        line = victim.stdout.readline().split()
        assert line and line[0] == "HOLDING", line
        victim_session = line[1]
        held = baseline - torch.cuda.mem_get_info()[0]
        assert held >= 2048 * MiB, f"the victim's staging was not visible ({held / MiB:.0f} MiB)"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)

        def gone():
            ids = [s.session_id for s in self.client.list_sessions()]
            return victim_session not in ids

        wsgpu.wait_for("the victim's session to go", gone, 30)
        wsgpu.wait_for(
            "device memory to come back",
            lambda: abs(torch.cuda.mem_get_info()[0] - baseline) <= 2 * MiB,
            30,
        )
        assert self.run_steps(survivor, 2, send_plan=False) == 0, "survivor read wrong bytes"
        survivor.close()
        return f"victim held {held / MiB:.0f} MiB; memory back to baseline; survivor exact"

    def shutdown(self):
        session = self.small_session()
        assert self.run_steps(session, 1) == 0
        code = self.daemon.stop(timeout=30)
        started = time.monotonic()
        try:
            session.acquire(0)
            raise AssertionError("acquire succeeded after the daemon stopped")
        except weightstream.DaemonUnavailable as e:
            # The daemon's FAULT_SHUTTING_DOWN ends the session: "the daemon is stopping".
            assert "stopping" in str(e), e
            message = str(e)
        except Exception as e:  # noqa: BLE001 - a closed stream is also a clear failure
            message = repr(e)
        elapsed = time.monotonic() - started
        assert elapsed < 5, f"the failing call took {elapsed:.1f} s"
        assert code == 0, f"daemon exit code {code}"
        left = [p for p in os.listdir("/dev/shm") if p.startswith("weightstream-")]
        assert not left, f"shared memory left: {left}"
        assert not os.path.exists(self.socket), "socket left behind"
        return f"next call failed in {elapsed * 1000:.0f} ms: {message[:80]}"

    def run(self):
        self.expected = make_model(Path(self.model_path))
        self.expected_bytes = {k: wsgpu.tensor_bytes(v) for k, v in self.expected.items()}
        self.start_daemon()
        self.check("info: CUDA backend, device named by the UUID torch reports", self.info)
        self.check("load: the generated model", self.load_model)
        if not hasattr(self, "manifest"):
            return self.finish()
        self.check("bytes: every group exact under a plan, >= 95 % hits", self.bytes_under_plan)
        self.check("staged from another session's resident groups", self.staged_within_device)
        self.check("ordering: ready event orders reads; control sees stale", self.ordering)
        self.check("two consumer processes at once, one host copy", self.two_consumers)
        self.check("SIGKILL mid-step: memory back, the other goes on", self.sigkill)
        self.check("shutdown: the next call fails fast and clearly", self.shutdown)
        return self.finish()

    def finish(self):
        if self.daemon is not None:
            self.daemon.stop(timeout=30)
        passed = sum(r["ok"] for r in self.results)
        failed = len(self.results) - passed
        (self.out / "gpu_suite.json").write_text(json.dumps(self.results, indent=2))
        print(f"{passed} passed, {failed} failed")
        return 1 if failed else 0


def consumer_role(args):
    """One of two consumers: open, meet at the barrier, verify three steps, report JSON."""
    client = wsgpu.connect(args.socket)
    manifest = client.load_model([args.model])
    expected = {k: wsgpu.tensor_bytes(v) for k, v in load_file(args.model, device="cuda").items()}
    groups = [(t.name, [t.name]) for t in manifest.tensors if not t.name.startswith("big.")]
    session = wsgpu.Session(
        client, manifest.model_id, budget=96 * MiB, staging=96 * MiB, groups=groups
    )
    barrier = Path(args.barrier)
    (barrier / f"ready-{args.id}").touch()
    wsgpu.wait_for("go", lambda: (barrier / "go").exists(), 120)
    n = len(groups)
    order = list(range(n)) + list(reversed(range(n)))
    mismatches = 0
    for step in range(3):
        for g in order:
            ticket, staged, view = session.acquire(g)
            session.wait_ready(staged)
            want = expected[session.opened.groups[g].tensors[0].name]
            mismatches += not torch.equal(view[: want.numel()], want)
            session.release(ticket, staged)
        if step == 0:
            session.plan(order)
    session.close()
    client.release_model(manifest.model_id)
    print(json.dumps({"model_id": manifest.model_id, "mismatches": mismatches}), flush=True)


def holder_role(args):
    """Opens a session with a 2 GiB staging arena, holds tickets, and waits to be killed."""
    client = wsgpu.connect(args.socket)
    manifest = client.load_model([args.model])
    groups = [(t.name, [t.name]) for t in manifest.tensors]
    session = wsgpu.Session(
        client, manifest.model_id, budget=2048 * MiB, staging=2048 * MiB, groups=groups
    )
    for g in range(3):
        _, staged, _ = session.acquire(g)
        session.wait_ready(staged)
    torch.cuda.synchronize()
    print(f"HOLDING {session.id}", flush=True)
    sys.stdin.read()  # killed here


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="target/release/weightstream")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/ws-gpu-out"))
    parser.add_argument("--role", default="suite")
    parser.add_argument("--socket")
    parser.add_argument("--model")
    parser.add_argument("--barrier")
    parser.add_argument("--id", default="0")
    args = parser.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    if args.role == "consumer":
        return consumer_role(args)
    if args.role == "holder":
        return holder_role(args)
    return Suite(args).run()


if __name__ == "__main__":
    sys.exit(main())
