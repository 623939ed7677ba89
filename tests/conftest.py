"""Session-wide test settings."""

import atexit
import os
import shutil
import sys
import tempfile
import unittest
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

# With mpi4py installed, Lightning's MPIEnvironment.detect() initialises MPI in the test process itself; an
# isolated singleton keeps Open MPI from starting a helper daemon (orted) that would outlive the test that made it.
os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")
# Isolated singletons on a host share a job id, so a session directory: one ending removes it while another is making
# it, and that one's MPI_Init aborts. Each test process gets a base of its own, each job one inside it
# (tests/procs.py job_env), each warm rank one inside its job's (tests/warm.py); the package's rank shim does the same
# for the ranks it starts (lightning_gaudi_ds/launch/rank.py own_mpi_session_base).
_OMPI_BASE = tempfile.mkdtemp(prefix="lgds-tests-ompi-", dir=os.environ.get("OMPI_MCA_orte_tmpdir_base") or None)
os.environ["OMPI_MCA_orte_tmpdir_base"] = _OMPI_BASE

import pytest  # noqa: E402

_EXIT_STATUS: list[int] = []


def _exit_without_finalizing() -> None:
    """Registered before the package and the libraries the tests import register theirs, so it runs after their exit
    handlers (atexit runs the last registered first): the package's own, which ends the process groups an in-process
    fit started (checked in fresh processes by tests/test_exit.py), still runs. Then the suite's process ends without
    the interpreter's finalization, which frees a heap of torch, Lightning and transformers object by object (2.4 s
    of the unit tier). Only once the session has finished, and not under coverage (which saves in its handler)."""
    if _EXIT_STATUS and "coverage" not in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[0])


atexit.register(_exit_without_finalizing)
atexit.register(shutil.rmtree, _OMPI_BASE, True)  # runs before the handler above


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not hasattr(session.config, "workerinput"):  # not in a pytest-xdist worker: execnet ends those
        _EXIT_STATUS[:] = [int(exitstatus)]

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


@pytest.fixture
def logs() -> Callable[..., AbstractContextManager[Any]]:
    """``with logs(level, logger) as seen:`` (logger: the package's by default) fails unless that logger emits at
    ``level`` or above in the block; ``seen.output`` holds the lines: the standard library's ``assertLogs``. In place
    of pytest's ``caplog``: the suite runs without pytest's logging plugin (pyproject.toml), which at every phase of
    every test attaches its handlers to each of the thousands of loggers torch and transformers make."""
    check = unittest.TestCase()
    return lambda level, logger="lightning_gaudi_ds": check.assertLogs(logger, level)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true",
                     help="also run the soak loops (marker slow: many jobs in a row, ten minutes or more; not in CI)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = config.getoption("--soak")
    for item in items:
        if item.nodeid.startswith(FORK_TIER) and not item.nodeid.startswith(NOT_FORK_TIER):
            item.add_marker(pytest.mark.fork_tier)
        if "slow" in item.keywords and not soak:
            item.add_marker(pytest.mark.skip(reason="a soak loop: run with --soak"))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (tests are collected there)
        _group_shared_fixtures(items)
        items.sort(key=_run_order)  # stable: collection order within each class


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The suite's own fixtures wider than one test that ``item`` uses, as one key per instance: a module-scoped
    fixture is made once per module, a session-scoped one once per session (per xdist worker)."""
    keys = []
    for name, defs in item._fixtureinfo.name2fixturedefs.items():  # type: ignore[attr-defined]
        fixture = defs[-1]  # the one this item gets (a closer definition overrides)
        if not fixture.baseid or fixture.scope == "function":  # pytest's and plugins' own (tmp_path_factory ...)
            continue
        if fixture.scope == "module":
            keys.append(f"module {item.nodeid.split('::', 1)[0]}/{name}")
        elif fixture.scope == "class":
            keys.append(f"class {item.nodeid.rsplit('::', 1)[0]}/{name}")
        else:  # package, session
            keys.append(f"{fixture.scope} {fixture.baseid}/{name}")
    return keys


def _group_shared_fixtures(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, every test that shares an instance of a module- or session-scoped fixture with another
    (a job several tests check, the multi-node hosts, the SLURM cluster, a built op) gets one ``xdist_group``:
    ``--dist loadgroup`` runs each group on one worker, so no fixture is made twice and no two workers touch one
    instance. Groups are transitive: a test using two shared fixtures joins their groups."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    keys = {item.nodeid: _shared_fixtures(item) for item in items}
    for found in keys.values():
        for other in found:
            parent[find(other)] = find(found[0])
    members: dict[str, list[str]] = {}
    for key in parent:
        members.setdefault(find(key), []).append(key)
    widest = {"session": 0, "package": 1, "module": 2, "class": 3}
    names = {root: min(found, key=lambda k: (widest[k.split(" ", 1)[0]], k)).split(" ", 1)[1]
             .replace("@", "-").replace("]", ")") for root, found in members.items()}  # xdist splits at "@"
    for item in items:
        if keys[item.nodeid]:
            name = names[find(keys[item.nodeid][0])]
            item.add_marker(pytest.mark.xdist_group(name))
            if hasattr(item, "_id"):  # pytest >= 9: nodeid is str(_id); pytest-xdist 3.8 appends "@group" to _nodeid,
                # which pytest no longer reads, and --dist loadgroup would silently spread a group over the workers
                item._id = type(item._id).parse(f"{item.nodeid}@{name}")


def _run_order(item: pytest.Item) -> int:
    """Under pytest-xdist, the longest work first (a worker that takes the multi-node hosts at the end would run them
    alone): the multi-node tier, then the other process tests, then the unit tier, which fills the workers' ends."""
    if "multinode" in item.keywords:
        return 0
    return 1 if "multiprocess" in item.keywords else 2


def _cpu_seconds() -> float:
    """CPU time of this process, of the children it has reaped (cold jobs), and of the warm jobs that ended."""
    import resource

    from tests import procs

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + procs.WARM_CPU[0]


_CPU_AT_START: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if os.environ.get("LGDS_SUITE_TIMES"):
        _CPU_AT_START[nodeid] = _cpu_seconds()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``LGDS_SUITE_TIMES=<folder>``, each test phase's duration goes to ``<folder>/tests.jsonl`` (the tear-down
    row also holds the test's CPU seconds, its jobs' included): with the job times from tests/procs.py, what
    benchmarks/suite.py tabulates."""
    folder = os.environ.get("LGDS_SUITE_TIMES")
    if not folder or getattr(report, "node", None) is not None:  # under xdist: a worker's report, written there
        return
    import json

    from tests.procs import plain_node_id

    row = {"test": plain_node_id(report.nodeid), "phase": report.when, "seconds": round(report.duration, 3),
           "outcome": report.outcome, "venv": os.path.basename(sys.prefix)}
    if report.when == "teardown" and report.nodeid in _CPU_AT_START:
        row["cpu"] = round(_cpu_seconds() - _CPU_AT_START.pop(report.nodeid), 3)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tests.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
