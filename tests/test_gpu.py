"""GPU layer: FA3, sage attention and FP8 inside compiled blocks, against eager (skipped without CUDA).

The tiny pipeline's text encoders and VAE, with a transformer whose blocks have FLUX.1-dev's width
(24 heads x 128) so FA3 and FP8 run the kernels they run on the real model. Run on the H200 with
`AOT_FA3_KERNEL` naming the FA3 source there (e.g. `fa3_fwd_interface`).
"""

import os

import numpy as np
import pytest
import torch
from conftest import TINY, ZeroGPUSpace, decided, generate

from aot.apply import patch_blocks_
from aot.blocks import rel_error
from aot.export import MAX_REL_ERROR, compile_blocks
from aot.fp8 import FP8_MAX_REL_ERROR
from aot.options import Options
from aot.pipeline import load_pipeline
from tools.attention_error import NORMS
from tools.bench import published_transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FA3_KERNEL = os.environ.get("AOT_FA3_KERNEL", Options.fa3_kernel)
# Images after 2 steps of a random model and a random VAE, compiled vs eager. Each block matches
# eager within compile.MAX_REL_ERROR (checked by compile_blocks); through the whole pipeline FA3 vs
# SDPA measured 1.3e-2 on the H200 (2026-11-29).
IMAGE_TOLERANCE = 3e-2


def wide_pipeline(dtype=torch.bfloat16):
    from diffusers import FluxTransformer2DModel

    pipe = load_pipeline(Options(model=TINY, device="cuda", dtype=str(dtype).removeprefix("torch.")))
    torch.manual_seed(0)
    # FLUX.1-dev's blocks, two of each, fed by the tiny text encoders and VAE.
    config = {**published_transformer("flux"), "in_channels": 16, "num_layers": 2, "num_single_layers": 2}
    config.update(joint_attention_dim=32, pooled_projection_dim=32)
    with torch.device("cuda"):
        pipe.transformer = FluxTransformer2DModel(**config).to(dtype)
    return pipe


def images(pipe, size=(1024, 768)):
    return generate(pipe, *size).float()


def test_fa3_blocks_match_eager():
    pipe = wide_pipeline()
    expected = images(pipe)
    compiled = compile_blocks(*decided(pipe, Options(attention="fa3", fa3_kernel=FA3_KERNEL, fp8="off")))
    assert compiled.decisions[1].value == "fa3", compiled.decisions[1]
    assert all(p.rel_error < MAX_REL_ERROR for p in compiled.packages.values())
    patch_blocks_(pipe, compiled)
    error = rel_error(images(pipe), expected)
    assert error < IMAGE_TOLERANCE, f"FA3 compiled vs eager SDPA: {error:.2e}"


