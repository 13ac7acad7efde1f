"""Each head's RMS norm and RoPE in norm_rope.py's Triton kernel, on a CPU: its torch reference against
diffusers' own ops, the kernel run by Triton's interpreter, the kernel compiled ahead for the GPUs the
plans serve, the graph rewrite on the tiny families' blocks, and packages compiled with it against eager.
test_gpu.py runs the kernel on a GPU."""

import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
import triton
from conftest import ROOT, TOLERANCE, decided, load_tiny, tiny_options
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aot import norm_rope
from aot.apply import patch_blocks_
from aot.attention import attention_backend
from aot.blocks import rel_error, repeated_blocks
from aot.export import _capture_classes, compile_blocks, export_block
from aot.lowering import decomposed
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.plans import PLANS, resolve_norm_rope
from aot.target import Target

aten = torch.ops.aten
OPS = (torch.ops.aot_rope.norm_rope_real.default, torch.ops.aot_rope.norm_rope_complex.default)
NORM_ROPE = frozenset({"norm_rope"})  # what `Trials.ours` holds where the kernel is on


def heads(seq: int = 37, heads: int = 3, head_dim: int = 32, batch: int = 2, seed: int = 0):
    """x (batch, seq, heads, head_dim) bf16, a view of a GEMM's output whose rows start 16 bytes into it;
    a norm weight; RoPE's factors in the real form (cos, sin an entry) and the complex form (f a pair)."""
    torch.manual_seed(seed)
    out = torch.randn(batch, seq, heads * head_dim + 8, dtype=torch.bfloat16) * 3
    x = out[..., 8:].unflatten(-1, (heads, head_dim))
    weight = (torch.rand(head_dim) + 0.5).to(torch.bfloat16)
    angles = torch.randn(seq, head_dim) * 10  # one an entry, where diffusers repeats each pair's: any will do
    cos, sin = (t[None, :, None] for t in (angles.cos(), angles.sin()))
    pairs = angles[:, ::2]
    return x, weight, cos, sin, torch.polar(torch.ones_like(pairs), pairs)[:, None]


def two_parts():
    """Text and image heads as two parts of one joint sequence, each with a norm weight of its own: the
    real form with the joint sequence's factors (FLUX's double block), the complex one with each part's
    (Qwen-Image's). form -> (the ops' output, the `cat` of the reference of each part, the same with the
    parts' weights swapped)."""
    x, weight, cos, sin, f = heads()
    text, image = x[:, :5], x[:, 5:]
    other = (2 - weight.float()).to(weight.dtype)
    pairs = torch.view_as_real(f).flatten(-2)
    per_part = [pairs[:5], pairs[5:]]

    def cat(weights, factors):
        parts = zip((text, image), weights, factors, strict=True)
        return torch.cat([norm_rope.reference(t, w, 1e-6, *fs, torch.bfloat16, True) for t, w, fs in parts], 1)

    real = norm_rope.norm_rope_real([text, image], [other, weight], 1e-6, [cos], [sin], torch.bfloat16, True)
    joint = [(cos[:, :5], sin[:, :5]), (cos[:, 5:], sin[:, 5:])]
    complex_ = norm_rope.norm_rope_complex(
        [text, image], [other, weight], 1e-6, [p.unflatten(-1, (-1, 2)) for p in per_part], torch.bfloat16, True
    )
    each = [(p, None) for p in per_part]
    return {
        "real": (real, cat((other, weight), joint), cat((weight, other), joint)),
        "complex": (complex_, cat((other, weight), each), cat((weight, other), each)),
    }


