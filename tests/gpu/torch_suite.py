"""weightstream.torch.attach on the H200: the CPU tests' equality checks on CUDA (bf16, with
gradient checkpointing, deterministic algorithms on both sides; 8-bit streaming; torchao's
weights streamed as they are, against the same torchao layers in place; 8-bit uploads quantized
on the device against the daemon's quantization) and the prefetch hit rate, and the
trainer's wait for weights as the compute stream measures it (``gpu_wait_ns``).
Prints PASS/FAIL per check and "N passed, M failed"; exits non-zero on any failure."""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: torch's fp8 quantization of the edge cases, the daemon's test fixture.
FP8_VECTORS = ROOT / "daemon" / "e2e" / "tests" / "data" / "fp8_vectors.safetensors"
import weightstream  # noqa: E402
import weightstream.torch as wst  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from weightstream import _fused_dequant, _upload, quantize  # noqa: E402

from tests.daemon import Daemon  # noqa: E402
from tests.python.client import test_coded  # noqa: E402
from tests.python.torch import test_torch as t  # noqa: E402
from tests.python.torch import test_torch_fp8 as t8  # noqa: E402


def attach_cuda(client, model, budget, staging, group_by, **options):
    """``attach`` of the suite's models on the GPU: every Linear and Conv2d streamed."""
    return wst.attach(
        model,
        "cuda",
        client=client,
        min_bytes=0,
        vram_budget=budget,
        staging_bytes=staging,
        group_by=group_by,
        **options,
    )


def equality(
    client,
    dtype,
    ckpt,
    autocast=False,
    steps=4,
    group_by="layer",
    fp8=False,
    dequantize="layer",
    mixed=False,
    early_release=False,
):
    """The model streamed against the same model resident on the GPU. With ``fp8``: streamed
    in 8 bits (fused dequantization on the device) against the 8-bit resident reference, every
    streamed weight replaced in place by its w_hat; ``dequantize``: attach's. ``mixed`` (8 bits
    only): a budget where about half of the groups stay resident, the rest streamed.
    ``early_release``: attach's (a streamed group dequantized by group gives its ticket back
    once its dequantization and bias copy are queued: the daemon may copy into that space
    while the group's layers still run)."""
    ref = t.make_model(dtype).cuda()
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    budget, staging = t.BUDGETS[group_by, dtype]
    if mixed:
        sizes = t8.fp8_sizes(streamed, group_by, client.info().alignment)
        budget, staging = t8.budget(sizes, "mixed")
    handle = attach_cuda(
        client,
        streamed,
        budget,
        staging,
        group_by,
        quantize="fp8" if fp8 else None,
        dequantize=dequantize,
        early_release=early_release,
    )
    if early_release:
        assert handle._early_release, "no group gives its ticket back early"
    if fp8:
        quantize.to_fp8_resident(ref, handle.streamed)
    xs = t.inputs(steps, dtype, device="cuda")
    t.assert_equal_runs(
        t.train(ref, xs, sample_between=True, autocast=autocast),
        t.train(streamed, xs, sample_between=True, autocast=autocast),
    )
    # Counted before detach, which clears them.
    stats, streamed, resident = handle.stats(), len(handle.streamed), len(handle.resident)
    assert streamed > 0, "nothing was streamed"
    in_place = [g.resident for g in handle.session.groups]
    if mixed:
        assert any(in_place) and not all(in_place), f"resident groups: {in_place}"
    if dequantize == "auto":
        # The toy model's groups are far below the limit: every group with an 8-bit weight,
        # resident or streamed, dequantizes at once.
        layer_groups = {layer.group for layer in handle.streamed.values()}
        assert len(stats["dequant_by_group"]) == len(layer_groups), stats["dequant_by_group"]
    handle.detach(release=True)
    detail = f"{resident} layers kept on the device, {sum(in_place)} of {len(in_place)} groups"
    detail += f" resident, {stats['acquires']} acquires"
    if fp8:
        detail += (
            f", {streamed} streamed in 8 bits, scratch {stats['dequant_scratch_peak_bytes']} B"
        )
    return detail


