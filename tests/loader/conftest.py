import pytest


@pytest.fixture(scope="session", autouse=True)
def deepinfer_cache_dir(tmp_path_factory):
    """One fresh cache for the whole session: tests never read or write ~/.cache/deepinfer."""
    path = tmp_path_factory.mktemp("deepinfer-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE_DIR", str(path))
        yield path