def test_fa3_fp8_attention_matches_sdpa_within_fp8_error_and_compiles_into_the_blocks():
    """The op alone at FLUX.1-dev's 1024x1024 attention shape against SDPA in float32, then the
    blocks compiled with it (the exported graph calls `aot_fa3::fp8_forward`: `_compile_class`
    checks) against eager SDPA."""
    from aot.fa3 import fp8_attention, load_fa3

    load_fa3(FA3_KERNEL)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    out = fp8_attention(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    op_error = rel_error(out.float(), reference.transpose(1, 2))
    print(f"fa3-fp8 op vs float32 SDPA: {op_error:.2e}")
    assert op_error < FP8_MAX_REL_ERROR
    low_precision_blocks_match_eager(Options(attention="fa3-fp8", fa3_kernel=FA3_KERNEL, fp8="off"))


def test_the_norm_rope_kernel_matches_its_reference_at_fluxs_shape():
    """norm_rope.py's kernel at FLUX.1-dev's single block, 1 x 4608 x 24 x 128, x a view of a wider GEMM
    output, and at its double block, 512 text and 4096 image tokens as two parts, each a view of its own,
    against its torch reference (of each part, joined): each entry within one bf16 step of its row's
    largest (Triton may fuse a multiply and an add that torch rounds apart), or one FP8 step (2^-3) where it
    casts to FP8; then the wide pipeline's blocks compiled with it under FA3's FP8 forward against eager."""
    from aot import norm_rope

    torch.manual_seed(0)
    x = (torch.randn(1, 4608, 3 * 3072, device="cuda", dtype=torch.bfloat16) * 3)[..., :3072].unflatten(-1, (24, 128))
    text = (torch.randn(1, 512, 3 * 3072, device="cuda", dtype=torch.bfloat16) * 3)[..., :3072].unflatten(-1, (24, 128))
    image = x[:, 512:]
    weight = (torch.rand(128, device="cuda") + 0.5).to(torch.bfloat16)
    text_weight = (2 - weight.float()).to(torch.bfloat16)
    angles = torch.randn(4608, 128, device="cuda") * 10
    cos, sin = (t[None, :, None] for t in (angles.cos(), angles.sin()))
    pairs = torch.view_as_real(torch.polar(torch.ones_like(angles[:, ::2]), angles[:, ::2]))[:, None]
    parts = [(text, text_weight, cos[:, :512], sin[:, :512]), (image, weight, cos[:, 512:], sin[:, 512:])]
    for dtype, step in ((torch.bfloat16, 2**-7), (torch.float8_e4m3fn, 2**-3)):
        for round_first in (False, True):
            args = (1e-6, [cos], [sin], dtype, round_first)
            cases = {
                "real": (
                    norm_rope.norm_rope_real([x], [weight], *args),
                    norm_rope.reference(x, weight, 1e-6, cos, sin, dtype, round_first),
                ),
                "complex": (
                    norm_rope.norm_rope_complex([x], [weight], 1e-6, [pairs], dtype, round_first),
                    norm_rope.reference(x, weight, 1e-6, pairs.flatten(-2), None, dtype, round_first),
                ),
                "two parts": (
                    norm_rope.norm_rope_real([text, image], [text_weight, weight], *args),
                    torch.cat([norm_rope.reference(t, w, 1e-6, c, s, dtype, round_first) for t, w, c, s in parts], 1),
                ),
            }
            for form, (got, expected) in cases.items():
                expected = expected.float()
                far = (got.float() - expected).abs() > step * expected.abs().amax(-1, keepdim=True)
                equal = (got.float() == expected).float().mean().item()
                print(f"norm_rope {form} {dtype} round_first={round_first}: {equal:.4f} equal to the reference")
                assert not far.any(), (form, dtype, round_first, far.float().mean().item())
    low_precision_blocks_match_eager(Options(attention="fa3-fp8", fa3_kernel=FA3_KERNEL, fp8="off", norm_rope="on"))


def test_the_row_fp8_kernel_matches_its_reference_at_fluxs_shape():
    """row_fp8.py's kernel at FLUX.1-dev's single block, `proj_out`'s input: the attention output (1 x 4608 x
    3072, a view of a wider tensor) and the MLP's GEMM product (1 x 4608 x 12288) with `row-after`'s row and
    column scales and bias, then the tanh GELU, joined; and the MLP's output alone (the double block's).
    Against its torch reference: each row's scale within a bf16 step (the GPU's tanh is `tanh.approx.f32`,
    the reference's torch's), each FP8 entry within one FP8 step (2^-3) of its row's largest, an all-zero
    row NaN unfloored (torchao's 0 / 0) and 0 floored; then the wide pipeline's blocks compiled with the
    kernel at both row-wise granularities against eager."""
    from aot import row_fp8

    torch.manual_seed(0)
    attention = (torch.randn(1, 4608, 3 * 3072, device="cuda") * 3).bfloat16()[..., :3072]
    product = (torch.randn(1, 4608, 12288, device="cuda") * 50).bfloat16()
    r = torch.rand(1, 4608, 1, device="cuda") * 0.1 + 0.01
    c, b = (torch.rand(12288, device="cuda") + 0.5).bfloat16(), torch.randn(12288, device="cuda").bfloat16()
    attention[0, 0], product[0, 0] = 0, 0
    cases = {
        "proj_out, row-after": (([attention, product], [None, r], [None, c], [None, b], [False, True]), True),
        "proj_out, row": (([attention, product], [None] * 2, [None] * 2, [None] * 2, [False, True]), False),
        "MLP out, row": (([product], [None], [None], [None], [True]), False),
    }
    for name, (args, floor) in cases.items():
        data, scale = row_fp8.row_quantize(*args, floor)
        expected, expected_scale = row_fp8.reference(*args, floor)
        assert ((scale - expected_scale).abs() <= 2**-8 * expected_scale).all(), name
        rows = expected_scale.squeeze(-1) > 0
        far = (data.float() - expected.float()).abs() > 2**-3 * expected.float().abs().amax(-1, keepdim=True)
        equal = (data.float() == expected.float())[rows].float().mean().item()
        print(f"row_fp8 {name}: {equal:.4f} equal to the reference")
        assert not far[rows].any(), (name, far[rows].float().mean().item())
        zero = data[0, 0].float()
        if not rows[0, 0]:
            assert bool((zero == 0).all() if floor else zero.isnan().all()), name
    for granularity in ("row", "row-after"):
        options = Options(attention="sdpa", fp8="on", fp8_granularity=granularity, row_fp8="on")
        low_precision_blocks_match_eager(options)


def low_precision_blocks_match_eager(options: Options, sizes=((1024, 768),)) -> None:
    """The wide pipeline's blocks compiled with the attention `options` asks for (FP8 attention: held
    to the FP8 bound) against its eager images at each of `sizes`."""
    pipe = wide_pipeline()
    expected = [images(pipe, size) for size in sizes]
    compiled = compile_blocks(*decided(pipe, options))
    assert compiled.decisions[1].value == options.attention, compiled.decisions[1]
    print({name: f"{p.rel_error:.2e}" for name, p in compiled.packages.items()})
    patch_blocks_(pipe, compiled)
    for size, reference in zip(sizes, expected, strict=True):
        error = rel_error(images(pipe, size), reference)
        print(f"{options.attention} images at {size} vs eager: {error:.2e}")
        assert error < FP8_MAX_REL_ERROR, f"{options.attention} compiled vs eager SDPA at {size}: {error:.2e}"


def test_fa3_with_chromas_mask_folded_matches_masked_sdpa():
    """Chroma's mask (diffusers 0.42: its padding mask times itself, added to the scores) folded into
    the head dim (128 + 8: FA3's 192 kernel) at Chroma's 1024x1024 attention shape, against SDPA
    given the mask."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from aot.attention import attention_backend
    from aot.fa3 import load_fa3

    load_fa3(FA3_KERNEL)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tokens = torch.ones(1, 4608, device="cuda", dtype=torch.bfloat16)
    tokens[0, 100:512] = 0  # a 100-token prompt padded to 512
    mask = tokens[:, None, None, :] * tokens[:, None, :, None]
    reference = dispatch_attention_fn(q, k, v, attn_mask=mask)  # diffusers' default: SDPA
    with attention_backend("fa3"):
        out = dispatch_attention_fn(q, k, v, attn_mask=mask)
    error, unmasked = rel_error(out, reference), rel_error(dispatch_attention_fn(q, k, v), reference)
    print(f"fa3 with the mask folded vs masked SDPA: {error:.2e} (unmasked: {unmasked:.2e})")
    assert error < MAX_REL_ERROR < unmasked


def test_auto_attention_is_fa3_fp8_and_falls_back_to_fa3_where_attention_is_too_sharp():
    """Hopper's plan tries FP8 attention first, held to `FP8_ATTENTION_MAX_REL_ERROR` on each class's
    eager block. With the query and key norms' weights x16 (every logit x256: each query reads about
    one key), FP8's rounding of the logits moves the blocks beyond it, and bf16 FA3 is compiled."""
    pipe = wide_pipeline()
    options = Options(fa3_kernel=FA3_KERNEL, fp8="off")
    attention = compile_blocks(*decided(pipe, options)).decisions[1]
    assert attention.value == "fa3-fp8", attention
    for name, module in pipe.transformer.named_modules():
        if name.rsplit(".", 1)[-1] in NORMS:
            module.weight.data *= 16
    attention = compile_blocks(*decided(pipe, options)).decisions[1]
    print(attention)
    assert attention.value == "fa3", attention
    assert "fa3-fp8 failed its trial" in attention.reason
    assert "fa3-fp8 attention moves the eager block" in attention.reason