def fused_dequant():
    """The fused kernel against the documented formula (evaluated by torch on the CPU) on the
    committed edge vectors (zeros, subnormal products, ties, +-448 * scale, tiny and huge
    scales) and on random weights of the shapes FLUX uses, in every compute dtype."""
    vectors = load_file(str(FP8_VECTORS))
    cases = [
        (vectors[f"{k[:-2]}.q"].view(torch.float8_e4m3fn), vectors[f"{k[:-2]}.scale"])
        for k in sorted(vectors)
        if k.endswith(".w")
    ]
    g = torch.Generator().manual_seed(3)
    for shape in [(3072, 3072), (12288, 3072), (3072, 15360), (5, 100), (7, 64, 3, 3)]:
        w = torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)
        cases.append(quantize.quantize_fp8_block64(w))
    bad = []
    for i, (q, scale) in enumerate(cases):
        rows, nb = scale.shape
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want = (q.float().view(rows, nb, -1) * scale.view(rows, nb, 1)).view(q.shape)
            want = want.to(dtype)
            qd, sd = q.cuda(), scale.cuda()
            assert _fused_dequant.applies(qd, sd, dtype), "the fused kernel does not apply"
            got = quantize.dequantize(qd, sd, dtype).cpu()
            bits = torch.int32 if dtype == torch.float32 else torch.int16  # -0.0 != 0.0
            if got.dtype != dtype or not torch.equal(got.view(bits), want.view(bits)):
                bad.append(f"case {i} {tuple(q.shape)} {dtype}")
    assert not bad, f"{len(bad)} differ: {bad[:10]}"
    # The group kernel: FLUX.1's double block's weights side by side in one buffer, as a
    # staging block holds them, in one launch, each equal to the single-weight kernel's.
    shapes = [(3072, 3072)] * 8 + [(18432, 3072)] * 2 + [(12288, 3072), (3072, 12288)] * 2
    pairs = [quantize.quantize_fp8_block64(torch.randn(s, generator=g).mul_(0.02)) for s in shapes]
    sizes = [q.numel() for q, _ in pairs] + [s.numel() * 4 for _, s in pairs]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda")
    parts = list(buf.split(sizes))
    weights = []
    for i, (q, s) in enumerate(pairs):
        qd = parts[i].view(torch.float8_e4m3fn).view(q.shape)
        sd = parts[len(pairs) + i].view(torch.float32).view(s.shape)
        qd.copy_(q)
        sd.copy_(s)
        weights.append((qd, sd))
    # Each plan is run twice: the first launch goes through Triton's dispatch, the second
    # starts the kernel Triton compiled (``GroupLaunch``); and after the buffer's data changed.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        plan = _fused_dequant.plan_group(weights, dtype)
        assert plan is not None, "the group kernel does not apply"
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        for launch in ("dispatched", "compiled", "new data"):
            if launch == "new data":
                for qd, sd in weights:
                    qd.view(torch.uint8).copy_(qd.view(torch.uint8).flip(0))
                    sd.copy_(sd.flip(0))
            group = plan.run(weights[0], weights[-1])
            if launch != "dispatched":
                assert plan.compiled is not None, "the compiled kernel was not kept"
            for i, ((qd, sd), got) in enumerate(zip(weights, group, strict=True)):
                want = quantize.dequantize(qd, sd, dtype)
                if not torch.equal(got.view(bits), want.view(bits)):
                    bad.append(f"group weight {i} {tuple(qd.shape)} {dtype} {launch}")
    assert not bad, f"{len(bad)} differ: {bad[:10]}"
    return (
        f"{len(cases)} tensors x 3 dtypes bit for bit; a group of {len(pairs)} in one launch, "
        "dispatched and compiled"
    )


def comfy_mixed_on_cuda():
    """ComfyUI's mixed-precision dequantization (``TensorCoreFP8Layout.dequantize``:
    ``qdata.to(orig_dtype) * scale``) as ComfyUI runs it, on the GPU with the 0-d fp32 scale on
    the device, against ``dequantize_as("fp8_scaled_comfy")``. The CPU tests write out the rule
    this relies on (the GPU casts the 0-d operand to the common dtype; the CPU would keep a 0-d
    CPU tensor in fp32): here it is checked where ComfyUI computes."""
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(3072, 3072, generator=g) * 20).to(torch.float8_e4m3fn).cuda()
    bad = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        for value in (0.0123456789, 1.0 / 3.0, 2.5e-4):
            scale = torch.tensor(value, dtype=torch.float32, device="cuda")
            comfy = torch.ops.aten._to_copy.default(q, dtype=dtype) * scale
            got = quantize.dequantize_as(quantize.FP8_SCALED_COMFY, q, scale, dtype)
            if got.dtype != dtype or not torch.equal(got.view(bits), comfy.view(bits)):
                bad.append(f"{dtype} scale {value}")
    assert not bad, f"differ from ComfyUI on CUDA: {bad}"
    return "3 dtypes x 3 scales bit for bit"


