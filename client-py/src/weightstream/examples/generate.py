"""Generation without a trainer: a diffusers pipeline whose denoiser (and, on request, other
large components) streams its weights from the weightstream daemon::

    python -m weightstream.examples.generate --model black-forest-labs/FLUX.2-dev \\
        --prompt "a lighthouse at dusk" --steps 28 --size 1024 --vram-budget 15GiB

Every denoising step is a forward pass under ``no_grad``: it follows the forward plan (the
module order, then the first pass as it ran), cyclically, so that consecutive steps stream
without a miss (``Handle.stats()``'s ``sample_*``). Several such processes on one box (on one
GPU or on several, ``--device cuda:N``) share the daemon's one host copy of the model: the same
weights uploaded twice are stored once, and ``--model-file`` has the daemon read the denoiser's
safetensors itself. ``--socket`` names the daemon, ``--hold`` keeps the sessions open after the
image until stdin ends, ``--pipeline`` builds a pipeline diffusers' ``from_pretrained`` does
not. diffusers is imported when the pipeline is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

import torch
from torch import nn

import weightstream
import weightstream.torch as wst
from weightstream.sizes import parse_size

#: The pipeline components that stream by default: the denoiser, whichever the pipeline has.
DENOISERS = ("transformer", "unet")


def load_pipeline(model: str, dtype: torch.dtype, factory: str | None = None):
    """``diffusers.DiffusionPipeline.from_pretrained(model)`` in ``dtype``, on the CPU; with
    ``factory`` (``"package.module:callable"``), ``callable(model, dtype)`` instead."""
    if factory is not None:
        module, sep, name = factory.partition(":")
        if not sep or not module or not name:
            raise SystemExit(f"--pipeline {factory}: expected MODULE:CALLABLE")
        return getattr(importlib.import_module(module), name)(model, dtype)
    try:
        import diffusers
    except ImportError:
        raise SystemExit(
            "weightstream.examples.generate needs diffusers: pip install diffusers"
        ) from None
    return diffusers.DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)


def stream_components(
    pipe, names, device, vram_budget=None, client=None, model_files=None, model_ids=None, **options
) -> dict:
    """Attaches each named component of ``pipe`` (None: its denoiser) to the daemon (with
    ``StreamOptions`` fields in ``options``), and moves every other ``nn.Module`` component
    to ``device``. ``model_files``: name -> safetensors files of that component, which the
    daemon loads itself (tensor names as the module's parameters) instead of an upload;
    ``model_ids``: name -> the id of a model the daemon already holds with that component's
    weights (another process's upload, ``weightstream status``), attached without an upload.
    Returns name -> ``Handle``."""
    components = {n: c for n, c in pipe.components.items() if isinstance(c, nn.Module)}
    names = list(names or [n for n in DENOISERS if n in components][:1])
    missing = [n for n in names if n not in components]
    if missing:
        raise ValueError(f"--stream {','.join(missing)}: the pipeline has {sorted(components)}")
    model_files, model_ids = model_files or {}, model_ids or {}
    for flag, given in (("--model-file", model_files), ("--model-id", model_ids)):
        unknown = [n for n in given if n not in names]
        if unknown:
            raise ValueError(f"{flag} for {','.join(unknown)}, which does not stream: {names}")
    both = sorted(set(model_files) & set(model_ids))
    if both:
        raise ValueError(f"--model-file and --model-id both given for {','.join(both)}: one")
    client = client or weightstream.connect()
    handles = {}
    for name in names:
        module = components[name].requires_grad_(False)
        files = model_files.get(name)
        model = client.load_model(files).model_id if files else model_ids.get(name)
        staging = "forward" if isinstance(vram_budget, int) else 0  # every pass forward-only
        handles[name] = wst.attach(
            module,
            device,
            vram_budget=vram_budget,
            staging_bytes=staging,
            client=client,
            model=model,
            **options,
        )
    for name, module in components.items():
        if name not in handles:
            module.to(device)
    return handles


def held_hint(client, error, modules) -> str | None:
    """For an upload refused for want of host room (``RESOURCE_EXHAUSTED``): the line that
    names the models of the same name the daemon already holds, with the ``--model-id`` to
    attach one instead (an upload is found to be the same only once all of it is in the
    daemon, so a second upload of a model needs room for it meanwhile)."""
    if error.code != "RESOURCE_EXHAUSTED" or "host_bytes" not in error.message:
        return None
    names = {type(m).__name__ for m in modules}
    held = [m for m in client.list_models().models if m.name in names]
    if not held:
        return None
    ids = ", ".join(f"{m.name!r} as {m.model_id}" for m in held)
    return (
        f"the daemon already holds {ids}: if it is these weights, run this process with "
        f"--model-id {held[0].model_id} to attach it without an upload of its own"
    )


def generate(pipe, handles: dict, prompt: str, steps: int, size: int, seed: int):
    """One image of ``prompt`` (the pipeline's first output), each attached component's
    sampling budget in force meanwhile (``Handle.sampling()``)."""
    generator = torch.Generator().manual_seed(seed)
    # no_grad, not inference_mode: the session's views are made once and kept, and a view
    # made under inference_mode could not serve a later training pass of the same handle.
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for handle in handles.values():
            stack.enter_context(handle.sampling())
        out = pipe(
            prompt=prompt,
            num_inference_steps=steps,
            height=size,
            width=size,
            generator=generator,
        )
    return out.images[0]


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m weightstream.examples.generate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="a diffusers model id or directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--steps", type=int, default=28, help="denoising steps (default 28)")
    p.add_argument("--size", type=int, default=1024, help="height and width (default 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--vram-budget", help="each streamed component's device budget (e.g. 15GiB)")
    p.add_argument("--stream", help="components to stream, comma-separated (default: the denoiser)")
    p.add_argument(
        "--model-file",
        action="append",
        help="safetensors of the (first) streamed component for the daemon to load itself "
        "(repeat for shards); without it the weights are uploaded",
    )
    p.add_argument(
        "--model-id",
        help="attach the (first) streamed component to this model the daemon already holds "
        "(another process's, `weightstream status`) instead of uploading its weights",
    )
    p.add_argument("--socket", help="the daemon's socket (default: WEIGHTSTREAM_SOCKET's rules)")
    p.add_argument("--pipeline", help="MODULE:CALLABLE building the pipeline from (model, dtype)")
    p.add_argument("--min-bytes", help="layers smaller than this stay on the device (a size)")
    p.add_argument(
        "--hold",
        action="store_true",
        help="after the image, keep the sessions open until stdin ends or gives a line",
    )
    p.add_argument("--out", default="image.png", help="the image (a .pt file: torch.save)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    budget = parse_size("--vram-budget", args.vram_budget) if args.vram_budget else None
    options = {}
    if args.min_bytes is not None:
        options["min_bytes"] = parse_size("--min-bytes", args.min_bytes)
    pipe = load_pipeline(args.model, getattr(torch, args.dtype), args.pipeline)
    names = args.stream.split(",") if args.stream else None
    client = weightstream.connect(args.socket)
    first = names[0] if names else next((n for n in DENOISERS if n in pipe.components), None)
    files = {first: args.model_file} if args.model_file else None
    ids = {first: args.model_id} if args.model_id else None
    try:
        handles = stream_components(pipe, names, args.device, budget, client, files, ids, **options)
    except weightstream.RequestRejected as e:
        hint = held_hint(client, e, pipe.components.values())
        if hint is None:
            raise
        raise SystemExit(f"{e}\n{hint}") from None
    image = generate(pipe, handles, args.prompt, args.steps, args.size, args.seed)
    if args.out.endswith(".pt"):
        torch.save(image, args.out)
    else:
        image.save(args.out)
    for name, handle in handles.items():
        s = handle.stats()
        print(
            f"{name}: {s['sample_passes']} passes, {s['sample_acquires']} acquires, "
            f"hit rate {s['sample_hit_rate']:.3f}, GPU wait {s['sample_gpu_wait_ns'] / 1e9:.3f} s"
        )
    print(f"wrote {args.out}", flush=True)
    if args.hold:
        sys.stdin.readline()
    for handle in handles.values():
        handle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
