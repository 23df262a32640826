"""The CPU-sized worlds, one folder each: its grammar, renderer and pipeline builder (`world.py`), its exact reward
(`reward.py`, registered in rewards/ as `--reward toy`, `toy_edit`, `toy_video`) and the scripts that regenerate its
shipped model and dataset, which stay under data/ (`--model-path toy`, `--dataset data/toy...`).

    toy         prompts -> 32×32 images of flat shapes (docs/toy-world.md); also the OPD task split, data/toy_opd/
    toy_edit    instruction-based edits of the toy scenes (docs/toy-edit-world.md)
    toy_video   the toy shapes, moving: 5-frame clips (docs/toy-video-world.md)

The presets below are the flags that put a script in a world (each script's `toy`, `toy-edit`, `toy-video` preset).
"""

from worlds.toy.world import TOY_WORLD
from worlds.toy_edit.world import TOY_EDIT_WORLD
from worlds.toy_video.world import TOY_VIDEO_WORLD

__all__ = ["TOY_WORLD", "TOY_EDIT_WORLD", "TOY_VIDEO_WORLD"]