TORCHAO_WHEEL = "torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"


def torchao():
    """torchao's quantization module (its wheel carried in .whl/, installed by run.sh)."""
    try:
        import torchao.quantization as tq
    except ImportError as e:
        raise RuntimeError(f"torchao is not installed: carry .whl/{TORCHAO_WHEEL}") from e
    return tq


def torchao_configs():
    tq = torchao()
    return {
        quantize.TORCHAO_FLOAT8_ROWWISE: tq.Float8WeightOnlyConfig,
        quantize.TORCHAO_INT8_ROWWISE: tq.Int8WeightOnlyConfig,
    }


def torchao_formulas():
    """On CUDA, where FLUX trains: ``dequantize_as`` (the fused kernel for float8) equals
    torchao's ``dequantize()``, and ``linear_as`` equals torchao's own ``F.linear`` (output and
    input gradient), for FLUX's shapes, in bf16 and fp32."""
    from weightstream.torch import torchao_weights

    tq = torchao()
    bad, n = [], 0
    g = torch.Generator().manual_seed(11)
    for fmt, config in torchao_configs().items():
        for (out, inputs), dtype in [
            ((3072, 3072), torch.bfloat16),
            ((12288, 3072), torch.bfloat16),
            ((3072, 12288), torch.bfloat16),
            ((1000, 333), torch.float32),
        ]:
            layer = torch.nn.Linear(inputs, out, device="cuda", dtype=dtype)
            tq.quantize_(layer, config())
            w = layer.weight
            form = torchao_weights.upload_form(w)
            if fmt == quantize.TORCHAO_FLOAT8_ROWWISE:
                assert _fused_dequant.applies(w.qdata, w.scale, dtype), "no fused kernel"
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            got = quantize.dequantize_weight(form, dtype)
            if not torch.equal(got.view(bits), w.dequantize().view(bits)):
                bad.append(f"{fmt} {out}x{inputs} {dtype}: dequantize")
            x = torch.randn(2, 512, inputs, generator=g).to("cuda", dtype)
            want, want_grad = _output_and_input_grad(torch.nn.functional.linear, x, w, layer.bias)
            form = form._replace(dtype=dtype)
            y, grad = _output_and_input_grad(_linear_as, x, form, layer.bias)
            if not torch.equal(y, want) or not torch.equal(grad, want_grad):
                bad.append(f"{fmt} {out}x{inputs} {dtype}: linear")
            n += 1
    assert not bad, f"differ from torchao on CUDA: {bad}"
    return f"{n} layers: dequantize, linear and its input gradient bit for bit"


def _output_and_input_grad(linear, x, weight, bias):
    """``linear(x, weight, bias)`` and the gradient of ``x`` for an upstream gradient made
    from the output."""
    x = x.clone().requires_grad_(True)
    y = linear(x, weight, bias)
    y.backward(torch.ones_like(y).mul_(0.5).add_(y.detach().sin()))
    return y.detach(), x.grad


def _linear_as(x, weight: quantize.Fp8Weight, bias):
    return quantize.linear_as(weight, x, bias)


def torchao_equality(client, fmt, dtype, ckpt, autocast=False, group_by="layer", steps=4):
    """The LoRA model with its base layers quantized by torchao on the GPU, streamed (each
    torchao weight uploaded as torchao holds it) against the same quantized model in place."""
    ref = t.make_model(dtype).cuda()
    torchao().quantize_(
        ref, torchao_configs()[fmt](), filter_fn=lambda m, fqn: fqn.endswith("base_layer")
    )
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    budget, staging = t.BUDGETS[group_by, dtype]
    handle = attach_cuda(client, streamed, budget, staging, group_by)
    placed = {p.name: p.quantization for g in handle.session.groups for p in g.tensors}
    as_is = [n for n, q in placed.items() if q == fmt]
    assert len(as_is) == 18, f"{len(as_is)} weights streamed as {fmt}"
    xs = t.inputs(steps, dtype, device="cuda")
    t.assert_equal_runs(
        t.train(ref, xs, sample_between=True, autocast=autocast),
        t.train(streamed, xs, sample_between=True, autocast=autocast),
    )
    stats = handle.stats()
    handle.detach(release=True)
    return f"{len(as_is)} torchao weights streamed, {stats['acquires']} acquires"


