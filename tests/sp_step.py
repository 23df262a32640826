"""Run under ACCELERATE_2CPU (one sequence-parallel group of 2): one training step of a tiny model's LoRA, split over
the two processes (common.parallel, under DDP as the scripts run it), against the same step unsplit on each process.

usage: sp_step.py MODEL OUT_JSON
Writes the largest differences of the transformer's output, the SDE log-probs and the LoRA gradients (after DDP's
mean) between the two, with the scale of each, for the test to judge.
"""

import json
import sys

import torch

if __name__ == "__main__":
    from accelerate import Accelerator

    from common.dynamics import sde_step
    from common.flops import FlopCounter
    from common.models import load_adapter
    from common.parallel import device_mesh, enable_sequence_parallel
    from common.sampling import sample_generators
    from common.training import add_lora

    model, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)
    device = accelerator.device
    adapters = []
    for split in (False, True):
        adapter = load_adapter(model, "tiny", device, torch.float32, 32, max_sequence_length=8,
                               num_frames=5 if model.startswith("wan") else None)
        add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
        torch.manual_seed(1)  # lora_B starts at 0 (no gradient reaches lora_A): give both copies the same nonzero B
        for name, p in adapter.transformer.named_parameters():
            if "lora_" in name:
                p.data = torch.randn_like(p) * 0.1
                p.requires_grad_(True)
        if split:
            enable_sequence_parallel(adapter.transformer, device_mesh(accelerator, 2), 2, device)
            adapter.transformer = accelerator.prepare(adapter.transformer)
        adapters.append(adapter)

    cond = adapters[0].encode_prompts(["a red apple", "two blue squares"])
    generators = sample_generators([3, 4], device)
    x = adapters[0].noise(generators)
    sigma, sigma_next = adapters[0].sigmas(4)[1:3]
    x_next = x - 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    weight = torch.tensor([0.7, -1.3])
    results = {}
    flops = {}
    for adapter, name in zip(adapters, ("unsplit", "split")):
        counter = FlopCounter()
        counter.attach(accelerator.unwrap_model(adapter.transformer), adapter=adapter)
        v = adapter.velocity(x, sigma, cond, 1.0)
        _, log_prob, _, _ = sde_step("flow-sde", v, x, sigma, sigma_next, 0.8, prev_sample=x_next)
        accelerator.backward((weight * log_prob).sum()) if name == "split" else (weight * log_prob).sum().backward()
        module = accelerator.unwrap_model(adapter.transformer)
        grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if "lora_" in n}
        results[name] = (v.detach(), log_prob.detach(), grads)
        flops[name] = counter.take()
    (v1, lp1, g1), (v2, lp2, g2) = results["unsplit"], results["split"]
    assert g1.keys() == g2.keys() and g1
    report = {
        "rank": accelerator.process_index,
        "velocity": [float((v2 - v1).abs().max()), float(v1.abs().max())],
        "log_prob": [float((lp2 - lp1).abs().max()), float(lp1.abs().max())],
        "grads": {n: [float((g2[n] - g1[n]).abs().max()), float(g1[n].abs().max())] for n in g1},
        "grad_count": len(g1),
        "flops": flops,
    }
    reports = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(reports, report)
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump(reports, f)
