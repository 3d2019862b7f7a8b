"""``Settings``: what the ai-toolkit integration needs beyond ai-toolkit's own calls, read once
from a ``weightstream:`` section of the job's YAML and from environment variables (which win),
and checked into typed values before ai-toolkit starts."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from weightstream.sizes import parse_size

#: The environment variable of each setting.
ENV = {
    "socket": "WEIGHTSTREAM_SOCKET",
    "vram_budget": "WEIGHTSTREAM_BUDGET",
    "staging_bytes": "WEIGHTSTREAM_STAGING_BYTES",
    "min_bytes": "WEIGHTSTREAM_MIN_BYTES",
    "group_by": "WEIGHTSTREAM_GROUP_BY",
    "lookahead": "WEIGHTSTREAM_LOOKAHEAD",
    "quantize": "WEIGHTSTREAM_QUANTIZE",
    "dequantize": "WEIGHTSTREAM_DEQUANTIZE",
    "early_release": "WEIGHTSTREAM_EARLY_RELEASE",
    "compute": "WEIGHTSTREAM_COMPUTE",
    "grad_compute": "WEIGHTSTREAM_GRAD_COMPUTE",
    "rotation": "WEIGHTSTREAM_ROTATION",
    "trainable": "WEIGHTSTREAM_TRAINABLE",
    "trainable_delay": "WEIGHTSTREAM_TRAINABLE_DELAY",
    "trainable_master": "WEIGHTSTREAM_TRAINABLE_MASTER",
    "sample_vram_budget": "WEIGHTSTREAM_SAMPLE_BUDGET",
    "load_from_files": "WEIGHTSTREAM_LOAD_FROM_FILES",
    "coding": "WEIGHTSTREAM_CODING",
}

#: The values of ``trainable``.
TRAINABLE = ("device", "host")
#: The values of ``dequantize`` (``StreamOptions.dequantize``).
DEQUANTIZE = ("auto", "layer", "group")
#: The values of ``compute`` (``StreamOptions.compute``) and ``grad_compute``.
COMPUTE = ("bf16", "fp8", "int8")
#: The values of ``coding`` (``StreamOptions.coding``).
CODINGS = ("none", "rans8")
#: The values of ``trainable_master`` (``weightstream.torch.trainable.MASTERS``).
MASTERS = ("fp32", "none")

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_bool(what: str, value) -> bool:
    """A YAML boolean, or ``true``/``false``/``1``/``0``/``yes``/``no`` (any case)."""
    if isinstance(value, bool):
        return value
    flag = _BOOLS.get(str(value).strip().lower())
    if flag is None:
        raise ValueError(f"{what}: {value!r}: expected true or false")
    return flag


@dataclass(frozen=True)
class Settings:
    """- ``socket``: the daemon's socket. Default: where every weightstream client looks
      (``weightstream.client.socket_path``): ``$WEIGHTSTREAM_SOCKET``, else the system socket
      if it exists, else ``$XDG_RUNTIME_DIR/weightstream.sock`` (or
      ``/tmp/weightstream-<uid>/weightstream.sock``).
    - ``vram_budget``: device bytes of each attached module's session, or ``auto``
      (``weightstream.torch.budget``: grown after the first step to what the device has left
      less a margin). Default: ``auto`` where ai-toolkit's ``offload_percent`` is 1 (its
      default: offload everything, weightstream decides what stays resident); where the job
      sets a smaller percent, that fraction streams and the rest stays on the device as
      ai-toolkit does, with weightstream's fixed default (a quarter of the streamed bytes, at
      least three of the largest blocks).
    - ``staging_bytes``: the streaming part of that budget (default: the daemon's choice).
    - ``min_bytes``: layers with fewer weight bytes stay on the device (default 0: every
      Linear and Conv2d counts, as in ai-toolkit's offloading).
    - ``group_by``: ``block`` or ``layer`` (``StreamOptions.group_by``).
    - ``lookahead``: ``StreamOptions.lookahead`` (``none``: as many as staging holds).
    - ``quantize``: ``fp8`` streams the weights in 8 bits (``StreamOptions.quantize``);
      ``none`` (the default): as they are.
    - ``dequantize``: ``auto`` (the default), ``layer`` or ``group``: when the 8-bit weights
      are dequantized (``StreamOptions.dequantize``).
    - ``early_release``: ``true`` gives a block's staging back once its 8-bit weights are
      dequantized together (``StreamOptions.early_release``). Default ``false``.
    - ``compute``: ``bf16`` (the default), ``fp8`` or ``int8``: how the streamed Linear layers
      multiply (``StreamOptions.compute``: ``fp8``/``int8`` are 8-bit matmuls on weights
      prepared once, row-scaled; a ``qfloat8`` base computes as it is in ``fp8``).
    - ``grad_compute``: the 8-bit layers' input gradient: ``none`` or ``bf16`` (the default:
      in the trainer's dtype), or the mode itself (``StreamOptions.grad_compute``).
    - ``rotation``: 0 (the default) or a block-Hadamard rotation of that block for 8-bit
      compute (``StreamOptions.rotation``; advised with ``int8``).
    - ``trainable``: where the LoRA's weights and optimizer state live. ``device`` (the
      default): where ai-toolkit puts them. ``host``: in host memory
      (``weightstream.torch.stream_trainable``), the optimizer ai-toolkit asks for (``adamw``,
      ``adamw8bit`` and their aliases) run there as ``HostAdamW``
      (``weightstream.integrations.ai_toolkit.trainable``).
    - ``trainable_delay``: with ``trainable: host``, ``HostAdamW``'s delayed update (each step's
      update applied during the next backward, so the GPU never waits for the CPU; the weights
      are one step behind). Default ``true``.
    - ``trainable_master``: with ``trainable: host``, ``fp32`` keeps an fp32 master of each
      bf16/f16 LoRA weight for the optimizer, ``none`` keeps none (the optimizer updates the
      weights in place; 4 bytes less per parameter). Default: ``none`` where the network's
      weights are bf16 or f16 (ai-toolkit's optimizers step its parameters in place and keep no
      master of their own), ``fp32`` otherwise (fp32 weights are their own master either way).
    - ``sample_vram_budget``: device bytes of each session while ai-toolkit samples (its
      ``sample``, at step 0 and every ``sample_every`` steps): the session grows to it for the
      sampling passes and gives it back before the next training step
      (``StreamOptions.sample_vram_budget``, ``Handle.sampling()``); ``auto``: what the device
      has free when sampling begins, less what the first sampling took (before that, half of
      what is free is left to the trainer) and a margin, for the attached session that
      streams the most bytes only (the transformer's); ``none``: sampling at the training
      budget (its passes follow the forward plan either way). Default: ``auto`` where the
      session's ``vram_budget`` is ``auto`` and ``trainable`` is ``device`` (before the first
      training step ``vram_budget: auto`` runs at its minimum, two of the largest group, with
      nothing in flight: ai-toolkit's sample at step 0 would fetch every group on demand),
      else ``none``. Not with ``trainable: host``.
    - ``load_from_files``: with ``layer_offloading``, a loader that reads the model with
      safetensors' ``load_file`` and assigns it (FLUX.2's) never reads the streamed Linear/Conv2d
      weights: the daemon loads the same files (in 8 bits where ai-toolkit would quantize to
      ``float8``/``qfloat8``, or ``quantize: fp8``) and the layers attach by its model's id
      (``files``). Default ``true``: where the files cannot serve (a key renamed, a cast, another
      qtype) the weights are read and uploaded as before, and the loading line says why.
    - ``coding``: ``rans8`` has the daemon hold the 8-bit weights coded losslessly, decoded on
      the device after each copy (``StreamOptions.coding``); ``none`` (the default): as they are.
    """

    socket: str | None = None
    vram_budget: int | str | None = None
    staging_bytes: int = 0
    min_bytes: int = 0
    group_by: str = "block"
    lookahead: int | None = None
    quantize: str | None = None
    dequantize: str = "auto"
    early_release: bool = False
    compute: str = "bf16"
    grad_compute: str | None = None
    rotation: int = 0
    trainable: str = "device"
    trainable_delay: bool = True
    trainable_master: str | None = None
    sample_vram_budget: int | str | None = None
    load_from_files: bool = True
    coding: str = "none"

    def __post_init__(self):
        if self.sample_vram_budget not in (None, "none") and self.trainable == "host":
            raise ValueError(
                "weightstream.sample_vram_budget with trainable: host: the LoRA's state lives "
                "in the session's host memory, which reopening the session for sampling would "
                "drop; leave sample_vram_budget unset"
            )

    @classmethod
    def load(cls, section: Mapping | None = None, env: Mapping[str, str] | None = None):
        """From a YAML ``weightstream:`` section and the environment (``ENV``; set and not
        empty wins over the section). Unknown keys and bad values raise ``ValueError`` naming
        the key or variable."""
        env = os.environ if env is None else env
        if section is not None and not isinstance(section, Mapping):
            raise ValueError(f"weightstream: expected a mapping of settings, got {section!r}")
        raw = {}
        for key, value in (section or {}).items():
            if key not in ENV:
                raise ValueError(
                    f"weightstream.{key}: unknown setting (known: {', '.join(sorted(ENV))})"
                )
            raw[key] = (f"weightstream.{key}", value)
        for key, var in ENV.items():
            if env.get(var):
                raw[key] = (var, env[var])
        return cls(**{key: _convert(key, what, value) for key, (what, value) in raw.items()})

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


def _convert(key: str, what: str, value):
    if key == "socket":
        return str(value)
    if key == "sample_vram_budget":  # None: not set (the default), "none": set to none
        if value is None:
            return None
        if str(value).strip().lower() in ("none", "auto"):
            return str(value).strip().lower()
        return parse_size(what, value) or "none"
    if key in ("vram_budget", "staging_bytes", "min_bytes"):
        if key == "vram_budget" and str(value).lower() in ("none", "default", ""):
            return None
        if key == "vram_budget" and str(value).strip().lower() == "auto":
            return "auto"
        return parse_size(what, value)
    if key == "group_by":
        if value not in ("block", "layer"):
            raise ValueError(f"{what}: {value!r}: expected 'block' or 'layer'")
        return value
    if key == "quantize":
        if value is None or str(value).lower() in ("none", ""):
            return None
        if value not in ("fp8", "fp8_e4m3_block64"):
            raise ValueError(f"{what}: {value!r}: expected 'fp8' or 'none'")
        return "fp8"
    if key == "coding":
        if value not in CODINGS:
            raise ValueError(f"{what}: {value!r}: expected one of {', '.join(CODINGS)}")
        return value
    if key == "dequantize":
        if value not in DEQUANTIZE:
            raise ValueError(f"{what}: {value!r}: expected one of {', '.join(DEQUANTIZE)}")
        return value
    if key in ("compute", "grad_compute"):
        if key == "grad_compute" and (value is None or str(value).lower() in ("none", "")):
            return None
        if value not in COMPUTE:
            raise ValueError(f"{what}: {value!r}: expected one of {', '.join(COMPUTE)}")
        return value
    if key == "rotation":
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: {value!r}: expected 0 or a block size") from None
    if key == "trainable":
        if value not in TRAINABLE:
            raise ValueError(f"{what}: {value!r}: expected one of {', '.join(TRAINABLE)}")
        return value
    if key in ("trainable_delay", "early_release", "load_from_files"):
        return parse_bool(what, value)
    if key == "trainable_master":
        if value not in MASTERS:
            raise ValueError(f"{what}: {value!r}: expected one of {', '.join(MASTERS)}")
        return value
    if value is None or str(value).lower() == "none":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0 or isinstance(value, bool):
        raise ValueError(f"{what}: {value!r}: expected none, 0 or more")
    return n


_current: Settings | None = None


def configure(settings: Settings | None):
    """The settings of every later ``MemoryManager.attach`` (the launcher calls this; without
    it they are read from the environment at the first ``attach``)."""
    global _current
    _current = settings


def current() -> Settings:
    global _current
    if _current is None:
        _current = Settings.load()
    return _current
