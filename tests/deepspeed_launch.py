"""Run an algorithm script under accelerate's DeepSpeed code path on CPU processes.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/deepspeed_launch.py \
        configs/deepspeed_zero2.yaml algos/grpo.py ARGS...

accelerate uses DeepSpeed only on accelerators (on CPU it silently runs DDP). This wrapper lets the script's
`Accelerator(cpu=True)` set up its gloo process group, then switches the accelerator's state to DeepSpeed with
the plugin the config file's deepspeed_config describes, as `AcceleratorState` does on GPUs. From then on
accelerate's own code runs: `prepare` calls deepspeed.initialize (ZeRO on DeepSpeed's CPU accelerator),
`backward` runs the engine's backward and, at accumulation boundaries, its optimizer step; `clip_grad_norm_` and
`no_sync` take their DeepSpeed branches.
The script itself runs unchanged (runpy); on exit the wrapper prints the engine and ZeRO stage it ran with.
"""

import os
import runpy
import sys

from accelerate import Accelerator, PartialState
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.utils import DeepSpeedPlugin, DistributedType

import deepspeed.ops

# DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (deepspeed_shm_comm) the first time a
# machine uses it: over a CPU-minute of C++ per fresh CI machine. GPUs never use that op (NCCL does their
# collectives); marked incompatible here, DeepSpeed's collectives go through torch.distributed (gloo on CPU).
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

# deepspeed_config keys of an accelerate config file that are DeepSpeedPlugin fields of the same name
_PLUGIN_FIELDS = ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
                  "offload_param_device", "zero3_init_flag")


def deepspeed_plugin(config_file: str) -> tuple[DeepSpeedPlugin, str]:
    config = ClusterConfig.from_yaml_file(config_file)
    assert config.distributed_type == DistributedType.DEEPSPEED, f"{config_file} is not a DeepSpeed config"
    fields = {k: config.deepspeed_config[k] for k in _PLUGIN_FIELDS if k in config.deepspeed_config}
    return DeepSpeedPlugin(**fields), config.mixed_precision


accelerators = []
_original_init = Accelerator.__init__


def _init(config_file, mixed_precision):
    def init(self, *args, **kwargs):
        _original_init(self, *args, **kwargs)
        plugin, config_precision = deepspeed_plugin(config_file)
        plugin.set_mixed_precision(mixed_precision or config_precision)
        plugin.select(_from_accelerator_state=True)
        self.state.deepspeed_plugins = plugin
        # PartialState too: AcceleratorState() copies the shared PartialState into itself when it is built again
        PartialState().distributed_type = self.state.distributed_type = DistributedType.DEEPSPEED
        self.deepspeed_engine_wrapped = None  # what Accelerator.__init__ sets when given a plugin
        accelerators.append(self)
    return init


if __name__ == "__main__":
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")  # gloo process group, as the CPU tests launch scripts
    # float32 unless asked: with bf16 DeepSpeed casts the module, so the script needs --dtype bfloat16 (the GPU
    # default) for its inputs to match.
    mixed_precision = os.environ.get("DEEPSPEED_LAUNCH_MIXED_PRECISION", "no")
    config_file, script = sys.argv[1], sys.argv[2]
    Accelerator.__init__ = _init(config_file, mixed_precision)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
    (accelerator,) = accelerators
    engine = accelerator.deepspeed_engine_wrapped.engine
    print(f"deepspeed_launch: engine={type(engine).__name__} zero_stage={engine.zero_optimization_stage()} "
          f"optimizer={type(engine.optimizer).__name__} world={engine.world_size} optimizer_steps={engine.global_steps}",
          flush=True)
