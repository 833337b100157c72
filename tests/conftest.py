import os

import pytest
import torch

from store_services import SERVICES
from tiny_checkpoints import make_checkpoint, tiny_llama_config


@pytest.fixture(scope="session", autouse=True)
def deepinfer_cache_dir(tmp_path_factory):
    """One fresh cache (converted models, disk KV tier) for the whole session: tests never read
    or write ~/.cache/deepinfer, and the embedded model is converted once per session."""
    path = tmp_path_factory.mktemp("deepinfer-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE_DIR", str(path))
        yield path


TEST_DEVICE = os.environ.get("DEEPINFER_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def test_device():
    """Every engine left on device/dtype "auto" runs on $DEEPINFER_TEST_DEVICE (default cpu, even
    where CUDA exists) in float32, the dtype the comparisons with transformers are exact in."""
    if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        pytest.exit(f"DEEPINFER_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device", returncode=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_DEVICE", TEST_DEVICE)
        mp.setenv("DEEPINFER_DTYPE", "float32")
        yield TEST_DEVICE


@pytest.fixture(scope="session")
def native_kernels():
    """Our C++ kernels a tiny model's step uses, built (once per machine, minutes on a cold
    loaded one) before any test's clock runs: otherwise the first request of whichever test
    comes first pays the build, and a worker answering /health meanwhile looks hung."""
    from deepinfer.layers.batch_rows_linear import batch_rows_kernel
    from deepinfer.layers.native_decode import native_decode_kernel
    from deepinfer.layers.native_ops import small_ops_kernel
    from deepinfer.layers.native_prefill import native_prefill_kernel
    from deepinfer.layers.small_row_linear import small_rows_kernel

    return (native_decode_kernel(), small_ops_kernel(), small_rows_kernel(), native_prefill_kernel(),
            batch_rows_kernel())


@pytest.fixture
def no_batch_rows(monkeypatch):
    """bfloat16 linears kept off the batch-rows kernel for a test of the kernels it replaces."""
    from deepinfer.layers import batch_rows_linear

    monkeypatch.setattr(batch_rows_linear, "batch_rows_usable", lambda: False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, native_kernels):
    """Path of a tiny random Llama checkpoint (2 layers, hidden 64) with a ChatML tokenizer
    (the native kernels built first: the servers over it answer their first request at once)."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama"), tiny_llama_config())


@pytest.fixture
def threads():
    """``torch.set_num_threads`` for a test, the thread count restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add sync overhead (and thrash on a busy machine).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(SERVICES))
def store_service(request, tmp_path_factory):
    """A real Mooncake Store or Redis on loopback (each test runs against both); the services
    are in store_services.py."""
    svc = SERVICES[request.param](tmp_path_factory.mktemp(f"{request.param}-logs")).start()
    yield svc
    svc.kill()
