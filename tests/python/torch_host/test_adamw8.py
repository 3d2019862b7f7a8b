"""The 8-bit AdamW step (weightstream.torch.host.adamw8): the native kernel gives the bits of the
torch reference over several steps (sizes around the block, both gradient types, weight decay,
gradient scale, extreme and non-finite values, every compiled variant), the reference's
float32 operations are the single IEEE roundings its formula says, arguments are checked at
the edge, and the optimizer tracks fp32 torch.optim.AdamW. Needs no daemon."""

from __future__ import annotations

import math

import pytest
import torch
from weightstream import _native
from weightstream.torch.host import adamw8

pytestmark = pytest.mark.no_daemon

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width: equal bits, not equal values (-0 != 0)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.detach().contiguous().view(width)


def assert_same_bits(name: str, native: torch.Tensor, ref: torch.Tensor, nan_ok: bool = False):
    """Equal bits; with ``nan_ok``, NaNs at the same places stand for each other (torch and the
    kernel write different NaN bits for a NaN bf16)."""
    assert native.dtype == ref.dtype and native.shape == ref.shape, name
    a, b = bits(native), bits(ref)
    if nan_ok and native.is_floating_point():
        nan_a, nan_b = torch.isnan(native), torch.isnan(ref)
        assert torch.equal(nan_a, nan_b), f"{name}: NaNs at different places"
        a, b = a[~nan_a], b[~nan_b]
    differ = (a != b).nonzero().flatten()
    if differ.numel():
        i = differ[0].item()
        raise AssertionError(
            f"{name}: {differ.numel()} of {a.numel()} differ, first at {i}: bits "
            f"{a[i].item():#x} (native) != {b[i].item():#x} (reference)"
        )


class Pair:
    """One parameter stepped by both implementations, from the same start. A bfloat16 ``p0``
    is the working weight updated in place (no ``w``)."""

    def __init__(self, p0: torch.Tensor, with_w: bool = True):
        n = p0.numel()
        self.p = [p0.clone(), p0.clone()]
        self.state = [adamw8.new_state(n), adamw8.new_state(n)]
        with_w = with_w and p0.dtype == torch.float32
        self.w = [torch.empty(n, dtype=torch.bfloat16) if with_w else None for _ in range(2)]

    def step(self, g: torch.Tensor, t: int, isa: str | None = None, **hp):
        hp = {**HP, "weight_decay": 0.0, "grad_scale": 1.0, **hp}
        args = (hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])
        adamw8.reference_step(self.p[1], g, *self.state[1], self.w[1], t, *args, hp["grad_scale"])
        if isa is None:
            adamw8.native_step(self.p[0], g, *self.state[0], self.w[0], t, *args, hp["grad_scale"])
        else:
            p, (qm, qv, sm, sv), w = self.p[0], self.state[0], self.w[0]
            _native.adamw8bit_step(
                p.data_ptr(),
                g.data_ptr(),
                "bf16" if g.dtype == torch.bfloat16 else "f32",
                qm.data_ptr(),
                qv.data_ptr(),
                sm.data_ptr(),
                sv.data_ptr(),
                0 if w is None else w.data_ptr(),
                p.numel(),
                t,
                *args,
                hp["grad_scale"],
                p_dtype="bf16" if p.dtype == torch.bfloat16 else "f32",
                isa=isa,
            )

    def assert_same(self, nan_ok: bool = False):
        names = ("p", "qm", "qv", "sm", "sv")
        native, ref = (self.p[0], *self.state[0]), (self.p[1], *self.state[1])
        tensors = zip(names, native, ref, strict=True)
        for name, native, ref in tensors:
            assert_same_bits(name, native, ref, nan_ok)
        if self.w[0] is not None:
            assert_same_bits("w", self.w[0], self.w[1], nan_ok)


