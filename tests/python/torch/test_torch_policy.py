"""weightstream.torch.policy and StreamOptions without a daemon: what streams and why not,
groups and their sizes, the plan recorder and the lookahead."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from weightstream.torch import placeholder, policy
from weightstream.torch.options import StreamOptions


class OwnForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def zoo() -> nn.Module:
    """One layer per reason a layer stays on the device, and one that streams."""
    torch.manual_seed(0)
    root = nn.Module()
    root.big = nn.Linear(64, 64)  # 16.25 KiB
    root.small = nn.Linear(4, 4)
    root.trainable = nn.Linear(64, 64)
    root.tied_a, root.tied_b = (
        nn.Linear(64, 64, bias=False),
        nn.Linear(64, 64, bias=False),
    )
    root.tied_b.weight = root.tied_a.weight
    root.norm = parametrizations.weight_norm(nn.Linear(64, 64))
    root.mha = nn.MultiheadAttention(64, 4)
    root.custom = OwnForward(64, 64)
    root.skipped = nn.Linear(64, 64)
    root.skipped_type = nn.Conv2d(64, 64, 1)
    root.meta = nn.Linear(64, 64, device="meta")
    root.streamed = nn.Linear(64, 64)
    root.streamed.weight = placeholder.parameter(root.streamed.weight, torch.device("cpu"), "w")
    root.emb = nn.Embedding(64, 64)
    root.requires_grad_(False)
    root.trainable.requires_grad_(True)
    return root


def test_select_gives_each_resident_layer_its_reason():
    options = StreamOptions(
        min_bytes=4096,
        include=(nn.Linear, nn.Conv2d, nn.Embedding),
        ignore=["skipped", nn.Conv2d],
    )
    selection = policy.select(zoo(), options)
    want = {
        "big": None,
        "small": "small",
        "trainable": "trainable",
        "tied_a": "tied",
        "tied_b": "tied",
        "norm": "parametrized",
        "mha.out_proj": "read_directly",
        "custom": "own_forward",
        "skipped": "ignored",
        "skipped_type": "ignored",
        "meta": "no_weight",
        "streamed": "no_weight",
        "emb": "unsupported",
    }
    streamed = [n for n, _ in selection.streamed]
    got = {n: None for n in streamed} | selection.resident
    wrong = [
        f"{n}: want {w}, got {got.get(n, 'absent')}"
        for n, w in want.items()
        if got.get(n, "absent") != w
    ]
    assert not wrong, wrong
    assert set(got) == set(want)
    assert selection.kinds["emb"] == "Embedding"


def subclass_of(module: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """A stand-in for a library's tensor subclass, named as the library names it."""
    return torch.Tensor._make_subclass(type(name, (torch.Tensor,), {"__module__": module}), t)


def test_quantizer_of_tells_quantized_weights_by_their_type():
    w = torch.randn(4, 4)
    cases = {
        "plain": (w, None),
        "parameter": (nn.Parameter(w), None),
        "placeholder": (placeholder.Placeholder(w, torch.device("cpu"), "w"), None),
        "torchao": (subclass_of("torchao.quantization", "Float8Tensor", w), "torchao"),
        "torchao.dtypes": (
            subclass_of("torchao.dtypes.affine_quantized_tensor", "AQT", w),
            "torchao",
        ),
        "quanto": (subclass_of("optimum.quanto.tensor", "WeightQBytesTensor", w), "optimum-quanto"),
        "torch quantized": (
            torch.quantize_per_tensor(w, 0.1, 0, torch.qint8),
            "torch.quantization",
        ),
        "other subclass": (subclass_of("mylib.tensors", "Packed", w), "mylib.tensors.Packed"),
        "torchaox is not torchao": (subclass_of("torchaox", "T", w), "torchaox.T"),
    }
    wrong = [
        f"{case}: want {want}, got {policy.quantizer_of(t)}"
        for case, (t, want) in cases.items()
        if policy.quantizer_of(t) != want
    ]
    assert not wrong, wrong


