# Benchmark: what counting FLOPs (common/flops.py, behind metrics.jsonl's tflops and mfu) costs a transformer call.
# The counter is one Python hook per Linear, convolution and attention module; the relative cost is largest where
# the layers are smallest, so this measures the toy world's FLUX.1 (LoRA r16, batch 8, 32 px), on the CPU:
#   python benchmarks/flop_counter.py
import statistics
import time

import torch

from common.flops import FlopCounter
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from worlds.toy.world import toy_model_path


def seconds_per_call(adapter, x, cond, calls: int) -> tuple[float, float]:
    """(forward s, forward + backward s), after warm-up."""
    with torch.no_grad():
        for _ in range(5):
            adapter.velocity(x, 0.6, cond, 1.0)
        start = time.perf_counter()
        for _ in range(calls):
            adapter.velocity(x, 0.6, cond, 1.0)
        forward = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls // 4):
        adapter.velocity(x, 0.6, cond, 1.0).square().mean().backward()
    return forward, (time.perf_counter() - start) / (calls // 4)


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core: steadier times
    adapter = load_adapter("flux1", str(toy_model_path("flux1")), "cpu", torch.float32, 32, 32)
    add_lora(adapter.transformer, 16, 16, adapter.lora_target_modules)
    cond = adapter.encode_prompts(["two blue squares on the left"] * 8)
    x = adapter.noise(sample_generators(list(range(8)), "cpu"))
    times = {False: [], True: []}
    counter = FlopCounter()
    for _ in range(5):  # alternate, so that a slower stretch of the machine falls on both
        for counted in (False, True):
            if counted:
                counter.attach(adapter.transformer, adapter=adapter)
            times[counted].append(seconds_per_call(adapter, x, cond, 40))
            counter.detach()
    plain, counted = ([statistics.median(t[i] for t in times[c]) for i in (0, 1)] for c in (False, True))
    print(f"toy FLUX.1, batch 8, medians of 5 alternating rounds: forward {plain[0] * 1e3:.2f} ms without the counter, "
          f"{counted[0] * 1e3:.2f} ms with ({counted[0] / plain[0]:.3f}x); forward + backward {plain[1] * 1e3:.2f} / "
          f"{counted[1] * 1e3:.2f} ms ({counted[1] / plain[1]:.3f}x)")
