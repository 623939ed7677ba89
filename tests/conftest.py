"""Session-wide test settings."""

import os
import sys
from collections.abc import Iterator

# With mpi4py installed, Lightning's MPIEnvironment.detect() initialises MPI in the test process itself; an
# isolated singleton keeps Open MPI from starting a helper daemon (orted) that would outlive the test that made it.
os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")

import pytest  # noqa: E402

# The process tests the DeepSpeed 0.16.1 tier runs besides the unit tier (`bash scripts/test.sh --deepspeed 0.16.1`):
# every stage training in fp32 (against DDP) and bf16, resume and resharding, tensor-parallel serving, the seed's and
# the shipped JSON configs, DeepSpeed's own launcher, sequence parallelism (DistributedAttention). 0.16.1 is what Habana's fork (1.20.0, 1.21.0) is built on.
FORK_TIER = (
    "tests/test_training.py::",
    "tests/test_checkpoint.py::",
    "tests/test_inference.py::",
    "tests/test_config_training.py::test_seed_config_verbatim_from_env_var",
    "tests/test_config_training.py::test_shipped_config",
    "tests/test_launch_e2e.py::test_deepspeed_launcher",
    "tests/test_exit.py::test_process_group_threads_end_before_finalization",
    "tests/multinode/test_hpz.py::",  # DeepSpeed 0.16.1 kept hpZ's stale secondary partitions across a resume
    "tests/test_sequence.py::",
)
# Left to the main tier: examples/generate.py's CLI wiring (80 s) does not depend on DeepSpeed's version; the
# tensor-parallel engine it drives is in the 0.16.1 tier through the other tests of tests/test_inference.py.
NOT_FORK_TIER = ("tests/test_inference.py::test_generate_example_same_text_on_two_ranks_as_on_one",)


# Variables Lightning's own code writes into the test process: its launcher and cluster environments (a Trainer built
# with devices > 1 in-process), seed_everything, Trainer(deterministic=True), its CPU thread default.
# And two that the libraries write once per process, whichever test comes first: Lightning's and DeepSpeed's import
# (PYTORCH_NVML_BASED_CUDA_CHECK, again after a test has removed it), torch's inductor on first use of its cache.
LIGHTNING_WRITES = frozenset({
    "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS",
    "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR",
})


@pytest.fixture(autouse=True)
def rank_zero_as_it_was() -> Iterator[None]:
    """Lightning's strategies set ``rank_zero_only.rank`` to their global rank in-process (a Trainer or Fabric with
    rank 1 wired to the Gaudi double): put it back, or every later rank-zero warning of the session stays silent."""
    import lightning.fabric.utilities.rank_zero  # noqa: F401  (its import sets the rank from the environment, once)
    from lightning_utilities.core.rank_zero import rank_zero_only

    before = getattr(rank_zero_only, "rank", None)
    yield
    if before is None:
        if hasattr(rank_zero_only, "rank"):
            del rank_zero_only.rank
    else:
        rank_zero_only.rank = before


@pytest.fixture(autouse=True)
def environ_as_it_was() -> Iterator[None]:
    """Every test ends with ``os.environ`` as it began, as Lightning's own test harness demands. What Lightning's code
    wrote is put back; anything else a test leaves behind fails it: the package promises not to touch the
    environment, so a leak from it is a bug."""
    own = "PYTEST_CURRENT_TEST"  # pytest's, set per phase
    before = {k: v for k, v in os.environ.items() if k != own}
    yield
    after = {k: v for k, v in os.environ.items() if k != own}
    if after == before:
        return
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    for key in changed:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    foreign = sorted(changed - LIGHTNING_WRITES)
    if foreign:
        pytest.fail(f"the test changed os.environ: {', '.join(foreign)} (restored)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true",
                     help="also run the soak loops (marker slow: many jobs in a row, ten minutes or more; not in CI)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = config.getoption("--soak")
    for item in items:
        if item.nodeid.startswith(FORK_TIER) and not item.nodeid.startswith(NOT_FORK_TIER):
            item.add_marker(pytest.mark.fork_tier)
        if "slow" in item.keywords and not soak:
            item.add_marker(pytest.mark.skip(reason="a soak loop: run with --soak"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``LGDS_SUITE_TIMES=<folder>``, each test phase's duration goes to ``<folder>/tests.jsonl``: with the job
    times from tests/procs.py, what benchmarks/suite.py tabulates."""
    folder = os.environ.get("LGDS_SUITE_TIMES")
    if not folder:
        return
    import json

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tests.jsonl"), "a") as f:
        f.write(json.dumps({"test": report.nodeid, "phase": report.when, "seconds": round(report.duration, 3),
                            "outcome": report.outcome, "venv": os.path.basename(sys.prefix)}) + "\n")