def test_fp8_blocks_stay_close_to_bf16():
    pipe = wide_pipeline()
    expected = images(pipe)
    compiled = compile_blocks(*decided(pipe, Options(attention="sdpa", fp8="on")))
    assert all(p.fp8 for p in compiled.packages.values()), compiled.decisions[2]
    assert all(p.rel_error < FP8_MAX_REL_ERROR for p in compiled.packages.values())
    patch_blocks_(pipe, compiled)
    actual = images(pipe)
    assert torch.isfinite(actual).all()
    error = rel_error(actual, expected)
    assert error < FP8_MAX_REL_ERROR, f"FP8 compiled vs bf16 eager: {error:.2e}"


def test_row_wise_fp8_runs_a_text_mlp_at_a_short_prompt():
    """Qwen-Image's text MLP (3072 -> 12288 -> 3072, biases) at 1..32 text tokens, quantized row-wise
    by `quantize_block_` with the rows its calls saw: with the bias in the GEMM cuBLASLt refuses it
    at 12288 -> 3072 (CUBLAS_STATUS_NOT_SUPPORTED, H200, 2026-12-03); `BiasAfterGEMM` runs it, close
    to bf16. The same MLP fed only image tokens (4096 rows) keeps the bias in the GEMM, and runs."""
    from aot.fp8 import BiasAfterGEMM, fewest_rows, quantize_block_

    torch.manual_seed(0)

    def mlp():
        layers = torch.nn.Sequential(torch.nn.Linear(3072, 12288), torch.nn.GELU("tanh"), torch.nn.Linear(12288, 3072))
        return layers.to("cuda", torch.bfloat16)

    text, image = mlp(), mlp()
    x = torch.randn(1, 4096, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        with fewest_rows(text) as text_rows:
            references = {rows: text(x[:, :rows]) for rows in (1, 14, 32)}
        assert text_rows == {"0": 1, "2": 1}
        assert quantize_block_(text, "row", text_rows) == (2, 0)
        assert type(text[2]) is BiasAfterGEMM
        for rows, reference in references.items():
            assert rel_error(text(x[:, :rows]), reference) < FP8_MAX_REL_ERROR

        with fewest_rows(image) as image_rows:
            reference = image(x)
        assert quantize_block_(image, "row", image_rows) == (2, 0)
        assert type(image[2]) is not BiasAfterGEMM and image[2].bias is not None
        assert rel_error(image(x), reference) < FP8_MAX_REL_ERROR


def test_row_scales_after_the_gemm_match_cublas_row_wise_gemm():
    """`RowScalesAfterGEMM` (sm_120's row-wise FP8: a unit-scaled GEMM, the scales after it) against
    cuBLAS's row-wise scaled GEMM on the same FP8 values, which Hopper runs: they differ by the product's
    second bf16 rounding only. FLUX.1-dev's MLP widths, 4096 rows of activations whose scales span 1e-3 to 1e3."""
    from aot.fp8 import RowScalesAfterGEMM, quantize_block_

    torch.manual_seed(0)
    row, after = (torch.nn.Sequential(torch.nn.Linear(3072, 12288), torch.nn.Linear(12288, 3072)) for _ in range(2))
    after.load_state_dict(row.state_dict())
    row, after = row.to("cuda", torch.bfloat16), after.to("cuda", torch.bfloat16)
    assert quantize_block_(row, "row") == quantize_block_(after, "row-after") == (2, 0)
    assert type(after[0]) is RowScalesAfterGEMM and type(row[0]) is torch.nn.Linear
    magnitudes = 10.0 ** torch.linspace(-3, 3, 4096, device="cuda").reshape(1, 4096, 1)
    for layer, width in ((0, 3072), (1, 12288)):
        x = (torch.randn(1, 4096, width, device="cuda") * magnitudes).to(torch.bfloat16)
        with torch.no_grad():
            expected, actual = row[layer](x).float(), after[layer](x).float()
        per_row = (actual - expected).norm(dim=-1) / expected.norm(dim=-1)
        assert per_row.max() < 5e-3, f"layer {layer}: {per_row.max():.2e}"


def test_a_cuda_packages_tanh_gelu_runs_the_tanh_instruction_within_its_bound():
    """In a CUDA package `gelu.tanh_approx` is PTX's tanh.approx.f32, at most 2^-11 of tanh off (PTX ISA):
    a float32 GELU stays within 0.5 |x| 2^-11 plus float32 rounding of torch's, which uses libdevice's tanhf.
    Were the package's tanh libdevice's too (within 2 ulp), only the rounding would part them, under 2e-6 for
    |x| <= 12 (a float32 ulp of 12 is 9.5e-7); the instruction's own error (about 1e-5 of tanh,
    `gelu.TANH_APPROX_PTX`) shows through: 5.5e-6 at most on an H100 (2026-12-06)."""
    from aot.lowering import compile_package
    from aot.runner import bind

    module = torch.nn.GELU("tanh")
    x = torch.linspace(-12, 12, 1 << 20, device="cuda")
    runner, _ = bind(compile_package(torch.export.export(module, (x,))), module)
    error = (runner(x) - module(x)).abs()
    bad = error > 0.5 * x.abs() * 2**-11 + 2e-6
    assert not bad.any(), f"x {x[bad][:4].tolist()}: off by {error[bad][:4].tolist()}"
    assert error.max() > 3e-6, f"{error.max():.2e}: libdevice's tanhf ran, not the instruction"


class MinMax(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.maximum(x, y), torch.minimum(x, y), x.clamp(-1, 1), torch.relu(y), x.abs().amax(-1)


@pytest.mark.parametrize("width", [4096, 20000])
def test_a_cuda_packages_min_and_max_propagate_nan_and_infinities_as_eager(width):
    """`lowering.native_min_max`: Triton's native min/max in a package give eager's values, NaN where
    eager's is NaN, infinities clamped, in elementwise min/max, clamp, ReLU and a row's abs-max: a
    persistent reduction at 4096 wide, a looped one (whose step is a native max) past
    `lowering.PERSISTENT_ROW_MAX`."""
    from aot.lowering import compile_package
    from aot.runner import bind

    torch.manual_seed(0)
    x, y = torch.randn(2, 64, width, device="cuda"), torch.randn(2, 64, width, device="cuda")
    x[0, 3, 7], y[0, 5, 9], x[1, 2, :3], y[1, 4, 1] = float("nan"), float("nan"), float("inf"), float("-inf")
    x[1, 6, 0] = y[1, 6, 0] = float("nan")
    module = MinMax()
    runner, _ = bind(compile_package(torch.export.export(module, (x, y))), module)
    wanted = module(x, y)
    for got, want in zip(runner(x, y), wanted, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert wanted[0].isnan().sum() == 3 and wanted[4].isnan().sum() == 2  # so NaN was there to keep


def test_zerogpu_cards_plan_forced_on_this_gpu_times_sage_and_runs_row_scales_after_the_gemm():
    """sm_120 (ZeroGPU's RTX Pro 6000) cannot run FA3 or cuBLAS's row-wise scaled FP8; its plan tries
    sage, kept only where it beats SDPA here (on an H100, cuDNN's bf16 kernel is the faster:
    BENCHMARKS.md), then SDPA, with row-wise FP8 whose scales are applied after the GEMM."""
    pipe = wide_pipeline()
    expected = images(pipe)
    compiled = compile_blocks(*decided(pipe, Options(plan="12.0", fa3_kernel=FA3_KERNEL)))
    plan, attention, fp8, *_ = compiled.decisions
    print(attention)
    assert (plan.value, fp8.value) == ("sm_120", "row-after"), compiled.decisions
    assert attention.value in ("sage", "sdpa"), compiled.decisions
    assert "ms a call against SDPA's" in attention.reason
    assert attention.value == "sage" or "sage failed its trial (RuntimeError: sage: " in attention.reason
    assert all(p.fp8 == "row-after" for p in compiled.packages.values())
    patch_blocks_(pipe, compiled)
    error = rel_error(images(pipe), expected)
    assert error < FP8_MAX_REL_ERROR, f"sm_120 plan compiled vs bf16 eager: {error:.2e}"


def test_sage_kernel_computes_its_8_bit_arithmetic_and_stays_near_sdpa():
    """The op on 64 keys (one step of any config: one running max) against the same arithmetic in
    float64: INT8 Q·K^T exact, P rounded to e4m3 after `P_SCALE`, V as FP8; then the whole kernel at
    FLUX.1-dev's 1024x1024 shape and at a ragged grouped-query shape against float32 SDPA."""
    from aot.sage import P_SCALE, quantize_per_head, quantize_per_token, sage_attention, sage_forward, tokens_innermost

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 128, device="cuda", dtype=torch.bfloat16) for n in (300, 64, 64))
    (qi, qs), (ki, ks), (v8, vd) = quantize_per_token(q), quantize_per_token(k), quantize_per_head(v)
    scale = 128**-0.5
    out = sage_forward(qi, ki, tokens_innermost(v8), qs, ks, vd, scale).double()
    logits = torch.einsum("bqhd,bkhd->bhqk", qi.double(), ki.double()) * qs.transpose(1, 2)[..., None].double()
    logits = logits * ks.transpose(1, 2)[:, :, None, :].double() * scale * 1.4426950408889634
    p = torch.exp2(logits - logits.amax(-1, keepdim=True))
    p8 = (p * P_SCALE.value).float().to(torch.float8_e4m3fn).double() / P_SCALE.value
    expected = torch.einsum("bhqk,bkhd->bqhd", p8, v8.double()) * vd[:, None, :, None].double()
    expected = expected / p.sum(-1).transpose(1, 2)[..., None]
    arithmetic = rel_error(out, expected)
    errors = {}
    for shape_q, shape_k in (((1, 4608, 24, 128), (1, 4608, 24, 128)), ((2, 1000, 8, 64), (2, 777, 2, 64))):
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(shape_k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.float().transpose(1, 2) for t in (q, k, v)), enable_gqa=True
        ).transpose(1, 2)
        errors[shape_k] = rel_error(sage_attention(q, k, v).float(), ref)
    print(f"sage op vs its arithmetic in float64: {arithmetic:.2e}; vs float32 SDPA: {errors}")
    assert arithmetic < 4e-3  # the output's bf16 rounding (2^-9) and float32 sums
    assert all(error < FP8_MAX_REL_ERROR for error in errors.values()), errors