def test_reference_ops_are_single_ieee_roundings():
    """The float32 operations reference_step uses (tensor op tensor, tensor op Python scalar,
    square root through float64) round once: they equal the float64 result rounded, which is
    the correctly rounded float32 result for + - * / and sqrt."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(1 << 16, generator=gen) * torch.exp(torch.randn(1 << 16, generator=gen) * 8)
    b = torch.rand(1 << 16, generator=gen) + 0.5
    s = adamw8.constants(3, **HP, weight_decay=0.1).step_size
    exact = {
        "mul": (a * b, a.double() * b.double()),
        "add": (a + b, a.double() + b.double()),
        "sub": (a - b, a.double() - b.double()),
        "div": (a / b, a.double() / b.double()),
        "mul scalar": (a * s, a.double() * s),
        "div scalar": (b / 1.875, b.double() / 1.875),
        "scalar div (tensor)": (torch.full_like(b, 1.9375) / b, 1.9375 / b.double()),
        "sqrt": (torch.sqrt(b.double()).float(), torch.sqrt(b.double())),
    }
    for name, (f32, f64) in exact.items():
        assert_same_bits(name, f32, f64.float())


@pytest.mark.parametrize("n", [1, 255, 256, 257, 100_003])
@pytest.mark.parametrize("g_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16])
def test_native_matches_reference(n, g_dtype, weight_decay, grad_scale, p_dtype):
    gen = torch.Generator().manual_seed(n)
    pair = Pair(torch.randn(n, generator=gen).to(p_dtype))
    for t in range(1, 6):
        g = (torch.randn(n, generator=gen) * 10 ** (t - 3)).to(g_dtype)
        pair.step(g, t, weight_decay=weight_decay, grad_scale=grad_scale)
        pair.assert_same()


@pytest.mark.parametrize("isa", _native.adamw8bit_isas())
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16])
def test_every_compiled_variant_matches_reference(isa, p_dtype):
    n = 3 * 256 + 77
    gen = torch.Generator().manual_seed(7)
    pair = Pair(torch.randn(n, generator=gen).to(p_dtype))
    for t in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        pair.step(g, t, isa=isa, weight_decay=0.1, grad_scale=0.5)
        pair.assert_same()


def test_magnitudes_and_zero_blocks():
    """Blocks of zeros (no gradient ever), of tiny and of huge gradients (up to 1e17: g * g
    overflows float32 above 1.8e19), a block spanning 35 decades, parameters of every scale,
    and subnormal gradients."""
    gen = torch.Generator().manual_seed(3)
    n = 8 * 256 + 5
    p0 = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 20)
    p0[256:512] = 0.0
    pair = Pair(p0)
    for t in range(1, 8):
        g = torch.randn(n, generator=gen)
        g[:256] = 0.0
        g[512:768] *= 1e-30
        g[768:1024] *= 1e17
        g[1024:1280] *= torch.exp(torch.linspace(-40, 40, 256))
        g[1280:1536] = torch.randn(256, generator=gen) * 1e-40
        g[1536:1792] *= 1e-3 if t % 2 else 1e3
        pair.step(g, t, weight_decay=0.05)
        pair.assert_same()
    (qm, qv, sm, sv) = pair.state[0]
    assert sm[0].item() == 0.0 and sv[0].item() == 0.0
    assert torch.equal(qm[:256], torch.zeros(256, dtype=torch.int8))
    assert torch.equal(qv[:256], torch.zeros(256, dtype=torch.uint8))


@pytest.mark.parametrize("hp", [dict(beta1=0.0, beta2=0.0), dict(lr=0.5, weight_decay=1.5)])
def test_extreme_hyper_parameters(hp):
    gen = torch.Generator().manual_seed(11)
    n = 1000
    pair = Pair(torch.randn(n, generator=gen))
    for t in (1, 2, 1000, 10**9):
        pair.step(torch.randn(n, generator=gen), t, **hp)
        pair.assert_same()


@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16])
def test_non_finite_gradients_poison_their_block(p_dtype):
    """A NaN in block 0 and an infinity in block 2: those blocks store NaN maxima and zero m
    codes and their parameters turn NaN, on the next step too; the others step as usual."""
    gen = torch.Generator().manual_seed(5)
    n = 4 * 256
    pair = Pair(torch.randn(n, generator=gen).to(p_dtype))
    pair.step(torch.randn(n, generator=gen), 1)
    g = torch.randn(n, generator=gen)
    g[10] = math.nan
    g[600] = math.inf
    pair.step(g, 2)
    pair.assert_same(nan_ok=True)
    pair.step(torch.randn(n, generator=gen), 3)
    pair.assert_same(nan_ok=True)
    p, (qm, _, sm, sv) = pair.p[0], pair.state[0]
    for b in (0, 2):
        assert math.isnan(sm[b].item()) and math.isnan(sv[b].item())
        assert torch.equal(qm[b * 256 : (b + 1) * 256], torch.zeros(256, dtype=torch.int8))
        assert bool(torch.isnan(p[b * 256 : (b + 1) * 256]).all())
    for b in (1, 3):
        assert math.isfinite(sm[b].item()) and math.isfinite(sv[b].item())
        assert bool(torch.isfinite(p[b * 256 : (b + 1) * 256]).all())


def test_parameters_and_integer_like_steps():
    """p may be an nn.Parameter (a leaf that requires grad) of any contiguous shape, and step
    anything with __index__; the kernel's block is the module's."""
    assert _native.ADAMW8_BLOCK == adamw8.BLOCK == 256
    gen = torch.Generator().manual_seed(4)
    pair = Pair(torch.randn(3, 100, generator=gen))
    pair.p = [torch.nn.Parameter(p) for p in pair.p]
    pair.step(torch.randn(3, 100, generator=gen), torch.tensor(1))
    pair.assert_same()
    with pytest.raises(
        ValueError, match=r"step must be an int >= 1 \(1 for the first step\), got 1.5"
    ):
        pair.step(torch.randn(3, 100, generator=gen), 1.5)


@pytest.mark.parametrize("g_dtype", [torch.bfloat16, torch.float32])
def test_a_bf16_parameter_steps_as_its_master_would_then_rounds(g_dtype):
    """One implementation of the math: from a bf16 weight, the in-place bf16 step writes what
    the fp32-master step writes as ``w_out`` (and the same state); over later steps the two
    part (the master keeps the bits the bf16 weight rounds away)."""
    gen = torch.Generator().manual_seed(9)
    n = 2 * 256 + 31
    w0 = torch.randn(n, generator=gen).bfloat16()
    master, working = Pair(w0.float()), Pair(w0)
    grads = [(torch.randn(n, generator=gen) * 1e-2).to(g_dtype) for _ in range(3)]
    master.step(grads[0], 1, weight_decay=0.1)
    working.step(grads[0], 1, weight_decay=0.1)
    working.assert_same()
    assert_same_bits("p", working.p[0], master.w[0])
    for a, b in zip(working.state[0], master.state[0], strict=True):
        assert_same_bits("state", a, b)
    for t, g in enumerate(grads[1:], start=2):
        master.step(g, t, weight_decay=0.1)
        working.step(g, t, weight_decay=0.1)
        working.assert_same()
    assert not torch.equal(working.p[0], master.w[0]), "the rounding of each step adds up"


def test_without_w_out_the_state_is_the_same():
    gen = torch.Generator().manual_seed(2)
    n = 777
    p0 = torch.randn(n, generator=gen)
    with_w, without = Pair(p0), Pair(p0, with_w=False)
    for t in range(1, 4):
        g = torch.randn(n, generator=gen).bfloat16()
        with_w.step(g, t)
        without.step(g, t)
        without.assert_same()
        native, ref = (with_w.p[0], *with_w.state[0]), (without.p[0], *without.state[0])
        for a, b in zip(native, ref, strict=True):
            assert_same_bits("p or state", a, b)


@pytest.mark.parametrize("bits", [adamw8.M_BITS, adamw8.V_BITS])
def test_codes_are_8_bit_floats(bits):
    """decode gives 2^(e - 15) * (1 + f / 2^bits), or c * 2^-(14 + bits) below 2^bits, exactly;
    encode gives the code of the nearest value (ties to the even code) of min(y, top), and 0
    for NaN: checked against every code's value, computed in Python, by a search."""
    codes = torch.arange(1 << (4 + bits), dtype=torch.int32)

    def value(c: int) -> float:
        e, f = c >> bits, c & ((1 << bits) - 1)
        return c * 2.0 ** -(14 + bits) if e == 0 else 2.0 ** (e - 15) * (1 + f / 2**bits)

    values = [value(c) for c in codes.tolist()]
    assert adamw8.decode(codes, bits).tolist() == values
    assert values[-1] == adamw8.top(bits) == 2 - 2**-bits

    gen = torch.Generator().manual_seed(bits)
    midpoints = torch.tensor([(a + b) / 2 for a, b in zip(values, values[1:], strict=False)])
    ys = torch.cat(
        [
            torch.tensor(values),
            midpoints,
            torch.exp(torch.empty(20_000).uniform_(-20, 1, generator=gen)),
            torch.tensor([0.0, 2.5, 1e30, math.inf]),
        ]
    ).float()
    assert torch.equal(midpoints.float().double(), midpoints.double())  # exact ties
    got = adamw8.encode(ys, bits).tolist()
    table = torch.tensor(values, dtype=torch.float64)
    for y, code in zip(ys.tolist(), got, strict=True):
        distance = (table - min(y, values[-1])).abs()
        nearest = (distance == distance.min()).nonzero().flatten().tolist()
        assert code == (nearest[0] if len(nearest) == 1 else next(c for c in nearest if c % 2 == 0))
    assert adamw8.encode(torch.tensor([math.nan]), bits).tolist() == [0]


