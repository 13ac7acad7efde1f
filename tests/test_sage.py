"""sage attention (INT8 Q·K, FP8 P·V in Triton) on a CPU: its quantization, V's layout, the kernel
compiled for each GPU the plans try it on, the kernel run by Triton's interpreter, and blocks
exported with it. test_gpu.py runs it on a GPU."""

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
import triton
from conftest import ROOT, load_tiny, tiny_options
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aot import sage
from aot.attention import MIN_GAIN, attention_backend, attention_op, speed_note
from aot.blocks import repeated_blocks
from aot.export import _capture_classes, export_block
from aot.plans import PLANS
from aot.target import Target

# Shared memory one block may use (opt-in), bytes, per compute capability: the CUDA C++ Programming
# Guide's table of compute capabilities (99 KB on 8.9 and 12.0, 227 KB on 9.0 and 10.0).
SHARED_MEMORY = {(8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}


def test_quantize_per_token_maps_each_rows_abs_max_to_127():
    torch.manual_seed(0)
    x = (torch.randn(2, 40, 3, 32) * torch.logspace(-3, 3, 40)[None, :, None, None]).to(torch.bfloat16)
    x[1, 5, 2] = 0
    q, scale = sage.quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2, 40, 3)
    top = q.abs().amax(-1)
    assert torch.all((top == 127) | (x.abs().amax(-1) == 0)) and scale[1, 5, 2] == 1
    error = (q.float() * scale[..., None] - x.float()).abs()
    assert torch.all(error <= scale[..., None] * (0.5 + 1e-4))  # half a step, and float32's rounding


def test_tokens_innermost_pads_each_row_of_tokens_to_the_alignment():
    v = torch.randn(2, 70, 3, 16).to(torch.float8_e4m3fn)
    rows = sage.tokens_innermost(v)
    align = sage.TOKEN_ALIGN
    assert rows.shape == (2, 80, 3, 16) and rows.stride(1) == 1
    assert all(n % align == 0 for n in (rows.stride(0), rows.stride(2), rows.stride(3)))
    assert torch.equal(rows[:, :70].float(), v.float()) and not rows[:, 70:].float().any()


# The arguments AOTInductor tells Triton are multiples of 16 at a FLUX block's shapes: the pointers and the
# strides of a static size. V's row stride, which follows the token count, is not among them.
DIVISIBLE = ("Q", "K", "V", "QS", "KS", "VS", "Out", "stride_qb", "stride_qs", "stride_qh", "stride_kb")
DIVISIBLE += ("stride_ks", "stride_kh", "stride_vb", "stride_vh", "stride_ob", "stride_os", "stride_oh")


