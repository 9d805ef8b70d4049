"""The tutorials' programs as scripts (``examples/``), run as a user would run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                       text=True, timeout=120, cwd=EXAMPLES.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_remote_module_pipeline_trains_like_the_local_model() -> None:
    out = _run("06_remote_module.py", "--epochs", "3")
    m = re.search(r"(\d+) steps: loss ([\d.]+) -> ([\d.]+), equal to the local model's", out)
    assert m, out
    steps, first, last = int(m[1]), float(m[2]), float(m[3])
    assert steps == 24 and last < first * 0.75, out


def test_script_mode_example_runs() -> None:
    out = _run("script_mode.py")
    assert "counter on worker1 = 6" in out, out


def test_batch_update_parameter_server_trains_every_trainer() -> None:
    out = _run("04_parameter_server.py", "--trainers", "3", "--batches", "10")
    found = re.findall(r"trainer(\d): loss ([\d.]+) -> ([\d.]+)", out)
    assert sorted(int(t) for t, _, _ in found) == [1, 2, 3], out
    assert all(float(last) < float(first) / 2 for _, first, last in found), out


def test_rnn_over_a_parameter_server_learns_the_corpus() -> None:
    out = _run("03_rnn_parameter_server.py", "--epochs", "3")
    m = re.search(r"(\d+) iterations: loss ([\d.]+) -> ([\d.]+)", out)
    assert m and int(m[1]) == 90 and float(m[3]) < float(m[2]) * 0.6, out


def test_rl_observers_reach_the_reward_threshold() -> None:
    out = _run("02_rl_observers.py", "--world-size", "3", "--reward-threshold", "60",
               "--max-episodes", "100")
    m = re.search(r"Solved! Running reward is now ([\d.]+) after (\d+) episodes", out)
    assert m and float(m[1]) > 60 and int(m[2]) <= 100, out


def test_batch_rpc_runs_batched_and_unbatched_and_learns() -> None:
    out = _run("05_batch_rpc.py", "--world-sizes", "3", "--num-episode", "8",
               "--num-steps", "100", "--print-log")
    assert re.search(r"^3, [\d.]+, [\d.]+$", out, re.M), out
    runs = re.split(r"^Episode 0\t", out, flags=re.M)[1:]
    assert len(runs) == 2, out            # one training log per mode, batched first
    batched = [float(r) for r in re.findall(r"Average reward: ([\d.]+)", runs[0])]
    assert len(batched) == 8 and batched[-1] > batched[0], out


def test_ddp_with_rpc_averages_the_dense_gradients_in_the_context() -> None:
    out = _run("07_ddp_rpc.py", "--epochs", "4")
    assert "the dense layer's gradient was the trainers' mean at every step" in out, out
    found = re.findall(r"trainer(\d): loss ([\d.]+) -> ([\d.]+)", out)
    assert sorted(int(t) for t, _, _ in found) == [0, 1], out
    assert all(float(last) < float(first) for _, first, last in found), out


def test_pipeline_parallelism_trains_like_the_local_model_in_any_split() -> None:
    out = _run("08_pipeline_parallelism.py", "--splits", "1", "4", "--batches", "6")
    found = re.findall(r"number of splits = (\d+), execution time = [\d.]+ s, "
                       r"loss ([\d.]+) -> ([\d.]+), equal to the local model's", out)
    assert [int(n) for n, _, _ in found] == [1, 4], out
    # the same training whatever the split: micro-batches change only the rounding
    assert len({(first, last) for _, first, last in found}) == 1, out
    assert all(float(last) < float(first) * 0.95 for _, first, last in found), out