def test_state_codes_of_one_step():
    """One block, one step from zero state, beta1 = beta2 = 0 (m = g, sqrt(v) = |g|):
    sm = sv = max |g| = 4, and the codes of |g| * 1.875 / 4 (m) and |g| * 1.9375 / 4 (v)."""
    g = torch.tensor([-4.0, 1.0, 0.25, 1e-3, 0.0, 1e-12, -1e-9, 2.0, 1e-5, 3e-5])
    p = torch.zeros(10)
    qm, qv, sm, sv = adamw8.new_state(10)
    adamw8.native_step(p, g, qm, qv, sm, sv, None, 1, 1e-3, 0.0, 0.0, 1e-8, 0.0)
    assert sm.tolist() == [4.0] and sv.tolist() == [4.0]
    # 1.875 (top) = 127; 0.46875 = 2^-2 * 1.875: e = 13, f = 7, 13 * 8 + 7 = 111; 2^-12 * 1.92:
    # e = 3, f = round(7.36) = 7; below 2^-14, 4.69e-6 * 2^17 = 0.61 -> 1, 1.41e-5 * 2^17 = 1.84
    # -> 2; and for v 2^-12 * 1.98 rounds up to the next binade, e = 4, f = 0: 64.
    assert qm.tolist() == [-127, 111, 95, 31, 0, 0, 0, 119, 1, 2]
    assert qv.tolist() == [255, 223, 191, 64, 0, 0, 0, 239, 1, 4]


