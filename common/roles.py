"""Trained roles: LoRA adapters that train beside the run's own ("default") on the same transformer, each with its
own AdamW, gradient clip, learning-rate schedule and checkpointed state (TDM-R1's fake score and surrogate reward,
algorithms.md §9). `common.setup` builds them (`setup(..., roles={name: RoleOptimizer(...)})`) before `prepare`,
so DDP registers only the default adapter's weights.

A role's forward with gradients runs inside `role.trained()`, which switches the module to its adapter: peft then
gives requires_grad to that adapter alone, so a backward inside reaches only its weights. Frozen queries (the
reference, shadows, another role's no-grad `velocity`) switch adapters too, which takes requires_grad away from
the others: a script runs them BEFORE the forward whose backward follows (a switch between a forward and its
backward would leave the weights without gradient).

Multi-role backward under DDP: a backward that reaches one adapter leaves DDP's registered weights (the default
adapter) without gradient, which its reducer refuses. So a script with roles runs every backward under no_sync
(`role_backward`) and all-reduces each role's gradients itself just before that role's step (`all_reduce_gradients`;
the default adapter's too, before `common.setup.optimizer_step`). FSDP2, DeepSpeed, sequence parallelism and full
fine-tuning are refused (`check_roles`)."""

import copy
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.training import apply_step, lr_scheduler
from common.utils import UserError


@dataclass
class RoleOptimizer:
    """A trained role's AdamW (weight decay, eps 1e-8, schedule and warm-up are the run's) and its clip."""

    learning_rate: float
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0


def check_roles(args, accelerator) -> None:
    """One-line refusals of what trained roles do not support yet."""
    from accelerate.utils import DistributedType

    if args.full_finetune:
        raise UserError("trained roles (fake score, surrogate) are LoRA adapters on one base model; --full-finetune "
                        "would need a transformer copy per role: train LoRA")
    if getattr(accelerator, "is_fsdp2", False) or accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise UserError("several trained adapters (fake score, surrogate) run on one process or under DDP only; "
                        "FSDP2 and DeepSpeed are not supported yet: launch with a DDP config (or none)")
    if args.sequence_parallel > 1:
        raise UserError("several trained adapters (fake score, surrogate) do not support --sequence-parallel yet")


class TrainedRole:
    """Adapter `name` on the run's transformer: same rank, α and targets as "default", zero-initialised B (so it
    starts equal to the base model), float32 weights, its own AdamW and schedule."""

    def __init__(self, adapter, transformer, name: str, spec: RoleOptimizer, weight_decay: float, schedule: str,
                 warmup_steps: int, total_steps: int):
        self.adapter, self.transformer, self.name, self.spec = adapter, transformer, name, spec
        with warnings.catch_warnings():  # peft warns that a second adapter is being added: intended here
            warnings.simplefilter("ignore")
            transformer.add_adapter(copy.deepcopy(transformer.peft_config["default"]), adapter_name=name)
        transformer.set_adapter("default")  # add_adapter activated the new one
        self.params = [p for n, p in transformer.named_parameters() if f".{name}." in n]
        for p in self.params:
            p.data = p.data.float()
        self.optimizer = torch.optim.AdamW(self.params, lr=spec.learning_rate, betas=spec.betas,
                                           weight_decay=weight_decay, eps=1e-8)
        self.scheduler = lr_scheduler(self.optimizer, schedule, warmup_steps, total_steps)
        self.steps = 0

    @contextmanager
    def trained(self):
        """Inside, the module runs this adapter and only its weights take gradients (run the backward inside)."""
        self.transformer.set_adapter(self.name)
        try:
            yield
        finally:
            self.transformer.set_adapter("default")

    @torch.no_grad()
    def velocity(self, x, sigma, cond, guidance_scale):
        """The role's velocity as a frozen query (no graph)."""
        with self.trained():
            return self.adapter.velocity(x, sigma, cond, guidance_scale)

    def step(self, accelerator, epoch: int) -> float:
        """All-reduce, clip to its own norm, check and apply this role's accumulated gradients; step its schedule.
        Returns the gradient norm before clipping; a non-finite one stops the run before the weights change."""
        all_reduce_gradients(accelerator, self.params)
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm))
        apply_step(norm, self.optimizer, self.scheduler, epoch, f"the {self.name} gradient norm")
        self.steps += 1
        return norm

    def state_dict(self) -> dict:
        return {"weights": [p.detach().cpu().clone() for p in self.params], "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, state["weights"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]


def role_backward(accelerator, model):
    """The context of every backward in a script with trained roles: no DDP reduction (see the module's note)."""
    return accelerator.no_sync(model)


def all_reduce_gradients(accelerator, params: list[torch.nn.Parameter]) -> None:
    """Average `params`' gradients over the processes (a missing gradient counts as zeros), as DDP would have."""
    if accelerator.num_processes == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= accelerator.num_processes
    for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p).clone()


def roles_state(roles: dict) -> dict:
    """The roles' entries of a checkpoint's training_state.pt."""
    return {f"role_{name}": role.state_dict() for name, role in roles.items()}


def load_roles_state(roles: dict, states: dict, folder) -> None:
    for name, role in roles.items():
        if f"role_{name}" not in states:
            raise UserError(f"--resume: {folder} holds no state of the {name} adapter (saved by another script?)")
        role.load_state_dict(states[f"role_{name}"])
