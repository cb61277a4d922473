"""Test-wide fixtures: the ``backend`` fixture runs a test on the CPU
emulator always and on a GPU (through ptxgen.driver) when one is present;
the GPU case is skipped cleanly, never errors, where there is none.

Random inputs: the ``rng`` fixture is the test's ``numpy.random.Generator``
and ``seed`` an integer seed for APIs that take one, both derived from the
session seed and the test's node id (tests/seeding.py).  ``pytest --seed N``
sets the session seed; by default each session draws a fresh one.  The seed
is shown in the report header and in a "random seed" section of every
failing test's report, with the command that reruns it.

Under pytest-xdist (``make test`` runs ``-n auto``) the controller draws the
session seed and hands it to every worker (``pytest_configure_node``), so
all workers, and a rerun with ``--seed``, with or without ``-n``, draw the
same inputs for a test.
"""

import os

import pytest

import seeding
from backends import Backend, cuda_available


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None, metavar="N",
                     help="session seed for the tests' random inputs (default: a fresh one)")


#: test files whose tests keep a worker busy for half a minute or more (the
#: emulator running models, the README's and the CLI's commands in
#: subprocesses), longest first.  Under pytest-xdist's ``--dist loadfile``
#: (``make test``) they are handed out first, so the run does not end with one
#: worker still on one of them and the others idle; pytest-xdist's own order
#: (files with the most tests first) would send these few-test files last.
LONG_FILES = (
    "tests/llm/test_batch_runner.py",
    "tests/test_readme.py",
    "tests/test_cli_frictions.py",
    "tests/llm/test_tensor_parallel.py",
    "tests/llm/test_prefill.py",
    "tests/llm/engine/test_engine_families.py",
    "tests/llm/test_gemma3.py",
    "tests/llm/test_qwen3moe.py",
    "tests/test_cli_text.py",
    "tests/llm/test_persistent.py",
)


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)     # set on pytest-xdist workers
    if workerinput is not None and "ptxgen_seed" in workerinput:
        seeding.configure(workerinput["ptxgen_seed"])
    else:
        seeding.configure(config.getoption("--seed"))
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False      # the collection's order: LONG_FILES first


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """:data:`LONG_FILES` first, in their order; the rest as collected."""
    rank = {f: i for i, f in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (controller): every worker gets the controller's seed."""
    node.workerinput["ptxgen_seed"] = seeding.session_seed()


def pytest_report_header(config):
    n = seeding.session_seed()
    return f"random seed: {n} (rerun with pytest --seed {n})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        n = seeding.session_seed()
        report.sections.append(("random seed", f"seed={n}; rerun with pytest --seed {n} "
                                               f"'{item.nodeid}'"))


@pytest.fixture
def rng(request):
    """The test's ``numpy.random.Generator`` (reproduced by ``--seed``)."""
    return seeding.rng_for(request.node.nodeid)


@pytest.fixture(scope="module")
def module_seed(request):
    """An integer seed for module-scoped fixtures (reproduced by ``--seed``)."""
    return seeding.seed_for(request.node.nodeid + "#module")


@pytest.fixture
def seed(request):
    """The test's integer seed (reproduced by ``--seed``)."""
    return seeding.seed_for(request.node.nodeid + "#seed")

_CUDA = None


def _have_cuda():
    global _CUDA
    if _CUDA is None:
        _CUDA = cuda_available()
    return _CUDA


@pytest.fixture(params=["emu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """A :class:`backends.Backend`: "emu", or "cuda" when a GPU is present."""
    if request.param == "cuda" and not _have_cuda():
        pytest.skip("no NVIDIA GPU / driver available for the cuda backend")
    return Backend(request.param)


@pytest.fixture
def emu_backend():
    """The emulator backend only (for tests of emulator diagnostics)."""
    return Backend("emu")


@pytest.fixture(scope="session")
def ptxas():
    """The ptxas executable; a clean skip without one, except under CI
    (CI=true), where a missing ptxas fails."""
    from ptxgen.ptxas import PtxasNotFound, find_ptxas
    try:
        return find_ptxas()
    except PtxasNotFound as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"ptxas is required under CI: {e}")
        pytest.skip(str(e))
