"""Trainable parameters (LoRA through peft), the disabled-adapter reference, an EMA of the trained weights, the
micro-batches of an optimizer step and the learning-rate schedule."""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.distributed import copy_full_, full_tensor, reshard
from common.utils import RunStopped, UserError


def add_lora(transformer, rank: int, alpha: float, target_modules: list[str], unused: list[str] = ()) -> None:
    """Attach a peft LoRA adapter. Gaussian init makes lora_B zero, so the model starts equal to the base. Layers
    in the `unused` modules (`adapter.unused_modules`: their output never reaches the model's) get none: they
    would get no gradient, which stops DDP."""
    from peft import LoraConfig

    exclude = [name for name, _ in transformer.named_modules() if _within(name, unused)]
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                       target_modules=target_modules, exclude_modules=exclude or None))


def full_finetune_parameters(transformer, unused: list[str] = ()) -> list[torch.nn.Parameter]:
    """The weights a full fine-tune trains, in module order: all but those of the `unused` modules
    (`adapter.unused_modules`), which no gradient reaches."""
    return [p for name, p in transformer.named_parameters() if not _within(name.rpartition(".")[0], unused)]


def _within(name: str, modules: list[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def trainable_parameters(module) -> list[torch.nn.Parameter]:
    """The parameters being trained, cast to float32 (master weights) whatever the model dtype."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


@contextmanager
def adapters_disabled(transformer):
    """The reference policy of a LoRA run: the same module with its adapters switched off, no copy."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


class EMA:
    """Exponential moving average of a list of parameters, kept in float32 on their device (shard by shard
    when they are FSDP2 DTensors: pass the parameters read after `prepare`, and the module holding them so
    that it is resharded before the EMA writes into them)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, module: torch.nn.Module | None = None):
        self.params = params
        self.decay = decay
        self.module = module
        self.shadow = [p.detach().clone().float() for p in params]

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        d = self.decay if decay is None else decay
        reshard(self.module)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - d)

    @contextmanager
    def applied(self):
        """Temporarily put the EMA weights into the model (e.g. for evaluation)."""
        reshard(self.module)
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            reshard(self.module)
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [full_tensor(s).cpu() for s in self.shadow]}  # collective if sharded

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        reshard(self.module)
        for s, saved in zip(self.shadow, state["shadow"]):
            copy_full_(s, saved)


@dataclass
class MicroBatch:
    """One backward pass of an optimizer step: which of this process's samples it holds and how each counts."""

    index: torch.Tensor   # positions in this process's part of the epoch (long)
    weight: torch.Tensor  # per-sample loss weight: processes / samples of this optimizer step (all processes); 0: pad
    last: bool            # the last micro-batch of its optimizer step (the accumulation boundary)

    @property
    def real(self) -> torch.Tensor:
        return self.weight > 0


def plan_micro_batches(keep: torch.Tensor, world: int, rank: int, batch_size: int,
                       updates: int) -> list[list[MicroBatch]]:
    """Micro-batches of each optimizer step of an epoch, for process `rank`.

    keep: (N,) bool over the epoch's samples in draw order (every process passes the same), process p owning the
    contiguous part p of N/world. Samples not kept (zero advantage: no policy gradient) are left out. Every process
    gets the SAME number of micro-batches (DDP, FSDP and DeepSpeed need equal backward counts): enough for the
    process with the most kept samples at ≤ batch_size each, a multiple of `updates`; the others' are smaller, and
    an empty one holds one padding sample of weight 0. With every sample kept the micro-batches are the rollout's
    (`rollout_micro_batches`), so the first ratio of an epoch is exactly 1. A loss written as Σ_i weight_i·ℓ_i per
    micro-batch and averaged over processes by DDP is the mean of ℓ over the step's kept samples."""
    keep = keep.bool().cpu()
    local = len(keep) // world
    kept = [torch.nonzero(keep[p * local:(p + 1) * local]).flatten() for p in range(world)]
    count = max(1, max(math.ceil(len(k) / batch_size) for k in kept))
    count = math.ceil(count / updates) * updates
    chunks = [list(torch.tensor_split(k, count)) for k in kept]
    per_update = count // updates
    plan = []
    for u in range(updates):
        steps = range(u * per_update, (u + 1) * per_update)
        total = sum(len(chunks[p][b]) for p in range(world) for b in steps)
        update = []
        for b in steps:
            index = chunks[rank][b]
            weight = torch.full((len(index),), world / max(total, 1), dtype=torch.float32)
            if len(index) == 0:
                index, weight = torch.zeros(1, dtype=torch.long), torch.zeros(1)
            update.append(MicroBatch(index, weight, last=b == steps[-1]))
        plan.append(update)
    return plan


def check_updates_per_epoch(updates: int, local_count: int) -> None:
    """One-line refusal of more optimizer steps than a process has samples: the rollout's micro-batches would hold
    padding, rolled out and scored as if it were samples."""
    if updates > local_count:
        raise UserError(f"--updates-per-epoch {updates} exceeds the {local_count} samples each process has per epoch "
                        f"(--prompts-per-epoch × --group-size / processes): every optimizer step needs at least one")


def rollout_micro_batches(local_count: int, batch_size: int, updates: int) -> list[torch.Tensor]:
    """The rollout's micro-batches of this process's samples: those of `plan_micro_batches` with every sample kept.
    Called by every script right after setup, so the check sees the process count that runs."""
    check_updates_per_epoch(updates, local_count)
    plan = plan_micro_batches(torch.ones(local_count, dtype=torch.bool), 1, 0, batch_size, updates)
    return [mb.index for update in plan for mb in update]


def apply_step(grad_norm: float, optimizer, scheduler, epoch: int, what: str = "the gradient norm") -> None:
    """Step the optimizer and its schedule on gradients already clipped to `grad_norm`, then zero them; a non-finite
    norm stops the run first, before the weights change (so the last checkpoint stays the state to resume)."""
    if not math.isfinite(grad_norm):
        raise RunStopped(f"epoch {epoch}: {what} is {grad_norm}; stopping before the optimizer step (the last "
                         f"checkpoint is intact)")
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def lr_scheduler(optimizer, schedule: str, warmup_steps: int, total_steps: int):
    """diffusers' learning-rate schedules, stepped once per optimizer step: constant, or linear warm-up then
    constant / cosine / linear decay to 0 at `total_steps`."""
    from diffusers.optimization import get_scheduler

    name = "constant_with_warmup" if schedule == "constant" and warmup_steps > 0 else schedule
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
