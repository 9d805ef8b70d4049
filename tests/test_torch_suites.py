"""PyTorch's own RPC test suites, unchanged, run against nbrpc.

The suites ship inside the torch wheel (``torch/testing/_internal/distributed``):
``RpcTest``, ``DistAutogradTest``, ``DistOptimizerTest``, ``RemoteModuleTest``,
``ThreeWorkersRemoteModuleTest``, ``ParameterServerTest``,
``ReinforcementLearningRpcTest``, and ``DdpUnderDistAutogradTest`` and
``DdpComparisonTest`` (DistributedDataParallel under distributed autograd,
with gloo process groups). Each class here is one of them mixed, as
PyTorch's ``rpc_utils.generate_tests`` mixes them, with a fixture for the agent
(here nbrpc, started through ``init_rpc`` with PyTorch's ``file://`` init) and
``MultiProcessTestCase``: every test runs in 4 processes (world size 4; 6 for
``DdpUnderDistAutogradTest``), each
calling ``init_rpc``, the test body and ``shutdown`` as PyTorch's ``dist_init``
does.

The processes come from a multiprocessing fork server that has imported torch,
nbrpc and ``torch_alias`` (which makes ``torch.distributed.rpc`` and friends
resolve to nbrpc) before the suites: each test's processes start in
milliseconds instead of importing torch four times. This pytest process keeps
PyTorch's real modules; it only starts, joins and checks the processes.

Which tests run is decided in ``tests/torch_suites.py``: everything that uses
only the public API, minus the exclusions listed there with their reasons.
``NBRPC_TORCH_SUITES=all`` runs the excluded and known-failing ones too (to
measure), ``NBRPC_TORCH_SUITES=known-failing`` only those.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

# Per test, the parent's wait for its 4 processes (PyTorch's default is 300 s).
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "100")
# Availability checks ask NVML, not CUDA: the fork server (which imports this
# module) must not initialize CUDA before it forks the test processes.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch_suites  # noqa: E402
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed import ddp_under_dist_autograd_test  # noqa: E402
from torch.testing._internal.distributed.nn.api import remote_module_test  # noqa: E402
from torch.testing._internal.distributed.rpc import (  # noqa: E402
    dist_autograd_test,
    dist_optimizer_test,
    rpc_test,
)
from torch.testing._internal.distributed.rpc.examples import (  # noqa: E402
    parameter_server_test,
    reinforcement_learning_rpc_test,
)
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (  # noqa: E402
    RpcAgentTestFixture,
)

# A failed test runs once more (its processes, fresh): PyTorch's own CI retries
# these suites too. What fails twice fails; tests seen failing once in a quiet
# run are listed in tests/torch_suites.py (FLAKY) with what they showed.
pytestmark = [pytest.mark.torch_suites, pytest.mark.timeout(150), pytest.mark.flaky(reruns=1)]

SUITES = [rpc_test.RpcTest, dist_autograd_test.DistAutogradTest,
          dist_autograd_test.TensorPipeAgentDistAutogradTest,  # (sparse tensors; the graph)
          rpc_test.TensorPipeAgentRpcTest,  # (its options; sparse tensors; dynamic groups)
          dist_optimizer_test.DistOptimizerTest, remote_module_test.RemoteModuleTest,
          remote_module_test.ThreeWorkersRemoteModuleTest,
          parameter_server_test.ParameterServerTest,
          reinforcement_learning_rpc_test.ReinforcementLearningRpcTest,
          ddp_under_dist_autograd_test.DdpUnderDistAutogradTest,
          ddp_under_dist_autograd_test.DdpComparisonTest]

# PyTorch's CUDA RPC tests, where this host has a GPU (``make test-gpu``): those
# that need more GPUs than it has are left out, with that reason.
GPUS = torch.cuda.device_count()  # (NVML: CUDA is not initialized)
CUDA_NEEDS = torch_suites.gpus_needed(rpc_test.TensorPipeAgentCudaRpcTest)
if GPUS:
    SUITES.append(rpc_test.TensorPipeAgentCudaRpcTest)

_FORKSERVER = multiprocessing.get_context("forkserver")
# The fork server imports these once; every test process is forked from it.
_FORKSERVER.set_forkserver_preload(["torch_alias", __name__])


def _ensure_forkserver() -> None:
    """Start the fork server with this directory on its import path (Python
    3.11's fork server ignores the parent's ``sys.path``; without it the
    preloads fail silently and the processes would import PyTorch's modules)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), old]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


class NbrpcAgentTestFixture(RpcAgentTestFixture):
    """The agent under test: nbrpc, as ``TensorPipeRpcAgentTestFixture`` is for
    TensorPipe (same backend type, PyTorch's expected error patterns)."""

    @property
    def rpc_backend(self):
        from nbrpc import rpc
        return rpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):
        from nbrpc import rpc
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        return "(.*)"  # as TensorPipe's fixture

    def get_timeout_error_regex(self) -> str:
        return "RPC ran for more than"  # as TensorPipe's fixture


# A test process still running after this many seconds writes every thread's stack
# to a file beside the test's own temporary file (and runs on): a test that then
# fails (an RPC's 60 s timeout, the parent's 100 s wait) shows where each of its
# processes was.
WATCHDOG_S = 50