def test_sage_blocks_compile_into_packages_and_match_eager():
    """`attention=sage` asked for: no timing, the blocks compiled with the kernel in their packages
    (the exported graph calls `aot_sage::forward`: `_compile_class` checks) against eager SDPA, at a
    size whose token count V needs no padding for and at one it does (1040x1040: 4225 image tokens)."""
    low_precision_blocks_match_eager(Options(attention="sage", fp8="off"), sizes=((1024, 768), (1040, 1040)))


def test_fp32_pipeline_falls_back_to_sdpa():
    # FlashAttention has no fp32 kernels; auto must say so instead of crashing in the kernel.
    from aot.plans import resolve_attention

    pipe = wide_pipeline(torch.float32)
    decision = resolve_attention(Options(fa3_kernel=FA3_KERNEL), pipe.transformer, torch.device("cuda"))
    assert (decision.value, decision.reason) == (
        "sdpa",
        "auto: FA3 supports bfloat16/float16, the transformer is torch.float32",
    )


def test_cuda_graph_replays_match_plain_steps():
    # Replays must compute what a plain step computes, for each size and after switching sizes.
    from conftest import optimize

    from aot.blocks import unpatch_forward
    from aot.graphs import GraphedStep

    pipe = wide_pipeline()
    report = optimize(pipe, Options(attention="sdpa", fp8="off", cuda_graphs="on"))
    assert report.decisions[-1].value == "on", report.decisions[-1]
    graphed = pipe.transformer.forward
    assert isinstance(graphed, GraphedStep)
    sizes = [(1024, 768), (512, 512), (1024, 768)]
    replayed = [generate(pipe, *size, steps=3).float() for size in sizes]
    assert len(graphed.graphs) == 2 and graphed.failed is None, graphed.failed
    assert unpatch_forward(pipe.transformer, GraphedStep) is graphed  # plain steps from here
    for size, actual in zip(sizes, replayed, strict=True):
        error = rel_error(actual, generate(pipe, *size, steps=3).float())
        assert error < 1e-3, f"{size}: graph replay vs plain step {error:.2e}"


