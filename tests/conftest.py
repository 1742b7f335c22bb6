"""Shared fixtures: tiny random checkpoints written once per test session."""
from __future__ import annotations

import pytest

from beeswarm.shard.tiny import write_tiny_checkpoint

FAMILY_SEEDS = {"llama": 0, "mistral": 1, "qwen2": 2}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> folder of an 8-layer random model, sharded so per-layer reads can be checked."""
    return {family: write_tiny_checkpoint(tmp_path_factory.mktemp(family), family, num_layers=8, seed=seed,
                                          max_shard_size="40KB")
            for family, seed in FAMILY_SEEDS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]
