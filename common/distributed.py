"""What the scripts need to stay correct when accelerate shards the transformer with FSDP2 (its parameters
become `DTensor` shards, new Parameter objects, after `prepare`).

Every function checks whether the module is sharded and otherwise does exactly the ordinary call, so
single-process and DDP runs (and their checkpoint files) are unchanged. The sharded paths use
torch.distributed.checkpoint's state-dict API, which gathers a full state dict from FSDP2 shards; all
processes must call the gathering functions (they are collectives when the module is sharded).
Activation checkpointing (configs/fsdp2.yaml) puts wrapper parts into parameter names: names are compared in
their canonical form. DeepSpeed is refused (`check_backend`).
"""

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from common.utils import UserError

# Full (unsharded) tensors, gathered onto the CPU of rank 0 only: no process holds the model twice on device.
_GATHER = dict(full_state_dict=True, cpu_offload=True)


# Wrappers that FSDP activation checkpointing and torch.compile insert into parameter and module names.
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical(name: str) -> str:
    """A parameter or module name without wrapper parts (the name it had before `prepare`)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def named_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """{canonical name: parameter} as the module holds them now."""
    return {canonical(n): p for n, p in module.named_parameters()}


def check_backend(accelerator) -> None:
    """Refuse DeepSpeed: the scripts accumulate gradients over micro-steps under `accelerator.no_sync`, but with
    DeepSpeed accelerate runs the optimizer step inside every `accelerator.backward` (no_sync does nothing for
    ZeRO >= 2), so each micro-step would be an optimizer step."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise UserError("DeepSpeed is not supported by these scripts (accelerate would step the optimizer at every "
                        "micro-step); use an FSDP2 config (configs/fsdp2.yaml) or DDP (configs/ddp_8gpu.yaml)")


def is_sharded(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def reshard(module: torch.nn.Module | None) -> None:
    """Put every FSDP2 unit of `module` back in its sharded state. A forward without backward leaves the root
    unit's parameters gathered (FSDP2 reshards the root only after backward); the module then exposes those
    gathered copies as its parameters, and the next forward reuses them, so writes to the shards in between
    (EMA, θ_old blends) would be lost or unseen. A no-op on an unsharded module."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules() if module is not None else []:
        if isinstance(m, FSDPModule):
            m.reshard()


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained parameters as the module holds them now: read them again after `prepare`, which under
    FSDP2 replaces every parameter by a sharded one (the optimizer is remapped, a list made before is stale)."""
    return [p for p in module.parameters() if p.requires_grad]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_(dst: torch.Tensor, full: torch.Tensor) -> None:
    """dst ← full, where dst may be a DTensor shard and `full` the whole tensor (present on every process)."""
    if isinstance(dst, DTensor):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(dst.device, dst.dtype), dst.device_mesh, dst.placements)
    dst.copy_(full)


def model_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's full state dict: gathered from the shards (on rank 0; other ranks get {}) when sharded,
    `module.state_dict()` otherwise. Call on all processes."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(module)  # after an evaluation forward the root's parameters are still the gathered copies
    return get_model_state_dict(module, options=StateDictOptions(**_GATHER))


