"""Optimizers over a contiguous parameter workspace."""
