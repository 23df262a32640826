"""What the scripts need to stay correct when accelerate shards the transformer with FSDP2 (its parameters
become `DTensor` shards, new Parameter objects, after `prepare`).

Every function checks whether the module is sharded and otherwise does exactly the ordinary call, so
single-process and DDP runs (and their checkpoint files) are unchanged. The sharded paths use
torch.distributed.checkpoint's state-dict API, which gathers a full state dict from FSDP2 shards; all
processes must call the gathering functions (they are collectives when the module is sharded).
Activation checkpointing (configs/fsdp2.yaml) puts wrapper parts into parameter names: names are compared in
their canonical form.

Under DeepSpeed ZeRO-1/2 (configs/deepspeed_zero2.yaml) the parameters stay whole, but the optimizer owns
float32 master copies of the trained ones, partitioned over the processes: checkpoints store those masters
and the full AdamW state keyed by parameter name (gathered with DeepSpeed's own tensor-fragment API), so a
DeepSpeed run saves the same files as any other and resumes on any number of processes.
"""

from contextlib import contextmanager, nullcontext

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


def configure_backend(accelerator, micro_batch_size: int, max_grad_norm: float) -> None:
    """Call before `prepare`. Under DeepSpeed: fill the config entries accelerate cannot infer without a
    prepared DataLoader, and make DeepSpeed clip at --max-grad-norm (it clips inside its own optimizer step;
    `accelerator.clip_grad_norm_` then only reports the norm). Refuse ZeRO-3, which partitions the parameters
    that the scripts read whole (KL reference, θ_old, EMA), and DeepSpeed's own accumulation count: the
    scripts mark accumulation boundaries themselves (`micro_step`). Other backends need nothing. Prints which
    backend runs (accelerate falls back to DDP silently on CPUs, whatever the config file asks)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    plugin = accelerator.state.deepspeed_plugin if kind == DistributedType.DEEPSPEED else None
    name = f"DeepSpeed ZeRO-{plugin.zero_stage}" if plugin else "FSDP2" if getattr(accelerator, "is_fsdp2", False) \
        else kind.value
    accelerator.print(f"backend: {name}, {accelerator.num_processes} process(es) on {accelerator.device.type}")
    if plugin is None:
        return
    if plugin.zero_stage not in (0, 1, 2):
        raise UserError(f"DeepSpeed ZeRO stage {plugin.zero_stage} is not supported (it partitions the parameters); "
                        f"use ZeRO-2 (configs/deepspeed_zero2.yaml) or FSDP2 (configs/fsdp2.yaml)")
    config = plugin.deepspeed_config
    if config.get("gradient_accumulation_steps", "auto") not in ("auto", 1):
        raise UserError("set gradient_accumulation_steps: 1 in the DeepSpeed config: the scripts accumulate "
                        "over samples × trained steps themselves (see --updates-per-epoch)")
    config["gradient_accumulation_steps"] = 1
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_clipping"] = max_grad_norm


def micro_step(accelerator, model, last: bool):
    """The context of one backward of an accumulated optimizer step. Gradients are summed over micro-steps
    until `last`: DDP and FSDP skip their gradient reduction before it (no_sync), and DeepSpeed, which runs
    its whole optimizer step (reduce, clip, AdamW, zero_grad) inside `accelerator.backward` whenever
    `sync_gradients` is set, takes it only at `last`."""
    accelerator.sync_gradients = last
    return nullcontext() if last else accelerator.no_sync(model)


def _deepspeed_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """{canonical name: parameter} of the parameters whose float32 masters a DeepSpeed ZeRO-1/2 optimizer
    holds ({} for any other module)."""
    return {canonical(n): p for n, p in module.named_parameters() if hasattr(p, "_hp_mapping")}


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
        state = module.state_dict()
        masters = _deepspeed_params(module)
        if masters:  # the trained weights as DeepSpeed's float32 masters, not their bf16 copies in the module
            from deepspeed.utils import safe_get_full_fp32_param

            state.update({name: safe_get_full_fp32_param(p).cpu() for name, p in masters.items()})
        return state
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


def lora_parameter_names(module, keys, adapter_name: str = "default") -> dict[str, str]:
    """{key: canonical parameter name} for LoRA keys in the diffusers/peft file format (keys without the
    adapter name); a key the module lacks maps to itself. This is peft's set_peft_model_state_dict key mapping
    done by hand: peft matches module names against state-dict keys, which activation checkpointing makes differ."""
    names = [k for k in named_parameters(module) if "lora_" in k and adapter_name in k.split(".")]
    to_model = {".".join(part for part in k.split(".") if part != adapter_name): k for k in names}
    return {k: to_model.get(k, k) for k in keys}


def load_lora_state_dict(module, state: dict[str, torch.Tensor], adapter_name: str = "default") -> list[str]:
    """Load a LoRA state dict in the diffusers/peft file format into the shards of a sharded module; returns
    the keys the module lacks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    names = lora_parameter_names(module, state, adapter_name)
    state = {names[k]: v for k, v in state.items()}
    known = named_parameters(module)
    unexpected = [k for k in state if k not in known]  # before loading: set_model_state_dict adds to `state`
    reshard(module)
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return unexpected


