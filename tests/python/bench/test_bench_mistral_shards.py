"""tests/bench/aitk/build_24g.py's full-size text encoder, on the CPU: a small stand-in of
Mistral Small 3.1's config (``MISTRAL_FULL`` scaled down) through the same shard-by-shard writer
(``mistral3_weights`` with ``shard_bytes``), against what ``save_pretrained`` writes and what
``from_pretrained`` loads; the full config's sizes; how many FLUX.2 single blocks fit a disk
(``--single-blocks``), and the report's lines for both."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.bench import ai_toolkit_24g
from tests.bench.aitk import build_24g, report_24g

pytestmark = pytest.mark.no_daemon

#: MISTRAL_FULL with every size cut (2 layers, width 64, vocabulary 1000): the same keys, the
#: same code path. Its embedding and lm_head (1000 x 64 bf16: 128000 bytes each) are larger
#: than SHARD, so they each make a shard of their own; the layers' tensors share shards.
SMALL = dict(
    build_24g.MISTRAL_FULL,
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
)
SHARD = 40_000
SEED = 7


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """SMALL written by the shard writer, and the same model saved by ``save_pretrained``."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    root = tmp_path_factory.mktemp("mistral")
    shards, reference = root / "shards", root / "reference"
    shards.mkdir()
    info = build_24g.mistral3_weights(shards, SMALL, SEED, "cpu", SHARD)
    model = Mistral3ForConditionalGeneration(build_24g.mistral3_config(SMALL))
    model.to(torch.bfloat16).save_pretrained(reference, max_shard_size=SHARD)
    return SimpleNamespace(shards=shards, reference=reference, info=info)


