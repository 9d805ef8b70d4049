#!/usr/bin/env bash
# One run of the GPU checks on a lent machine with a GPU (the `run` device tool), which
# has a CUDA build of torch but none of nbrpc's other dependencies:
#
#   run(command="bash tools/gpu_session.sh", carry=[".gpu-wheels"], timeout_s=560)
#
# .gpu-wheels/ (git-ignored) holds cp312 wheels of those dependencies, downloaded where
# the package index is reachable:
#   pip download --only-binary=:all: --python-version 3.12 -d .gpu-wheels \
#       pyzmq cloudpickle ipyparallel ipywidgets anywidget psutil numpy threadpoolctl \
#       pytest pytest-timeout pytest-rerunfailures expecttest ipython
# They go into a private directory (never into the machine's Python), then
# tools/test_gpu.sh (what `make test-gpu` runs; no `make` needed) runs the cuda
# tier, the CUDA benchmark rows and PyTorch's CUDA RPC suite. Everything it
# prints is also written to $OUT/test-gpu.log.
set -u
out=${OUT:-/tmp}
deps=$(mktemp -d /tmp/nbrpc-deps.XXXXXX)
{
  nvidia-smi -L || true
  python3 -m pip install --quiet --no-deps --no-index --target "$deps" .gpu-wheels/*.whl
  export PYTHONPATH="$deps:$PWD"
  python3 -c "import torch, zmq, numpy; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'pyzmq', zmq.__version__, 'numpy', numpy.__version__)"
  timeout 500 tools/test_gpu.sh python3
  echo "tools/test_gpu.sh: exit status $?"
} 2>&1 | tee "$out/test-gpu.log"