def test_the_reference_is_diffusers_rope_of_each_norm_to_the_bit():
    """torch's RMSNorm then `apply_rotary_emb` (FLUX), diffusers' RMSNorm then Qwen-Image's complex
    RoPE, and both followed by `fa3.unit_scaled`'s FP8 cast: the reference computes the same bits."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    from aot.fa3 import unit_scaled

    x, weight, cos, sin, f = heads()
    torch_norm, diffusers_norm = torch.nn.RMSNorm(32, eps=1e-6), RMSNorm(32, eps=1e-6)
    for norm in (torch_norm, diffusers_norm):
        norm.to(torch.bfloat16).weight.data.copy_(weight)
    with torch.no_grad():
        real = apply_rotary_emb(torch_norm(x), (cos[0, :, 0], sin[0, :, 0]), sequence_dim=1)
        complex_ = apply_rotary_emb_qwen(diffusers_norm(x), f[:, 0], use_real=False)
    pairs = torch.view_as_real(f).flatten(-2)
    assert not torch.equal(real, complex_)  # the two norms round differently
    for dtype, cast in ((torch.bfloat16, lambda t: t), (torch.float8_e4m3fn, unit_scaled)):
        got = norm_rope.reference(x, weight, 1e-6, cos, sin, dtype, round_first=False)
        assert torch.equal(got.float(), cast(real).float()), dtype
        got = norm_rope.reference(x, weight, 1e-6, pairs, None, dtype, round_first=True)
        assert torch.equal(got.float(), cast(complex_).float()), dtype


INTERPRETED = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_norm_rope import heads, two_parts
from aot import norm_rope
x, weight, cos, sin, f = heads()
pairs = torch.view_as_real(f)
errors = {}
for dtype in (torch.bfloat16, torch.float8_e4m3fn):
    for round_first in (False, True):
        for form in ("real", "complex"):
            if form == "real":
                got = norm_rope.norm_rope_real([x], [weight], 1e-6, [cos], [sin], dtype, round_first)
                ref = norm_rope.reference(x, weight, 1e-6, cos, sin, dtype, round_first)
                turned = norm_rope.reference(x, weight, 1e-6, cos, -sin, dtype, round_first)
            else:
                got = norm_rope.norm_rope_complex([x], [weight], 1e-6, [pairs], dtype, round_first)
                ref = norm_rope.reference(x, weight, 1e-6, pairs.flatten(-2), None, dtype, round_first)
                other_way = torch.view_as_real(f.conj().resolve_conj()).flatten(-2)
                turned = norm_rope.reference(x, weight, 1e-6, other_way, None, dtype, round_first)
            bound = (2**-3 if dtype == torch.float8_e4m3fn else 2**-5) * ref.float().abs().amax(-1, keepdim=True)
            over = lambda t: ((t.float() - ref.float()).abs() > bound).float().mean().item()
            errors[f"{dtype} {round_first} {form}"] = [over(got), over(turned), list(got.shape), got.is_contiguous()]
for form, (got, ref, swapped) in two_parts().items():
    bound = 2**-5 * ref.float().abs().amax(-1, keepdim=True)
    over = lambda t: ((t.float() - ref.float()).abs() > bound).float().mean().item()
    errors[f"two parts {form}"] = [over(got), over(swapped), list(got.shape), got.is_contiguous()]
print(json.dumps(errors))
"""