def compute8_equality(client, mode, dtype, ckpt, group_by="block", rotation=0, grad=None):
    """8-bit compute (``attach(compute=mode)``) streamed on the GPU against the same W8A8
    layers in place (``compute8.to_w8a8_resident``): the contract on the device, where the
    staging views' alignment could pick another cuBLASLt kernel than the weights in place."""
    from weightstream.torch import compute8

    from tests.python.torch import test_torch_compute8 as tc

    ref = t.make_model(dtype).cuda()
    streamed = copy.deepcopy(ref)
    ref.ckpt = streamed.ckpt = ckpt
    sizes = tc.sizes(streamed, mode, group_by, client.info().alignment)
    budget, staging = t8.budget(sizes, "streamed")
    handle = attach_cuda(
        client,
        streamed,
        budget,
        staging,
        group_by,
        compute=mode,
        rotation=rotation,
        grad_compute=grad,
    )
    assert [n for n, layer in handle.streamed.items() if layer.compute8] == tc.BASE
    compute8.to_w8a8_resident(ref, mode, tc.BASE, rotation=rotation, grad_compute=grad)
    xs = t.inputs(4, dtype, device="cuda")
    t.assert_equal_runs(
        t.train(ref, xs, sample_between=True),
        t.train(streamed, xs, sample_between=True),
    )
    stats = handle.stats()
    handle.detach(release=True)
    return f"{stats['compute_gemm8']} 8-bit matmuls, fallbacks {stats['compute_fallbacks']}"


def hit_rate(client):
    model = t.make_model(torch.bfloat16).cuda()
    model.ckpt = "non-reentrant"
    handle = wst.attach(
        model, "cuda", client=client, min_bytes=0, vram_budget=96 << 10, group_by="layer"
    )
    xs = t.inputs(6, torch.bfloat16, device="cuda")
    t.train(model, xs[:1])
    first = handle.stats()
    t.train(model, xs[1:])
    after = handle.stats()
    handle.detach(release=True)
    hits = after["hits"] - first["hits"]
    acquires = after["acquires"] - first["acquires"]
    assert after["misses"] > 0 and hits / acquires >= 0.95, (hits, acquires)
    return f"{hits}/{acquires} hits after the first step, {after['reuses']} reuses"


def reported(client, session):
    """The daemon's listing of ``session`` once it has every report of waits the client sent."""
    sent = session._native.gpu_wait_reports
    deadline = time.monotonic() + 30
    while True:
        [info] = [s for s in client.list_sessions() if s.session_id == session.id]
        if info.stats.gpu_wait_reports == sent:
            return info
        assert time.monotonic() < deadline, "the report of waits never arrived"
        time.sleep(0.01)


