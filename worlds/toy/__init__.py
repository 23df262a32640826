"""The toy world: a CPU-sized GenEval (docs/toy-world.md)."""
