"""The multi-node tier's two hosts, made once per session and always torn down (tests/multinode/cluster.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.multinode import cluster as cluster_module


@pytest.fixture(scope="session")
def cluster() -> Iterator[cluster_module.Cluster]:
    root = cluster_module.make_root()
    try:
        try:
            made = cluster_module.start(root)
        except cluster_module.Unavailable as why:
            pytest.skip(f"multi-node tier: cannot make two hosts here: {why}")
        try:
            yield made
        finally:
            cluster_module.stop(made)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def clean(cluster: cluster_module.Cluster) -> Iterator[cluster_module.Cluster]:
    """The hosts, with nothing of an earlier test running on them; whatever a test leaves is killed after it (the
    test itself asserts that nothing is left)."""
    for host in cluster.hosts:
        host.link(True)
    cluster.kill_leftovers()
    yield cluster
    for host in cluster.hosts:
        host.link(True)
    cluster.kill_leftovers()