def gpu_wait(client):
    """The compute stream's wait, timed with CUDA events: a copy held back by the session's
    bandwidth share (100 MB/s with a 16 MiB burst: a first copy of 48 MiB keeps the next one
    waiting ~335 ms) while the stream still has matmuls to run waits for the rest only, so the
    measured wait is the host's blocked time less the device's work that overlapped it (an
    acquire-pending or host-side figure would count it all); acquires whose bytes are staged
    and whose copies are done add no wait; ListSessions shows what the client measured.

    The device's work overlaps the block by what was left of it when the host began to wait:
    the matmuls started as the first was launched, so by then ``launch`` of them had run, and
    ``compute - launch`` was left (an earlier version compared with all of ``compute`` and
    failed by exactly the launch time: waited 0.221 s, blocked 0.262 s, compute 0.113 s over
    600 small launches that took ~0.07 s). Few large matmuls keep the launch time small, and
    one matmul before the share is charged keeps cuBLAS's set-up out of it (without it the
    first launch took 0.163 s, and the block, timed from the first acquire, ended before the
    device's work: blocked 0.139 s, compute 0.239 s)."""
    g = torch.Generator().manual_seed(5)
    tensors = {f"w{i}": torch.randn(12 << 20, generator=g) for i in range(3)}  # 48 MiB each
    manifest, _ = client.upload_model("gpu-wait", tensors)
    groups = [(name, [name]) for name in tensors]
    budget = 3 * (48 << 20)
    session = client.open_session(
        manifest.model_id,
        groups,
        budget,
        staging_bytes=budget,
        device="cuda",
        copy_bandwidth_limit=100_000_000,
    )
    try:
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 100
        torch.tanh(x @ x)  # cuBLAS's handle and workspace made before anything is timed
        torch.cuda.synchronize()
        session.release(session.acquire(0))  # charges the share: the next copy waits
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        launched_from = time.perf_counter()
        start.record()
        for _ in range(60):
            x = torch.tanh(x @ x)
        end.record()
        blocked_from = time.perf_counter()
        launch = blocked_from - launched_from
        ticket = session.acquire(1)
        blocked = time.perf_counter() - blocked_from
        session.release(ticket)
        torch.cuda.synchronize()
        compute = start.elapsed_time(end) / 1e3
        waits = session.gpu_wait()
        waited = waits.by_group[1] / 1e9
        overlapped = compute - launch  # the device's work left when the host began to wait
        assert overlapped > 0.05 and blocked > compute, (
            "the check's premise: device work left to overlap the block",
            blocked,
            compute,
            launch,
        )
        # At most the block less that work (the device may have started later than the first
        # launch, which only shortens its wait), with 5 ms for the events and the wake-up.
        assert 0 < waited <= blocked - overlapped + 0.005, (waited, blocked, compute, launch)

        # Staged again without a copy, the copies long done: polled, never waited for.
        before = session.gpu_wait()
        for group in (0, 1):
            number = session.submit(group)
            deadline = time.monotonic() + 30
            while (t2 := session.poll(number)) is None:
                assert time.monotonic() < deadline, "never staged"
                time.sleep(0.001)
            session.release(t2)
        torch.cuda.synchronize()
        after = session.gpu_wait()
        assert (after.total_ns, after.waits) == (before.total_ns, before.waits), (before, after)

        session.report_gpu_wait()
        info = reported(client, session)
        assert info.stats.gpu_wait_ns == after.total_ns, (info.stats, after)
        assert info.group_gpu_wait_ns == list(after.by_group), (info, after)
        pending = info.stats.acquire_pending_ns / 1e9
    finally:
        session.close()
        client.release_model(manifest.model_id)
    return (
        f"GPU waited {waited * 1e3:.1f} ms for group 1 while the host blocked "
        f"{blocked * 1e3:.1f} ms with {compute * 1e3:.1f} ms of compute queued; "
        f"daemon's acquire pending {pending * 1e3:.1f} ms"
    )


def device_quantization(client):
    """Weights on CUDA uploaded with ``quantize`` (``quantize_on="auto"``: quantized on the
    device as they are copied) against the daemon's quantization at commit of the same weights
    copied to the CPU: one model id (the same bytes), with the default chunks and with 4 MiB
    ones, during which the device held no more than a few chunks' temporaries (less than the
    quantized weights); a NaN is refused with the daemon's words and leaves no upload."""
    g = torch.Generator(device="cuda").manual_seed(11)
    shapes = [(12288, 3072), (3072, 15360), (3072, 3072), (33, 100), (7, 64, 3, 3)]
    tensors = {
        f"w{i}.weight": torch.randn(s, generator=g, device="cuda").mul_(0.02).to(torch.bfloat16)
        for i, s in enumerate(shapes)
    }
    tensors["w0.bias"] = torch.randn(12288, generator=g, device="cuda").to(torch.bfloat16)
    names = [n for n in tensors if n.endswith(".weight")]
    on_cpu = {n: w.cpu() for n, w in tensors.items()}
    daemon_side = {}
    ref, _ = client.upload_model("qd-cpu", on_cpu, names, phases=daemon_side)
    client.release_model(ref.model_id)
    assert "write_quantized_tensors" not in daemon_side, "the CPU's weights go to the daemon"
    fp8 = sum(quantize.fp8_nbytes(tensors[n].shape) for n in names)
    details = []
    for chunk in (_upload.QUANTIZE_CHUNK, 4 << 20):
        saved, _upload.QUANTIZE_CHUNK = _upload.QUANTIZE_CHUNK, chunk
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            phases = {}
            got, dedup = client.upload_model("qd-cuda", tensors, names, phases=phases)
            peak = torch.cuda.max_memory_allocated() - before
        finally:
            _upload.QUANTIZE_CHUNK = saved
        client.release_model(got.model_id)
        assert got.model_id == ref.model_id and not dedup, (got.model_id, ref.model_id)
        assert phases["write_quantized_tensors"] == len(names), phases
        assert phases["daemon_quantize_s"] == 0 and phases["write_bytes"] == fp8 + 12288 * 2
        if chunk == 4 << 20:
            assert peak <= 4 * chunk < fp8, f"{peak} B on the device at once, chunks of {chunk}"
        details.append(
            f"chunks of {chunk >> 20} MiB: quantize {phases['write_quantize_device_s']} s on "
            f"the device, write {phases['write_wall_s']} s, peak {peak >> 20} MiB"
        )
    bad = {"w.weight": torch.randn(256, 128, generator=g, device="cuda").to(torch.bfloat16)}
    bad["w.weight"][100, 5] = float("nan")
    messages = []
    for weights in ({n: w.cpu() for n, w in bad.items()}, bad):
        try:
            client.upload_model("qd-nan", weights, ["w.weight"])
            messages.append("accepted")
        except weightstream.RequestRejected as e:
            messages.append(str(e))
    want = "tensor 'w.weight': NaN at index 12805: cannot quantize"
    assert messages == [want] * 2, messages
    assert client.info().usage.uploads == 0, "a refused upload is dropped"
    return "; ".join(details)