def test_select_refuses_a_quantized_weight_unless_ignored():
    root = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).requires_grad_(False)
    w = subclass_of("torchao.quantization", "Float8Tensor", root[1].weight.detach())
    root[1].weight = nn.Parameter(w, requires_grad=False)
    with pytest.raises(policy.QuantizedWeight, match=r"^cannot stream '1': its weight is a Float8"):
        policy.select(root, StreamOptions(min_bytes=0))
    selection = policy.select(root, StreamOptions(min_bytes=0, ignore=["1"]))
    assert [n for n, _ in selection.streamed] == ["0"]


TOO_SMALL = (
    ". The largest layer under min_bytes holds {}: to stream layers that small, lower "
    "min_bytes (attach(..., min_bytes=0) streams every frozen Linear and Conv2d layer)"
)


def test_nothing_to_stream_counts_each_reason_most_first():
    """Trainable layers of at least min_bytes lead (the base was not frozen), then the rest,
    most first."""
    root = nn.Sequential(*(nn.Linear(64, 64) for _ in range(5)), nn.Linear(4, 4), nn.Linear(4, 4))
    root[5:].requires_grad_(False)
    options = StreamOptions(min_bytes=1024)
    message = policy.nothing_to_stream(policy.select(root, options), options, root)
    assert message == (
        "nothing to stream: 5 Linear layers skipped: their weights require grad — freeze the "
        "base model first (model.requires_grad_(False)); 2 smaller than min_bytes (1 KiB)"
        + TOO_SMALL.format("80 bytes")
    )


def test_a_small_frozen_model_with_a_lora_is_told_of_min_bytes():
    """peft's LoRA layers are trainable Linear layers, more of them than the frozen base's:
    the base's layers under min_bytes are the cause, and lead."""
    peft = pytest.importorskip("peft")
    root = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).requires_grad_(False)
    root = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["0", "2"]), root)
    options = StreamOptions()
    message = policy.nothing_to_stream(policy.select(root, options), options, root)
    assert message == (
        "nothing to stream: 2 Linear layers skipped: smaller than min_bytes (1 MiB); 4 trainable "
        "(their weights require grad: a LoRA's own layers stay on the device, a base model is "
        "frozen with model.requires_grad_(False)) and smaller than min_bytes (1 MiB)"
        + TOO_SMALL.format("16640 bytes")
    )
    selection = policy.select(root, StreamOptions(min_bytes=0))
    assert [n for n, _ in selection.streamed] == ["0.base_layer", "2.base_layer"]


@pytest.mark.parametrize(
    "root,options,want",
    [
        (
            nn.Sequential(nn.Conv2d(4, 4, 1)).requires_grad_(False),
            StreamOptions(min_bytes=1536),
            "nothing to stream: 1 Conv2d layer skipped: smaller than min_bytes (1536 bytes)"
            + TOO_SMALL.format("80 bytes"),
        ),
        (
            nn.Sequential(nn.ReLU()),
            StreamOptions(),
            "nothing to stream: Sequential has no Linear or Conv2d layer",
        ),
    ],
)
def test_nothing_to_stream_edge_cases(root, options, want):
    assert policy.nothing_to_stream(policy.select(root, options), options, root) == want


