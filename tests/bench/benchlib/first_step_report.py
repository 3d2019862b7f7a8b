"""The Markdown table of tests/bench/first_step.py: one row per part, from the results it wrote
to first_step.json (``report``)."""

from __future__ import annotations

from tests.bench.benchlib.first_step_parts import GiB


def gb(nbytes: float, secs: float) -> str:
    return f"{nbytes / secs / 1e9:.1f} GB/s" if secs > 0 else "–"


def row_load(r: dict, target: str) -> list[str]:
    ph, n = r["phases"], r["phases"]["input_bytes"]
    text = (
        f"ready in **{ph['total_s']:.1f} s** ({gb(n, ph['total_s'])} of the file's "
        f"{n / GiB:.1f} GiB): arena {ph['alloc_s']:.1f} s, reading {ph['read_s']:.1f} s "
        f"({gb(n, ph['read_s'])}), page-locking {ph['pin_s']:.1f} s ({gb(n, ph['pin_s'])}); "
        f"the command {r['wall_s']:.1f} s"
    )
    return [text, target]


def row_attach(r: dict, target: str) -> list[str]:
    a = r.get("attach", {})
    text = (
        f"attach {r['attach_s']:.1f} s (finding the model {a.get('attach_model_s', 0):.1f} s, "
        f"session {a.get('attach_open_session_s', 0):.1f} s) + first step "
        f"{r['first_step_s']:.1f} s = **{r['to_first_step_s']:.1f} s**; then "
        f"{', '.join(f'{s:.2f}' for s in r.get('steps_s', []))} s/step"
    )
    return [text, target]


def row_upload(r: dict, target: str) -> list[str]:
    a, n = r.get("attach", {}), r.get("bytes", 0)

    def g(k):
        return a.get(f"attach_upload_{k}", 0) or 0

    if "attach_upload_write_wall_s" in a:
        client = (
            f"begin {g('begin_s'):.1f} s; client write {g('write_wall_s'):.1f} s "
            f"({gb(n, g('write_wall_s'))}; faulting in {g('write_populate_s'):.1f} s, "
            f"cudaHostRegister {g('write_register_s'):.1f} s over "
            f"{g('write_threads')} threads, waited {g('write_wait_register_s'):.1f} s, copies "
            f"{g('write_copy_s'):.1f} s, unregister {g('write_unregister_s'):.1f} s"
        )
        if g("write_quantized_tensors"):
            client += (
                f"; {g('write_quantized_tensors')} weights quantized on the GPU: "
                f"{g('write_quantize_device_s'):.1f} s of GPU time, "
                f"{g('write_quantize_s'):.1f} s issuing"
            )
        client += f"); commit {g('commit_s'):.1f} s"
    else:  # tensors in host memory: the native client's memcpy path, not split
        client = f"upload {g('total_s'):.1f} s (host memory: the native path)"
    text = (
        f"attach **{r['attach_s']:.1f} s** for {n / GiB:.1f} GiB: {client} (daemon: seal "
        f"{g('daemon_seal_s'):.1f} s, quantize {g('daemon_quantize_s'):.1f} s, hash "
        f"{g('daemon_hash_s'):.1f} s while pinning {g('daemon_pin_s'):.1f} s); session "
        f"{a.get('attach_open_session_s', 0):.1f} s; first step {r['first_step_s']:.1f} s; "
        f"attach to the end of the first step **{r['to_first_step_s']:.1f} s**"
    )
    return [text, target]


def row_register(r: dict) -> list[str]:
    cases = [
        f"{k}: {v['register_gb_s']} GB/s"
        + (f" (populating {v['populate_s']} s first)" if "populate_s" in v else "")
        for k, v in r.items()
        if isinstance(v, dict) and "register_gb_s" in v
    ]
    return [f"{r.get('bytes', 0) / GiB:.1f} GiB: " + "; ".join(cases), ""]


ROWS = {
    "register": ("cudaHostRegister of shared memory", lambda r: row_register(r)),
    "gen": ("the file", lambda r: [f"{r['bytes'] / GiB:.1f} GiB written in {r['gen_s']} s", ""]),
    "load": ("`weightstream load` (bf16)", lambda r: row_load(r, "≤ 30 s for 64 GB")),
    "load-fp8": (
        "`weightstream load --quantize fp8`",
        lambda r: row_load(r, "≥ 3 GB/s of bf16 input"),
    ),
    "attach-id": ("second job, attach by id → first step", lambda r: row_attach(r, "≤ 10 s")),
    "attach-id-fp8": ("second job on the 8-bit model", lambda r: row_attach(r, "")),
    "upload": ("attach by upload (from the GPU)", lambda r: row_upload(r, "≤ 30 s")),
    "upload-fp8": (
        "attach by upload, 8 bits quantized on the GPU",
        lambda r: row_upload(r, "≤ 30 s"),
    ),
    "upload-fp8-daemon": ("attach by upload, 8 bits at commit", lambda r: row_upload(r, "")),
    "upload-daemon-reserves": (
        "attach by upload, the daemon reserving the region first",
        lambda r: row_upload(r, ""),
    ),
}


def report(results: dict) -> str:
    host = results.get("host", {})
    lines = [
        f"first_step ({results['model']}, scale {results['scale']}, {results['date']}, "
        f"commit {host.get('commit')}, {host.get('cpus')} CPUs, "
        f"{host.get('mem_total_gib')} GiB, {host.get('gpus')})",
        "",
        "| part | result | target |",
        "|---|---|---|",
    ]
    for part, r in results["parts"].items():
        label, row = ROWS.get(part, (part, None))
        if "error" in r or row is None:
            cells = [f"error: {r.get('error', '?')[:300]}", ""]
        else:
            try:
                cells = row(r)
            except (KeyError, TypeError, ValueError) as e:
                cells = [f"(incomplete result: {e!r})", ""]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |".replace("\n", " "))
    if "error" in results:
        lines.append(f"\nrun error: {results['error']}")
    return "\n".join(lines)
