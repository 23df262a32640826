"""common/training.py: the micro-batches of an optimizer step (zero-advantage samples dropped, equal backward counts
on every process, loss weights that average the kept samples) and the learning-rate schedules."""

import math

import numpy as np
import pytest
import torch

from common.training import lr_scheduler, plan_micro_batches, rollout_micro_batches


@pytest.mark.parametrize("world,local,batch,updates", [(1, 16, 8, 2), (2, 8, 8, 2), (2, 8, 4, 1), (4, 6, 4, 3)])
def test_with_every_sample_kept_the_plan_is_the_rollout_s(world, local, batch, updates):
    keep = torch.ones(world * local, dtype=torch.bool)
    for rank in range(world):
        plan = plan_micro_batches(keep, world, rank, batch, updates)
        assert len(plan) == updates and len({len(u) for u in plan}) == 1
        flat = [mb.index for update in plan for mb in update]
        assert [t.tolist() for t in flat] == [t.tolist() for t in rollout_micro_batches(local, batch, updates)]
        assert torch.cat(flat).tolist() == list(range(local)) and all(len(t) <= batch for t in flat)
        assert [mb.last for update in plan for mb in update] == [i == len(plan[0]) - 1
                                                                for _ in plan for i in range(len(plan[0]))]


@pytest.mark.parametrize("seed", range(6))
def test_dropping_keeps_equal_counts_covers_the_kept_samples_and_averages_them(seed):
    rng = np.random.default_rng(seed)
    world, local, batch, updates = int(rng.integers(1, 4)), int(rng.integers(2, 13)), int(rng.integers(1, 6)), 2
    keep = torch.from_numpy(rng.random(world * local) < 0.5)
    losses = rng.normal(size=world * local)  # ℓ_i of every sample of the epoch
    plans = [plan_micro_batches(keep, world, rank, batch, updates) for rank in range(world)]
    assert len({tuple(len(u) for u in plan) for plan in plans}) == 1  # the same backward count everywhere
    for u in range(updates):
        # what DDP computes: each process sums Σ_i w_i·ℓ_i over its micro-batches, then the processes are averaged
        ddp = np.mean([sum(float((mb.weight.double() * torch.from_numpy(losses[rank * local + mb.index.numpy()]))
                                 .sum()) for mb in plans[rank][u]) for rank in range(world)])
        kept = [rank * local + int(i) for rank in range(world) for mb in plans[rank][u] for i in mb.index[mb.real]]
        assert all(keep[k] for k in kept) and len(kept) == len(set(kept))
        assert ddp == pytest.approx(np.mean(losses[kept]) if kept else 0.0, rel=1e-6, abs=1e-12)
        for rank in range(world):
            for mb in plans[rank][u]:
                assert len(mb.index) <= max(batch, 1) and (mb.weight[~mb.real] == 0).all()
    covered = sorted(rank * local + int(i) for rank in range(world) for update in plans[rank] for mb in update
                     for i in mb.index[mb.real])
    assert covered == torch.nonzero(keep).flatten().tolist()  # every kept sample once, no dropped one


def test_a_process_with_nothing_kept_still_takes_its_backward_passes():
    keep = torch.tensor([True, True, True, True, False, False, False, False])
    mine, theirs = (plan_micro_batches(keep, 2, rank, 2, 1) for rank in (0, 1))
    assert len(mine[0]) == len(theirs[0]) == 2
    assert all(float(mb.weight.sum()) == 0 and len(mb.index) == 1 for mb in theirs[0])  # padding of weight 0
    assert [float(w) for mb in mine[0] for w in mb.weight] == [0.5] * 4  # 2 processes / 4 kept samples


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedules_match_their_formulas(schedule):
    base, warmup, total = 0.1, 3, 10
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = lr_scheduler(optimizer, schedule, warmup, total)
    lrs = []
    for _ in range(total):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    for step, lr in enumerate(lrs, start=1):
        if step < warmup:
            expected = base * step / warmup
        else:
            progress = (step - warmup) / (total - warmup)
            expected = base * {"constant": 1.0, "linear": 1 - progress,
                               "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[schedule]
        assert lr == pytest.approx(expected, abs=1e-12), (schedule, step)
