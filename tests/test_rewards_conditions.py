"""Rewards that judge a sample against its condition images (edits, image-to-video): they declare
`wants_conditions` and receive each sample's condition images; every other reward is called as before; the remote
reward sends them; groupwise rewards get them per group; samples without conditions give one clear line."""

import numpy as np
import pytest
import torch
from PIL import Image

from common.utils import UserError
from rewards import load_rewards, score_samples
from test_rewards_remote import serving


class Faithfulness:
    """1 − mean |sample − condition| (the condition resized to the sample), float64: an edit reward's shape."""

    wants_conditions = True

    def __call__(self, images, prompts, conditions):
        scores = []
        for image, (condition,) in zip(images, conditions):
            resized = torch.nn.functional.interpolate(condition[None], size=image.shape[-2:], mode="nearest")[0]
            scores.append(1 - float((image.double() - resized.double()).abs().mean()))
        return scores


class GroupSpread(Faithfulness):
    """Groupwise: each sample's faithfulness minus its group's mean (needs the whole group's conditions)."""

    groupwise = True

    def __call__(self, images, prompts, conditions):
        scores = np.array(super().__call__(images, prompts, conditions))
        return scores - scores.mean()


def plain(images, prompts):
    return [float(image.mean()) for image in images]


@pytest.fixture
def files(tmp_path):
    paths = []
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255), (255, 255, 255)]):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"{i}.png")
        paths.append((str(tmp_path / f"{i}.png"),))
    return paths


def reward_of(cls, **options):
    import sys
    import types

    module = types.ModuleType("conditions_rewards_mod")
    module.Faithfulness, module.GroupSpread, module.plain = Faithfulness, GroupSpread, plain
    sys.modules["conditions_rewards_mod"] = module
    return load_rewards([f"conditions_rewards_mod:{cls}"])[0]


def test_a_reward_that_wants_conditions_gets_each_samples_images(files):
    faithful, other = reward_of("Faithfulness"), reward_of("plain")
    assert faithful.wants_conditions and not other.wants_conditions
    red = torch.zeros(3, 4, 4)
    red[0] = 1
    images = torch.stack([red, red, torch.ones(3, 4, 4)])
    raw = score_samples([faithful, other], images, ["a", "b", "c"], torch.tensor([1, 2, 3]), conditions=files)
    # red vs red: 1; red vs blue: 1 − 2/3; white vs white: 1 (independent of the reward's own arithmetic)
    np.testing.assert_allclose(raw[:, 0].numpy(), [1.0, 1 - 2 / 3, 1.0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(raw[:, 1].numpy(), [1 / 3, 1 / 3, 1.0], rtol=0, atol=1e-7)


def test_groupwise_rewards_get_their_groups_conditions(files):
    red = torch.zeros(3, 4, 4)
    red[0] = 1
    images = torch.stack([red, red, red, red])
    conditions = [files[0], files[1], files[0], files[1]]
    raw = score_samples([reward_of("GroupSpread")], images, ["a"] * 4, torch.tensor([7, 7, 9, 9]),
                        conditions=conditions)
    np.testing.assert_allclose(raw[:, 0].numpy(), [1 / 3, -1 / 3, 1 / 3, -1 / 3], rtol=0, atol=1e-12)


def test_samples_without_conditions_give_one_line(files):
    with pytest.raises(UserError, match="reward 'Faithfulness' judges samples against their condition images, "
                                        "but these samples have none"):
        score_samples([reward_of("Faithfulness")], torch.zeros(2, 3, 4, 4), ["a", "b"], torch.tensor([1, 2]),
                      conditions=[(), ()])


def test_the_remote_reward_sends_the_conditions(files):
    local = reward_of("Faithfulness")
    red = torch.zeros(3, 4, 4)
    red[0] = 1
    images = torch.stack([red, torch.ones(3, 4, 4), red])
    with serving(local) as server:
        (remote,) = load_rewards([f"remote,url={server.url},batch_size=2"])
        assert remote.wants_conditions
        over_http = score_samples([remote], images, ["a", "b", "c"], torch.tensor([1, 2, 3]), conditions=files)
        assert server.server.requests_served == 2
    here = score_samples([local], images, ["a", "b", "c"], torch.tensor([1, 2, 3]), conditions=files)
    torch.testing.assert_close(over_http, here, rtol=0, atol=1e-12)