class GELU(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Block(nn.Module):
    """Shaped like diffusers' transformer blocks: ``ff.net`` is a ModuleList inside."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.to_q = nn.Linear(4, 4)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([GELU(), nn.Dropout(), nn.Linear(4, 4)])


def model_with_blocks() -> nn.Module:
    root = nn.Module()
    root.proj_in = nn.Linear(4, 4)
    root.transformer_blocks = nn.ModuleList(Block() for _ in range(2))
    root.proj_out = nn.Linear(4, 4)
    return root


def test_block_of_is_the_child_of_the_outermost_container():
    root = model_with_blocks()
    cases = {
        "transformer_blocks.1.attn.to_q": "transformer_blocks.1",
        "transformer_blocks.0.ff.net.0.proj": "transformer_blocks.0",  # not ff.net.0
        "transformer_blocks.0.ff.net.2": "transformer_blocks.0",
        "proj_out": "proj_out",
    }
    wrong = {n: policy.block_of(root, n) for n, w in cases.items() if policy.block_of(root, n) != w}
    assert not wrong, wrong
    assert policy.block_of(nn.Sequential(nn.Linear(2, 2)), "0") == "0"


def test_group_layers_by_block_layer_or_function_keeps_the_models_order():
    root = model_with_blocks()
    layers = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear)]

    def names(by):
        return {g: [n for n, _ in ms] for g, ms in policy.group_layers(root, layers, by).items()}

    assert list(names("block")) == [
        "proj_in",
        "transformer_blocks.0",
        "transformer_blocks.1",
        "proj_out",
    ]
    assert names("block")["transformer_blocks.1"] == [
        "transformer_blocks.1.attn.to_q",
        "transformer_blocks.1.ff.net.0.proj",
        "transformer_blocks.1.ff.net.2",
    ]
    assert list(names("layer")) == [n for n, _ in layers]
    assert list(names(lambda n: n.split(".")[0])) == [
        "proj_in",
        "transformer_blocks",
        "proj_out",
    ]


@pytest.mark.parametrize(
    "sizes,alignment,want",
    [
        ([100], 256, 256),
        ([100, 300], 256, 768),  # 100 at 0, 300 at 256, end 556 rounded up
        ([256, 256], 256, 512),
        ([0], 256, 256),
        ([100, 300], 1, 400),
        ([16384, 256], 4096, 20480),
    ],
)
def test_group_nbytes_lays_out_as_the_daemon_does(sizes, alignment, want):
    assert policy.group_nbytes(sizes, alignment) == want


def test_choose_groups_streams_layers_when_three_blocks_do_not_fit():
    root = model_with_blocks()
    layers = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear)]
    # A Linear(4, 4) is a 64-byte weight and a 16-byte bias, each starting on a 256-byte
    # boundary: 512 bytes; a block of three, 1536.
    blocks = policy.choose_groups(root, layers, "block", 256, 3 * 1536, 0)
    assert blocks.fallback is None and blocks.sizes == [512, 1536, 1536, 512]
    small = policy.choose_groups(root, layers, "block", 256, 3 * 1536 - 1, 0)
    assert small.fallback == (
        "attach: vram_budget 4607 is less than three of the largest block (1536 bytes): "
        "streaming layer by layer instead"
    )
    assert list(small.members) == [n for n, _ in layers] and small.sizes == [512] * 8
    staged = policy.choose_groups(root, layers, "block", 256, 1000, 800)
    assert staged.fallback is None, "an explicit staging size keeps blocks"
    assert policy.default_budget([512, 1536, 1536, 512]) == 3 * 1536
    assert policy.default_budget([1 << 20] * 40) == 10 << 20


def test_the_plan_is_one_step_forward_and_backward():
    recorder = policy.PlanRecorder()
    forward, backward = [0, 1, 2], [2, 1, 0]
    ends = [recorder.add(g, False) for g in forward]
    ends += [recorder.add(0, False)]  # a second forward before any backward: same step
    ends += [recorder.add(g, True) for g in backward]
    assert not any(ends)
    assert recorder.add(0, False), "group 0 in forward after a backward starts the next step"
    assert recorder.groups == [0, 1, 2, 0, 2, 1, 0]


def test_without_graph_task_ids_everything_is_recorded():
    recorder = policy.PlanRecorder()
    assert not any(recorder.add(g, None) for g in [0, 1, 0, 1])
    assert recorder.groups == [0, 1, 0, 1]


class FakeSession:
    def __init__(self):
        self.sent: list[int] = []  # groups, in submit order
        self.given_back: list[int] = []  # numbers

    def submit(self, group: int) -> int:
        self.sent.append(group)
        return len(self.sent)

    def give_back(self, number: int):
        self.given_back.append(number)


def lookahead(plan, staging, limit=None):
    s = FakeSession()
    return s, policy.Lookahead(plan, [10, 10, 10, 10], staging, s.submit, s.give_back, limit)


def test_lookahead_keeps_the_plans_next_acquires_in_flight_within_staging():
    s, ahead = lookahead([0, 1, 2, 3], staging=50)  # room for 50 - 2 * 10 = 30: three groups
    assert ahead.take(0) == 1
    assert s.sent == [0, 1, 2, 3]
    assert ahead.take(1) == 2, "the acquire in flight serves the plan's next group"
    assert s.sent == [0, 1, 2, 3, 0], "and one more goes out, wrapping to the next step"
    assert s.given_back == []


def test_lookahead_resyncs_when_the_client_leaves_the_plan():
    s, ahead = lookahead([0, 1, 2, 3], staging=50)
    ahead.take(0)
    assert ahead.take(2) == 5, "group 1 skipped: a fresh acquire"
    assert s.given_back == [2, 3, 4], "the acquires in flight were given back"
    assert s.sent[5:] == [3, 0, 1], "and the lookahead follows on from group 2"


def test_lookahead_respects_its_limit_and_off_plan_groups():
    s, ahead = lookahead([0, 1, 2, 3], staging=1000, limit=1)
    ahead.take(0)
    assert s.sent == [0, 1]
    s, ahead = lookahead([0, 1], staging=1000)
    ahead.take(3)  # not in the plan (a sampling pass): no lookahead
    assert s.sent == [3]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"input_grad": "guess"},
            "input_grad='guess': expected 'formula' or 'recompute'",
        ),
        (
            {"group_by": "rows"},
            "group_by='rows': expected 'block', 'layer' or a function",
        ),
        ({"min_bytes": -1}, "min_bytes=-1: expected 0 or more"),
        ({"lookahead": -1}, "lookahead=-1: expected None, 0 or more"),
    ],
)
def test_stream_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        StreamOptions(**kwargs)


def test_stream_options_freeze_what_callers_pass():
    options = StreamOptions(ignore=["a", nn.Conv2d], include=[nn.Linear])
    assert options.ignore == frozenset({"a", nn.Conv2d}) and options.include == (nn.Linear,)
    hash(options)


@pytest.mark.parametrize(
    "budget,staging,want",
    [
        (3 << 20, 0, None),
        (3 << 20, 3 << 20, None),
        (
            (3 << 20) - 1,
            0,
            "vram_budget=3145727 is smaller than the largest streamed group 'b' (3.00 MiB, "
            "3145728 bytes): the session needs at least 3145728 bytes; raise vram_budget or pass "
            "vram_budget='auto'. Nothing was freed.",
        ),
        (
            8 << 20,
            1 << 20,
            "staging_bytes=1048576 is smaller than the largest streamed group 'b' (3.00 MiB, "
            "3145728 bytes): give at least 3145728 bytes, or 0 for the daemon's choice. Nothing "
            "was freed.",
        ),
        (
            4 << 20,
            5 << 20,
            "staging_bytes=5242880 exceeds vram_budget=4194304: staging is a part of the budget. "
            "Nothing was freed.",
        ),
    ],
)
def test_check_budget_refuses_what_the_daemon_would(budget, staging, want):
    grouping = policy.Grouping({"a": [], "b": [], "c": []}, [1 << 20, 3 << 20, 2 << 20])
    if want is None:
        policy.check_budget(grouping, budget, staging)
        return
    with pytest.raises(ValueError) as raised:
        policy.check_budget(grouping, budget, staging)
    assert str(raised.value) == want
