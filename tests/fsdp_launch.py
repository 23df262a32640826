"""Run an algorithm script with its transformer sharded by accelerate's FSDP2 code on CPU processes.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp_launch.py \
        configs/fsdp2.yaml algos/grpo.py ARGS...

accelerate ignores its FSDP plugin on CPU (it silently runs DDP), so this wrapper replaces
`Accelerator.prepare(model, optimizer)` by the steps of accelerate's own FSDP2 path
(Accelerator._prepare_fsdp2): the plugin is built from the config file's fsdp_config, then accelerate's
`fsdp2_apply_ac` (activation checkpointing) and `fsdp2_prepare_model` (fully_shard per transformer block, then
the root) run on the model, and the optimizer's parameters are swapped for the sharded ones by name. The
script itself runs unchanged (runpy); on exit the wrapper prints how many parameters were DTensor shards.
"""

import os
import runpy
import sys

import torch
from accelerate import Accelerator
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common.distributed import canonical

# fsdp_config keys of an accelerate config file -> FullyShardedDataParallelPlugin fields
_PLUGIN_FIELDS = {"fsdp_version": "fsdp_version", "fsdp_auto_wrap_policy": "auto_wrap_policy",
                  "fsdp_transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
                  "fsdp_reshard_after_forward": "reshard_after_forward",
                  "fsdp_activation_checkpointing": "activation_checkpointing",
                  "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
                  "fsdp_offload_params": "cpu_offload", "fsdp_state_dict_type": "state_dict_type"}


def fsdp_plugin(config_file: str) -> FullyShardedDataParallelPlugin:
    config = ClusterConfig.from_yaml_file(config_file)
    assert config.fsdp_config.get("fsdp_version") == 2, f"{config_file} is not an FSDP2 config"
    return FullyShardedDataParallelPlugin(**{field: config.fsdp_config[key] for key, field in _PLUGIN_FIELDS.items()
                                             if key in config.fsdp_config})


def fsdp2_prepare(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config_file: str):
    """Shard `model` as accelerate's FSDP2 plugin does; point `optimizer` at the sharded parameters."""
    names = {id(p): canonical(n) for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    accelerator.state.fsdp_plugin = fsdp_plugin(config_file)
    try:
        if accelerator.state.fsdp_plugin.activation_checkpointing:
            model = fsdp2_apply_ac(accelerator, model)
        model = fsdp2_prepare_model(accelerator, model)
    finally:
        accelerator.state.fsdp_plugin = None  # the rest of the run stays accelerate's CPU path
    params = {canonical(n): p for n, p in model.named_parameters()}
    for group, group_names in zip(optimizer.param_groups, groups):
        group["params"] = [params[n] for n in group_names]
    return model


prepared = []
_original_prepare = Accelerator.prepare


def _prepare(config_file):
    def prepare(self, *objects):
        if not any(isinstance(o, torch.nn.Module) for o in objects):
            return _original_prepare(self, *objects)
        model, optimizer = objects
        model = fsdp2_prepare(self, model, optimizer, config_file)
        prepared.append(model)
        return model, _original_prepare(self, optimizer)
    return prepare


if __name__ == "__main__":
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # gloo process group, as the CPU tests launch scripts
    config_file, script = sys.argv[1], sys.argv[2]
    Accelerator.prepare = _prepare(config_file)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
    (model,) = prepared
    params = list(model.parameters())
    sharded = sum(isinstance(p, DTensor) for p in params)
    print(f"fsdp_launch: FSDPModule={isinstance(model, FSDPModule)} DTensor parameters {sharded}/{len(params)}")
