"""The toy edit world: instruction-based edits of the toy scenes (docs/toy-edit-world.md)."""
