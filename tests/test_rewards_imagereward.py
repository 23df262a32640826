"""ImageReward on a tiny random release (BLIP's key names, saved with torch.save and loaded with weights_only=True)
against BLIP written out in numpy float64 from the checkpoint's own keys (ViT, BERT with cross-attention, the head),
and its preprocessing's resize and crop."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from rewards import load_rewards, score_samples
from rewards.imagereward import (
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    preprocess,
    save_tiny_imagereward,
)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-imagereward")
    save_tiny_imagereward(folder)
    return folder


def layer_norm(x, w, b, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * w + b


def gelu(x):
    import math

    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))  # the exact (erf) GELU of BLIP's nn.GELU


def attention(q, k, v, heads, mask=None):
    """q (Lq, D), k/v (Lk, D): softmax(q·kᵀ/√d)·v per head, masked keys (mask 0) left out."""
    split = lambda x: x.reshape(len(x), heads, -1).transpose(1, 0, 2)
    q, k, v = split(q), split(k), split(v)
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    if mask is not None:
        logits = np.where(mask[None, None, :] > 0, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(len(q[0]), -1)


def blip_numpy(state, med, pixels, ids, mask):
    """ImageReward's raw head output for one image (3, 224, 224) and one token row, in float64 from BLIP's keys."""
    s = {k: v.double().numpy() for k, v in state.items()}
    linear = lambda x, name: x @ s[f"{name}.weight"].T + s[f"{name}.bias"]
    v = "blip.visual_encoder."
    width, patch = s[v + "cls_token"].shape[-1], 16
    grid = pixels.shape[-1] // patch
    patches = pixels.reshape(3, grid, patch, grid, patch).transpose(1, 3, 0, 2, 4).reshape(grid * grid, -1)
    x = patches @ s[v + "patch_embed.proj.weight"].reshape(width, -1).T + s[v + "patch_embed.proj.bias"]
    x = np.concatenate([s[v + "cls_token"][0], x]) + s[v + "pos_embed"][0]
    heads = width // 64
    for block in sorted({int(k.split(".")[3]) for k in s if k.startswith(v + "blocks.")}):
        b = f"{v}blocks.{block}."
        h = layer_norm(x, s[b + "norm1.weight"], s[b + "norm1.bias"], 1e-6)
        q, k, val = np.split(linear(h, b + "attn.qkv"), 3, axis=-1)
        x = x + linear(attention(q, k, val, heads), b + "attn.proj")
        h = layer_norm(x, s[b + "norm2.weight"], s[b + "norm2.bias"], 1e-6)
        x = x + linear(gelu(linear(h, b + "mlp.fc1")), b + "mlp.fc2")
    image = layer_norm(x, s[v + "norm.weight"], s[v + "norm.bias"], 1e-6)

    t, eps, heads = "blip.text_encoder.", med["layer_norm_eps"], med["num_attention_heads"]
    x = s[t + "embeddings.word_embeddings.weight"][ids] + s[t + "embeddings.position_embeddings.weight"][:len(ids)]
    x = layer_norm(x, s[t + "embeddings.LayerNorm.weight"], s[t + "embeddings.LayerNorm.bias"], eps)
    for layer in range(med["num_hidden_layers"]):
        p = f"{t}encoder.layer.{layer}."
        for kind, keys, keys_mask in (("attention", x, mask), ("crossattention", image, None)):
            a = attention(linear(x, p + kind + ".self.query"), linear(keys, p + kind + ".self.key"),
                          linear(keys, p + kind + ".self.value"), heads, keys_mask)
            x = layer_norm(linear(a, p + kind + ".output.dense") + x, s[p + kind + ".output.LayerNorm.weight"],
                           s[p + kind + ".output.LayerNorm.bias"], eps)
        h = linear(gelu(linear(x, p + "intermediate.dense")), p + "output.dense")
        x = layer_norm(h + x, s[p + "output.LayerNorm.weight"], s[p + "output.LayerNorm.bias"], eps)
    h = x[0]
    for index in (0, 2, 4, 6, 7):  # Dropout between, no activations
        h = linear(h, f"mlp.layers.{index}")
    return float(h[0])


def test_imagereward_matches_blip_in_numpy(release):
    from transformers import BertTokenizer

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 3, 224, 224), generator=generator).float() / 255
    prompts = ["a cat on the grass", "two red cube", "an image of a blue dog sitting on the grass " * 3]
    (reward,) = load_rewards([f"imagereward,path={release},tokenizer={release},batch_size=2"])
    scores = score_samples([reward], images, prompts, torch.arange(3))[:, 0].numpy()
    state = torch.load(release / "ImageReward.pt", weights_only=True)
    med = json.loads((release / "med_config.json").read_text())
    tokenizer = BertTokenizer.from_pretrained(release)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    expected = []
    for image, prompt in zip(images, prompts):
        tokens = tokenizer(prompt, padding="max_length", truncation=True, max_length=35)
        assert tokens["input_ids"][0] == tokenizer.cls_token_id and len(tokens["input_ids"]) == 35
        pixels = (image.double().numpy() - np.array(OPENAI_CLIP_MEAN)[:, None, None]) / np.array(
            OPENAI_CLIP_STD)[:, None, None]  # 224 × 224 already: no resize, no crop
        raw = blip_numpy(state, med, pixels, np.array(tokens["input_ids"]), np.array(tokens["attention_mask"]))
        expected.append((raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)
    assert np.ptp(expected) > 1e-3  # the scores tell the images apart


def test_preprocess_resizes_the_short_side_and_crops_the_centre():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randint(0, 256, (1, 3, 224, 227), generator=generator).float() / 255  # short side already 224
    out = preprocess(wide, 224)[0].double().numpy()
    normalised = (wide[0].double().numpy() - np.array(OPENAI_CLIP_MEAN)[:, None, None]) / np.array(
        OPENAI_CLIP_STD)[:, None, None]
    np.testing.assert_allclose(out, normalised[:, :, 2:226], atol=1e-5)  # left offset round(3 / 2) = 2
    tall = torch.rand(1, 3, 100, 50, generator=generator)
    resized = Image.fromarray((tall[0].numpy() * 255).round().astype(np.uint8).transpose(1, 2, 0)).resize(
        (224, 448), Image.BICUBIC)
    expected = np.asarray(resized, dtype=np.float64)[112:336].transpose(2, 0, 1) / 255  # top round(224 / 2)
    expected = (expected - np.array(OPENAI_CLIP_MEAN)[:, None, None]) / np.array(OPENAI_CLIP_STD)[:, None, None]
    np.testing.assert_allclose(preprocess(tall, 224)[0].double().numpy(), expected, atol=1e-5)
