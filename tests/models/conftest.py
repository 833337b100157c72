import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add sync overhead (and thrash on a busy machine).
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
