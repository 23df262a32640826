"""The transformer's floating-point work, counted as it runs, for the `tflops` and `mfu` of metrics.jsonl.

Counted per call from the shapes that reach each layer, so one rule serves every adapter (and the tests check it
against torch's own FlopCounterMode on every tiny model):
- a Linear: 2·(input elements)·out_features forward; in the backward the same again for the input's gradient when
  the input needs one, and again for the weight's when the weight is trained (a frozen base layer under LoRA costs
  one, its LoRA factors two);
- a convolution: 2·(output elements)·(in_channels / groups)·kernel size, with the same backward rule;
- an attention module of diffusers (the product of q and k, then of the scores and v): 4·B·S_q·S_k·inner_dim
  forward, twice that backward; S_q = S_k = image + text tokens for joint attention (a module with `add_q_proj`
  given `encoder_hidden_states`: FLUX.1's double blocks, SD3, Qwen-Image), S_k = the encoder's tokens for cross
  attention (Wan), both the input's tokens for self attention; the adapter's `attention_pairs` says how many of
  those query-key pairs a call computes (all of them, but for Qwen-Image 2.1's block-causal attention, computed per
  segment). Under sequence parallelism (common.parallel) a process holds 1/N of the queries and, after Ulysses'
  all-to-all, all keys for H/N heads: split keys count N times, so that the processes' counts add up to the unsplit
  model's.
A layer's backward is counted when its output's gradient is computed (a tensor hook), so only what the loss uses.
Recomputation by gradient checkpointing is not counted: `tflops` is the model's work, not the hardware's, the
usual convention of MFU. Norms, activations and rotary embeddings are left out (as FlopCounterMode does)."""

import math
from contextlib import contextmanager

import torch

_HOOKED = "_flop_counter_hooked"

# Dense bf16 tensor-core peaks in TFLOP/s (no sparsity), by a substring of torch.cuda.get_device_name(), the most
# specific first; --peak-tflops overrides it, and with none known mfu is left out.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
               ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("L40S", 362.0), ("MI300X", 1307.0),
               ("MI325X", 1307.0))


def default_peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from PEAK_TFLOPS, or None (a CPU, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def _attention_modules() -> tuple[type, ...]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return Attention, AttentionModuleMixin


def _ulysses_degree(attention: torch.nn.Module) -> int:
    """N when sequence parallelism (common.parallel) splits this attention's tokens over N processes, else 1."""
    config = getattr(getattr(getattr(attention, "processor", None), "_parallel_config", None),
                     "context_parallel_config", None)
    return config.ulysses_degree if config is not None else 1


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a forward there is gradient checkpointing's recomputation."""
    return torch._C._current_graph_task_id() != -1


class FlopCounter:
    """Counts the FLOPs of the modules it is attached to (see the module docstring) into `total`. Hooks are plain
    closures over this counter, so a deepcopy of an attached module (a frozen full copy) counts here too."""

    def __init__(self):
        self.total = 0
        self.counting = True
        self._handles = []

    def attach(self, *modules: torch.nn.Module | None, adapter) -> None:
        """Hook every Linear, convolution and attention module inside `modules`, transformers of `adapter` (whose
        `attention_pairs` counts an attention call's query-key pairs); None is skipped, and a module already hooked
        is left as it is, so attaching a module twice, or its copy, never counts twice."""
        attention = _attention_modules()
        for root in modules:
            if root is None:
                continue
            for module in root.modules():
                if getattr(module, _HOOKED, False):
                    continue
                if isinstance(module, torch.nn.Linear):
                    handle = module.register_forward_hook(self._linear_hook())
                elif isinstance(module, torch.nn.modules.conv._ConvNd):
                    handle = module.register_forward_hook(self._conv_hook())
                elif isinstance(module, attention):
                    handle = module.register_forward_hook(self._attention_hook(adapter.attention_pairs),
                                                          with_kwargs=True)
                else:
                    continue
                self._handles.append((module, handle))
                setattr(module, _HOOKED, True)

    def detach(self) -> None:
        """Remove the hooks this counter attached (those modules run as if it never had; a deepcopy made of an
        attached module keeps its copies of the hooks, counting here, until it is dropped)."""
        for module, handle in self._handles:
            handle.remove()
            delattr(module, _HOOKED)
        self._handles = []

    def take(self) -> int:
        """The FLOPs counted since the last take."""
        total, self.total = self.total, 0
        return total

    @contextmanager
    def paused(self):
        """Count nothing inside (evaluation is not part of an epoch's training throughput)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    def _add(self, forward: int, backward: int, output) -> None:
        if not self.counting or _in_backward():
            return
        self.total += forward
        if backward and torch.is_tensor(output) and output.requires_grad:
            # counted when the gradient reaches this output: an output the loss does not use (the text stream of
            # Qwen-Image's last block) has no backward
            output.register_hook(lambda grad: self._add_backward(backward))

    def _add_backward(self, backward: int) -> None:
        self.total += backward

    def _linear_hook(self):
        def hook(module, args, output):
            x = args[0]
            forward = 2 * x.numel() * module.out_features
            self._add(forward, forward * (int(x.requires_grad) + int(module.weight.requires_grad)), output)
        return hook

    def _conv_hook(self):
        def hook(module, args, output):
            x = args[0]
            forward = 2 * output.numel() * (module.in_channels // module.groups) * math.prod(module.kernel_size)
            self._add(forward, forward * (int(x.requires_grad) + int(module.weight.requires_grad)), output)
        return hook

    def _attention_hook(self, attention_pairs):
        def hook(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
            tokens = hidden.shape[1]
            if context is None:
                queries = keys = tokens
            elif getattr(module, "add_q_proj", None) is not None:  # joint: one attention over both streams
                queries = keys = tokens + context.shape[1]
            else:
                queries, keys = tokens, context.shape[1]
            if context is None or getattr(module, "add_q_proj", None) is not None:
                keys *= _ulysses_degree(module)  # split keys: each process attends to all of them (with H/N heads)
            forward = 4 * hidden.shape[0] * attention_pairs(tokens, queries, keys, kwargs) * module.inner_dim
            first = output[0] if isinstance(output, tuple) else output
            self._add(forward, 2 * forward, first)
        return hook
