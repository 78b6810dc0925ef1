import subprocess
from collections import Counter

import numpy as np
import pytest
import zarr
from s3_server import s3, s3_server  # noqa: F401  (fixtures: a moto S3 server, a fresh bucket)

from napari_tileshard.engine.backends import gpu_unavailable_reason


def _qt_binding_reason() -> str | None:
    """None when a Qt binding imports here, else why not (the test extra alone brings none)."""
    try:
        import qtpy  # noqa: F401
    except Exception as exc:  # qtpy raises its own error when it finds no binding
        return f"no Qt binding ({type(exc).__name__}: {exc}); install the napari extra"
    return None


QT_UNAVAILABLE = _qt_binding_reason()
# pytest-qt refuses to start without a binding (a UsageError for the whole run): it is loaded here,
# only where it can work (pyproject's addopts keep it from loading itself), and Qt tests skip otherwise.
pytest_plugins = [] if QT_UNAVAILABLE else ["pytestqt.plugin"]
_QT_FIXTURES = {"qtbot", "qapp", "make_napari_viewer", "make_napari_viewer_proxy"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _QT_FIXTURES & set(getattr(item, "fixturenames", ())) and "qt" not in item.keywords:
            item.add_marker(pytest.mark.qt)
        if QT_UNAVAILABLE and "qt" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"a Qt test: {QT_UNAVAILABLE}"))


def _gpu_param():
    return pytest.param("gpu", marks=pytest.mark.gpu, id="gpu")


@pytest.fixture(params=["cpu", _gpu_param()])
def backend(request, monkeypatch):
    """Every writer test runs on both backends; the GPU case skips with the reason where it can't run."""
    if request.param == "gpu":
        reason = gpu_unavailable_reason()
        if reason:
            pytest.skip(f"GPU backend not usable here: {reason}")
        from napari_tileshard.engine.backends.gpu import GpuBackend

        # Small batches keep hundreds of tiny test writers cheap (pinned + device memory per writer).
        monkeypatch.setattr(GpuBackend, "default_batch_bytes", 4 << 20)
    return request.param


class MetadataCountingStore(zarr.storage.LocalStore):
    """A read-only LocalStore that counts the ``zarr.json`` objects read through it."""

    def __init__(self, root):
        super().__init__(root, read_only=True)
        self.metadata_reads: Counter[str] = Counter()

    async def get(self, key, prototype=None, byte_range=None):
        if key.rsplit("/", 1)[-1] == "zarr.json":
            self.metadata_reads[key] += 1
        return await super().get(key, prototype, byte_range)


@pytest.fixture
def metadata_counting_store():
    """``(root) ->`` a read-only local zarr Store whose ``metadata_reads`` counts each ``zarr.json``
    read through it: how often a caller opens a store, through the public API."""
    return MetadataCountingStore


def read_back(path):
    return zarr.open_array(path, mode="r")[...]


def read_tensorstore(path):
    ts = pytest.importorskip("tensorstore")
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
    return np.asarray(store.read().result())


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, name)`` -> a fresh size-limited tmpfs (a real full disk); needs root and
    mount, and skips with the reason where they are not allowed."""
    mounted = []

    def mount(size: str, name: str = "tmpfs"):
        point = tmp_path / name
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True, text=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here: {result.stderr.strip() or result.returncode}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
