#!/usr/bin/env bash
# The GPU checks (`make test-gpu`, and tools/gpu_session.sh where `make` may be
# missing): nbrpc's cuda tier (tests/test_cuda.py), the benchmark's CUDA rows
# (nbrpc against TensorPipe; they do not change the exit status), then PyTorch's
# CUDA RPC suite against nbrpc, the tests that need at most as many GPUs as the
# host has. In that order, so that a short lease of a GPU returns nbrpc's own
# results and numbers first; each of PyTorch's tests waits at most 60 s for its
# processes. Availability checks ask NVML, so no process that forks workers
# initializes CUDA first. Without a GPU each part says so, and skips.
#
#   tools/test_gpu.sh [PYTHON]      (default: python3)
set -u
py=${1:-python3}
export PYTORCH_NVML_BASED_CUDA_CHECK=1
"$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py
ours=$?
"$py" benchmarks/bench_rpc.py --cases cuda --repeat 1 --timeout 150 || true
DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=60 "$py" -m pytest -q -rs -p no:cacheprovider \
  tests/test_torch_suites.py -k "CudaRpcTest or cuda_suite"
theirs=$?
exit $(( ours || theirs ))
