"""FA3's FP8 forward as the blocks call it: the per-head quantization's numerics, and a block
exported under `fa3-fp8` (the FP8 casts in the block's own graph, the op after them). Export needs
only the op's fake implementation, so this runs on the CPU; the kernel itself runs in test_gpu.py."""

import pytest
import torch
from conftest import ROOT, decided, load_tiny, tiny_options

from aot.attention import attention_backend, attention_op
from aot.blocks import repeated_blocks
from aot.export import _capture_classes, compile_blocks, export_block
from aot.fa3 import (
    E4M3_MAX,
    FOLDED,
    fold_token_mask,
    fp8_attention,
    quantize_per_head,
    unit_scale_problem,
    unit_scaled,
)
from aot.options import Options
from aot.plans import PLANS, Plan
from aot.target import Target

# float8_e4m3fn keeps 3 mantissa bits: a normal value rounds to within half a unit in the last
# place, 2**-4 of itself.
E4M3_ROUNDING = 2**-4


def test_quantize_per_head_scales_each_head_to_the_fp8_range():
    torch.manual_seed(0)
    heads = 8
    x = torch.randn(2, 64, heads, 32, dtype=torch.bfloat16) * torch.logspace(-2, 2, heads).to(torch.bfloat16)[:, None]
    x[1, :, 0] = 0  # an all-zero head in the second batch entry
    fp8, descale = quantize_per_head(x)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, heads)
    # each head's largest value lands on the top of the range (the zero head: nothing to scale)
    top = fp8.float().abs().amax(dim=(1, 3))
    assert torch.equal(top[0], torch.full((heads,), E4M3_MAX))
    back = fp8.float() * descale[:, None, :, None]
    normal = x.float().abs() >= descale[:, None, :, None] * 2**-6
    error = (back - x.float()).abs()[normal] / x.float().abs()[normal]
    assert error.max() <= E4M3_ROUNDING, error.max()
    assert torch.equal(back[1, :, 0], torch.zeros_like(back[1, :, 0])) and descale[1, 0] == 1


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
    calls = [n for n in nodes if n.target is attention_op("fa3-fp8")]
    assert len(calls) == 1, f"{name}: {len(calls)} calls of aot_fa3::fp8_forward"
    q, k, v = (arg.meta["val"] for arg in calls[0].args[:3])
    assert (q.dtype, k.dtype, v.dtype) == (torch.float8_e4m3fn,) * 3
    assert calls[0].meta["val"].dtype == torch.bfloat16
    assert not any(n.target is attention_op("fa3") for n in nodes)
    for kernel in ("fa3-fp8", "fa3"):
        with pytest.raises(RuntimeError, match="boom"), attention_backend(kernel):
            raise RuntimeError("boom")
        assert registry._backends[attention_dispatch.AttentionBackendName._FLASH_3] is flash_3, kernel


def sdpa(q, k, v, **kwargs):
    """torch's SDPA on diffusers' layout, (batch, seq, heads, head_dim)."""
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), **kwargs)
    return out.transpose(1, 2)


