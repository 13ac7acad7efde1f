"""FA3's FP8 forward as the blocks call it: the per-head quantization's numerics, and a block
exported under `fa3-fp8` (the FP8 casts in the block's own graph, the op after them). Export needs
only the op's fake implementation, so this runs on the CPU; the kernel itself runs in test_gpu.py."""

import pytest
import torch
from conftest import load_tiny, tiny_options

from aot.blocks import repeated_blocks
from aot.export import _capture_classes, export_block
from aot.fa3 import E4M3_MAX, attention_backend, fa3_op, fp8_attention, quantize_per_head
from aot.target import Target

# float8_e4m3fn keeps 3 mantissa bits: a normal value rounds to within half a unit in the last
# place, 2**-4 of itself.
E4M3_ROUNDING = 2**-4


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2)])
def test_quantize_per_head_scales_each_kv_group_to_the_fp8_range(heads, kv_heads):
    torch.manual_seed(0)
    x = torch.randn(2, 64, heads, 32, dtype=torch.bfloat16) * torch.logspace(-2, 2, heads).to(torch.bfloat16)[:, None]
    group = heads // kv_heads  # query heads per KV head, sharing its scale
    x[1, :, :group] = 0  # an all-zero group in the second batch entry
    fp8, descale = quantize_per_head(x, kv_heads)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, kv_heads)
    grouped = fp8.float().reshape(2, 64, kv_heads, group, 32)
    # each group's largest value lands on the top of the range (the zero group: nothing to scale)
    top = grouped.abs().amax(dim=(1, 3, 4))
    assert torch.equal(top[0], torch.full((kv_heads,), E4M3_MAX))
    back = (grouped * descale[:, None, :, None, None]).reshape(x.shape)
    normal = x.float().abs() >= descale.repeat_interleave(group, 1)[:, None, :, None] * 2**-6
    error = (back - x.float()).abs()[normal] / x.float().abs()[normal]
    assert error.max() <= E4M3_ROUNDING, error.max()
    assert torch.equal(back[1, :, :group], torch.zeros_like(back[1, :, :group]))
    assert descale[1, 0] == 1


def test_fp8_attention_refuses_what_fa3_fp8_cannot_do():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="no mask, no causal attention and no returned log-sum-exp"):
        fp8_attention(q, q, q, attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no mask, no causal"):
        fp8_attention(q, q, q, is_causal=True)


def test_a_block_exported_under_fa3_fp8_quantizes_in_its_graph_and_calls_the_op(monkeypatch):
    from diffusers.models import attention_dispatch

    # diffusers lets its `_flash_3` backend be entered only once FA3 is loaded (`load_fa3`), which
    # needs a Hopper GPU; tracing calls no kernel (the op's fake implementation), so say it is.
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", True)
    pipe = load_tiny()
    pipe.transformer._repeated_blocks = ["FluxSingleTransformerBlock"]
    target = Target.of(pipe, tiny_options())
    ((name, (block, inputs, contract, *_)),) = _capture_classes(pipe, repeated_blocks(pipe.transformer), target).items()
    registry = attention_dispatch._AttentionBackendRegistry
    flash_3 = registry._backends[attention_dispatch.AttentionBackendName._FLASH_3]
    with attention_backend("fa3-fp8"):
        exported = export_block(block, inputs[0], contract)
    assert registry._backends[attention_dispatch.AttentionBackendName._FLASH_3] is flash_3  # put back
    nodes = list(exported.graph.nodes)
    calls = [n for n in nodes if n.target is fa3_op("fa3-fp8")]
    assert len(calls) == 1, f"{name}: {len(calls)} calls of aot_fa3::fp8_forward"
    q, k, v = (arg.meta["val"] for arg in calls[0].args[:3])
    assert (q.dtype, k.dtype, v.dtype) == (torch.float8_e4m3fn,) * 3
    assert calls[0].meta["val"].dtype == torch.bfloat16
    assert not any(n.target is fa3_op("fa3") for n in nodes)
    with pytest.raises(RuntimeError, match="boom"), attention_backend("fa3-fp8"):
        raise RuntimeError("boom")
    assert registry._backends[attention_dispatch.AttentionBackendName._FLASH_3] is flash_3