def bnb4_equality(
    client, quant_type: str, double: bool, dtype, ckpt, group_by="layer", device="cuda"
):
    """bitsandbytes' ``Linear4bit`` base layers (the CPU test's model, quantized by bitsandbytes
    and moved to the GPU) streamed as they are, with three of the largest group for staging and
    nothing resident, against the same layers in place: losses, outputs, LoRA gradients and
    no_grad samples equal; every packed byte back after ``detach``."""
    from tests.python.torch import test_packed_bnb as tb
    from tests.python.torch.test_packed import as_bytes, attach_packed

    ref = tb.bnb_model(quant_type, double, dtype).to(device)
    streamed = tb.bnb_model(quant_type, double, dtype).to(device)
    ref.ckpt = streamed.ckpt = ckpt
    mods = tb.layers(streamed)
    state = {n: tb.streamed_state(m) for n, m in mods.items()}
    handle = attach_packed(client, streamed, mods, group_by, "streamed", device)
    xs = t.inputs(4, dtype, device=device)
    t.assert_equal_runs(t.train(ref, xs, sample_between=True), t.train(streamed, xs, True))
    stats = handle.stats()
    handle.detach(release=True)
    for name, m in tb.layers(streamed).items():
        back = tb.streamed_state(m)
        for k, want in state[name].items():
            assert torch.equal(as_bytes(back[k]), as_bytes(want)), (name, k)
    form = stats["packed_formats"][f"bnb.{quant_type}"]
    return (
        f"{form['layers']} Linear4bit layers, {form['bits_per_weight']} bits a weight, "
        f"{stats['acquires']} acquires"
    )


#: The packed forms' checks (test_packed's ``FORMS``, each once): (form, dtype, ckpt,
#: autocast, group_by, where); "mixed": the three smallest groups resident, the rest streamed.
PACKED_CASES = [
    ("aitk.uint4", torch.bfloat16, "non-reentrant", False, "block", "mixed"),
    ("aitk.uint3", torch.bfloat16, None, False, "layer", "streamed"),
    ("aitk.nvfp4", torch.float32, "reentrant", True, "layer", "streamed"),
    ("aitk.convrot8", torch.bfloat16, None, False, "layer", "streamed"),
    ("aitk.convrot4", torch.bfloat16, "non-reentrant", False, "block", "streamed"),
    ("aitk.convrotint3", torch.bfloat16, "reentrant", False, "layer", "streamed"),
    ("aitk.convrotint8", torch.bfloat16, "non-reentrant", False, "block", "mixed"),
    ("torchao.NF4Tensor", torch.bfloat16, "non-reentrant", False, "layer", "streamed"),
    ("torchao.IntxUnpackedToInt8Tensor", torch.float32, None, True, "block", "mixed"),
]


