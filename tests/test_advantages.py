"""Group advantages against an independent numpy computation, in one process and gathered over two."""

import json

import numpy as np
import pytest
import torch

from common.advantages import compute_advantages
from conftest import ACCELERATE_2CPU, run_script


def numpy_advantages(rewards, weights, groups, aggregation, global_std, clip):
    rewards, weights, groups = np.asarray(rewards, np.float64), np.asarray(weights, np.float64), np.asarray(groups)
    out = np.zeros(len(groups))
    if aggregation == "sum":
        r = rewards @ weights
        for g in set(groups.tolist()):
            m = groups == g
            std = r.std() if global_std else r[m].std()
            out[m] = (r[m] - r[m].mean()) / (std + 1e-4)
    else:
        c = np.zeros(len(groups))
        for k, w in enumerate(weights):
            for g in set(groups.tolist()):
                m = groups == g
                c[m] += w * (rewards[m, k] - rewards[m, k].mean()) / max(rewards[m, k].std(), 1e-6)
        out = (c - c.mean()) / max(c.std(), 1e-6)
    return np.clip(out, -clip, clip)


def toy_epoch(seed=0, groups=6, k=4, rewards=2):
    rng = np.random.default_rng(seed)
    ids = np.repeat(rng.integers(0, 2**62, size=groups), k)
    perm = rng.permutation(len(ids))
    values = rng.normal(size=(groups * k, rewards)) * np.array([1.0, 10.0])[:rewards]
    return values, ids[perm]


@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
@pytest.mark.parametrize("global_std", [False, True])
def test_matches_numpy(aggregation, global_std):
    values, ids = toy_epoch()
    weights = [1.0, 0.5]
    adv, _ = compute_advantages(torch.tensor(values), weights, torch.tensor(ids), aggregation, global_std, clip=5.0)
    np.testing.assert_allclose(adv.numpy(), numpy_advantages(values, weights, ids, aggregation, global_std, 5.0),
                               rtol=1e-12, atol=1e-12)


def test_clip_and_zero_std_fraction():
    ids = np.array([1, 1, 1, 2, 2, 2, 3, 3, 3])
    values = np.array([[0.0], [0.0], [100.0], [5.0], [5.0], [5.0], [1.0], [2.0], [3.0]])
    adv, stats = compute_advantages(torch.tensor(values), [1.0], torch.tensor(ids), "sum", False, clip=1.0)
    assert adv.abs().max() <= 1.0 and adv[2] == 1.0
    assert stats["zero_std_frac"] == pytest.approx(1 / 3)
    np.testing.assert_array_equal(adv[3:6].numpy(), 0.0)


def test_two_processes_gather_the_whole_epoch(tmp_path):
    values, ids = toy_epoch(seed=4, groups=4, k=4)
    data = tmp_path / "epoch.json"
    data.write_text(json.dumps({"values": values.tolist(), "ids": [int(i) for i in ids]}))
    run_script("tests/dist_advantages.py", data, tmp_path, launcher=ACCELERATE_2CPU)
    got = np.concatenate([np.load(tmp_path / f"adv_{rank}.npy") for rank in range(2)])
    expected = numpy_advantages(values, [1.0, 0.5], ids, "sum", True, 5.0)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_group_members_and_best_worst_pairs():
    from common.advantages import best_worst_pairs, group_members

    ids = torch.tensor([7, 3, 7, 3, 9, 9])
    advantages = torch.tensor([0.5, -1.0, -0.5, 1.0, 0.0, 0.0], dtype=torch.float64)
    members = group_members(ids)
    assert {g: m.tolist() for g, m in members.items()} == {3: [1, 3], 7: [0, 2], 9: [4, 5]}
    assert sorted(best_worst_pairs(advantages, ids)) == [(0, 2), (3, 1)]  # group 9 ties: no pair