def _stacks(file_name: str, rank: int) -> Path:
    return Path(f"{file_name}.stacks-{rank}")


class ForkServerHelper(MultiProcessTestCase):
    """``rpc_utils.SpawnHelper``, with processes from the fork server, each
    with a watchdog that writes its threads' stacks if it runs long."""

    def setUp(self) -> None:
        super().setUp()
        _ensure_forkserver()
        self._start_processes(_FORKSERVER.Process)

    def tearDown(self) -> None:
        for rank in range(len(self.processes)):
            _stacks(self.file_name, rank).unlink(missing_ok=True)
        super().tearDown()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe, **kwargs) -> None:
        # In a test process: the suites must have bound nbrpc, never PyTorch's agent.
        assert getattr(sys.modules["torch.distributed.rpc"], "__nbrpc_alias__", False), (
            "torch.distributed.rpc is PyTorch's in this process: the fork server did not "
            "preload torch_alias")
        stacks = open(_stacks(file_name, rank), "w")  # noqa: SIM115 (open while it runs)
        faulthandler.dump_traceback_later(WATCHDOG_S, file=stacks)
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)

    def _check_return_codes(self, *args, **kwargs) -> None:
        try:
            super()._check_return_codes(*args, **kwargs)
        except Exception as e:
            _add_stacks(e, self.file_name, len(self.processes))
            raise


def _add_stacks(error: BaseException, file_name: str, ranks: int) -> None:
    """Append to ``error``'s message the stacks each rank's watchdog wrote."""
    dumps = ""
    for rank in range(ranks):
        try:
            text = _stacks(file_name, rank).read_text()
        except OSError:
            continue  # (no file: that process never started)
        if text:
            dumps += f"\nrank {rank}'s threads at {WATCHDOG_S} s:\n{text}"
    if dumps and error.args and isinstance(error.args[0], str):
        error.args = (error.args[0] + dumps, *error.args[1:])


def test_a_failed_tests_error_ends_with_the_stacks_its_watchdogs_wrote(tmp_path: Path) -> None:
    file_name = str(tmp_path / "test-file")
    _stacks(file_name, 1).write_text("Thread 0x01 (most recent call first):\n  File x.py\n")
    _stacks(file_name, 2).write_text("")  # armed, never fired: nothing to say
    error = RuntimeError("Process 1 exited with error code 10")
    _add_stacks(error, file_name, ranks=3)
    assert str(error) == ("Process 1 exited with error code 10\nrank 1's threads at "
                          f"{WATCHDOG_S} s:\nThread 0x01 (most recent call first):\n  File x.py\n")
    quiet = RuntimeError("Process 0 timed out")
    _add_stacks(quiet, str(tmp_path / "other"), ranks=3)
    assert str(quiet) == "Process 0 timed out"


def _make(suite: type) -> type:
    name = suite.__name__
    tests = [t for t in dir(suite) if t.startswith("test") and callable(getattr(suite, t))]
    # A name set to None is no test: neither pytest nor the processes see it.
    dropped = {t: None for t in tests if not torch_suites.runs(name, t)
               or (name == torch_suites.CUDA_SUITE and CUDA_NEEDS.get(t, 0) > GPUS)}
    cls = type(f"Nbrpc{name}", (suite, NbrpcAgentTestFixture, ForkServerHelper), dropped)
    cls.__module__ = __name__
    return cls


for _suite in SUITES:
    _cls = _make(_suite)
    globals()[_cls.__name__] = _cls
del _suite, _cls

@pytest.mark.skipif(max(CUDA_NEEDS.values(), default=0) <= GPUS,
                    reason="every CUDA test fits this host's GPUs: the suite runs above")
def test_cuda_suite_on_this_hosts_gpus() -> None:
    """Say in the skip list what of PyTorch's CUDA RPC suite this host cannot
    run: all of it without a GPU (with what a GPU host would run), else the
    tests that need more GPUs than it has, by name."""
    if not GPUS:
        one = sum(1 for n in CUDA_NEEDS.values() if n <= 1)
        pytest.skip(f"no CUDA device here: PyTorch's {torch_suites.CUDA_SUITE} ({one} tests "
                    f"need at most one GPU, {len(CUDA_NEEDS) - one} need 2 or 4) runs where "
                    "torch.cuda.device_count() >= 1 (make test-gpu)")
    beyond: dict[int, list[str]] = {}
    for test, n in sorted(CUDA_NEEDS.items()):
        if n > GPUS:
            beyond.setdefault(n, []).append(test)
    pytest.skip(f"this host has {GPUS} GPU{'s' if GPUS > 1 else ''}; PyTorch's "
                f"{torch_suites.CUDA_SUITE} also has " + "; ".join(
                    f"{len(names)} tests that need {n} ({', '.join(names)})"
                    for n, names in sorted(beyond.items())))


if "torch_alias" not in sys.modules:  # this pytest process: check the lists are current
    torch_suites.check_names({s.__name__: {t for t in dir(s) if t.startswith("test")}
                              for s in SUITES})
