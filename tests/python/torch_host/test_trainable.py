"""Trainable weights in host memory (``stream_trainable`` + ``HostAdamW``), on the CPU: losses
and LoRA weights ``torch.equal`` to the same model trained with its LoRA in place and the
documented optimizer formula applied to fp32 masters (``master="fp32"``) or to the bf16 weights
themselves (``master="none"``); delayed updates equal to a reference that applies each update
one step late; accumulation, clipping, schedulers, resume and the saved state."""

from __future__ import annotations

import copy

import pytest
import torch
from weightstream.torch.host import HostAdamW, TrainableError, stream_trainable

from tests.python.torch_host.trainable_pair import (
    AUTOCAST,
    Reference,
    assert_same_lora,
    batches,
    lora_params,
    loss_of,
    make,
    step_both,
    train_pair,
)


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("master", ["fp32", "none"])
def test_adamw_equals_torch_adamw_on_masters(ckpt, master):
    ref_model, model, tr, _, _ = train_pair(ckpt=ckpt, master=master)
    assert_same_lora(ref_model, model)
    assert all(p.grad is None for p in lora_params(model))
    assert all(p.device.type == "cpu" for p in lora_params(model))
    tr.close()


@pytest.mark.parametrize(
    "kw", [{}, {"delay": True, "ckpt": True}, {"accumulate": 2, "max_norm": 0.05}]
)
@pytest.mark.parametrize("master", ["fp32", "none"])
def test_adamw8bit_equals_its_torch_reference(kw, master):
    """HostAdamW's adamw8bit (the native kernel) against adamw8.reference_step on the masters
    (or on the bf16 weights themselves): equal losses every step (train_pair) and equal LoRA
    weights at the end."""
    ref_model, model, tr, _, _ = train_pair(steps=5, kind="adamw8bit", master=master, **kw)
    assert_same_lora(ref_model, model)
    tr.close()


def test_fp32_lora_under_autocast():
    """fp32 working weights are their own masters; autocast's casts are differentiated by
    running the op again."""
    try:
        ref_model, model, tr, _, _ = train_pair(autocast=True, ckpt=True, max_norm=0.05)
    finally:
        AUTOCAST[0] = False
    assert_same_lora(ref_model, model)
    assert all(s.master is s.working for s in tr.slots)
    assert all(p.dtype == torch.float32 for p in lora_params(model))
    tr.close()


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_clipping_and_accumulation(master):
    ref_model, model, tr, _, _ = train_pair(accumulate=2, max_norm=0.05, master=master)
    assert_same_lora(ref_model, model)
    tr.close()


@pytest.mark.parametrize("master", ["fp32", "none"])
@pytest.mark.parametrize("group_by", ["block", "layer"])
def test_delayed_update_is_one_step_late(master, group_by):
    """Per layer, backward takes a group (and sets its update off) several groups before it
    gives the gradient: its copies are kept until then, or a later copy would read the updated
    weight."""
    ref_model, model, tr, opt, ref = train_pair(
        steps=5, delay=True, ckpt=True, master=master, group_by=group_by
    )
    assert_same_lora(ref_model, model)
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    tr.close()


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("blocks", [3, 7])
def test_delayed_update_with_accumulation_lands_after_the_first_backward(ckpt, blocks):
    """With gradient accumulation the previous step's update lands during the step's first
    backward and the later micro-batches compute with it, whether their forward still finds
    the group's copies (3 blocks: all live) or copies them again (7: they come and go)."""
    ref_model, model, tr, opt, ref = train_pair(
        steps=4, accumulate=3, delay=True, ckpt=ckpt, blocks=blocks, max_norm=0.05
    )
    assert_same_lora(ref_model, model)
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    tr.close()