def packed_name(form, dtype, ckpt, autocast, group_by, where) -> str:
    """A ``PACKED_CASES`` check's name: "equal: packed FORM, DTYPE, CHECKPOINTING, BY, ..."."""
    precision = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    return ", ".join(
        [
            f"equal: packed {form}",
            precision + (" under bf16 autocast" if autocast else ""),
            f"{ckpt} checkpointing" if ckpt else "no checkpointing",
            f"by {group_by}",
            "resident and streamed groups" if where == "mixed" else "all groups streamed",
        ]
    )


def packed_equality(client, form, dtype, ckpt, autocast, group_by, where, device="cuda"):
    """ai-toolkit's ``OstrisLinear`` forms (``aitk_layouts``' stand-ins, each with a trainable
    ARA) and torchao's ``NF4Tensor`` / ``IntxUnpackedToInt8Tensor``: test_packed's model of
    ``form`` moved to ``device``, streamed as it is against the same packed layers in place
    there (``test_packed.packed_equality``, the CPU test's one implementation): the daemon
    holds every inner tensor byte for byte, losses, outputs, ARA/LoRA and input gradients and
    no_grad samples equal, every inner byte back after ``detach``. test_packed imports
    torchao: it needs the carried wheel for every form."""
    from tests.python.torch import test_packed as tp

    args = (form, dtype, ckpt, autocast, group_by, where)
    stats = tp.packed_equality(client, *args, device=device)
    summary = stats["packed_formats"][form]
    return (
        f"{summary['layers']} layers, {summary['bits_per_weight']} bits a weight, "
        f"{stats['acquires']} acquires"
    )


def trainable_equality(ckpt: bool, delay: bool, kind: str = "adamw", master: str = "fp32"):
    """LoRA weights in host memory (``stream_trainable`` + ``HostAdamW``, clipping on) against
    the LoRA on the device with the same optimizer formula on fp32 masters on the CPU: equal
    losses every step, equal weights after."""
    from tests.python.torch_host import trainable_pair as tt

    ref_model, model, tr, _, _ = tt.train_pair(
        steps=4, ckpt=ckpt, device="cuda", delay=delay, kind=kind, max_norm=0.05, master=master
    )
    tt.assert_same_lora(ref_model, model)
    host = tr.host_bytes
    tr.close()
    return f"{len(tr.slots)} LoRA weights, {host} B of host memory, 4 steps"


