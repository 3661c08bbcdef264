import os
import warnings

import pytest

import flame


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (bf16 numerics, SDXL shapes, speed paths)")
    config.addinivalue_line("markers", "slow: a minute or more on the interpreter; collected first, so that parallel "
                                       "workers (pytest -n) start it early instead of ending the run on it")
    config.addinivalue_line("markers", "extended: a parity or end-to-end run of minutes on the interpreter whose "
                                           "parts cheaper tests cover; left out of the default run (pyproject's "
                                           "addopts), run with -m extended (the GPU runs take them too)")
    flame.testing.simulate_shared_memory_limit()  # FLAME_TEST_MAX_SHARED_MEMORY: as a smaller card would run
    # The interpreter evaluates masked-out lanes too (log(0), x/0): NumPy warns about them.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\..*")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: otherwise file order
    if not flame.is_interpreter():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with FLAME_DEVICE=cuda on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    import torch
    torch.manual_seed(0)
    flame.manual_seed(0)
    os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(autouse=True, scope="module")
def _return_cached_gpu_memory():
    """On a GPU, hand each module's cached blocks back to the driver: the parallel workers of
    ``pytest -n`` (and the trainer and benchmark processes the tests start) share one card."""
    yield
    if not flame.is_interpreter():
        import torch
        torch.cuda.empty_cache()


@pytest.fixture
def tma_in_interpreter(monkeypatch):
    """Route 16-bit GEMMs and convolutions to the TMA kernels on the interpreter, which emulates
    tensor descriptors: their indexing is then tested on CPU."""
    import flame.kernels.matmul as KM
    monkeypatch.setattr(KM, "TMA", True)
    monkeypatch.setattr(KM, "tma_available", lambda: True)

