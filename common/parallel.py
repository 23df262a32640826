"""Sequence parallelism (Ulysses, --sequence-parallel N): the N processes of one sequence-parallel group run every
transformer call together, each on 1/N of the tokens, and trade sequence for heads around each attention (an
all-to-all before it, so that each process attends over all tokens with H/N heads, and one after). The processes of
a group hold the same samples: the data is split over the world / N data-parallel ranks only (`DataParallel`).

diffusers' own machinery does the work: each transformer's `_cp_plan` (which inputs to split along the sequence,
which output to gather), its split and gather hooks, and its Ulysses attention (`TemplatedUlyssesAttention`, forward
and backward, over the attention backend's own forward and backward ops). Only `ModelMixin.enable_parallelism` is
not called: it takes the device as `rank % torch.accelerator.device_count()`, which divides by zero on CPU
processes (gloo); `enable_sequence_parallel` does what it does for context parallelism without that line, on a
device mesh (data, ring 1, ulysses N) whose data dimension also gives the data-parallel collectives.

Gradients: every process of a group computes the same loss, and the gather's backward hands each process the
gradient of its own tokens only, so the group's gradients SUM to the unsplit one. DDP (and FSDP2) average over all
world = D·N processes: the gathered output's gradient is multiplied by N, so that the average is the unsplit
run's mean over its D processes (docs/distributed.md)."""

import inspect
import typing
from contextlib import contextmanager

import torch

from common.utils import UserError


def plan_owner(pipeline_class_name: str):
    """The transformer class of a diffusers pipeline when it carries a sequence-parallel plan (`_cp_plan`), else
    None."""
    import diffusers

    pipeline = getattr(diffusers, pipeline_class_name)
    annotation = inspect.signature(pipeline.__init__).parameters["transformer"].annotation
    for cls in typing.get_args(annotation) or (annotation,):
        if getattr(cls, "_cp_plan", None) is not None:
            return cls
    return None


def models_with_plans(adapters: dict) -> list[str]:
    return [name for name, adapter in adapters.items() if plan_owner(adapter.pipeline_class_name) is not None]


def check_world(degree: int, world: int) -> None:
    if world % degree:
        raise UserError(f"--sequence-parallel {degree} does not divide the {world} processes: launch a multiple of "
                        f"{degree} (world = data-parallel groups × {degree})")