def main():
    """``torch_suite.py [BINARY [WORD ...]]``: every check, or those whose name holds a WORD."""
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/weightstream"
    only = sys.argv[2:]
    out = Path(os.environ.get("OUT", "/tmp/ws-gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True)
    daemon = Daemon(
        tempfile.mkdtemp(prefix="ws-torch-"),
        binary=binary,
        backend="cuda",
        log=out / "torch-daemon.log",
        log_level=None,
        ready_s=60,
    )
    client = daemon.client

    def by_block_8bit(**kwargs):
        """8-bit streaming by block, bf16, non-reentrant checkpointing."""
        return equality(
            client, torch.bfloat16, "non-reentrant", group_by="block", fp8=True, **kwargs
        )

    checks = [
        ("equal: bf16, no checkpointing", lambda: equality(client, torch.bfloat16, None)),
        (
            "equal: bf16, reentrant checkpointing",
            lambda: equality(client, torch.bfloat16, "reentrant"),
        ),
        (
            "equal: bf16, non-reentrant checkpointing",
            lambda: equality(client, torch.bfloat16, "non-reentrant"),
        ),
        (
            "equal: fp32 under bf16 autocast, checkpointing",
            lambda: equality(client, torch.float32, "non-reentrant", autocast=True),
        ),
        (
            "equal: bf16, non-reentrant checkpointing, by block",
            lambda: equality(client, torch.bfloat16, "non-reentrant", group_by="block"),
        ),
        (
            "equal: fp32 under bf16 autocast, checkpointing, by block",
            lambda: equality(client, torch.float32, "non-reentrant", True, group_by="block"),
        ),
        ("fused fp8 dequantization == the documented formula", fused_dequant),
        (
            "equal: fp8 streaming, bf16, non-reentrant checkpointing",
            lambda: equality(client, torch.bfloat16, "non-reentrant", fp8=True),
        ),
        (
            "equal: fp8 streaming, fp32, by block",
            lambda: equality(client, torch.float32, None, group_by="block", fp8=True),
        ),
        (
            "equal: fp8 streaming dequantized by group, bf16, checkpointing, by block",
            lambda: by_block_8bit(dequantize="group"),
        ),
        (
            "equal: fp8 dequantized by group (auto), resident and streamed groups, by block",
            lambda: by_block_8bit(dequantize="auto", mixed=True),
        ),
        (
            "equal: fp8 by group with early release, resident and streamed groups, by block",
            lambda: by_block_8bit(dequantize="auto", mixed=True, early_release=True),
        ),
        (
            "equal: fp8 streaming held coded (rans8), decoded on the device, by layer",
            lambda: test_coded.coded_training(client, "cuda"),
        ),
        (
            "fp8 quantized on the device as it is copied == the daemon's model",
            lambda: device_quantization(client),
        ),
        ("ComfyUI mixed-precision fp8 == ComfyUI's own expression on CUDA", comfy_mixed_on_cuda),
        ("torchao float8/int8: dequantize and linear == torchao's own on CUDA", torchao_formulas),
        (
            "equal: torchao float8 weights, bf16, non-reentrant checkpointing",
            lambda: torchao_equality(
                client, quantize.TORCHAO_FLOAT8_ROWWISE, torch.bfloat16, "non-reentrant"
            ),
        ),
        (
            "equal: torchao float8 weights, fp32 under bf16 autocast, by block",
            lambda: torchao_equality(
                client, quantize.TORCHAO_FLOAT8_ROWWISE, torch.float32, None, True, "block"
            ),
        ),
        (
            "equal: torchao int8 weights, bf16, reentrant checkpointing, by block",
            lambda: torchao_equality(
                client, quantize.TORCHAO_INT8_ROWWISE, torch.bfloat16, "reentrant", False, "block"
            ),
        ),
        (
            "equal: LoRA in host memory, AdamW, non-reentrant checkpointing",
            lambda: trainable_equality(True, False),
        ),
        (
            "equal: LoRA in host memory, AdamW, delayed update, no checkpointing",
            lambda: trainable_equality(False, True),
        ),
        (
            "equal: LoRA in host memory, 8-bit AdamW, delayed update, checkpointing",
            lambda: trainable_equality(True, True, "adamw8bit"),
        ),
        (
            "equal: LoRA in host memory, no fp32 master, 8-bit AdamW, delayed, checkpointing",
            lambda: trainable_equality(True, True, "adamw8bit", "none"),
        ),
        (
            "equal: 8-bit compute fp8, fp8 input gradient, non-reentrant checkpointing, by block",
            lambda: compute8_equality(client, "fp8", torch.bfloat16, "non-reentrant", grad="fp8"),
        ),
        (
            "equal: 8-bit compute fp8, bf16 input gradient, by layer",
            lambda: compute8_equality(client, "fp8", torch.bfloat16, None, "layer", grad="bf16"),
        ),
        (
            "equal: 8-bit compute int8, int8 input gradient, rotation 64, reentrant checkpointing",
            lambda: compute8_equality(
                client, "int8", torch.bfloat16, "reentrant", rotation=64, grad="int8"
            ),
        ),
        (
            "equal: bitsandbytes Linear4bit nf4, bf16, non-reentrant checkpointing",
            lambda: bnb4_equality(client, "nf4", False, torch.bfloat16, "non-reentrant"),
        ),
        (
            "equal: bitsandbytes Linear4bit nf4 double quantized, bf16, by block",
            lambda: bnb4_equality(client, "nf4", True, torch.bfloat16, None, "block"),
        ),
        (
            "equal: bitsandbytes Linear4bit fp4, fp32 weights' dtype, reentrant checkpointing",
            lambda: bnb4_equality(client, "fp4", False, torch.float32, "reentrant"),
        ),
        *(
            (packed_name(*case), lambda case=case: packed_equality(client, *case))
            for case in PACKED_CASES
        ),
        ("hit rate >= 95 % after the first step", lambda: hit_rate(client)),
        (
            "GPU wait: the compute stream's own wait, reported as gpu_wait_ns",
            lambda: gpu_wait(client),
        ),
    ]
    checks = [(n, f) for n, f in checks if not only or any(w in n for w in only)]
    passed = failed = 0
    for name, fn in checks:
        try:
            detail = fn()
            passed += 1
            print(f"PASS {name}: {detail}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            failed += 1
            print(f"FAIL {name}: {e!r}", flush=True)
            traceback.print_exc()
    daemon.stop(timeout=60)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