def test_nonzero_m_code_lifts_a_zero_v_code_to_1():
    """Element 1's sqrt(v) is 1.4e-7 of element 0's (below the smallest code) while its m is the
    block's largest (code 127): its v code becomes 1, so that a later step does not divide its m by
    eps alone."""
    p = torch.zeros(4)
    qm, qv, sm, sv = adamw8.new_state(4)
    for t, g in enumerate(([1e4, 0.0, 0.0, 0.0], [0.0, 1e-3, 0.0, 0.0]), start=1):
        adamw8.native_step(p, torch.tensor(g), qm, qv, sm, sv, None, t, 1e-3, 0.0, 0.5, 1e-8, 0.0)
    assert qm.tolist() == [0, 127, 0, 0]
    assert qv.tolist() == [255, 1, 0, 0]


def test_native_checks_its_arguments():
    n = 300
    p, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    qm, qv, sm, sv = adamw8.new_state(n)
    hp = (1, 1e-3, 0.9, 0.999, 1e-8, 0.0)

    def fails(match: str, *tensors, hp=hp, grad_scale=1.0):
        with pytest.raises(ValueError, match=match):
            adamw8.native_step(*tensors, *hp, grad_scale)
        with pytest.raises(ValueError, match=match):
            adamw8.reference_step(*tensors, *hp, grad_scale)

    fails(
        r"g must be torch.bfloat16 or torch.float32, got torch.float16",
        p,
        g.half(),
        qm,
        qv,
        sm,
        sv,
        None,
    )
    fails(r"qm must be torch.int8, got torch.uint8", p, g, qv, qv, sm, sv, None)
    fails(r"sm must have 2 elements \(for p's 300\), got 3", p, g, qm, qv, torch.zeros(3), sv, None)
    fails(
        r"w_out must have 300 elements", p, g, qm, qv, sm, sv, torch.empty(3, dtype=torch.bfloat16)
    )
    fails(r"p must be torch.float32 or torch.bfloat16, got torch.float16", p.half(), g, qm, qv,
          sm, sv, None)  # fmt: skip
    fails(
        r"w_out must be None for a bfloat16 p: the parameter is the working weight",
        p.bfloat16(),
        g,
        qm,
        qv,
        sm,
        sv,
        torch.empty(n, dtype=torch.bfloat16),
    )
    fails(r"g must be contiguous", p, torch.zeros(2 * n)[::2], qm, qv, sm, sv, None)
    fails(
        r"p must have at least 1 element",
        torch.zeros(0),
        g[:0],
        qm[:0],
        qv[:0],
        sm[:0],
        sv[:0],
        None,
    )
    fails(r"step must be an int >= 1", p, g, qm, qv, sm, sv, None, hp=(0, *hp[1:]))
    fails(r"lr must be finite and >= 0, got -1", p, g, qm, qv, sm, sv, None, hp=(1, -1.0, *hp[2:]))
    fails(
        r"beta1 must be in \[0, 1\), got 1.0",
        p,
        g,
        qm,
        qv,
        sm,
        sv,
        None,
        hp=(1, 1e-3, 1.0, *hp[3:]),
    )
    fails(
        r"beta2 must be in \[0, 1\), got -0.1",
        p,
        g,
        qm,
        qv,
        sm,
        sv,
        None,
        hp=(*hp[:3], -0.1, *hp[4:]),
    )
    fails(r"eps must be finite and > 0", p, g, qm, qv, sm, sv, None, hp=(*hp[:4], 0.0, 0.0))
    fails(
        r"weight_decay must be finite and >= 0", p, g, qm, qv, sm, sv, None, hp=(*hp[:5], math.nan)
    )
    fails(
        r"grad_scale must be finite and >= 0, got inf",
        p,
        g,
        qm,
        qv,
        sm,
        sv,
        None,
        grad_scale=math.inf,
    )
    fails(
        r"lr / \(1 - beta1 \*\* step\) overflows float32",
        p,
        g,
        qm,
        qv,
        sm,
        sv,
        None,
        hp=(1, 1e38, 0.9, *hp[3:]),
    )
    with pytest.raises(ValueError, match=r"native_step runs on the CPU: p is on meta"):
        meta = [torch.empty_like(t, device="meta") for t in (p, g, qm, qv, sm, sv)]
        adamw8.native_step(*meta, None, *hp)


