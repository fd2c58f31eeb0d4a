"""The weight-free figures of docs/models/qwen3_omni.md: the released thinker's parameter count and 4-bit size from
its tensor shapes, and the router-quantisation study's direction."""

from omnitide_mlx.bench.qwen3_omni import memory, router_flips


def test_released_thinker_memory_from_shapes():
    m = memory(4)
    experts = 48 * 128 * 3 * 2048 * 768
    assert m["parts"]["experts"]["params"] == experts
    assert m["parts"]["routers"]["params"] == 48 * 128 * 2048
    assert m["parts"]["embeddings+head"]["params"] == 2 * 152064 * 2048
    assert m["total"]["params"] == 31_719_205_488
    assert m["parts"]["experts"]["converted_bytes"] == experts * 4.5 / 8  # 4 bits + a bf16 scale and bias / 64
    assert m["parts"]["routers"]["converted_bytes"] == m["parts"]["routers"]["bf16_bytes"]  # kept in float
    assert m["parts"]["vision"]["converted_bytes"] == m["parts"]["vision"]["bf16_bytes"]
    assert 18.0 < m["total_gib"]["converted_bytes"] < 18.5


def test_router_quantisation_flips_fewer_experts_at_8_bits():
    r = router_flips(tokens=512, layers=1)
    assert 0.3 < r["4bit"]["flip_share"] < 0.9  # 0.585 at 8 x 4,096 tokens
    assert r["8bit"]["flip_share"] < 0.15  # 0.048
