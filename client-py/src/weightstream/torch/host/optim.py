"""``HostAdamW``: AdamW for the trainable weights ``stream_trainable`` holds in host memory.
The step runs on the trainer's CPU threads, on the master weights and moments in the daemon's
shared memory, and writes the working weights the next forward copies to the device.

Two kinds, exact by construction or by test, each in the trainable's two ``master`` modes
(``stream_trainable(..., master=...)``; the optimizer follows the trainable, ``master``):

- ``"adamw"``: each weight's step *is* ``torch.optim.AdamW(fused=True)`` (on a torch without
  the CPU fused kernel, ``foreach=False``). With ``master="fp32"``: applied to its fp32 master
  with the gradient converted to fp32, fp32 moments, then the working weight rounded from the
  master (``.copy_``: round to nearest even). With ``master="none"``: applied to the working
  weight itself with its gradient, torch's semantics for a bf16 (f16) parameter: the moments
  are in the parameter's dtype too (4 bytes per bf16 element, not 8), and the kernel's fp32
  result is rounded into the weight. ``reference`` says which.
- ``"adamw8bit"``: block-wise 8-bit moments (``weightstream.torch.host.adamw8``: the formula, its
  torch reference, and the native kernel that is ``torch.equal`` to it). With
  ``master="none"`` the kernel's parameter is the bf16 weight itself: read to fp32, the same
  fp32 formula, rounded to nearest-even back (as bitsandbytes' AdamW8bit updates a bf16
  parameter). Not for f16 weights (``TrainableError``: use ``"adamw"``).

Gradient clipping (``max_grad_norm``) is ``torch.nn.utils.clip_grad_norm_``'s over the host
gradients, in their dtype, before the step (``clip_grads_``). ``delay=True`` is ZeRO-Offload's
delayed update: ``step()`` returns at once and each weight's update runs during the next
backward, right after that weight's last use in the step (so the trainer never waits for the
CPU); step ``k`` then
computes with the weights updated through step ``k - 2``. The trajectory is exactly that of a
reference which applies each step's update one step late; ``flush()`` applies the one pending.
Per-group learning rates and any ``torch.optim.lr_scheduler`` work as usual (``param_groups``);
gradient accumulation is several backwards before one ``step()``.
"""

from __future__ import annotations

import functools
import time

import torch

from weightstream.torch.host.layers import Slot, Trainable
from weightstream.torch.host.sizing import OPTIMIZERS, check_optimizer
from weightstream.torch.host.storage import Carver, TrainableError

KINDS = OPTIMIZERS
#: The torch optimizer the "adamw" kind matches bit for bit.
FUSED = "fused" in torch.optim.AdamW.__init__.__code__.co_varnames


