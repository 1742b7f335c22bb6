"""Shared fixtures: tiny random checkpoints written once per test session."""
from __future__ import annotations

import pytest

from tiny_checkpoints import write_tiny_checkpoint

FAMILY_SEEDS = {"llama": 0, "mistral": 1, "qwen2": 2, "qwen3": 3, "phi3": 4, "gemma2": 5, "gemma3_text": 6,
                "mixtral": 7, "qwen3_moe": 8}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> folder of an 8-layer random model, sharded so per-layer reads can be checked."""
    return {family: write_tiny_checkpoint(tmp_path_factory.mktemp(family), family, num_layers=8, seed=seed,
                                          max_shard_size="40KB")
            for family, seed in FAMILY_SEEDS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture
def mesh():
    """Start real p2p nodes on 127.0.0.1 on demand; all are stopped after the test.

    mesh(n, secret=None, bootstrap=None, members=True, info=None, setup=None): the nodes of one call
    bootstrap from the first of them (one group per call) unless `bootstrap` is given; `info(peer)`
    makes each one's NodeInfo; `setup(node)` runs before the node starts (to attach services).
    `node.members` is its Membership.
    """
    from beeswarm.p2p import identity
    from beeswarm.p2p.membership import Membership, NodeInfo
    from beeswarm.p2p.node import Node, NodeConfig
    from helpers import INTERVAL, LOCAL

    started = []

    def make(n=1, secret=None, bootstrap=None, members=True, info=None, setup=None):
        out = []
        for _ in range(n):
            me = identity.ephemeral()
            boot = bootstrap if bootstrap is not None else ([out[0].addrs[0]] if out else [])
            node = Node(me, NodeConfig(listen=LOCAL, bootstrap=boot, secret=secret))
            node.members = None
            if members:
                node.members = Membership(node, info(me.peer_id) if info else NodeInfo(peer=me.peer_id),
                                          interval=INTERVAL)
                node.members.start()
            if setup:
                setup(node)
            node.start()
            started.append(node)
            out.append(node)
        return out

    yield make
    for node in started:
        node.stop()
