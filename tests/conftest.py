"""Session-wide test settings."""

import os

# With mpi4py installed, Lightning's MPIEnvironment.detect() initialises MPI in the test process itself; an
# isolated singleton keeps Open MPI from starting a helper daemon (orted) that would outlive the test that made it.
os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")

import pytest  # noqa: E402

# The process tests the DeepSpeed 0.16.1 tier runs besides the unit tier (`bash scripts/test.sh --deepspeed 0.16.1`):
# every stage training in fp32 (against DDP) and bf16, resume and resharding, tensor-parallel serving, the seed's and
# the shipped JSON configs, DeepSpeed's own launcher. 0.16.1 is what Habana's fork (1.20.0, 1.21.0) is built on.
FORK_TIER = (
    "tests/test_training.py::",
    "tests/test_checkpoint.py::",
    "tests/test_inference.py::",
    "tests/test_config_training.py::test_seed_config_verbatim_from_env_var",
    "tests/test_config_training.py::test_shipped_config",
    "tests/test_launch_e2e.py::test_deepspeed_launcher",
    "tests/test_exit.py::test_process_group_threads_end_before_finalization",
)
# Left to the main tier: examples/generate.py's CLI wiring (80 s) does not depend on DeepSpeed's version; the
# tensor-parallel engine it drives is in the 0.16.1 tier through the other tests of tests/test_inference.py.
NOT_FORK_TIER = ("tests/test_inference.py::test_generate_example_same_text_on_two_ranks_as_on_one",)


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