def test_a_checked_shape_is_captured_again_without_a_check_replay():
    # graphs.VERIFIED: a new GraphedStep (on ZeroGPU: a later worker, which inherits the set) captures
    # a shape already checked without replaying it against the step, and still matches plain steps.
    from conftest import optimize

    from aot.blocks import unpatch_forward
    from aot.costs import COSTS
    from aot.graphs import VERIFIED, GraphedStep, graph_step_

    pipe = wide_pipeline()
    optimize(pipe, Options(attention="sdpa", fp8="off", cuda_graphs="on"))
    VERIFIED.clear()
    checks, captures = COSTS.checks, COSTS.captures
    generate(pipe, 1024, 768, steps=3)
    assert (COSTS.checks - checks, COSTS.captures - captures) == (1, 1)
    unpatch_forward(pipe.transformer, GraphedStep)
    graph_step_(pipe.transformer)
    replayed = generate(pipe, 1024, 768, steps=3).float()
    assert (COSTS.checks - checks, COSTS.captures - captures) == (1, 2), "the second capture replayed a check"
    step = unpatch_forward(pipe.transformer, GraphedStep)
    assert step.failed is None and len(step.graphs) == 1, step.failed
    error = rel_error(replayed, generate(pipe, 1024, 768, steps=3).float())
    assert error < 1e-3, f"graph replay without a check vs plain step {error:.2e}"


