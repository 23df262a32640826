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
    (tmp_path / "train.txt").write_text("a cat\n")
    with pytest.raises(UserError) as info:
        load_prompts(tmp_path / "train.txt", "train")
    assert str(info.value) == (f"--dataset {str(tmp_path / 'train.txt')!r} is a file, not a folder: give the folder "
                               f"that holds train.jsonl or train.txt")


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "train.txt").write_bytes(bom + "a cat\r\nune tête\r\n".encode())
    (tmp_path / "test.jsonl").write_bytes(bom + b'{"prompt": "a dog"}\n{"prompt": "a fox"}\n')
    assert [p.prompt for p in load_prompts(tmp_path, "train")] == ["a cat", "une tête"]
    assert [p.prompt for p in load_prompts(tmp_path, "test")] == ["a dog", "a fox"]


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


def _edit_folder(tmp_path, lines: list[str]):
    from PIL import Image

    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new("RGB", (8, 8), "red").save(tmp_path / "img" / "a.png")
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "img" / "b.jpg")
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "img" / "c.gif")
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_condition_images_resolve_against_the_folder_and_key_their_contents(tmp_path):
    from PIL import Image

    folder = _edit_folder(tmp_path, ['{"prompt": "make it green", "image": "img/a.png"}',
                                     '{"prompt": "make it green", "images": ["img/b.jpg", "img/a.png"]}',
                                     '{"prompt": "make it green"}'])
    one, two, plain = load_prompts(folder, "train")
    assert one.images == (str((folder / "img" / "a.png").resolve()),) and len(two.images) == 2
    assert one.source.endswith("train.jsonl:1") and plain.images == ()
    assert len({one.key, two.key, plain.key}) == 3 and plain.entry() == "make it green" != one.entry()
    Image.new("RGB", (8, 8), "green").save(folder / "img" / "a.png")  # same path, other contents: other entry
    assert load_prompts(folder, "train")[0].entry() != one.entry()


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "x", "image": "img/missing.png"}', r"train.jsonl:2: condition image 'img/missing.png' does not exist"),
    ('{"prompt": "x", "image": "img/broken.png"}', r"train.jsonl:2: condition image 'img/broken.png' is not a readable"),
    ('{"prompt": "x", "image": "img/c.gif"}', r"train.jsonl:2: condition image 'img/c.gif' is GIF; use PNG, JPEG or WebP"),
    ('{"prompt": "x", "image": "img/a.png", "images": ["img/a.png"]}', r'train.jsonl:2: has both "image" and "images"'),
    ('{"prompt": "x", "images": []}', r'train.jsonl:2: "image" must be a path and "images" a non-empty list'),
    ('{"prompt": "x", "image": 3}', r'train.jsonl:2: "image" must be a path'),
])
def test_bad_condition_images_name_file_and_line(tmp_path, line, message):
    folder = _edit_folder(tmp_path, ['{"prompt": "fine", "image": "img/a.png"}', line])
    with pytest.raises(UserError, match=message):
        load_prompts(folder, "train")


def test_conditions_must_fit_the_model(tmp_path):
    from common.data import check_conditions

    folder = _edit_folder(tmp_path, ['{"prompt": "a", "image": "img/a.png"}', '{"prompt": "b"}',
                                     '{"prompt": "c", "images": ["img/a.png", "img/b.jpg"]}'])
    records = load_prompts(folder, "train")
    with pytest.raises(UserError, match=r"train.jsonl:1: has a condition image, but flux1 is a text-only model"):
        check_conditions(records, 0, 0, "flux1")
    with pytest.raises(UserError, match=r"train.jsonl:2: flux1-kontext needs a condition image"):
        check_conditions(records[:2], 1, 1, "flux1-kontext")
    with pytest.raises(UserError, match=r"train.jsonl:3: 2 condition images, but flux1-kontext takes at most 1"):
        check_conditions([records[0], records[2]], 1, 1, "flux1-kontext")
    check_conditions([records[0], records[2]], 1, None, "qwen-image-edit")
    (folder / "test.txt").write_text("plain\n")
    with pytest.raises(UserError, match=r"test.txt:1: flux1-kontext needs a condition image"):
        check_conditions(load_prompts(folder, "test"), 1, 1, "flux1-kontext")


def _with_pixel_data(png: bytes, change) -> bytes:
    """`png` with each IDAT chunk's compressed pixels replaced by `change(data)`, under a valid checksum."""
    import zlib

    out, pos = png[:8], 8
    while pos < len(png):
        length, kind = int.from_bytes(png[pos:pos + 4], "big"), png[pos + 4:pos + 8]
        body = png[pos + 8:pos + 8 + length]
        body = change(body) if kind == b"IDAT" else body
        out += len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")
        pos += 12 + length
    return out


@pytest.mark.parametrize("damage", ["flipped bits", "cut short"])
def test_a_png_whose_pixels_do_not_decode_is_refused_when_loaded(tmp_path, damage):
    """Chunk checksums that match and a deflate stream that does not: Image.verify() passes it, the encoder would
    fail on it hours into a run; load_prompts decodes every condition image in full and names file and line."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buffer, "PNG")
    change = (lambda data: data[:2] + bytes(b ^ 0xFF for b in data[2:])) if damage == "flipped bits" else \
        (lambda data: data[: len(data) // 2])
    folder = _edit_folder(tmp_path, ['{"prompt": "fine", "image": "img/a.png"}',
                                     '{"prompt": "x", "image": "img/bad.png"}'])
    (folder / "img" / "bad.png").write_bytes(_with_pixel_data(buffer.getvalue(), change))
    with Image.open(folder / "img" / "bad.png") as image:
        image.verify()  # what the check relied on
    with pytest.raises(UserError, match=r"train.jsonl:2: condition image 'img/bad.png' is not a readable image "
                                        r"\((broken data stream|image file is truncated)"):
        load_prompts(folder, "train")


def test_a_16_bit_greyscale_png_is_scaled_to_8_bits_not_clipped(tmp_path):
    from PIL import Image

    from common.data import load_images

    values = np.linspace(0, 65535, 64 * 3).round().astype(np.uint16).reshape(8, 24)
    Image.fromarray(values).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as image:
        assert image.mode == "I;16"  # as PNG keeps it
    (loaded,) = load_images([tmp_path / "deep.png"])
    expected = np.floor(values.astype(np.float64) * 255 / 65535 + 0.5).astype(np.uint8)  # 65535 -> 255, 257 -> 1
    assert loaded.mode == "RGB" and expected.max() == 255 and np.unique(expected).size > 100
    np.testing.assert_array_equal(np.asarray(loaded), np.repeat(expected[:, :, None], 3, axis=2))


@pytest.mark.parametrize("orientation,turn", [(3, 2), (6, -1), (8, 1)])  # EXIF: 180°, 90° clockwise, 90° counter
def test_exif_orientation_turns_condition_images_as_diffusers_load_image(tmp_path, orientation, turn):
    from diffusers.utils import load_image
    from PIL import Image

    from common.data import condition_image_size, load_images

    pixels = np.random.default_rng(orientation).integers(0, 256, (4, 10, 3), dtype=np.uint8)  # 10 wide, 4 high
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "photo.png"
    Image.fromarray(pixels).save(path, exif=exif)
    (loaded,) = load_images([path])
    expected = np.rot90(pixels, k=turn)  # numpy's counter-clockwise quarter turns
    np.testing.assert_array_equal(np.asarray(loaded), expected)
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(load_image(str(path))))
    assert condition_image_size(str(path)) == (expected.shape[1], expected.shape[0])
