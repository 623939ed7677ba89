"""The multi-node tier's two hosts, made once per session and always torn down (tests/multinode/cluster.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.multinode import cluster as cluster_module
from tests.multinode import slurm as slurm_module


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


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurm_module.Slurm]:
    """Two more hosts, running a SLURM cluster (tests/multinode/slurm.py): its daemons live as long as the session, so
    they have hosts of their own, apart from :func:`cluster`'s, whose tests end every process they find."""
    root = cluster_module.make_root()
    try:
        try:
            made = cluster_module.start(root)
        except cluster_module.Unavailable as why:
            pytest.skip(f"multi-node tier: cannot make two hosts here: {why}")
        try:
            try:
                yield slurm_module.start(made)
            except cluster_module.Unavailable as why:
                pytest.skip(f"SLURM tests: cannot start a SLURM cluster on the two hosts: {why}")
        finally:
            cluster_module.stop(made)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster: slurm_module.Slurm) -> Iterator[slurm_module.Slurm]:
    """The SLURM cluster with both nodes up and idle and no job process left; after the test, any job still known to
    SLURM is cancelled and whatever a test left is killed (the test itself asserts that nothing is left)."""
    for host in slurm_cluster.cluster.hosts:
        host.link(True)
    slurm_cluster.ensure_up()
    yield slurm_cluster
    for host in slurm_cluster.cluster.hosts:
        host.link(True)
    slurm_cluster.run("scancel", "--user=root", check=False)
    slurm_cluster.cluster.kill_leftovers()