def test_a_step_that_gives_nan_is_not_captured_and_leaves_graphs_on():
    # One request whose step is NaN (the check replay could never match it) must not switch CUDA
    # graphs off for every later request: that shape is captured at its next finite call.
    from conftest import optimize

    from aot.blocks import unpatch_forward
    from aot.graphs import GraphedStep, graph_step_
    from tools.bench import step_inputs

    pipe = wide_pipeline()
    optimize(pipe, Options(attention="sdpa", fp8="off", cuda_graphs="off"))
    inputs = step_inputs(pipe, 512)  # a pipeline call: through a GraphedStep it would capture this shape
    graphed = graph_step_(pipe.transformer)
    with torch.no_grad():
        nan = pipe.transformer(**{**inputs, "hidden_states": torch.full_like(inputs["hidden_states"], float("nan"))})
        assert not torch.isfinite(nan[0]).all()
        assert graphed.failed is None and not graphed.graphs
        pipe.transformer(**inputs)
    assert graphed.failed is None and len(graphed.graphs) == 1, graphed.failed
    replayed = generate(pipe, 512, 512, steps=3).float()
    unpatch_forward(pipe.transformer, GraphedStep)
    error = rel_error(replayed, generate(pipe, 512, 512, steps=3).float())
    assert error < 1e-3, f"graph replay vs plain step {error:.2e}"


