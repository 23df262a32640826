"""Reward models on Qwen-VL backbones (HPSv3, EditReward, VideoAlign): tiny random models of the real transformers
classes saved in the references' checkpoint layout, loaded through the same path as the published checkpoints, and
scored against an independent computation: transformers' own processor and ForConditionalGeneration model on the
same weights, the heads by hand in float64."""

import numpy as np
import pytest
import torch
from PIL import Image

from common.utils import UserError
from rewards import load_rewards, score_samples
from rewards.qwen_vl import HPSV3_INSTRUCTION, HPSV3_PIXELS, save_tiny_qwen_vl

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hpsv3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hpsv3")
    return save_tiny_qwen_vl(folder, "Qwen2VLModel", ("<|Reward|>",), ("rm_head.",)), folder / "base"


def quantised(count, height, width, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, height, width), generator=generator).float() / 255


def ranknet(state, prefix, hidden):
    """The ranknet MLP in float64: Linear at 0, 3, 5 with ReLU after the first two."""
    w = {k.removeprefix(prefix): v.double().numpy() for k, v in state.items() if k.startswith(prefix)}
    x = np.maximum(hidden @ w["0.weight"].T + w["0.bias"], 0)
    x = np.maximum(x @ w["3.weight"].T + w["3.bias"], 0)
    return x @ w["5.weight"].T + w["5.bias"]


def reference_hidden(checkpoint, base, model_class, special_tokens, text, images, pixels):
    """Last hidden states at the reward tokens, from transformers' processor and ForConditionalGeneration model on
    the checkpoint's weights (one sample, no padding)."""
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    vision = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels)(images=images, return_tensors="pt")
    for grid in vision["image_grid_thw"]:  # each placeholder becomes t·h·w / merge² tokens, as the processor does
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    ids = tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors="pt")["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == image_token).long(), **vision)
    state = load_file(checkpoint)
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = state["model.language_model.embed_tokens.weight"].shape[0]
    model = getattr(transformers, model_class)(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and all(k.startswith("rm_head") for k in unexpected)
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state[0].double().numpy()
    ids = inputs["input_ids"][0].tolist()
    return hidden[[ids.index(t) for t in tokenizer.convert_tokens_to_ids(list(special_tokens))]], state


def test_hpsv3_matches_transformers_and_hand_head(hpsv3):
    checkpoint, base = hpsv3
    images, prompts = quantised(3, 32, 48), ["a cat", "two dogs on the grass at night", "x"]
    (reward,) = load_rewards([f"hpsv3,path={checkpoint},base={base},batch_size=2"])  # batches pad on the right
    scores = score_samples([reward], images, prompts, torch.arange(3))[:, 0].numpy()
    expected = []
    for image, prompt in zip(images, prompts):
        pil = Image.fromarray((image.numpy() * 255).round().astype(np.uint8).transpose(1, 2, 0))
        text = SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>" + HPSV3_INSTRUCTION.format(
            text_prompt=prompt) + ASSISTANT
        hidden, state = reference_hidden(checkpoint, base, "Qwen2VLForConditionalGeneration", ("<|Reward|>",),
                                         text, [pil], HPSV3_PIXELS)
        expected.append(ranknet(state, "rm_head.", hidden[0])[0])  # (μ, σ): μ is the score
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert HPSV3_INSTRUCTION.endswith("Please provide the overall ratings of this image: <|Reward|>\n\nEND\n")


def test_hpsv3_wrong_base_is_one_line(hpsv3, tmp_path):
    checkpoint, _ = hpsv3
    with pytest.raises(UserError, match="cannot load the reward's base model"):
        load_rewards([f"hpsv3,path={checkpoint},base={tmp_path / 'nothing'}"])
    with pytest.raises(UserError, match="cannot load the reward checkpoint"):
        load_rewards([f"hpsv3,path={tmp_path / 'missing.safetensors'}"])
