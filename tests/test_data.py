"""Prompt files, the K-repeat epoch draw, sharding."""

import json

import numpy as np
import pytest

from common.data import DEFAULT_DATASET, Prompt, epoch_draw, load_prompts, sample_seeds, shard
from common.utils import UserError


def test_default_dataset_loads():
    assert len(load_prompts(DEFAULT_DATASET, "train")) >= 16 and load_prompts(DEFAULT_DATASET, "test")


def test_jsonl_and_txt(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "a", "negative_prompt": "blurry"}) + "\n\n"
                                          + json.dumps({"prompt": "b"}) + "\n")
    (tmp_path / "test.txt").write_text("x\n\n y \n")
    assert load_prompts(tmp_path, "train") == [Prompt("a", "blurry"), Prompt("b")]
    assert load_prompts(tmp_path, "test") == [Prompt("x"), Prompt("y")]


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', r"train.jsonl:2: malformed JSON"),
    ('{"prompt": "ok"}\n{"text": "no prompt"}\n', r"train.jsonl:2: expected an object"),
    ('{"prompt": "a", "negative_prompt": 3}\n', r"train.jsonl:1: \"negative_prompt\" must be a string"),
    ("\n", r"holds no prompts"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, content, message):
    (tmp_path / "train.jsonl").write_text(content)
    with pytest.raises(UserError, match=message):
        load_prompts(tmp_path, "train")


def test_missing_dataset(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(tmp_path / "nope", "train")
    with pytest.raises(UserError, match="neither train.jsonl nor train.txt"):
        load_prompts(tmp_path, "train")


def test_group_key_depends_on_texts_not_position():
    assert Prompt("a cat").key == Prompt("a cat").key != Prompt("a cat", "dog").key
    assert 0 <= Prompt("x").key < 2**63


def test_epoch_draw_is_m_prompts_k_times_and_deterministic():
    draw = epoch_draw(20, prompts_per_epoch=5, group_size=4, seed=3, epoch=7)
    values, counts = np.unique(draw, return_counts=True)
    assert len(values) == 5 and (counts == 4).all()
    assert np.array_equal(draw, epoch_draw(20, 5, 4, seed=3, epoch=7))
    assert not np.array_equal(draw, epoch_draw(20, 5, 4, seed=3, epoch=8))
    assert sample_seeds(1, 2, 8) == sample_seeds(1, 2, 8) != sample_seeds(1, 3, 8)
    with pytest.raises(UserError, match="exceeds the 20 training prompts"):
        epoch_draw(20, 21, 2, 0, 0)


def test_shard_covers_everything_once():
    parts = [shard(12, rank, 3) for rank in range(3)]
    assert sorted(i for p in parts for i in range(12)[p]) == list(range(12))
    with pytest.raises(UserError, match="do not split evenly over 5 processes"):
        shard(12, 0, 5)


def test_whole_group_draw_keeps_each_group_on_one_process():
    draw = epoch_draw(20, prompts_per_epoch=4, group_size=3, seed=1, epoch=2, whole_groups=True)
    assert sorted(draw.tolist()) == sorted(epoch_draw(20, 4, 3, seed=1, epoch=2).tolist())  # same prompts
    for rank in range(2):  # 2 processes × 2 groups each
        part = draw[shard(12, rank, 2)]
        assert all((part == p).sum() == 3 for p in set(part.tolist()))


def test_both_txt_and_jsonl_and_non_utf8_are_refused(tmp_path):
    (tmp_path / "train.txt").write_text("a cat\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "a cat"}\n')
    with pytest.raises(UserError, match="has both train.jsonl and train.txt: keep one"):
        load_prompts(tmp_path, "train")
    (tmp_path / "train.jsonl").unlink()
    (tmp_path / "train.txt").write_bytes(b"a cat\n\xff dog\n")
    with pytest.raises(UserError, match=r"train.txt:2: not UTF-8 text \(byte 0xff at column 1\)"):
        load_prompts(tmp_path, "train")