def test_lora_switching_on_fa3_fp8_blocks_matches_eager_lora_and_restores_the_base_exactly(tmp_path):
    # One transformer step on fixed inputs, the LoRA at scale 4: at scale 1 it moved this random
    # 2+2-block step by 1.8e-2 (H200, 2026-12-01), too close to FP8's own 7e-3 to tell "applied"
    # (error ~ FP8's) from "ignored" (error ~ the LoRA's effect); 2-step latents hid it further.
    from conftest import optimize

    from aot import lora, lora_specs
    from aot.fp8 import fp8_config
    from tools.bench import random_lora, step_inputs

    pipe = wide_pipeline()
    source = tmp_path / "lora.safetensors"
    random_lora(pipe, source)  # rank 16, every attention and MLP layer of the blocks
    inputs = step_inputs(pipe, 1024)

    def step():
        with torch.no_grad():
            return pipe.transformer(**inputs)[0].float()

    base = step()
    pipe.load_lora_weights(str(source), adapter_name="random")
    pipe.set_adapters(["random"], adapter_weights=[4.0])
    expected = step()  # eager bf16 + peft's LoRA layers
    pipe.unload_lora_weights()
    effect = rel_error(expected, base)
    report = optimize(pipe, Options(fa3_kernel=FA3_KERNEL, fp8="on"))  # attention auto: FP8 attention on Hopper
    assert "attention: fa3-fp8, fp8: row, text_fp8: off, cuda_graphs: on" in report.summary(), report
    adapters = lora.Adapters(pipe, [lora_specs.LoraSpec("random", str(source), scale=4.0)], fp8_config("row"))
    layers = [m for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    before = [{n: t.clone() for n, t in lora.inner_tensors(m.weight).items()} for m in layers]
    fp8_error = rel_error(step(), base)  # captures the step's CUDA graph: the switch must reach replays
    adapters.use("random")
    error = rel_error(step(), expected)
    print(f"LoRA effect {effect:.2e}; FP8 compiled vs eager: base {fp8_error:.2e}, with the LoRA {error:.2e}")
    assert error < effect / 4 and error < 2 * fp8_error, "the replayed graph runs the LoRA, within FP8 error"
    adapters.use(None)
    for layer, saved in zip(layers, before, strict=True):
        assert all(torch.equal(t, saved[n]) for n, t in lora.inner_tensors(layer.weight).items())
    assert rel_error(step(), base) == pytest.approx(fp8_error, rel=1e-3), "the base is back"


def test_zerogpu_space_compiles_in_the_worker_with_fa3_fp8_and_cuda_graphs(tmp_path):
    """The whole ZeroGPU flow on the GPU, nothing stood in: the real spaces package in ZeroGPU
    mode, zerogpu_harness.py's device API, FLUX.1-dev-width blocks, every fast path `auto`."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError
    from PIL import Image

    folder = tmp_path / "wide-flux"
    wide_pipeline().save_pretrained(folder)
    torch.cuda.empty_cache()
    env = {"MODEL_ID": str(folder), "AOT_FA3_KERNEL": FA3_KERNEL}
    app = ZeroGPUSpace(env, tmp_path / "app.log")
    try:
        app.wait_until_serving()
        log = app.text()
        assert "GPU granted for 1500 s, worker new" in log
        assert "attention: fa3-fp8, fp8: row, text_fp8: on, cuda_graphs: on" in log, log[-3000:]

        def request(seed=5, steps=4):
            path, _, _ = Client(app.url, verbose=False).predict(
                "a red fox", seed, False, 1024, 768, steps, 3.5, api_name="/generate"
            )
            return np.asarray(Image.open(path)).astype(float)

        images = [request() for _ in range(3)]
        assert app.device("/status")["allow"] == 2, "startup worker + one worker for three requests"
        app.device("/reclaim", "POST")
        images.append(request())  # a new worker: weights moved, blocks bound, graph captured again
        assert app.device("/status")["allow"] == 3
        app.device("/abort-next?after=0.1", "POST")  # 0.1 s into the next call: mid-request
        with pytest.raises(AppError, match="GPU task aborted"):
            request(steps=50)
        images.append(request())
        assert images[0].std() > 1, "a flat image"
        for image in images[1:]:
            assert np.abs(image - images[0]).max() <= 2, "the same request gave another image"
        assert "CUDA graphs off" not in app.text() and "Traceback" not in app.text(), app.text()[-3000:]
    finally:
        app.stop()