def clip_grads_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` applied to gradient tensors themselves (torch's takes
    parameters and reads their ``.grad``; given bare gradients it clips nothing): the total
    2-norm as torch computes it (``get_total_norm``), then each gradient multiplied by
    ``min(max_norm / (total + 1e-6), 1)``. Returns the total norm."""
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


def alone(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, on the CPU) over the same memory, in a storage of its own that holds
    exactly its bytes: ``torch.save`` of a view writes the whole storage it views, and refuses
    views of one storage in different dtypes."""
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)


def reference_adamw(params, **hyper) -> torch.optim.AdamW:
    """The torch optimizer an ``"adamw"`` step equals, for ``params`` (fp32 masters)."""
    if FUSED:
        return torch.optim.AdamW(params, fused=True, **hyper)
    return torch.optim.AdamW(params, foreach=False, **hyper)


class HostAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        trainable: Trainable,
        kind: str = "adamw",
        max_grad_norm: float | None = None,
        delay: bool = False,
    ):
        check_optimizer(kind)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.trainable, self.kind, self.delay = trainable, kind, delay
        self.max_grad_norm = max_grad_norm
        missing = [
            tuple(p.shape)
            for g in self.param_groups
            for p in g["params"]
            if id(p) not in trainable.by_param
        ]
        if missing:
            raise TrainableError(
                f"{len(missing)} of the optimizer's parameters (shapes {missing[:4]}"
                f"{' …' if len(missing) > 4 else ''}) are not weights stream_trainable holds "
                "in host memory: give HostAdamW only those (trainable.params()), and another "
                "optimizer the rest"
            )
        #: (slot, group index) in the groups' order.
        self._slots: list[tuple[Slot, int]] = [
            (trainable.by_param[id(p)], gi)
            for gi, g in enumerate(self.param_groups)
            for p in g["params"]
        ]
        if kind == "adamw8bit":
            odd = [s for s, _ in self._slots if s.param.dtype == torch.float16]
            if odd:
                raise TrainableError(
                    f"{odd[0].name}: adamw8bit steps bf16 and fp32 weights, and this one is "
                    "float16: use adamw, or a bf16 LoRA"
                )
        self.steps = {s.index: 0 for s, _ in self._slots}
        self._moments: dict[int, tuple[torch.Tensor, ...]] = {}
        self._inner: dict[int, torch.optim.AdamW] = {}
        self._scratch: torch.Tensor | None = None
        self._allocate()
        trainable._users.append(self)

    @property
    def master(self) -> str:
        """The trainable's ``master`` mode (``"fp32"`` or ``"none"``): whether the step updates
        fp32 masters of the narrower weights or the weights themselves."""
        return self.trainable.master

    @property
    def reference(self) -> str:
        """The exact formula a step applies, in words."""
        if self.kind == "adamw8bit":
            if self.master == "none":
                return (
                    "weightstream.torch.host.adamw8.reference_step (the bf16 weight itself, "
                    "updated in place; fp32 weights: their own master; 8-bit moments)"
                )
            return "weightstream.torch.host.adamw8.reference_step (fp32 master, 8-bit moments)"
        how = "fused=True" if FUSED else "foreach=False"
        if self.master == "none":
            return (
                f"torch.optim.AdamW({how}) on the weights themselves, moments in their dtype, "
                "gradient as it is"
            )
        return f"torch.optim.AdamW({how}) on the fp32 master, gradient cast to fp32"

    def _allocate(self):
        carver = Carver()
        plan = {}
        for s, _ in self._slots:
            n = s.numel
            if self.kind == "adamw":
                # fp32 moments for an fp32 master (or weight); torch's AdamW keeps the moments
                # of a bf16/f16 parameter in its dtype (master="none").
                plan[s.index] = (
                    carver.reserve(s.param.shape, s.master.dtype),
                    carver.reserve(s.param.shape, s.master.dtype),
                )
            else:
                blocks = -(-n // 256)
                plan[s.index] = (
                    carver.reserve((n,), torch.int8),
                    carver.reserve((n,), torch.uint8),
                    carver.reserve((blocks,), torch.float32),
                    carver.reserve((blocks,), torch.float32),
                )
        try:
            region = self.trainable.storage.alloc(carver.size, f"{self.kind} state")
        except Exception as e:
            raise TrainableError(
                f"{self.kind}'s state needs {carver.size / (1 << 30):.2f} GiB of host memory "
                f"beside the trainable weights' {self.trainable.host_bytes / (1 << 30):.2f} "
                f"GiB, and the daemon refused it: {e}"
            ) from e
        views = carver.views(region)
        for s, _ in self._slots:
            moments = tuple(views[i] for i in plan[s.index])
            for t in moments:
                t.zero_()
            self._moments[s.index] = moments
            if self.kind == "adamw":
                inner = reference_adamw([s.master])
                inner.state[s.master] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": moments[0],
                    "exp_avg_sq": moments[1],
                }
                self._inner[s.index] = inner

    def release(self):
        """Drops this optimizer's views of the host memory (``Trainable.close`` calls it): the
        regions are unmapped, and stop counting against the uid, when the last view goes."""
        self._moments.clear()
        self._inner.clear()
        self._scratch = None
        self._slots = []

    # --- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tr = self.trainable
        tr.wait_grads()
        taken = [(s, gi) for s, gi in self._slots if s.grads > 0]
        self._clip(taken)
        started = time.perf_counter()
        for s, gi in taken:
            g = self.param_groups[gi]
            hyper = (float(g["lr"]), tuple(map(float, g["betas"])), float(g["eps"]))
            hyper += (float(g["weight_decay"]),)
            update = functools.partial(self._update, hyper=hyper)
            s.grads = 0
            if self.delay:
                s.pending = update
            else:
                tr.before_write(s)
                update(s)
        tr.times["step_update_s"] += time.perf_counter() - started
        tr.invalidate()
        return loss

    def _clip(self, taken: list[tuple[Slot, int]]):
        """Clips the gradients of this step's ``(slot, group index)`` to ``max_grad_norm``, all
        together (a subclass may clip otherwise)."""
        if self.max_grad_norm is not None and taken:
            clip_grads_([s.grad for s, _ in taken], self.max_grad_norm)

    def _fp32(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` in fp32, in one scratch buffer reused by every update (they run one at a
        time: in ``step()``, or on the gradient worker when delayed), not a new allocation."""
        n = grad.numel()
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(max(s.numel for s, _ in self._slots), dtype=torch.float32)
        return self._scratch[:n].view(grad.shape).copy_(grad)

    def _update(self, s: Slot, hyper):
        lr, (beta1, beta2), eps, wd = hyper
        self.steps[s.index] += 1
        if self.kind == "adamw":
            inner = self._inner[s.index]
            inner.param_groups[0].update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
            s.master.grad = s.grad if s.grad.dtype == s.master.dtype else self._fp32(s.grad)
            try:
                inner.step()
            finally:
                s.master.grad = None
            if s.working is not s.master:
                s.working.copy_(s.master)
        else:
            from weightstream.torch.host import adamw8

            qm, qv, sm, sv = self._moments[s.index]
            # With master="none" (or an fp32 weight) the master is the working weight: the
            # kernel updates it in place.
            adamw8.native_step(
                s.master.view(-1),
                s.grad.view(-1),
                qm,
                qv,
                sm,
                sv,
                None if s.working is s.master else s.working.view(-1),
                step=self.steps[s.index],
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=wd,
            )

    def flush(self):
        """Applies the pending delayed updates now (before saving the final weights)."""
        tr = self.trainable
        tr.wait_grads()
        for s, _ in self._slots:
            if s.pending is not None:
                update, s.pending = s.pending, None
                tr.before_write(s)
                update(s)
        tr.invalidate()

    def zero_grad(self, set_to_none: bool = True):
        self.trainable.wait_grads()
        for s, _ in self._slots:
            if s.pending is None:
                s.grads = 0
        super().zero_grad(set_to_none)

    # --- resume ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Master weights (with ``master="none"``: the weights themselves), moments and step
        counts per parameter index (views of the live state: save them, do not keep them), the
        groups' hyper-parameters, the trainable's ``master`` mode, and the delayed update
        still pending (its gradient and hyper-parameters). Each tensor has a storage of
        its own over its bytes (``alone``): ``torch.save`` writes those bytes only, and takes
        tensors of several dtypes that share one host region."""
        self.trainable.wait_grads()
        state = {}
        for i, (s, _) in enumerate(self._slots):
            entry = {"step": self.steps[s.index], "master": alone(s.master)}
            names = ("exp_avg", "exp_avg_sq") if self.kind == "adamw" else ("qm", "qv", "sm", "sv")
            entry.update(zip(names, map(alone, self._moments[s.index]), strict=True))
            if s.pending is not None:
                entry["pending_grad"] = alone(s.grad)
                entry["pending_hyper"] = s.pending.keywords["hyper"]
            state[i] = entry
        groups = []
        start = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(start, start + n)),
                }
            )
            start += n
        return {
            "kind": self.kind,
            "master": self.master,
            "delay": self.delay,
            "state": state,
            "param_groups": groups,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict):
        if state_dict.get("kind") != self.kind:
            raise TrainableError(
                f"the state dict is of a {state_dict.get('kind')!r} optimizer, this one is "
                f"{self.kind!r}"
            )
        saved = state_dict["state"]
        if len(saved) != len(self._slots) or len(state_dict["param_groups"]) != len(
            self.param_groups
        ):
            raise TrainableError(
                f"the state dict has {len(saved)} parameters in "
                f"{len(state_dict['param_groups'])} groups, this optimizer "
                f"{len(self._slots)} in {len(self.param_groups)}"
            )
        for i, (s, _) in enumerate(self._slots):
            entry = saved[i]
            live = (s.master, *self._moments[s.index])
            names = ("master",) + (
                ("exp_avg", "exp_avg_sq") if self.kind == "adamw" else ("qm", "qv", "sm", "sv")
            )
            for name, t in zip(names, live, strict=True):
                got = entry[name]
                if tuple(got.shape) != tuple(t.shape) or got.dtype != t.dtype:
                    saved_master = state_dict.get("master", "fp32")
                    hint = (
                        f" (saved with master={saved_master!r}, this optimizer's trainable has "
                        f"master={self.master!r}: resume with the same master)"
                        if saved_master != self.master
                        else ""
                    )
                    raise TrainableError(
                        f"parameter {i} ({s.name}): {name} is {list(got.shape)} {got.dtype} in "
                        f"the state dict, {list(t.shape)} {t.dtype} here{hint}"
                    )
        self.trainable.wait_grads()
        for i, (s, _) in enumerate(self._slots):
            entry = saved[i]
            self.trainable.before_write(s)
            s.master.copy_(entry["master"])
            for t, name in zip(
                self._moments[s.index],
                ("exp_avg", "exp_avg_sq") if self.kind == "adamw" else ("qm", "qv", "sm", "sv"),
                strict=True,
            ):
                t.copy_(entry[name])
            if s.working is not s.master:
                s.working.copy_(s.master)
            self.steps[s.index] = int(entry["step"])
            if self.kind == "adamw":
                self._inner[s.index].state[s.master]["step"].fill_(float(entry["step"]))
            s.pending = None
            s.grads = 0
            if "pending_grad" in entry:
                s.grad.copy_(entry["pending_grad"])
                s.pending = functools.partial(self._update, hyper=entry["pending_hyper"])
        for g, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved_group.items() if k != "params"})
        self.trainable.invalidate()