def test_a_token_mask_folded_into_the_head_dim_is_the_masked_attention():
    """Chroma's mask as diffusers 0.42 builds it, its padding mask times itself, added to the scores:
    folded into the head dim, attention without a mask gives the masked attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 40, 3, 16, dtype=torch.float64) for _ in range(3))
    tokens = torch.ones(2, 40, dtype=torch.float64)
    tokens[0, 5:12] = tokens[1, 20:31] = 0  # padded text tokens
    mask = tokens[:, None, None, :] * tokens[:, None, :, None]
    reference = sdpa(q, k, v, attn_mask=mask)
    assert (reference - sdpa(q, k, v)).abs().max() > 1e-2  # the mask matters
    for scale in (None, 0.3):
        folded_q, folded_k, folded_v, folded_scale = fold_token_mask(q, k, v, mask, scale)
        assert folded_q.shape[-1] == folded_k.shape[-1] == folded_v.shape[-1] == 16 + FOLDED
        out = sdpa(folded_q, folded_k, folded_v, scale=folded_scale)
        torch.testing.assert_close(out[..., :16], sdpa(q, k, v, attn_mask=mask, scale=scale), rtol=1e-12, atol=1e-12)
        assert not out[..., 16:].any()
    # grouped queries: 6 query heads over the 3 key heads
    grouped = torch.randn(2, 40, 6, 16, dtype=torch.float64)
    folded_q, folded_k, folded_v, folded_scale = fold_token_mask(grouped, k, v, mask, None)
    out = sdpa(folded_q, folded_k, folded_v, scale=folded_scale, enable_gqa=True)[..., :16]
    torch.testing.assert_close(out, sdpa(grouped, k, v, attn_mask=mask, enable_gqa=True), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"folds only an additive float mask .* got a torch.bool mask"):
        fold_token_mask(q, k, v, mask.bool(), None)
    wide = torch.zeros(2, 40, 1, 256, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"head dims up to 248 \(FA3 takes 256\); this model's is 256"):
        fold_token_mask(wide, wide, wide, mask, None)
    with pytest.raises(ValueError, match=r"shape \(2, 1, 40, 20\) for 40 queries and 20 keys"):
        fold_token_mask(q, k[:, :20], v[:, :20], mask[..., :20], None)


def test_fa3_runs_chromas_blocks_with_their_mask_folded(monkeypatch):
    """The tiny Chroma pipeline's blocks under `fa3`: exported, each calls diffusers' FA3 op (its fake
    implementation) once, on the folded head dim; run, they match eager SDPA with the mask. A CPU has
    no FA3 to run: in diffusers' registry an SDPA stand-in then takes its place, refusing a mask as
    diffusers' FA3 backend does and using the scale it is given."""
    from diffusers import DiffusionPipeline
    from diffusers.models import attention_dispatch

    pipe = DiffusionPipeline.from_pretrained(ROOT / "assets" / "tiny-chroma")
    head_dim = pipe.transformer.config.attention_head_dim

    def flash_3(query, key, value, attn_mask=None, scale=None, is_causal=False, return_lse=False, **_):
        assert attn_mask is None and not is_causal and not return_lse, "diffusers' FA3 refuses these"
        assert query.shape[-1] == head_dim + FOLDED, query.shape
        return sdpa(query, key, value, scale=scale)

    target = Target.of(pipe, Options(model=str(ROOT / "assets" / "tiny-chroma"), device="cpu"))
    classes = _capture_classes(pipe, repeated_blocks(pipe.transformer), target)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", True)  # as in the test above
    for block, inputs, contract, _, _ in classes.values():
        assert inputs[0]["attention_mask"] is not None
        with attention_backend("fa3"):
            nodes = export_block(block, inputs[0], contract).graph.nodes
        calls = [n for n in nodes if n.target is attention_op("fa3")]
        assert len(calls) == 1 and calls[0].args[0].meta["val"].shape[-1] == head_dim + FOLDED
    registry = attention_dispatch._AttentionBackendRegistry
    monkeypatch.setitem(registry._backends, attention_dispatch.AttentionBackendName._FLASH_3, flash_3)
    for block, inputs, _, references, _ in classes.values():
        with attention_backend("fa3"), torch.no_grad():
            for kwargs, reference in zip(inputs, references, strict=True):
                torch.testing.assert_close(block(**kwargs), reference, rtol=1e-5, atol=1e-5)