def test_the_kernel_run_by_tritons_interpreter_matches_its_reference_within_its_roundings():
    """The kernel's code run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, read when the module
    is imported: a process of its own): both forms, both norms' roundings, bf16 and FP8 out, rows that
    start 16 bytes into a GEMM's output, a row count that is no multiple of a program's rows. Triton 3.6's
    interpreter rounds a float32 to bf16 toward zero (a GPU rounds to nearest), up to three times an entry,
    so each entry is within four bf16 steps of its row's largest (2^-7 each, 2^-5 in all), where rotating the
    other way leaves most entries beyond. In FP8, within a step of it (2^-3), but for about 0.5% of the
    entries, which the interpreter rounds a binade too low (sage's test says why), and most of the other way.
    Two parts of one joint sequence (`two_parts`) are each part's reference, joined, where most entries of
    the reference with the parts' weights swapped are beyond."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", INTERPRETED, str(ROOT / "tests")]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.splitlines()[-1])
    assert len(errors) == 10
    for case, (over, turned, shape, contiguous) in errors.items():
        assert shape == [2, 37, 3, 32] and contiguous, case
        assert over <= (0.01 if "float8" in case else 0) and turned > 0.5, (case, over, turned)


def test_the_kernel_refuses_what_it_cannot_read():
    x, weight, cos, sin, f = heads()
    cases = [
        (x[..., :24], "head dim must be a power of two"),
        (x.flatten(-2)[..., 1:33].unflatten(-1, (1, 32)), "must start 16-byte aligned"),
        (x.float(), "weight must be"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            norm_rope.norm_rope_real([bad], [weight if bad.shape[-1] == 32 else None], 1e-6, [cos], [sin], bad.dtype)
    with pytest.raises(ValueError, match="do not broadcast"):
        norm_rope.norm_rope_real([x], [weight], 1e-6, [cos[:, :5]], [sin[:, :5]], torch.bfloat16)
    with pytest.raises(ValueError, match="output dtype"):
        norm_rope.norm_rope_real([x], [weight], 1e-6, [cos], [sin], torch.int8)
    text, image = x[:, :5], x[:, 5:]
    parts = [
        ([text, image], [weight, None], "every part's norm has a weight or none"),
        ([text, image[:, :, :2]], [weight, weight], "share dtype, batch, heads and head dim"),
        ([text, image.float()], [weight, weight.float()], "share dtype"),
        ([text, image, x], [weight] * 3, "one or two parts"),
    ]
    for xs, weights, message in parts:
        with pytest.raises(ValueError, match=message):
            norm_rope.norm_rope_real(xs, weights, 1e-6, [cos], [sin], torch.bfloat16)
    with pytest.raises(ValueError, match="do not broadcast"):  # each part's factors, given the joint's
        norm_rope.norm_rope_real([text, image], [weight] * 2, 1e-6, [cos] * 2, [sin] * 2, torch.bfloat16)
    for short in (cos[:, 5:], torch.cat([cos, cos[:, :1]], 1)):  # the joint's factors span its 37 tokens exactly
        with pytest.raises(ValueError, match="do not span the parts' joint sequence"):
            norm_rope.norm_rope_real([text, image], [weight] * 2, 1e-6, [short], [short], torch.bfloat16)
    with pytest.raises(ValueError, match="cos and sin must come alike"):
        norm_rope.norm_rope_real([text, image], [weight] * 2, 1e-6, [cos[:, :5], cos[:, 5:]], [sin], torch.bfloat16)
    with pytest.raises(ValueError, match="each factor must be float32"):
        norm_rope.norm_rope_real([x], [weight], 1e-6, [torch.tensor(1.0)], [torch.tensor(0.0)], torch.bfloat16)
    with pytest.raises(ValueError, match="pairs must be"):
        norm_rope.norm_rope_complex([x], [weight], 1e-6, [torch.ones(32)], torch.bfloat16)


def _compiled(capability: int, complex_: bool, align: int, joined: bool = False) -> str:
    """The kernel's PTX for compute capability `capability` (e.g. 90), its arguments typed as a FLUX block's
    package passes them: bf16 x, float32 factors, FP8 out from the real form; the pointers and static strides
    multiples of 16 (AOTInductor says so), x's batch strides, which follow the token count, not; x's rows
    said to start `align` entries apart; in two parts where `joined`."""
    fn = norm_rope._norm_rope_kernel
    constants = {"HEAD_DIM": 128, "HAS_WEIGHT": True, "ROUND_FIRST": complex_, "COMPLEX": complex_, "ALIGN_F": 4}
    constants.update(SATURATE=not complex_, ALIGN_X=align, JOINED=joined, **norm_rope.CONFIG.kwargs)
    kinds = {"X": "*bf16", "W": "*bf16", "C": "*fp32", "S": "*fp32"}
    types = {f"{name}{part}": kind for name, kind in kinds.items() for part in ("", "2")}  # the second part's too
    types["Out"] = "*bf16" if complex_ else "*fp8e4nv"
    types["eps"] = "fp64"  # AOTInductor passes a Python float as fp64
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    divisible = [n for n in fn.arg_names if n in types or n.startswith("stride")]
    divisible = [n for n in divisible if n not in ("eps", "stride_xb", "stride_x2b")]
    source = ASTSource(
        fn,
        signature,
        constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()},
        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible},
    )
    options = {"num_warps": norm_rope.CONFIG.num_warps}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("capability", [90, 120])
def test_the_kernel_compiles_to_16_byte_loads_for_hopper_and_zerogpus_card(capability):
    """Triton compiles the kernel ahead for GPUs this machine does not have (ptxas ships with it). Every
    load of x and of the factors is 16 bytes wide, the weights' 4, no arithmetic is in fp64, and the clamp
    before the FP8 cast keeps NaN (PTX's `.NaN` min and max; plain ones would turn it into -448). Without
    being told that x's rows are aligned, the compiler loads x two bytes at a time: the L1-bound reads
    Inductor's own kernel makes (BENCHMARKS.md, "Pair rotations flipped"). One part reads the first part's
    arguments alone, with no pointer chosen between parts (`selp.b64`): the code it had before parts; two
    parts load one more weight and choose each row's pointers."""
    for complex_, joined in itertools.product((False, True), (False, True)):
        ptx = _compiled(capability, complex_, align=8, joined=joined)
        loads = Counter(re.findall(r"ld\.global[\w.]*", ptx))
        assert loads == {"ld.global.v4.b32": 3 if complex_ else 5, "ld.global.b32": 1 + joined}, loads
        assert len(re.findall(r"selp\.b64", ptx)) == joined * (2 if complex_ else 3)  # x's, and the factors'
        assert not re.search(r"\b(mul|fma|add|sub|rsqrt)[\w.]*\.f64", ptx)
        assert bool(re.search(r"cvt[\w.]*e4m3", ptx)) is not complex_  # the FP8 cast, in the real case here
        clamps = set(re.findall(r"\b(?:max|min)[\w.]*\.f32", ptx))  # a NaN stays NaN, as torch's clamp keeps it
        assert clamps == (set() if complex_ else {"max.NaN.f32", "min.NaN.f32"}), clamps
    told_nothing = Counter(re.findall(r"ld\.global[\w.]*", _compiled(capability, False, align=1)))
    assert told_nothing["ld.global.b16"] == 8, told_nothing


def test_torch_sees_that_the_kernel_writes_only_its_output(monkeypatch):
    """torch.export asks which inputs a user's Triton kernel mutates by compiling it to Triton's IR; where
    that fails it assumes all. Triton names the compile target after the active GPU driver, which a CPU
    machine lacks: a stand-in names an H100's here; nothing runs."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors

    class HopperTarget:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", HopperTarget())
    x, weight, cos, sin, _ = heads()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    arguments = dict(X=x, X2=x, W=weight, W2=weight, C=cos, C2=cos, S=sin, S2=sin, Out=out, rows=222, seq=37, seq1=37)
    arguments.update(heads=3, eps=1e-6)
    arguments.update({name: 1 for name in norm_rope._norm_rope_kernel.arg_names if name.startswith("stride")})
    arguments.update(HEAD_DIM=32, HAS_WEIGHT=True, ROUND_FIRST=False, COMPLEX=False, SATURATE=True, ALIGN_X=8)
    arguments.update(ALIGN_F=4, JOINED=False, **norm_rope.CONFIG.kwargs)
    assert identify_mutated_tensors(norm_rope._norm_rope_kernel, arguments, {}) == ["Out"]


def tiny_blocks(model: str, attention: str, dtype=torch.bfloat16):
    """Each repeated block class of the tiny pipeline `model` (a folder in assets/), in `dtype`, exported
    under `attention`: name -> (the exported program, its first captured inputs)."""
    options = Options(model=str(ROOT / "assets" / model), device="cpu", dtype=str(dtype).removeprefix("torch."))
    pipe = load_pipeline(options)
    classes = _capture_classes(pipe, repeated_blocks(pipe.transformer), Target.of(pipe, options))
    exported = {}
    for name, (block, inputs, contract, *_) in classes.items():
        with attention_backend(attention):
            exported[name] = export_block(block, inputs[0], contract), inputs[0]
    return exported


def calls(program: torch.export.ExportedProgram) -> Counter:
    return Counter(node.target for node in program.graph.nodes if node.op == "call_function")


def test_flux_blocks_under_fp8_attention_get_one_call_each_for_q_and_k(monkeypatch):
    """FLUX's blocks cast their rotated Q and K to FP8 for FA3 (`fa3.unit_scaled`): each norm, rotation and
    cast becomes one call writing FP8, and no norm or clamp is left. In the double block the call takes
    the text and image heads as two parts, each with its norm's weight, and writes them joined: of its
    three `cat`s of heads, V's is left."""
    from diffusers.models import attention_dispatch

    # Export calls no kernel (the op's fake implementation): say FA3 is loaded, as test_fa3.py does.
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", True)
    blocks = tiny_blocks("tiny-flux", "fa3-fp8")
    for name, parts in (("FluxSingleTransformerBlock", 1), ("FluxTransformerBlock", 2)):
        program, _ = blocks[name]
        fused = calls(decomposed(program, NORM_ROPE))
        assert fused[OPS[0]] == 2 and not fused[aten.rms_norm.default] and not fused[aten.clamp.default], name
        ops = [n for n in decomposed(program, NORM_ROPE).graph.nodes if n.target in OPS]
        assert all(n.meta["val"].dtype == torch.float8_e4m3fn for n in ops)
        assert all(u.target is torch.ops.aot_fa3.fp8_forward.default for n in ops for u in n.users)
        weights = [[w.target for w in n.args[1]] for n in ops]
        assert all(len(n.args[0]) == parts == len(set(w)) for n, w in zip(ops, weights, strict=True)), weights
        assert calls(decomposed(program))[aten.rms_norm.default] == 2 * parts  # off unless asked
    joined = calls(decomposed(blocks["FluxTransformerBlock"][0]))[aten.cat.default]
    assert (joined, fused[aten.cat.default]) == (3, 1)


@pytest.mark.parametrize(
    ("model", "taken"),
    [
        ("tiny-flux2", {"Flux2SingleTransformerBlock": (OPS[0], 2), "Flux2TransformerBlock": (OPS[0], 2)}),
        ("tiny-z-image", {"ZImageTransformerBlock-layers": (OPS[1], 2)}),
        ("tiny-qwen-image", {"QwenImageTransformerBlock": (OPS[1], 2)}),
        ("tiny-chroma", {"ChromaSingleTransformerBlock": (OPS[0], 2), "ChromaTransformerBlock": (OPS[0], 2)}),
    ],
)
def test_rewritten_blocks_compute_the_same_bits_on_a_cpu(model, taken):
    """Under SDPA in bf16, the rewritten program (the ops' torch reference on a CPU) gives the original's
    output to the bit: FLUX.2's and Chroma's blocks (torch's RMSNorm, the real form; the double blocks'
    text and image heads joined before RoPE), Z-Image's (diffusers' RMSNorm, the complex form), Qwen-Image's
    (the complex form, text and image heads each rotated by their own factors, then joined)."""
    blocks = tiny_blocks(model, "sdpa")
    for name, (op, count) in taken.items():
        program, inputs = blocks[name]
        rewritten = decomposed(program, NORM_ROPE)
        assert calls(rewritten)[op] == count, name
        with torch.no_grad():
            got, expected = (torch.utils._pytree.tree_leaves(p.module()(**inputs)) for p in (rewritten, program))
        assert len(got) == len(expected) and all(map(torch.equal, got, expected)), name


def _rope(x, cos, sin, alpha=1):
    """diffusers' `apply_rotary_emb` (real form), with the sum's `alpha` a caller may set."""
    e, o = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    turned = torch.stack([-o, e], -1).flatten(3)
    return torch.add(x.float() * cos, turned.float() * sin, alpha=alpha).to(x.dtype)


def _norm(x):
    """diffusers' `RMSNorm` without a weight and without its cast back: float32 out of bf16 x."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)


def _complex_rope_as_5d(x, f):
    """Qwen-Image's complex RoPE, its product permuted as (batch, heads, seq, pairs, 2) before flattening."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * f.unsqueeze(1)).permute(0, 2, 1, 3, 4).flatten(3)


class LookAlike(torch.nn.Module):
    """A norm and a rotation that only look like a site: the rotation's sum scaled by `alpha=-1`, a Python
    number where the weight would be, a norm whose output stays float32 (bf16 x), a rotated product that is
    5-D where the site's end would be (a float32 model, so no casts mark the end), two norms joined along
    the heads rather than the tokens, two joined along the tokens with different eps, a float32 norm rounded
    through bf16 before its float32 weight (its output in x's dtype again)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, cos, sin, f):
        if self.kind == "alpha":
            q, k = (_rope(torch.rms_norm(t, [t.shape[-1]], None, 1e-6), cos, sin, alpha=-1) for t in (q, k))
        elif self.kind == "number":
            q, k = (_rope(_norm(t).to(t.dtype) * 2.0, cos, sin) for t in (q, k))
        elif self.kind == "float32 norm":
            q, k = (_rope(_norm(t), cos, sin) for t in (q, k))
        elif self.kind == "rounded through bf16":
            weight = torch.linspace(0.5, 1.5, q.shape[-1])
            q, k = (_rope(_norm(t).to(torch.bfloat16) * weight, cos, sin) for t in (q, k))
        elif self.kind in ("joined heads", "two eps"):
            dim, eps = (2, 1e-6) if self.kind == "joined heads" else (1, 1e-5)
            q, k = (
                torch.cat([torch.rms_norm(t.narrow(dim, 0, 1), [t.shape[-1]], None, 1e-6),
                           torch.rms_norm(t.narrow(dim, 1, t.shape[dim] - 1), [t.shape[-1]], None, eps)], dim)
                for t in (q, k)
            )
            q, k = (_rope(t, cos, sin) for t in (q, k))
        else:
            normed = (torch.nn.functional.rms_norm(t, t.shape[-1:], None, 1e-6) for t in (q, k))
            q, k = (_complex_rope_as_5d(t, f[:, 0]) for t in normed)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v.transpose(1, 2))
        return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v.to(q.dtype))))


LOOK_ALIKES = ["alpha", "number", "float32 norm", "5-D product", "joined heads", "two eps", "rounded through bf16"]


@pytest.mark.parametrize("kind", LOOK_ALIKES)
def test_what_only_looks_like_a_site_is_left_as_it_is(kind):
    x, _, cos, sin, f = heads(batch=1)
    x = x.float() if kind in ("5-D product", "rounded through bf16") else x
    args = (x, x * 0.5, x * 2, cos, sin, f)
    program = torch.export.export(LookAlike(kind), args)
    rewritten = decomposed(program, NORM_ROPE)
    assert not set(OPS) & set(calls(rewritten))
    with torch.no_grad():
        assert torch.equal(rewritten.module()(*args), program.module()(*args))


def test_heads_quantized_by_sage_are_left_to_inductor():
    """sage quantizes the rotated Q and K per token: a reduction Inductor fuses into the kernel that
    makes them, which our kernel would split into two passes. Such a site is left as it is."""
    from test_sage import tiny_pipeline_at_head_dim_32

    pipe = tiny_pipeline_at_head_dim_32().to(torch.bfloat16)
    target = Target.of(pipe, tiny_options())
    classes = _capture_classes(pipe, repeated_blocks(pipe.transformer), target)
    block, inputs, contract, *_ = classes["FluxSingleTransformerBlock"]
    with attention_backend("sage"):
        program = export_block(block, inputs[0], contract)
    assert not set(OPS) & set(calls(decomposed(program, NORM_ROPE)))
    with attention_backend("sdpa"):
        program = export_block(block, inputs[0], contract)
    assert calls(decomposed(program, NORM_ROPE))[OPS[0]] == 2  # the same block under SDPA


def test_the_plans_it_was_measured_in_take_the_kernel_and_on_or_off_is_as_asked():
    plans = {plan.name: plan for *_, plan in PLANS}
    assert sorted(name for name, plan in plans.items() if plan.norm_rope) == ["sm_120", "sm_90"]
    decision = resolve_norm_rope(tiny_options(), plans["sm_90"])
    assert (decision.value, decision.reason) == ("on", "auto: plan sm_90")
    decision = resolve_norm_rope(tiny_options(), plans["sm_89"])
    assert (decision.value, decision.reason) == ("off", "auto: plan sm_89 leaves each head's norm and RoPE to Inductor")
    assert resolve_norm_rope(tiny_options(norm_rope="off"), plans["sm_90"]).value == "off"
    assert resolve_norm_rope(tiny_options(norm_rope="on"), plans["sm_89"]).value == "on"


def test_packages_with_and_without_the_kernel_are_told_apart():
    """A set compiled with the kernel gets a variant name of its own, and a set saved without it is not
    loaded where the trials take it (its fingerprint differs), nor the other way round."""
    from aot.fingerprint import differences, fingerprint, variant

    pipe = load_tiny()
    resolution = Target.of(pipe, tiny_options()).resolution
    on, off = (fingerprint(pipe.transformer, resolution, "sdpa", "off", None, o) for o in (NORM_ROPE, frozenset()))
    assert (variant(on), variant(off)) == ("sdpa-float32-normrope-512-1536", "sdpa-float32-512-1536")
    assert differences(off, on) == ["norm_rope: off (packages) vs on (here)"]


@pytest.mark.parametrize("model", ["tiny-z-image", "tiny-qwen-image"])
def test_packages_compiled_with_the_kernel_match_eager_and_say_so(model):
    """The tiny Z-Image and Qwen-Image pipelines (float32 on a CPU: the ops' torch reference inside the
    packages; Qwen-Image's text and image heads as two parts) compiled with `norm_rope=on`: the decision
    is recorded and the images match eager's at both ends of the sizes."""
    from test_families import SIZES, images, options

    pipe = load_pipeline(options(model))
    expected = [images(pipe, height, width) for height, width in SIZES]
    compiled = compile_blocks(*decided(pipe, options(model, norm_rope="on")))
    assert [str(d) for d in compiled.decisions if d.name == "norm_rope"] == ["norm_rope: on (requested)"]
    patch_blocks_(pipe, compiled)
    for (height, width), image in zip(SIZES, expected, strict=True):
        assert rel_error(images(pipe, height, width), image) < TOLERANCE, (height, width)
