"""Regional AoT compilation on the tiny pipeline (CPU): parity, one package per class, the shape contract."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TOLERANCE, decided, generate, load_tiny, tiny_options
from diffusers import FluxTransformer2DModel
from torch._functorch._aot_autograd.subclass_parametrization import unwrap_tensor_subclass_parameters

from aot.apply import patch_blocks_
from aot.blocks import block_constants, patch_forward, patched_forward, rel_error, repeated_blocks
from aot.compiled import BlockPackage
from aot.contract import contract_from_captures
from aot.costs import COSTS
from aot.export import capture_blocks, compile_blocks, dynamic_shapes, export_block
from aot.lowering import compile_package
from aot.resolution import Resolution
from aot.runner import CompiledBlock, SharedPackage


def compiled_blocks(pipe) -> list[CompiledBlock]:
    return [p for m in pipe.transformer.modules() if (p := patched_forward(m, CompiledBlock)) is not None]


@pytest.mark.parametrize("size", [(512, 512), (1536, 1536), (768, 1344)], ids=["min", "max", "non-square"])
def test_compiled_pipeline_matches_eager(eager_pipe, compiled_pipe, size):
    # Captured at 1024x1024: these sizes run the same dynamic graph (no specialization).
    expected = generate(eager_pipe, *size)
    actual = generate(compiled_pipe, *size)
    assert actual.shape == (1, 3, *size)
    error = rel_error(actual, expected)
    assert error < TOLERANCE, f"rel. error {error:.2e}, max abs {(actual - expected).abs().max():.2e}"


def test_one_package_per_block_class_and_every_block_patched(compiled, compiled_pipe):
    transformer = compiled_pipe.transformer
    assert set(compiled.packages) == set(transformer._repeated_blocks)
    patched = compiled_blocks(compiled_pipe)
    assert len(patched) == transformer.config.num_layers + transformer.config.num_single_layers
    for name, package in compiled.packages.items():
        users = [b for b in patched if b.package.block == name]
        assert len(users) == len(repeated_blocks(transformer)[name])
        assert all(b.package is package for b in users), "every block of a class shares one package"
        assert len(package.package) < 5e6, "weights-less package: code only"


def test_one_package_load_per_block_class_shared_by_its_blocks(compiled, compiled_pipe):
    # A new ZeroGPU worker loads what its process has not: one package per class, not one per block.
    loads, binds = COSTS.loads, COSTS.binds
    generate(compiled_pipe, 512, 512, steps=2)
    assert COSTS.loads - loads == len(compiled.packages)
    patched = compiled_blocks(compiled_pipe)
    for name in compiled.packages:
        runners = {id(b.shared.runner) for b in patched if b.package.block == name}
        assert len(runners) == 1 and None not in runners
    # Two blocks per class alternate: every call binds its block (2 steps x 4 blocks, no CUDA graphs).
    assert COSTS.binds - binds == 2 * len(patched)
    generate(compiled_pipe, 512, 512, steps=1)
    assert COSTS.loads - loads == len(compiled.packages), "loaded again"


def test_each_block_runs_with_its_own_weights_without_a_copy(compiled_pipe, eager_pipe):
    generate(compiled_pipe, 512, 512, steps=1)  # load and bind every package
    block, twin = (
        compiled_pipe.transformer.single_transformer_blocks[1],
        eager_pipe.transformer.single_transformer_blocks[1],
    )
    kwargs = _block_inputs(compiled_pipe, "FluxSingleTransformerBlock")
    with torch.no_grad():
        assert rel_error(block(**kwargs), twin(**kwargs)) < TOLERANCE
        # The package reads the block's own parameter memory: change it in place, the output follows.
        for module in (block, twin):
            module.proj_out.weight.mul_(-1.0)
        assert rel_error(block(**kwargs), twin(**kwargs)) < TOLERANCE


def test_size_outside_the_range_is_refused_before_any_compiled_call(compiled_pipe, eager_pipe):
    lo, hi = compiled_pipe_resolution(compiled_pipe).token_range
    with pytest.raises(ValueError, match=rf"sides 512\.\.1536 px.*{lo}\.\.{hi} image tokens"):
        generate(compiled_pipe, 496, 512)
    with pytest.raises(ValueError, match="hidden_states has 9312 image tokens"):
        generate(compiled_pipe, 1536, 1552)
    assert not any(b.loaded for b in compiled_blocks(compiled_pipe)), "a compiled block was called"
    assert rel_error(generate(compiled_pipe, 512, 512), generate(eager_pipe, 512, 512)) < TOLERANCE


def test_batch_other_than_compiled_is_refused_then_next_request_works(compiled_pipe):
    # AOTI checks no input shapes itself; a batch of 2 against a batch-1 package must not run.
    with pytest.raises(ValueError, match=r"\(2, 1024, 32\).*batch size and text length are fixed"):
        generate(compiled_pipe, 512, 512, num_images_per_prompt=2)
    assert generate(compiled_pipe, 512, 512).shape == (1, 3, 512, 512)


def test_arguments_other_than_captured_are_refused(compiled_pipe):
    block = compiled_pipe.transformer.transformer_blocks[0]
    kwargs = _block_inputs(compiled_pipe, "FluxTransformerBlock")
    kwargs["joint_attention_kwargs"] = {"ip_hidden_states": kwargs["temb"]}
    with pytest.raises(ValueError, match="FluxTransformerBlock was compiled for inputs"):
        block(**kwargs)


def test_export_spec_covers_every_captured_input(compiled):
    # one entry per captured kwarg, a tuple of per-tensor specs for the rotary embedding.
    contract = compiled.packages["FluxTransformerBlock"].contract
    kwargs = _block_inputs(load_tiny(), "FluxTransformerBlock")
    spec = dynamic_shapes(contract, kwargs)
    assert (
        set(spec)
        == set(kwargs)
        == {
            "hidden_states",
            "encoder_hidden_states",
            "temb",
            "image_rotary_emb",
            "joint_attention_kwargs",
        }
    )
    assert spec["encoder_hidden_states"] is None and spec["temb"] is None
    assert spec["joint_attention_kwargs"] == kwargs["joint_attention_kwargs"] == {}  # no tensors: nothing dynamic
    image = spec["hidden_states"][1]
    assert (image.min, image.max) == Resolution(512, 1536).token_range  # the Dim comes from the rule
    text = kwargs["encoder_hidden_states"].shape[1]
    assert [str(s[0]) for s in spec["image_rotary_emb"]] == [f"image_tokens + {text}"] * 2


def test_shape_rule_refuses_inputs_it_cannot_describe():
    resolution = Resolution(512, 1536)
    a = {"x": torch.zeros(1, 1024, 8)}
    b = {"x": torch.zeros(1, 2 * 2304, 8)}  # doubles instead of following the token count
    with pytest.raises(ValueError, match="not a whole multiple of the image tokens plus a constant"):
        contract_from_captures("Block", [((), a), ((), b)], [(1024, 512), (2304, 512)], resolution, (1024, 9216))


def test_captures_must_differ_in_one_count_at_a_time():
    # Were the text length to change with the size, its change would be read as the image's.
    x = [((), {"x": torch.zeros(1, n, 8)}) for n in (1024 + 14, 2304 + 20)]
    with pytest.raises(ValueError, match=r"differ in image tokens only, then in text tokens only"):
        contract_from_captures("Block", x, [(1024, 14), (2304, 20)], Resolution(512, 1536), (1024, 9216))


def test_one_size_only_is_refused_before_any_capture():
    with pytest.raises(ValueError, match=r"sides 512\.\.512 px: give two sizes"):
        compile_blocks(*decided(load_tiny(), tiny_options(min_side=512, max_side=512)))


def test_blocks_in_containers_whose_names_join_alike_stay_apart():
    # `a.b_c` and `a_b.c` would both read `a_b_c` with dots replaced: one package for two containers.
    class Block(torch.nn.Linear):
        pass

    def blocks(n):
        return torch.nn.ModuleList(Block(4, 4) for _ in range(n))

    model = torch.nn.Module()
    model.a, model.a_b = torch.nn.Module(), torch.nn.Module()
    model.a.b_c, model.a_b.c = blocks(1), blocks(2)
    model._repeated_blocks = ["Block"]
    assert {name: len(found) for name, found in repeated_blocks(model).items()} == {
        "Block-a.b_c": 1,
        "Block-a_b.c": 2,
    }


def test_pipeline_without_repeated_blocks_gets_a_clear_error(eager_pipe):
    eager_pipe.transformer._repeated_blocks = []
    with pytest.raises(ValueError, match="FluxTransformer2DModel has no `_repeated_blocks`"):
        repeated_blocks(eager_pipe.transformer)
    eager_pipe.transformer._repeated_blocks = ["FluxTransformerBlock", "NoSuchBlock"]
    with pytest.raises(ValueError, match="lists NoSuchBlock, but the model has no block of that class"):
        repeated_blocks(eager_pipe.transformer)


def test_packages_applied_to_other_weights_fail_at_apply_not_at_call(compiled):
    # a weights-less package bound to tensors of other shapes would read out of bounds.
    pipe = load_tiny()
    config = dict(pipe.transformer.config)
    config["num_attention_heads"] = 4
    pipe.transformer = FluxTransformer2DModel.from_config(config)
    with pytest.raises(ValueError, match=r"FluxTransformerBlock #0 does not match its compiled package"):
        patch_blocks_(pipe, compiled)
    assert not compiled_blocks(pipe), "no block may be patched after a failed check"


def test_cpu_offload_hooks_are_refused(compiled):
    # offload moves weights between calls; compiled blocks bind to their memory once.
    pipe = load_tiny()
    pipe.enable_model_cpu_offload(device="cpu")
    with pytest.raises(ValueError, match="offload hooks"):
        patch_blocks_(pipe, compiled)


def test_tensor_subclass_weights_bind_to_a_weights_less_package():
    # The FP8 path on the GPU quantizes with torchao; weights become tensor subclasses that export
    # as `parametrizations.weight.original<i>`. int8 weight-only runs the same mechanism on CPU.
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    pipe = load_tiny()
    blocks = pipe.transformer.single_transformer_blocks
    kwargs = _block_inputs(pipe, "FluxSingleTransformerBlock")
    contract = _contract(pipe, "FluxSingleTransformerBlock")
    for block in blocks:
        quantize_(block, Int8WeightOnlyConfig())
    constants = block_constants(blocks[0])
    assert "proj_out.parametrizations.weight.original0" in constants
    # The names torch's own unwrapping gives (on a copy: it registers parametrizations), same tensors.
    unwrapped = unwrap_tensor_subclass_parameters(copy.deepcopy(blocks[0])).state_dict(keep_vars=True)
    assert sorted(constants) == sorted(unwrapped)
    assert all(torch.equal(constants[name], unwrapped[name]) for name in constants)
    package = compile_package(export_block(blocks[0], kwargs, contract))
    holder = BlockPackage("FluxSingleTransformerBlock", package, contract, {}, False, 0.0, 0.0, 0.0)
    shared = SharedPackage(holder)
    expected = [block(**kwargs) for block in blocks]
    for block in blocks:
        patch_forward(block, CompiledBlock(block, shared))
    for _ in range(2):  # each call binds its block's tensors to the one loaded package
        for block, reference in zip(blocks, expected, strict=True):
            assert rel_error(block(**kwargs), reference) < TOLERANCE


def compiled_pipe_resolution(pipe) -> Resolution:
    return compiled_blocks(pipe)[0].package.contract.resolution


def _block_inputs(pipe, block_class: str) -> dict:
    """Real inputs of the first block of `block_class`, captured from a 512x512 pipeline call."""
    first = repeated_blocks(pipe.transformer)[block_class][0]
    (calls,) = capture_blocks(pipe, {block_class: first}, [(512, 512)])
    return copy.copy(calls[block_class][1])


def _contract(pipe, block_class: str):
    resolution = Resolution(512, 1536)
    first = repeated_blocks(pipe.transformer)[block_class][0]
    captures = capture_blocks(pipe, {block_class: first}, [(512, 512), (768, 768)])
    points = [(resolution.tokens(512, 512), 512), (resolution.tokens(768, 768), 512)]
    return contract_from_captures(
        block_class, [c[block_class] for c in captures], points, resolution, resolution.token_range
    )


def test_a_cuda_compile_starts_inductors_compile_workers_and_a_cpu_compile_does_not():
    """In a fresh process (a started pool would outlive the test here): for a CUDA device the pool
    Inductor compiles Triton kernels in is up before any kernel (so none is compiled one after another
    in this process while it starts); a CPU package has no Triton kernel and starts no pool."""
    code = (
        "import torch\n"
        "from torch._inductor.async_compile import AsyncCompile\n"
        "from aot.export import start_compile_workers\n"
        "start_compile_workers(torch.device('cpu'))\n"
        "assert AsyncCompile.process_pool.cache_info().currsize == 0, 'a pool for a CPU compile'\n"
        "start_compile_workers(torch.device('cuda'))\n"
        "assert AsyncCompile._ready_future is not None, 'no pool started'\n"
        "AsyncCompile._ready_future.result(timeout=120)  # its workers answer\n"
        "assert AsyncCompile.use_process_pool(), 'kernels would still compile in this process'\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2"}  # a pool even where CI has one core
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=300)