def test_delayed_updates_run_before_their_gradients_and_those_land_in_place():
    """Backward's first take of a group sets its delayed updates off: with the worker given
    time to finish them (here: each gradient waits for the worker to be idle), every gradient
    of a step after the first lands straight in its slot and none goes through the bounce
    ring, whether backward copied the group again (7 checkpointed blocks: the first ones) or
    found the copies forward left (the last). The ring is the session's host memory, twice
    the largest group's gradients, and every piece it lends comes back."""
    ref_model, model, tr, opt, ref = train_pair(steps=2, delay=True, ckpt=True, blocks=7)
    bounced = []
    take, grad_ready = tr._bounce.take, tr.grad_ready

    def counting(shape, dtype):
        bounced.append(shape)
        return take(shape, dtype)

    def after_the_worker(slot, grad):
        tr.wait_grads()
        grad_ready(slot, grad)

    tr._bounce.take, tr.grad_ready = counting, after_the_worker
    for x in batches(2, seed=9):
        step_both(ref_model, model, ref, opt, x)
        assert bounced == []
    assert tr._bounce.in_use == 0
    ref.apply(ref.pending)
    opt.flush()
    assert_same_lora(ref_model, model)
    block = sum(-(-s.param.nbytes // 256) * 256 for s in tr.groups["blocks.0"].slots)
    assert tr._bounce.size == tr.bounce_bytes == 8192 == -(-2 * block // 4096) * 4096
    tr.close()


def test_scheduler_sets_the_learning_rate():
    ref_model, model = make(), make()
    ref = Reference(ref_model)
    tr = stream_trainable(model, device="cpu")
    opt = HostAdamW(tr.params(), lr=1e-2, weight_decay=1e-2, trainable=tr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for i, x in enumerate(batches(3)):
        loss_of(ref_model, x).backward()
        loss_of(model, x).backward()
        for g in ref.opt.param_groups:
            g["lr"] = 1e-2 / (i + 1)
        ref.step()
        opt.step()
        sched.step()
    assert_same_lora(ref_model, model)


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_resume_continues_the_same_trajectory(master):
    data = batches(4)
    whole = make()
    tr = stream_trainable(whole, device="cpu", master=master)
    opt = HostAdamW(tr.params(), lr=1e-2, trainable=tr, delay=True)
    for x in data:
        loss_of(whole, x).backward()
        opt.step()
        opt.zero_grad()

    first = make()
    tr1 = stream_trainable(first, device="cpu", master=master)
    opt1 = HostAdamW(tr1.params(), lr=1e-2, trainable=tr1, delay=True)
    for x in data[:2]:
        loss_of(first, x).backward()
        opt1.step()
        opt1.zero_grad()
    saved = copy.deepcopy(opt1.state_dict())
    lora = {k: v.clone() for k, v in first.state_dict().items() if "lora_" in k}
    tr1.close()

    second = make()
    with torch.no_grad():
        for p in lora_params(second):
            p.zero_()  # the weights come from the saved LoRA, the masters from the state
    second.load_state_dict(lora, strict=False)
    tr2 = stream_trainable(second, device="cpu", master=master)
    opt2 = HostAdamW(tr2.params(), lr=1e-2, trainable=tr2, delay=True)
    opt2.load_state_dict(saved)
    for x in data[2:]:
        loss_of(second, x).backward()
        opt2.step()
        opt2.zero_grad()
    assert_same_lora(whole, second)


def test_a_state_saved_with_another_master_is_refused_naming_it():
    model = make()
    tr = stream_trainable(model, device="cpu")
    saved = HostAdamW(tr.params(), trainable=tr).state_dict()
    assert saved["master"] == "fp32"
    saved = copy.deepcopy(saved)
    tr.close()
    tr = stream_trainable(make(), device="cpu", master="none")
    opt = HostAdamW(tr.params(), trainable=tr)
    with pytest.raises(TrainableError) as e:
        opt.load_state_dict(saved)
    assert str(e.value) == (
        "parameter 0 (blocks.0.q.lora_A): master is [8, 48] torch.float32 in the state dict, "
        "[8, 48] torch.bfloat16 here (saved with master='fp32', this optimizer's trainable has "
        "master='none': resume with the same master)"
    )
    tr.close()


def test_the_state_dict_saves_with_torch_save_each_tensor_alone():
    """The state's tensors are views of shared regions in several dtypes (fp32 masters and a
    bf16 pending gradient in one region): ``torch.save`` takes them, each with its own bytes
    only, and ``torch.load(weights_only=True)`` gives them back equal."""
    import io

    model = make()
    tr = stream_trainable(model, device="cpu")
    opt = HostAdamW(tr.params(), lr=1e-2, trainable=tr, delay=True)
    for x in batches(2):
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    assert "pending_grad" in state["state"][0]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["kind"] == "adamw" and loaded["param_groups"] == state["param_groups"]
    for i, entry in state["state"].items():
        assert loaded["state"][i].keys() == entry.keys()
        for name, t in entry.items():
            got = loaded["state"][i][name]
            if isinstance(t, torch.Tensor):
                assert got.dtype == t.dtype and torch.equal(got, t), (i, name)
                assert got.untyped_storage().nbytes() == t.nbytes, (i, name)
            else:
                assert got == t, (i, name)
    tr.close()
