"""The toy world moved to worlds/toy/world.py. This re-export keeps `--model-path toy` working while
common/models/__init__.py still imports `toy_model_path` from here; delete it once that import names worlds."""

from worlds.toy.world import toy_model_path  # noqa: F401