def test_kernel_checks_addresses_and_values():
    """The extension's own checks, for callers other than native_step."""
    n = 300
    p, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    qm, qv, sm, sv = adamw8.new_state(n)
    buf = torch.zeros(2 * n, dtype=torch.uint8)

    def call(**change):
        args = dict(
            p_ptr=p.data_ptr(), g_ptr=g.data_ptr(), g_dtype="bf16", qm_ptr=qm.data_ptr(),
            qv_ptr=qv.data_ptr(), sm_ptr=sm.data_ptr(), sv_ptr=sv.data_ptr(), w_ptr=0, n=n,
            step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
        )  # fmt: skip
        _native.adamw8bit_step(**{**args, **change})

    call()
    cases = [
        (dict(p_ptr=0), r"p: the address is null"),
        (dict(sm_ptr=sm.data_ptr() + 2), r"sm: the address 0x[0-9a-f]+ is not aligned to its "
                                         r"element \(4 bytes\)"),
        (dict(g_dtype="f16"), r'g_dtype must be "bf16" or "f32", got "f16"'),
        (dict(p_dtype="f16"), r'p_dtype must be "bf16" or "f32", got "f16"'),
        (dict(p_dtype="bf16", w_ptr=buf.data_ptr()), r"w must be 0 for a bf16 p"),
        (dict(n=0), r"n must be >= 1"),
        (dict(qm_ptr=buf.data_ptr(), qv_ptr=buf.data_ptr() + n - 1), r"qm and qv overlap"),
        (dict(w_ptr=p.data_ptr()), r"p and w overlap in memory"),
        (dict(step=0), r"step must be >= 1"),
        (dict(beta2=1.0), r"beta2 must be in \[0, 1\), got 1"),
        (dict(isa="sse9"), r"isa must be one of \[.*\"baseline\"\] on this CPU, got \"sse9\""),
    ]  # fmt: skip
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**change)