def load_master_weights(module, state: dict[str, torch.Tensor]) -> None:
    """After loading weights into a module whose trained parameters DeepSpeed ZeRO-1/2 manages: set its float32
    masters from `state` (canonical parameter names → whole tensors) too, since the optimizer steps from them,
    not from the module's (bf16) copies. Nothing happens for any other module."""
    masters = _deepspeed_params(module)
    if not masters:
        return
    from deepspeed.utils import safe_set_full_fp32_param

    for name, p in masters.items():
        safe_set_full_fp32_param(p, state[name].to(p.device, torch.float32))


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


_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_state_dict(module, optimizer) -> dict:
    """The optimizer state for a checkpoint: `optimizer.state_dict()`, or, when `module` is sharded or its
    optimizer is DeepSpeed's, the full state keyed by parameter name (call on all processes: a gather; on
    FSDP2 only rank 0 gets it). Such a state resumes under FSDP2 or DeepSpeed on any number of processes."""
    masters = _deepspeed_params(module)
    if masters:
        return _deepspeed_optimizer_state(masters, _torch_optimizer(optimizer))
    if not is_sharded(module):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    reshard(module)  # the optimizer holds the shards: the module must show them to be matched by name
    return get_optimizer_state_dict(module, _torch_optimizer(optimizer), options=StateDictOptions(**_GATHER))


def load_optimizer_state_dict(module, optimizer, state: dict) -> None:
    """Inverse of `optimizer_state_dict` (every process passes the full state it read from the checkpoint)."""
    masters = _deepspeed_params(module)
    if masters:
        _load_deepspeed_optimizer_state(masters, _torch_optimizer(optimizer), state)
        return
    if not is_sharded(module):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    reshard(module)
    set_optimizer_state_dict(module, _torch_optimizer(optimizer), state,
                             options=StateDictOptions(full_state_dict=True))


def _deepspeed_optimizer_state(masters: dict, zero_optimizer) -> dict:
    """AdamW's moments of each trained parameter, assembled from DeepSpeed's flat partitions (a collective),
    in torch.distributed.checkpoint's full-state layout."""
    from deepspeed.utils import safe_get_full_optimizer_state

    adam = zero_optimizer.optimizer  # the torch AdamW, stepping DeepSpeed's flat float32 partitions
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(masters)} for g in adam.param_groups[:1]]
    if not adam.state:  # no optimizer step yet
        return {"state": {}, "param_groups": groups}
    step = next(iter(adam.state.values()))["step"]
    state = {name: {"step": step.clone()} | {k: safe_get_full_optimizer_state(p, k).cpu() for k in _ADAM_MOMENTS}
             for name, p in masters.items()}
    return {"state": state, "param_groups": groups}


def _load_deepspeed_optimizer_state(masters: dict, zero_optimizer, state: dict) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    if not state["state"]:
        return
    adam = zero_optimizer.optimizer
    step = next(iter(state["state"].values()))["step"]
    for group in adam.param_groups:  # AdamW creates its state lazily at the first step: create it now...
        for flat in group["params"]:
            adam.state[flat] = {"step": torch.tensor(float(step)), **{k: torch.zeros_like(flat) for k in _ADAM_MOMENTS}}
    zero_optimizer._lazy_init_hp_params_optimizer_state()  # ...and map each parameter to its slice, as DeepSpeed
    for name, p in masters.items():
        for k in _ADAM_MOMENTS:
            safe_set_full_optimizer_state(p, state["state"][name][k].to(p.device), k)


def staging_device(accelerator, full_finetune: bool) -> torch.device:
    """Where the transformer waits until `prepare`. Full fine-tuning under FSDP2 or DeepSpeed: on the CPU, since
    `prepare` moves it to the GPU sharded (FSDP2) or cast to bf16 (DeepSpeed); building the float32 master weights
    and the frozen copies (KL reference, θ_old) on the GPU first would need about 120 GB for FLUX.1-dev. Elsewhere:
    the accelerator."""
    from accelerate.utils import DistributedType

    sharding = getattr(accelerator, "is_fsdp2", False) or accelerator.distributed_type == DistributedType.DEEPSPEED
    return torch.device("cpu") if full_finetune and sharding else accelerator.device


def place_like(copy: torch.nn.Module | None, trained: torch.nn.Module) -> torch.nn.Module | None:
    """Put a frozen full copy (the KL reference, a θ_old/EMA model) where the trained model is after `prepare`:
    under FSDP2 sharded the same way (fully_shard on the submodules that are FSDP units there, innermost first,
    then the root, which also moves a copy that waited on the CPU to the GPU); otherwise on its device."""
    if copy is None:
        return None
    if not is_sharded(trained):
        device = next(trained.parameters()).device
        return copy if next(copy.parameters()).device == device else copy.to(device)
    if is_sharded(copy):
        return copy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = next(p.device_mesh for p in trained.parameters() if isinstance(p, DTensor))
    # (an activation-checkpoint wrapper and the block inside it can both be units: one name)
    units = {canonical(name) for name, m in trained.named_modules() if isinstance(m, FSDPModule) and name}
    copies = {canonical(name): m for name, m in copy.named_modules()}
    for name in sorted(units, key=lambda n: -n.count(".")):
        fully_shard(copies[name], mesh=mesh)
    fully_shard(copy, mesh=mesh)
    return copy
