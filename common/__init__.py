"""Shared pieces of the algorithm scripts: model adapters, dynamics, data, advantages, checkpoints."""