def test_tracks_fp32_adamw_on_a_quadratic():
    """The formula is AdamW: on 0.5 * sum(a * (x - t)^2) with curvatures a spread over e^±2,
    300 steps from the same start stay near torch.optim.AdamW's fp32 run, with and without
    weight decay."""
    n, steps, lr = 4096, 300, 1e-2
    gen = torch.Generator().manual_seed(0)
    a = torch.exp(torch.empty(n).uniform_(-2, 2, generator=gen))
    target = torch.randn(n, generator=gen)
    x0 = torch.randn(n, generator=gen)
    for weight_decay in (0.0, 0.1):
        x32 = x0.clone().requires_grad_(True)
        opt = torch.optim.AdamW(
            [x32], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay
        )
        x8, state = x0.clone(), adamw8.new_state(n)
        for t in range(1, steps + 1):
            opt.zero_grad()
            (0.5 * (a * (x32 - target) ** 2).sum()).backward()
            opt.step()
            g = a * (x8 - target)
            adamw8.native_step(x8, g, *state, None, t, lr, 0.9, 0.999, 1e-8, weight_decay)
            if t == 20:
                early = (x8 - x32.detach()).abs()
        loss0 = (0.5 * a * (x0 - target) ** 2).sum().item()
        loss32 = (0.5 * a * (x32.detach() - target) ** 2).sum().item()
        loss8 = (0.5 * a * (x8 - target) ** 2).sum().item()
        # After 20 steps (each coordinate moved about 0.19 by then): within 5 steps (0.05) of
        # fp32's everywhere, and within 1 (0.01) on average (linear or square-root codes of m,
        # which stick at small values, are 0.1 away at worst).
        assert early.max().item() < 5 * lr and early.mean().item() < lr, early
        # At the end both have removed >= 95% of the loss, agree on it to 15%, and the points
        # are on average within 0.05 (fp32's moved 1.0 on average).
        assert loss32 < 0.05 * loss0 and abs(loss8 - loss32) < 0.15 * loss32, (loss32, loss8)
        assert (x8 - x32.detach()).abs().mean().item() < 0.05, weight_decay