def _tensors(folder: Path) -> dict:
    """``{name: (file, dtype, shape)}`` of every tensor in a folder's safetensors files."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (path.name, s.get_dtype(), tuple(s.get_shape()))
    return out


def test_the_shards_have_save_pretrained_s_names_config_and_index(written):
    got, want = _tensors(written.shards), _tensors(written.reference)
    assert {k: v[1:] for k, v in got.items()} == {k: v[1:] for k, v in want.items()}
    assert "language_model.model.embed_tokens.weight" in got  # the checkpoint's layout
    # untied, as Mistral Small 3.1's
    assert got["language_model.lm_head.weight"][1:] == ("BF16", (1000, 64))
    for name in ("config.json", "generation_config.json"):
        assert json.loads((written.shards / name).read_text()) == json.loads(
            (written.reference / name).read_text()
        )
    index = json.loads((written.shards / "model.safetensors.index.json").read_text())
    ref = json.loads((written.reference / "model.safetensors.index.json").read_text())
    assert index["metadata"] == ref["metadata"]
    assert sorted(index["weight_map"]) == sorted(ref["weight_map"])
    assert index["weight_map"] == {k: v[0] for k, v in got.items()}
    files = sorted({v[0] for v in got.values()})
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, 10)]
    assert written.info["shards"] == 9
    assert written.info["bytes_on_disk"] == sum((written.shards / f).stat().st_size for f in files)


def test_from_pretrained_loads_every_tensor_the_builder_seeded(written):
    import torch
    from transformers import Mistral3ForConditionalGeneration

    model, info = Mistral3ForConditionalGeneration.from_pretrained(
        written.shards, dtype=torch.bfloat16, output_loading_info=True
    )
    assert {k: list(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }
    assert not info["error_msgs"]
    text = model.config.text_config
    assert (text.num_hidden_layers, text.vocab_size, text.rope_parameters["rope_theta"]) == (
        2,
        1000,
        1e9,
    )
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    state = model.state_dict()
    names = build_24g.saved_names(model)
    assert len(names) == len(state) == len(_tensors(written.shards))
    for saved, name in names.items():
        want = build_24g.seeded_tensor(saved, tuple(state[name].shape), SEED, "cpu")
        assert torch.equal(state[name], want), name
    norm = state["model.language_model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    up = state["model.language_model.layers.0.mlp.up_proj.weight"]
    assert abs(up.float().std().item() - 64**-0.5) < 0.01  # N(0, 1/fan_in)
    other = state["model.language_model.layers.1.mlp.up_proj.weight"]
    assert not torch.equal(up, other)  # each tensor from its own generator


def test_the_writer_holds_one_shard_at_a_time(written):
    sizes = {}
    for file, _, shape in _tensors(written.shards).values():
        sizes.setdefault(file, []).append(2 * math.prod(shape))
    held = {file: sum(n) for file, n in sizes.items()}
    assert written.info["largest_buffer_bytes"] == max(held.values()) == 128000
    for file, n in sizes.items():  # over SHARD only where one tensor is
        assert held[file] <= SHARD or len(n) == 1, file
    assert sum(held.values()) > 3 * max(held.values())


def test_the_full_config_is_mistral_small_3_1_s_text_model():
    import torch
    from transformers import Mistral3ForConditionalGeneration

    cfg = build_24g.mistral3_config(build_24g.MISTRAL_FULL)
    text = cfg.text_config
    assert (
        text.num_hidden_layers,
        text.hidden_size,
        text.intermediate_size,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
        text.vocab_size,
        text.rms_norm_eps,
        text.rope_parameters["rope_theta"],
        text.sliding_window,
    ) == (40, 5120, 32768, 32, 8, 128, 131072, 1e-5, 1e9, None)
    assert not cfg.tie_word_embeddings and not text.tie_word_embeddings
    assert cfg.vision_config.num_hidden_layers == 1
    # the byte-level tokenizer's ids all index the real vocabulary
    assert max(build_24g.mistral_vocab().values()) == 266 < text.vocab_size
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(cfg)
    count = {"text": 0, "vision": 0, "projector": 0}
    for name, p in model.named_parameters():
        part = (
            "vision" if "vision_tower" in name else "projector" if "projector" in name else "text"
        )
        count[part] += p.numel()
    # 40 x 555,755,520 a layer + 2 x 131072 x 5120 (embedding, lm_head) + the final norm
    assert count == {"text": 23_572_403_200, "vision": 34_912, "projector": 26_382_368}
    assert model.num_parameters() * 2 == 47_197_640_960  # bytes in bf16


#: FLUX.2-dev at --disk-dtype bf16 with the full text encoder, from the parameter counts
#: (flux2_disk_bytes on ai-toolkit's Flux2): the transformer without its single blocks
#: (8,668,057,600 parameters), the VAE and the encoder, 2 bytes each; a single block.
DEV = {"fixed": 64_701_848_390, "single": 981_467_648, "full": 48}


@pytest.mark.parametrize(
    "free,want",
    [
        (64 << 30, 2),  # a 64 GiB disk, empty: 3 would leave 1.07 GB, under the 1 GiB kept
        (DEV["fixed"] + 3 * DEV["single"] + build_24g.DISK_RESERVE, 3),
        (DEV["fixed"] + 3 * DEV["single"] + build_24g.DISK_RESERVE - 1, 2),
        (DEV["fixed"] + build_24g.DISK_RESERVE, 0),
        (10**15, 48),
    ],
)
def test_single_blocks_for_the_disk(free, want):
    assert build_24g.flux2_singles_for_disk(DEV, free) == want


def test_free_disk_counts_the_work_folders_old_files_as_free(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    work = tmp_path / "work"
    assert ai_toolkit_24g.free_disk(work / "deeper") == 1000  # not there yet: its parent's
    (work / "model").mkdir(parents=True)
    (work / "model" / "a").write_bytes(b"x" * 300)
    (work / "b").write_bytes(b"x" * 20)
    (work / "link").symlink_to(work / "b")
    assert ai_toolkit_24g.free_disk(work) == 1320


BENCH = ["--aitk", "/nonexistent/aitk", "--bin", "/nonexistent/ws", "--size", "dev"]


@pytest.mark.parametrize(
    "extra,want",
    [
        (["--te-size", "full", "--smoke"], "--te-size full is FLUX.2-dev's text encoder:"),
        (["--te-size", "full", "--arch", "flux"], "--arch flux2 --size dev only"),
        (["--single-blocks", "0"], "--single-blocks 0: expected 1 to 48 or `disk`"),
        (["--single-blocks", "49"], "--single-blocks 49: expected 1 to 48 or `disk`"),
        (["--single-blocks", "all"], "--single-blocks all: expected 1 to 48 or `disk`"),
        (["--single-blocks", "3", "--arch", "flux"], "not --arch flux's"),
    ],
)
def test_the_bench_refuses_te_size_and_single_blocks_it_cannot_build(tmp_path, capsys, extra, want):
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as e:
        ai_toolkit_24g.main([*BENCH, "--work", str(work), "--out", str(tmp_path), *extra])
    assert e.value.code == 2
    assert want in capsys.readouterr().err
    assert not work.exists()


@pytest.mark.parametrize(
    "given,free,want",
    [
        (
            "3",
            DEV["fixed"] + 3 * DEV["single"] + build_24g.DISK_RESERVE - 1,
            "the build writes 67.65 GB and WORK has 68.72 GB free, 1 GiB of which is kept for"
            " the runs: at most --single-blocks 2 fit (0.981 GB each); free the disk or give"
            " fewer",
        ),
        (
            "disk",
            DEV["fixed"] + build_24g.DISK_RESERVE,
            "the build writes 64.70 GB and WORK has 65.78 GB free, 1 GiB of which is kept for"
            " the runs: not one single block fits (0.981 GB each); free the disk",
        ),
    ],
)
def test_the_bench_stops_before_the_build_where_the_disk_cannot_hold_it(
    tmp_path, capsys, monkeypatch, given, free, want
):
    monkeypatch.setattr(ai_toolkit_24g, "flux2_disk_bytes", lambda aitk, size, fp8: dict(DEV))
    monkeypatch.setattr(ai_toolkit_24g, "free_disk", lambda work: free)
    work = tmp_path / "work"
    argv = [*BENCH, "--work", str(work), "--out", str(tmp_path), "--single-blocks", given]
    assert ai_toolkit_24g.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err == f"ai_toolkit_24g: --single-blocks {given}: " + want.replace("WORK", str(work)) + "\n"
    )
    assert not work.exists()


def _call(te_size: str, singles_by: str | None) -> dict:
    te = dict(
        params=23_598_820_480,
        layers=40,
        vocab=131072,
        tokenizer_ids=267,
        vision_layers=1,
        shards=10,
        bytes_on_disk=47_197_700_000,
        largest_buffer_bytes=4_907_386_880,
        hidden_size=5120,
        intermediate_size=32768,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    return {
        "arch": "flux2",
        "size": "dev",
        "sizes": {"transformer": {"depth_single_blocks": 2}},
        "built": {
            "transformer": {"params": 9_649_525_248, "bytes_on_disk": 19_299_100_000},
            "text_encoder": te,
        },
        "disk_dtype": "bf16",
        "host_gib": 0,
        "te_size": te_size,
        "singles_by": singles_by,
        "disk": dict(DEV, free=68_500_000_000, singles=2),
    }


def test_the_report_says_what_the_disk_cut_and_the_full_text_encoder():
    lines = report_24g._model_lines(_call("full", "disk"))
    assert lines[0] == (
        "- reduced: 2 of FLUX.2-dev's 48 single-stream blocks (all 8 double blocks, the real"
        " width): for the disk (`--single-blocks disk`): the build wrote 66.66 GB (0.981 GB a"
        " single block) where 68.50 GB were free, 1 GiB kept for the runs"
    )
    assert lines[2:] == [
        "- text encoder: Mistral Small 3.1's text model at its full size"
        " (Mistral3ForConditionalGeneration): 40 layers of width 5120, attention 32 x 128 / 8 kv"
        " heads, MLP 32768, an untied embedding and lm_head of 131072 x 5120: 23.60 B"
        " parameters, bf16, in 10 safetensors shards (47.2 GB), written one shard at a time (at"
        " most 4.91 GB of it in host memory);",
        "- reduced: the text encoder's vision tower (1 Pixtral layer of width 32; 24 of width"
        " 1024 in the real one) and its tokenizer, byte-level: 267 ids, all below the"
        " embedding's 131072 (Tekken's 131072 in the real one).",
    ]
    given = report_24g._model_lines(_call("full", "single-blocks"))[0]
    assert "for the disk (`--single-blocks 2`): the build wrote 66.66 GB" in given


def test_the_report_keeps_the_host_cut_and_the_reduced_encoder_by_default():
    call = _call("reduced", "host")
    call["host_gib"] = 128
    del call["disk"]
    lines = report_24g._model_lines(call)
    assert lines[0].startswith(
        "- reduced: 2 of FLUX.2-dev's 48 single-stream blocks (all 8 double blocks, the real"
        " width): with float8 on disk the loader's bf16 state dict is anonymous memory"
    )
    assert "more than the 128 GiB host" in lines[0]
    assert lines[2].startswith(
        "- reduced: the text encoder, Mistral3ForConditionalGeneration with 40 layers"
    )
    old = {k: v for k, v in call.items() if k not in ("te_size", "singles_by")}
    assert report_24g._model_lines(old) == lines  # a report from before these keys
