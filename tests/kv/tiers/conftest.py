import pytest

from store_services import SERVICES


@pytest.fixture(scope="module", params=sorted(SERVICES))
def store_service(request, tmp_path_factory):
    """A real Mooncake Store or Redis on loopback (each test runs against both)."""
    svc = SERVICES[request.param](tmp_path_factory.mktemp(f"{request.param}-logs")).start()
    yield svc
    svc.kill()