def with_module_names(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with canonical keys renamed to the module's own names, which FSDP activation checkpointing
    (configs/fsdp2.yaml) wraps: peft finds LoRA layers by those names. Unchanged on an unwrapped module."""
    names = {canonical(n): n for n, _ in module.named_modules()}
    renamed = {}
    for key, value in state.items():
        prefix, _, leaf = key.rpartition(".")
        renamed[f"{names[prefix]}.{leaf}" if prefix in names else key] = value
    return renamed


def lora_state_dict(module, state: dict[str, torch.Tensor], adapter_name: str = "default") -> dict:
    """peft's get_peft_model_state_dict of `adapter_name` from a state dict gathered by `model_state_dict`
    (canonical keys, as diffusers' `load_lora_weights` expects them)."""
    from peft.utils import get_peft_model_state_dict

    lora = get_peft_model_state_dict(module, with_module_names(module, state), adapter_name=adapter_name)
    return {canonical(k): v for k, v in lora.items()}


def load_lora_state_dict(module, state: dict[str, torch.Tensor], adapter_name: str = "default") -> list[str]:
    """Load a LoRA state dict in the diffusers/peft file format (keys without the adapter name) into the shards
    of a sharded module; returns the keys the module lacks. This is peft's set_peft_model_state_dict key mapping
    done by hand: peft matches module names against state-dict keys, which activation checkpointing makes differ."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    names = [k for k in named_parameters(module) if "lora_" in k and adapter_name in k.split(".")]
    to_model = {".".join(part for part in k.split(".") if part != adapter_name): k for k in names}
    state = {to_model.get(k, k): v for k, v in state.items()}
    unexpected = [k for k in state if k not in names]  # before loading: set_model_state_dict adds to `state`
    reshard(module)
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return unexpected


def save_pretrained(module, directory: str, state: dict[str, torch.Tensor]) -> None:
    """diffusers `save_pretrained` (config, safetensors shards, index) of a full `state` gathered by
    `model_state_dict` (save_pretrained itself would read the module's sharded state dict)."""
    if not is_sharded(module):
        module.save_pretrained(directory, safe_serialization=True)
        return
    module.state_dict = lambda *args, **kwargs: state  # an instance attribute shadows the method...
    try:
        module.save_pretrained(directory, safe_serialization=True)
    finally:
        del module.state_dict  # ...and removing it restores the method


@contextmanager
def full_state_loading(module: torch.nn.Module):
    """Inside the block, `module.load_state_dict(full_state, strict)` (as peft's set_peft_model_state_dict
    and the resume code call it) loads whole tensors into the shards. A no-op on an unsharded module."""
    if not is_sharded(module):
        yield
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def load(state_dict, strict=True, **_):
        del module.load_state_dict  # set_model_state_dict calls the real method
        try:
            return set_model_state_dict(module, {canonical(k): v for k, v in state_dict.items()},
                                        options=StateDictOptions(full_state_dict=True, strict=strict))
        finally:
            module.load_state_dict = load

    reshard(module)
    module.load_state_dict = load
    try:
        yield
    finally:
        del module.load_state_dict


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def optimizer_state_dict(module, optimizer) -> dict:
    """The optimizer state for a checkpoint: `optimizer.state_dict()`, or when `module` is sharded the full
    state keyed by parameter name (gathered on rank 0; call on all processes). A sharded run's optimizer
    state therefore resumes under sharding."""
    if not is_sharded(module):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    reshard(module)  # the optimizer holds the shards: the module must show them to be matched by name
    return get_optimizer_state_dict(module, _torch_optimizer(optimizer), options=StateDictOptions(**_GATHER))


def load_optimizer_state_dict(module, optimizer, state: dict) -> None:
    """Inverse of `optimizer_state_dict` (every process passes the full state it read from the checkpoint)."""
    if not is_sharded(module):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    reshard(module)
    set_optimizer_state_dict(module, _torch_optimizer(optimizer), state,
                             options=StateDictOptions(full_state_dict=True))


def shard_like(copy: torch.nn.Module | None, sharded: torch.nn.Module) -> torch.nn.Module | None:
    """Shard a frozen full copy (the KL reference, a θ_old/EMA model) the way `sharded` is: fully_shard on the
    submodules that are FSDP units there, innermost first, then the root. Unchanged when `sharded` is not."""
    if copy is None or not is_sharded(sharded):
        return copy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = next(p.device_mesh for p in sharded.parameters() if isinstance(p, DTensor))
    # (an activation-checkpoint wrapper and the block inside it can both be units: one name)
    units = {canonical(name) for name, m in sharded.named_modules() if isinstance(m, FSDPModule) and name}
    copies = {canonical(name): m for name, m in copy.named_modules()}
    for name in sorted(units, key=lambda n: -n.count(".")):
        fully_shard(copies[name], mesh=mesh)
    fully_shard(copy, mesh=mesh)
    return copy