def _compiled(target: tuple[int, int], config: triton.Config, known: tuple[str, ...] = (), head_dim: int = 128):
    """The kernel compiled for `target` with `config`, its arguments typed as AOTInductor passes them:
    the softmax scale (a Python float) as fp64, the arguments a FLUX block gives the value 1 as
    constants, `DIVISIBLE` and `known` as multiples of 16."""
    fn, ones = sage._sage_attention_kernel, ("stride_vs", "group", "stride_qsh", "stride_ksh", "stride_vsh")
    types = {"Q": "*i8", "K": "*i8", "V": "*fp8e4nv", "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "Out": "*bf16"}
    constants = {"HEAD_DIM": head_dim, "ALIGN": sage.TOKEN_ALIGN, **config.kwargs, **dict.fromkeys(ones, 1)}
    signature = {
        name: "constexpr" if name in constants else types.get(name, "fp64" if name == "qk_scale" else "i32")
        for name in fn.arg_names
    }
    constexprs = {(fn.arg_names.index(n),): v for n, v in constants.items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE + known}
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", target[0] * 10 + target[1], 32), options=options)


def _global_loads(ptx: str) -> Counter:
    """The kinds of global-memory loads in `ptx` (width, caching), with their counts."""
    loads = re.findall(r"(ld\.global[\w.]*|cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], \w+)", ptx)
    return Counter(re.sub(r"\[[^\]]*\]", "[]", load) for load in loads)


@pytest.mark.parametrize("capability", sorted(SHARED_MEMORY))
def test_the_kernel_compiles_with_8_bit_tensor_cores_and_fits_each_gpu_the_plans_try_it_on(capability):
    """Triton compiles the kernel ahead for GPUs this machine does not have (ptxas ships with it), to
    8-bit tensor-core instructions: INT8 for Q·K, e4m3 for P·V. Its loads are the same whether or not
    the package's compiler can prove V's rows 16-byte aligned (the measured package could; one
    without that was 2.2x slower: BENCHMARKS.md). It compiles at each head dim it takes; on ZeroGPU's
    sm_120 every config must fit its 99 KB of shared memory at the largest, as none can be run here."""
    plans = [plan for low, high, plan in PLANS if low <= capability <= high]
    assert "sage" in plans[0].attention or capability == (9, 0), plans  # 9.0: where `AOT_PLAN=12.0` rehearses
    for config in sage.CONFIGS if capability == (12, 0) else sage.CONFIGS[:1]:
        kernel = _compiled(capability, config)
        ptx = kernel.asm["ptx"]
        fp8 = r"mma[\w.]*\.e4m3\.e4m3|kind::f8f6f4"  # mma.sync, wgmma; sm_100's tcgen05
        assert re.search(r"mma[\w.]*\.s32\.s8\.s8", ptx) and re.search(fp8, ptx), config
        assert not re.search(r"\b(mul|fma|add|sub|max)[\w.]*\.f64", ptx), "fp64 arithmetic: the scale was not cast"
        assert kernel.metadata.shared <= SHARED_MEMORY[capability], (config, kernel.metadata.shared)
    for head_dim in sage.HEAD_DIMS[:-1]:
        assert _compiled(capability, sage.CONFIGS[0], head_dim=head_dim).metadata.shared > 0, head_dim
    unknown, aligned = (_compiled(capability, sage.CONFIGS[0], known).asm["ptx"] for known in ((), ("stride_vd",)))
    assert _global_loads(unknown) == _global_loads(aligned), "V's loads narrow where its rows are not proven aligned"


def test_torch_sees_that_the_kernel_writes_only_its_output(monkeypatch):
    """torch.export asks which inputs a user's Triton kernel mutates by compiling it to Triton's IR; where
    that fails it assumes all (and logs the failure). Triton names the compile target after the active
    GPU driver, which a CPU machine lacks: a stand-in names an H100's here; nothing runs."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors

    class HopperTarget:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", HopperTarget())
    q = torch.empty(1, 300, 4, 128, dtype=torch.int8)
    v = sage.tokens_innermost(torch.empty(1, 300, 4, 128, dtype=torch.float8_e4m3fn))
    scales, out = torch.empty(1, 300, 4), torch.empty(1, 300, 4, 128, dtype=torch.bfloat16)
    arguments = sage.kernel_arguments(q, q, v, scales, scales, scales[:, 0], out, 0.1) | sage.CONFIGS[0].kwargs
    assert identify_mutated_tensors(sage._sage_attention_kernel, arguments, {}) == ["Out"]


INTERPRETED = """
import json, sys, torch
from aot.sage import sage_attention
torch.manual_seed(0)
out = {}
for batch, seq_q, seq_k, heads, kv_heads, dim in json.loads(sys.argv[1]):
    q = torch.randn(batch, seq_q, heads, dim, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seq_k + 30, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    got = sage_attention(q, k[:, :seq_k], v[:, :seq_k]).float()
    def sdpa(keys):
        kk, vv = (t[:, :keys].repeat_interleave(heads // kv_heads, 2).transpose(1, 2).float() for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), kk, vv).transpose(1, 2)
    error = lambda ref: ((got - ref).norm() / ref.norm()).item()
    out[f"{batch}x{seq_q}x{seq_k}"] = [error(sdpa(seq_k)), error(sdpa(seq_k + 30)), list(got.shape)]
print(json.dumps(out))
"""


def test_the_kernel_run_by_tritons_interpreter_matches_sdpa_within_8_bit_rounding():
    """The kernel's code run on the CPU by Triton's interpreter (TRITON_INTERPRET=1, read when the
    module is imported: a process of its own) with the first config: grouped queries, a second batch
    entry, key counts that end inside a tile. The interpreter rounds some values to FP8 one binade
    too low (Triton 3.6: a carry out of the mantissa is lost), so its error is about 6e-2 against the
    GPU's 3.8e-2 (test_gpu.py); reading 30 keys past the end would give several times more."""
    cases = [(1, 64, 64, 2, 2, 32), (2, 70, 45, 4, 2, 32), (1, 80, 150, 2, 1, 64)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", INTERPRETED, json.dumps(cases)]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.splitlines()[-1])
    for (batch, seq_q, _, heads, _, dim), (error, past_the_end, shape) in zip(cases, errors.values(), strict=True):
        assert shape == [batch, seq_q, heads, dim]
        assert error < 0.1 and past_the_end > 2 * error, errors


def test_sage_refuses_what_its_kernel_cannot_do():
    q = torch.zeros(1, 16, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no mask, no dropout, no causal"):
        sage.sage_attention(q, q, q, attn_mask=torch.zeros(1, 1, 16, 16))
    for head_dim in (16, 24, 256):  # an 8-bit matmul's depth on NVIDIA GPUs, not a power of two, sm_120's memory
        with pytest.raises(ValueError, match=f"head dims 32, 64, 128; this model's is {head_dim}"):
            sage.sage_attention(*(torch.zeros(1, 16, 2, head_dim, dtype=torch.bfloat16),) * 3)
    i8, scales = torch.zeros(1, 16, 2, 32, dtype=torch.int8), torch.ones(1, 16, 2)
    v = torch.zeros(1, 16, 2, 32, dtype=torch.float8_e4m3fn)  # tokens not innermost
    with pytest.raises(ValueError, match="V with the tokens innermost"):
        sage.sage_forward(i8, i8, v, scales, scales, torch.ones(1, 2), 0.1)


def tiny_pipeline_at_head_dim_32():
    """The tiny FLUX pipeline with a random transformer of head dim 32, the smallest sage takes (the
    bundled one's is 16)."""
    from diffusers import FluxTransformer2DModel

    pipe = load_tiny()
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel(**{**config, "attention_head_dim": 32, "axes_dims_rope": (8, 8, 16)})
    return pipe


def test_blocks_exported_under_sage_quantize_in_their_graph_and_call_the_kernel_once():
    pipe = tiny_pipeline_at_head_dim_32()
    target = Target.of(pipe, tiny_options())
    classes = _capture_classes(pipe, repeated_blocks(pipe.transformer), target)
    for name, (block, inputs, contract, *_) in classes.items():
        with attention_backend("sage"):
            exported = export_block(block, inputs[0], contract)
        calls = [n for n in exported.graph.nodes if n.target is attention_op("sage")]
        assert len(calls) == 1, name
        q, k, v = (arg.meta["val"] for arg in calls[0].args[:3])
        assert (q.dtype, k.dtype, v.dtype) == (torch.int8, torch.int8, torch.float8_e4m3fn)
        assert v.stride()[1] == 1 and calls[0].meta["val"].dtype == torch.bfloat16


EXPORTED = """
import json, sys, torch
import aot.sage  # registers the op, its kernel interpreted
from aot.blocks import rel_error
program, cases = torch.export.load(sys.argv[1]).module(), torch.load(sys.argv[2])
errors = {}
for tokens, (kwargs, reference) in cases.items():
    with torch.no_grad():
        errors[tokens] = rel_error(program(**kwargs), reference)
print(json.dumps(errors))
"""


def test_an_exported_block_runs_the_kernel_at_aligned_and_ragged_token_counts(tmp_path):
    """A FLUX single block exported under sage, run as the exported program by Triton's interpreter at
    a token count V needs no padding for and at one it does (the image tokens cut to 1031, plus the
    prompt's), against the eager block with SDPA. Both ends of what the kernel reads of V: its padding (zeros) and
    its last, partial tile of keys."""
    pipe = tiny_pipeline_at_head_dim_32()
    pipe.transformer._repeated_blocks = ["FluxSingleTransformerBlock"]
    target = Target.of(pipe, tiny_options())
    ((block, inputs, contract, *_),) = _capture_classes(pipe, repeated_blocks(pipe.transformer), target).values()
    with attention_backend("sage"):
        exported = export_block(block, inputs[0], contract)
    text = inputs[0]["encoder_hidden_states"].shape[1]
    cut = dict(inputs[0], hidden_states=inputs[0]["hidden_states"][:, :1031])
    cut["image_rotary_emb"] = tuple(t[: text + 1031] for t in inputs[0]["image_rotary_emb"])
    cases = {}
    for kwargs in (inputs[1], cut):
        with torch.no_grad():
            cases[text + kwargs["hidden_states"].shape[1]] = (kwargs, block(**kwargs))
    assert sorted(n % sage.TOKEN_ALIGN == 0 for n in cases) == [False, True], list(cases)
    torch.export.save(exported, tmp_path / "block.pt2")
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", EXPORTED, str(tmp_path / "block.pt2"), str(tmp_path / "cases.pt")]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.splitlines()[-1])
    assert all(error < 5e-2 for error in errors.values()), errors


def test_a_timed_kernel_is_kept_only_where_it_beats_sdpa_by_the_stated_factor():
    assert speed_note("sage", 0.40, 0.40 * MIN_GAIN) == "0.400 ms a call against SDPA's 0.460 ms"
    with pytest.raises(RuntimeError, match=r"^sage: 0\.460 ms a call against SDPA's 0\.400 ms, not 1\.15x faster$"):
        speed_note("sage", 0.46, 0.40)
