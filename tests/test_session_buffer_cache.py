"""OmniSession on the CPU keeps freed MLX buffers for reuse (MLX's CPU default is 32 MiB), so an update's large
temporaries are not page-faulted in again at every update."""

import mlx.core as mx
import pytest

from omnitide_mlx.bench.shape_models import ShapeTrueModel
from omnitide_mlx.session import CPU_BUFFER_CACHE_BYTES, OmniSession, keep_cpu_buffers

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU allocator's cache limit")


def _limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


@pytest.fixture
def cache_limit():
    """Start from MLX's CPU default (32 MiB); restore whatever the process had afterwards."""
    before = mx.set_cache_limit(32 << 20)
    yield _limit
    mx.set_cache_limit(before)


def test_a_session_raises_the_limit_and_never_lowers_it(cache_limit):
    OmniSession(ShapeTrueModel("tiny"), policy="omnitide")
    assert cache_limit() == CPU_BUFFER_CACHE_BYTES
    mx.set_cache_limit(8 << 30)
    keep_cpu_buffers()
    assert cache_limit() == 8 << 30


def test_freed_temporaries_stay_in_the_cache(cache_limit):
    """The same 200 MB of temporaries: with MLX's CPU default they go back to the OS when freed (so the next
    update page-faults them in again); with the session's limit MLX keeps them for reuse. Checked on MLX's own
    cache accounting: page-fault counts depend on the kernel (transparent huge pages) and are left to benchmarks."""
    a = mx.random.normal((1024, 1024))
    b = mx.random.normal((1024, 25600))
    mx.eval(a, b)

    def cached_after_run() -> int:
        mx.clear_cache()
        y = a @ b
        mx.eval(y * y)
        del y
        return mx.get_cache_memory()

    default = cached_after_run()
    keep_cpu_buffers()
    kept = cached_after_run()
    assert default <= 32 << 20
    assert kept >= 100 << 20