def test_a_normed_rotated_head_stays_within_the_bound_unit_scale_problem_uses():
    """The bound `unit_scale_problem` rests on, with diffusers' RMSNorm and RoPE and torch's layer
    norm: each head row normalized, weighted (and shifted), then rotated pairwise. A row with all its
    energy in one entry nearly reaches it; so does a pair of equal biases rotated by 45 degrees."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm

    from aot.fa3 import _output_bound

    torch.manual_seed(0)
    dim = 128
    rms, layer = RMSNorm(dim, eps=1e-6), torch.nn.LayerNorm(dim)
    with torch.no_grad():
        rms.weight.copy_(torch.rand(dim) * 3)
        layer.bias[:2] = 40.0
    x = torch.randn(1, 6, 256, dim) * torch.logspace(-3, 3, 256)[:, None]  # (batch, heads, tokens, dim)
    x[0, 0, 0] = 0
    x[0, 0, 0, int(rms.weight.argmax())] = 5.0  # one entry carries the row
    angles = torch.rand(256, dim // 2) * 6.3
    angles[1, 0] = torch.pi / 4
    rope = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    for norm in (rms, layer):
        with torch.no_grad():
            out = apply_rotary_emb(norm(x), rope)
        bound = _output_bound(norm)
        assert out.abs().max() <= bound * (1 + 1e-5), type(norm).__name__
        assert out.abs().max() >= 0.7 * bound, type(norm).__name__  # not loose by construction
    assert _output_bound(layer) == pytest.approx(dim**0.5 + 2**0.5 * 40.0)


def test_unit_scaled_saturates_where_torch_cast_makes_nan():
    x = torch.tensor([0.5, -3.25, 448.0, 1000.0, -1e4])
    assert torch.isnan(x.to(torch.float8_e4m3fn).float()).any()  # what the clamp is for
    assert unit_scaled(x).float().tolist() == [0.5, -3.25, 448.0, 448.0, -448.0]


def test_unit_scale_problem_names_the_norm_beyond_fp8_range():
    transformer = load_tiny().transformer  # head dim 16: a per-head norm's entries stay within 4 x its weights
    assert unit_scale_problem(transformer) is None
    doubles, singles = repeated_blocks(transformer).values()
    with torch.no_grad():
        doubles[1].attn.norm_k.weight[3] = -150.0
    problem = "transformer_blocks.1.attn.norm_k: its outputs may reach 600, beyond FP8's 448"
    assert unit_scale_problem(transformer) == problem
    doubles[1].attn.norm_k = torch.nn.LayerNorm(16)
    with torch.no_grad():
        doubles[1].attn.norm_k.bias[5] = 314.0  # sqrt(16) + sqrt(2) x 314 = 448.1
    problem = "transformer_blocks.1.attn.norm_k: its outputs may reach 448, beyond FP8's 448"
    assert unit_scale_problem(transformer) == problem
    with torch.no_grad():
        doubles[1].attn.norm_k.bias[5] = 313.0  # 446.7
    assert unit_scale_problem(transformer) is None
    doubles[0].attn.norm_added_k = None  # beside add_k_proj: the text keys go unnormalized
    problem = "transformer_blocks.0.attn.norm_added_k is missing: its queries or keys are not normalized"
    assert unit_scale_problem(transformer) == problem
    doubles[0].attn.norm_added_k = torch.nn.Identity()
    problem = "transformer_blocks.0.attn.norm_added_k: cannot tell how many entries Identity normalizes over"
    assert unit_scale_problem(transformer) == problem
    doubles[0].attn.norm_added_k = torch.nn.RMSNorm(16)
    singles[1].attn.norm_q = None
    problem = "single_transformer_blocks.1.attn.norm_q is missing: its queries or keys are not normalized"
    assert unit_scale_problem(transformer) == problem


def test_fa3_fp8_is_left_out_of_a_plan_with_the_reason_where_a_norm_could_overflow(monkeypatch):
    """Decided before any capture: the walk leaves fa3-fp8 out, so neither the compile nor the load
    path tries it. Stand-ins for a Hopper GPU the CPU is not: FA3 passes its checks
    (`resolve_attention`), and a plan whose attention trials are fa3-fp8, then SDPA."""
    from aot import plans

    monkeypatch.setattr(plans, "resolve_attention", lambda *args: plans.Decision("attention", "fa3", "auto"))
    hopper = Plan("sm_90", ("fa3-fp8", "sdpa"), (), "a plan with FP8 attention")
    monkeypatch.setattr(plans, "PLANS", (((9, 0), (9, 9), hopper), *PLANS[1:]))
    pipe = load_tiny()
    assert plans.Trials.resolve(tiny_options(plan="9.0"), pipe.transformer).attention.steps == ("fa3-fp8", "sdpa")
    with torch.no_grad():
        pipe.transformer.single_transformer_blocks[0].attn.norm_q.weight.fill_(200.0)  # x sqrt(16), its head dim
    compiled = compile_blocks(*decided(pipe, tiny_options(plan="9.0")))
    attention = compiled.decisions[1]
    assert attention == plans.Decision(
        "attention",
        "sdpa",
        "plan sm_90: fa3-fp8 skipped (Q and K cannot be cast to FP8 unscaled: "
        "single_transformer_blocks.0.attn.norm_q: its outputs may reach 800, beyond FP8's 448) -> sdpa",
    )


def test_fp8_attention_is_refused_above_its_bound_and_named_with_its_error_below(monkeypatch):
    """`_attention_note`, a low-precision trial's first step, on errors and times as a GPU measures
    them: a CPU cannot run FP8 attention, so what `_low_precision_errors` and `_timed_note` would
    measure is given here (test_gpu.py measures them)."""
    from aot import export

    monkeypatch.setattr(export, "_low_precision_errors", lambda classes, kernel: {"A": 2e-3, "B": 9e-3})
    monkeypatch.setattr(export, "_timed_note", lambda classes, kernel: "0.400 ms a call against SDPA's 0.500 ms")
    assert export._attention_note({}, "fa3-fp8", timed=True) == (
        "fa3-fp8 (eager first blocks within 9.0e-03 of eager, <= 1e-02)"
    )
    assert export._attention_note({}, "sage", timed=True) == (
        "sage (0.400 ms a call against SDPA's 0.500 ms; eager first blocks within 9.0e-03 of eager, <= 1e-02)"
    )
    untimed = export._attention_note({}, "sage", timed=False)
    assert untimed == "sage (eager first blocks within 9.0e-03 of eager, <= 1e-02)"
    assert export._attention_note({}, "fa3", timed=True) == "fa3"
    monkeypatch.setattr(export, "_low_precision_errors", lambda classes, kernel: {"A": 2e-3, "B": 1.1e-2})
    refused = r"^B: fa3-fp8 attention moves the eager block by 1\.1e-02 \(relative\), above 1e-02$"
    with pytest.raises(RuntimeError, match=refused):
        export._attention_note({}, "fa3-fp8", timed=True)