def planned_transformers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformers inside `module` that carry a plan, outermost only (Wan2.2's two experts, or the module)."""
    found = {}
    for name, sub in module.named_modules():
        inside = any(outer == "" or name.startswith(f"{outer}.") for outer in found)
        if getattr(sub, "_cp_plan", None) is not None and not inside:
            found[name] = sub
    return list(found.values())


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times `factor` backward."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _check_split(owner: str, where: str, name: str, tensor, spec, degree: int) -> None:
    """One line when `degree` does not divide the length a plan splits (diffusers would stop on an assert)."""
    if not torch.is_tensor(tensor) or (spec.expected_dims is not None and tensor.dim() != spec.expected_dims):
        return  # diffusers leaves such an input whole
    length = tensor.shape[spec.split_dim]
    if length % degree:
        raise UserError(f"--sequence-parallel {degree} does not divide the sequence length {length} of {owner}'s "
                        f"{name} (at {where or 'its input'}): choose a resolution, frame count or "
                        f"--max-sequence-length whose token count {degree} divides, or another degree")


def _add_split_checks(model: torch.nn.Module, plan: dict, degree: int) -> None:
    from diffusers.hooks.context_parallel import _get_submodule_by_name
    from diffusers.models._modeling_parallel import ContextParallelInput

    owner = type(model).__name__
    for where, entry in plan.items():
        if not isinstance(entry, dict):
            continue
        modules = _get_submodule_by_name(model, where)
        for module in modules if isinstance(modules, list) else [modules]:
            inputs = {k: v for k, v in entry.items() if isinstance(v, ContextParallelInput) and not v.split_output}
            outputs = {k: v for k, v in entry.items() if isinstance(v, ContextParallelInput) and v.split_output}
            if inputs:
                signature = inspect.signature(type(module).forward)

                def check_inputs(mod, args, kwargs, inputs=inputs, signature=signature, where=where):
                    bound = signature.bind_partial(mod, *args, **kwargs).arguments
                    for name, spec in inputs.items():
                        _check_split(owner, where, name, bound.get(name), spec, degree)

                module.register_forward_pre_hook(check_inputs, with_kwargs=True)
            if outputs:
                def check_outputs(mod, args, output, outputs=outputs, where=where):
                    output = output if isinstance(output, (list, tuple)) else [output]
                    for index, spec in outputs.items():
                        _check_split(owner, where, f"output {index}", output[index], spec, degree)

                module.register_forward_hook(check_outputs)


def enable_sequence_parallel(module: torch.nn.Module, mesh, degree: int, device: torch.device) -> None:
    """Split every planned transformer inside `module` over the mesh's `ulysses` dimension (after LoRA is added: peft
    replaces the layers a hook sits on). Refuses, in one line, a module without a plan, a head count `degree` does not
    divide and an attention backend without a Ulysses path."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelOutput, ParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    transformers = planned_transformers(module)
    if not transformers:
        raise UserError(f"--sequence-parallel: {type(module).__name__} has no sequence-parallel plan (_cp_plan)")
    for model in transformers:
        heads = model.config.num_attention_heads
        if heads % degree:
            raise UserError(f"--sequence-parallel {degree} does not divide the {heads} attention heads of "
                            f"{type(model).__name__}: choose a degree that divides {heads}")
        processors = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None),
                                                                         "_parallel_config")]
        for processor in processors:
            backend = processor._attention_backend
            backend = AttentionBackendName(backend) if backend is not None else \
                _AttentionBackendRegistry.get_active_backend()[0]
            if not _AttentionBackendRegistry._is_context_parallel_available(backend):
                choices = ", ".join(sorted(b.value for b in _AttentionBackendRegistry._supports_context_parallel))
                raise UserError(f"--sequence-parallel: the attention backend {backend.value} has no Ulysses path in "
                                f"diffusers; choose one of: {choices}")
        config = ContextParallelConfig(ulysses_degree=degree, mesh=mesh)
        parallel = ParallelConfig(context_parallel_config=config)
        parallel.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), device, mesh=mesh)
        model._parallel_config = parallel  # what enable_parallelism records
        for processor in processors:
            processor._parallel_config = parallel
        _add_split_checks(model, model._cp_plan, degree)
        apply_context_parallel(model, config, model._cp_plan)
        for where, entry in model._cp_plan.items():  # the gathered output: its gradient × N (module docstring)
            if isinstance(entry, (ContextParallelOutput, list, tuple)):
                gather = model.get_submodule(where)
                gather.register_forward_hook(lambda mod, args, output: _ScaleGradient.apply(output, degree))


def sequence_parallel_degree(model: torch.nn.Module) -> int:
    """N of a transformer split by `enable_sequence_parallel`, 1 for any other."""
    parallel = getattr(model, "_parallel_config", None)
    config = getattr(parallel, "context_parallel_config", None)
    return config.ulysses_degree if config is not None else 1


def device_mesh(accelerator, degree: int):
    """The (data, ring, ulysses) mesh of world / N × 1 × N processes: the N consecutive ranks of a sequence-parallel
    group share a machine (its all-to-alls are the most traffic). None when N = 1."""
    if degree == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = accelerator.num_processes
    return init_device_mesh(accelerator.device.type, (world // degree, 1, degree),
                            mesh_dim_names=("data", "ring", "ulysses"))


class DataParallel:
    """The processes as the data sees them: `num_processes` data-parallel ranks (world / N), this process's
    `process_index` among them, and the collectives the data takes (gather, gather_object, reduce,
    pad_across_processes, split_between_processes) over them: each over the ranks that share this process's place
    in its sequence-parallel group, which hold one copy of every data-parallel rank's samples, so no sample counts
    twice. Anything else (device, is_main_process, print, ...) is the accelerator's. With N = 1 every call is the
    accelerator's own."""

    def __init__(self, accelerator, degree: int = 1, mesh=None):
        self.accelerator, self.degree, self.mesh = accelerator, degree, mesh
        self.group = mesh["data"].get_group() if mesh is not None else None
        world = accelerator.num_processes
        self.num_processes = world // degree
        self.process_index = accelerator.process_index // degree

    def __getattr__(self, name):
        return getattr(self.accelerator, name)

    @property
    def scores_here(self) -> bool:
        """Whether this process calls the rewards: the first of its sequence-parallel group (`scored_once`)."""
        return self.accelerator.process_index % self.degree == 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.accelerator.gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts)

    def gather_object(self, items: list) -> list:
        if self.group is None:
            from accelerate.utils import gather_object

            return gather_object(items)
        parts = [None] * self.num_processes
        torch.distributed.all_gather_object(parts, items, group=self.group)
        return [item for part in parts for item in part]

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        if self.group is None:
            return self.accelerator.reduce(tensor, reduction)
        ops = {"sum": torch.distributed.ReduceOp.SUM, "mean": torch.distributed.ReduceOp.SUM,
               "max": torch.distributed.ReduceOp.MAX}
        out = tensor.clone()
        torch.distributed.all_reduce(out, op=ops[reduction], group=self.group)
        return out / self.num_processes if reduction == "mean" else out

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.group is None:
            return self.accelerator.pad_across_processes(tensor, dim=dim)
        size = self.gather(torch.tensor([tensor.shape[dim]], device=tensor.device))
        missing = int(size.max()) - tensor.shape[dim]
        if not missing:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)

    @contextmanager
    def split_between_processes(self, items: list):
        """accelerate's contiguous split (the first len % D ranks take one more), over the data-parallel ranks."""
        if self.group is None:
            with self.accelerator.split_between_processes(items) as mine:
                yield mine
            return
        per, extra = divmod(len(items), self.num_processes)
        start = self.process_index * per + min(self.process_index, extra)
        yield items[start:start + per + (1 if self.process_index < extra else 0)]


def gather_objects(processes, items: list) -> list:
    """accelerate's gather_object over `processes` (an Accelerator, or a DataParallel's data-parallel ranks)."""
    if isinstance(processes, DataParallel):
        return processes.gather_object(items)
    from accelerate.utils import gather_object

    return gather_object(items)


def scored_once(processes, score):
    """`score()` on the first process of each sequence-parallel group, its result handed to the others (N > 1; else
    `score()` on every process): the processes of a group hold the same samples, so each reward is called once per
    sample, not N times (a shared judge or reward server gets one request for it). A UserError raised by `score` is
    raised on every process of the group. `processes`: an Accelerator, or a DataParallel."""
    if not isinstance(processes, DataParallel) or processes.degree == 1:
        return score()
    outcome = [None]
    if processes.scores_here:
        try:
            outcome[0] = score()
        except UserError as error:
            outcome[0] = error
    rank = processes.accelerator.process_index
    torch.distributed.broadcast_object_list(outcome, src=rank - rank % processes.degree,
                                            group=processes.mesh["ulysses"].get_group())
    if isinstance(outcome[0], UserError):
        raise outcome[0]
    return outcome[0]
