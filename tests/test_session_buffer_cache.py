"""OmniSession on the CPU keeps freed MLX buffers for reuse (MLX's CPU default is 32 MiB), so an update's large
temporaries are not page-faulted in again at every update."""

import resource

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


def test_kept_buffers_are_not_faulted_in_again(cache_limit):
    """The same 200 MB of temporaries, twice: with MLX's default the second time faults its pages in again, with
    the session's limit it reuses them."""
    a = mx.random.normal((1024, 1024))
    b = mx.random.normal((1024, 25600))
    mx.eval(a, b)

    def faults_of_second_run() -> int:
        mx.clear_cache()
        for i in range(2):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            y = a @ b
            mx.eval(y * y)
            del y
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    default = faults_of_second_run()
    keep_cpu_buffers()
    kept = faults_of_second_run()
    assert default > 20_000 and kept < default / 10
