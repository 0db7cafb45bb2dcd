import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): a worker a core the suite may use, at most 8 (the tests that launch two
    processes take a core each); none for the vLLM step (`-m vllm`), whose tests each start a vLLM engine pinned to
    the first core."""
    marks = config.getoption("markexpr") or ""
    if "vllm" in marks and "not vllm" not in marks:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 8) if cores > 1 else 0


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models on a 2-core machine: one intra-op thread per process is several times faster than two
    contending ones (tiny matmuls ran up to ~100x slower), and subprocess tests get a core of their own. The processes
    the tests start take one thread too (OMP_NUM_THREADS): a second thread's spinning cost the CPU check of
    scripts/gpu_check.py a third more CPU time for the same wall time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def own_datasets_cache(tmp_path_factory):
    """Keep the arrow caches of the tests' throwaway data files out of the user's ~/.cache."""
    import datasets.config

    cache = tmp_path_factory.mktemp("hf-datasets-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        mp.setenv("HF_DATASETS_CACHE", str(cache))  # and in the subprocesses the CLI tests start
        yield


@pytest.fixture(autouse=True, scope="session")
def own_timings_file(tmp_path_factory):
    """Verify timings kept between processes (`inference.engine.budget.timings_file`) go to a file of the suite's own,
    never the user's: tests of one tiny shape share it, and the user's timings stay what their machine measured."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEDUSA_TRAIN_TIMINGS", str(tmp_path_factory.mktemp("timings") / "timings.json"))
        yield
