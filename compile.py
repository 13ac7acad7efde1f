"""Regional ahead-of-time (AoT) compilation of a diffusion transformer, as the recipe's verbs.

    capture  record each repeated block class's real inputs from real pipeline calls (families.py
             says how a call of this pipeline class looks)
    export   torch.export one block per class, container and weight layout, with the image-token
             dimension dynamic (and the text-token one where the text length follows the prompt)
    compile  AOTInductor: one weights-less package per class (a few MB, no parameters inside)
    apply    every block of the class runs that one package, bound to the block's own weights
    graph    optional (`cuda_graphs`): each image size's step is captured once, then replayed (graphs.py)
    save / load   packages on disk or the Hub, verified by a fingerprint (packages.py)

`optimize_(pipe)` does all of it in place and returns a `Report`. Loading saved packages or the
first three steps (`compile_blocks`) run in one `@spaces.GPU(duration=1500)` call, which on a
ZeroGPU Space is a GPU worker: the pipeline reaches it through fork (module state), the attention
and FP8 decisions are made on the real card there, and only the small packages cross back.
`apply_` runs in the main process and touches no GPU; packages are loaded at each block's first
call, inside the request's worker. zerogpu.py has the whole map of what runs where. Outside ZeroGPU
`@spaces.GPU` changes nothing and everything runs in this process.

Every `auto` fast path is tried, not assumed, in the order the GPU's plan gives (`fast_paths.PLANS`,
keyed by compute capability): an FA3 or FP8 block that fails to export, compile, load or match eager
falls back to the plan's next step (FP8 row -> per tensor -> bf16, FA3 -> SDPA) with the reason in
the report; only the plain bf16 SDPA block has no fallback.

We use torch's AOTI API (`torch.export.export`, `torch._inductor.aoti_compile_and_package`, the
package loader behind `aoti_load_package` (see `blocks.load_runner`), `load_constants`) rather than
`spaces.aoti_*`, which wrap the same steps: we verify packages before loading them, skip torch's
CPU ISA probe at load, check every call's inputs, and run on CPU-only torch builds too.

    python compile.py --model assets/tiny-flux                      # compile, check, print the report
    python compile.py --model assets/tiny-flux --save packages      # ... and save the packages
    python compile.py --model assets/tiny-flux --load packages      # bind saved packages (compile if stale)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch.export import Dim
from torch.utils import _pytree as pytree

import lora
import text_fp8
import zerogpu
from blocks import (
    BlockPackage,
    Call,
    Compiled,
    Contract,
    Report,
    apply_,
    bind,
    contract_from_captures,
    forward_signature,
    probe_cpu_isa_in_background,
    rel_error,
    repeated_blocks,
    wait_for_cpu_isa_probe,
)
from families import family
from fast_paths import (
    FP8_MAX_REL_ERROR,
    FP8_MIN_FEATURES,
    Decision,
    attention_steps,
    brief,
    fp8_config,
    fp8_steps,
    quantize_block_,
    refuse_impossible_requests,
    resolve_cuda_graphs,
    resolve_plan,
)
from graphs import GraphedStep, graph_step_
from options import Options, stops_in_one_line
from packages import check_push_target, check_save_target, fingerprint, load_packages, push_packages, save_packages

log = logging.getLogger("compile")

# Inputs are captured at this size (the shape hint Inductor tunes for; FLUX.1-dev's default size)
# and once more at the smallest size, to find which input dimensions follow the image-token count.
CAPTURE_SIZE = (1024, 1024)
# A second capture prompt for families whose text length follows the prompt (families.py): longer
# than "capture" by far more than any padding step, far shorter than max_sequence_length.
LONG_PROMPT = "a photo of a red fox in fresh snow, morning light, " * 4
# The key under which `compile_blocks` captures the transformer's own call (beside its blocks').
TRANSFORMER = "<transformer>"
# Inductor settings for every package. Weights stay out of the package: each block binds its own.
INDUCTOR_CONFIGS: dict[str, Any] = {
    "aot_inductor.package_constants_in_so": False,
    # Store a pointwise result that is read more than once when it takes more than 16 ops,
    # instead of recomputing it in every kernel that reads it (Inductor's GPU default: 30). In
    # FLUX's single block the FP8 input of proj_out, cat(attention, gelu_tanh(mlp)), is read by the
    # row-amax and by the cast: one kernel instead of three, 1.709 -> 1.600 ms per FP8 block on the
    # H200 (BENCHMARKS.md).
    "realize_opcount_threshold": 16,
}
# Compiled block vs eager block on the captured inputs, ||out - ref|| / ||ref||. bf16 and fp32
# packages land far below; a larger error means the package computes something else.
MAX_REL_ERROR = 1e-2
# Largest transformer `load_pipeline` runs on a CPU: FLUX.1-dev (12B) would need ~48 GB in float32
# and minutes per step.
CPU_MAX_PARAMS = 1_000_000_000


# --------------------------------------------------------------------------------------------
# capture -> export -> compile


@contextlib.contextmanager
def capture(modules: dict[str, torch.nn.Module]):
    """Record the first call's inputs of each module while the block runs as usual.

    Yields a dict filled in as the modules are called: name -> (args, kwargs), args bound to
    keyword names by the module's forward signature.
    """
    calls: dict[str, Call] = {}
    handles = []
    for name, module in modules.items():

        def record(module, args, kwargs, name=name):
            if name not in calls:
                calls[name] = ((), dict(forward_signature(module).bind(*args, **kwargs).arguments))

        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def capture_blocks(
    pipe: Any, modules: dict[str, torch.nn.Module], sizes: list[tuple[int, int]], prompt: str = "capture"
) -> list[dict[str, Call]]:
    """Capture the first call's inputs of every module (block groups' first blocks, the transformer)
    from one real pipeline call per size.

    Each call is the one the app makes (`families.Family.call`: keyword arguments, the family's
    text length, guidance where the model takes it, an input image of the output size for an edit
    family), with the family's `capture_steps`, stopped at latents.

    Raises:
        RuntimeError: a module was not called by the pipeline.
    """
    row = family(type(pipe).__name__)
    captured = []
    for height, width in sizes:
        with capture(modules) as calls:
            pipe(**row.capture_call(pipe, prompt, height, width), output_type="latent")
        missing = sorted(set(modules) - set(calls))
        if missing:
            raise RuntimeError(f"the pipeline call at {height}x{width} never called {', '.join(missing)}")
        captured.append(calls)
    return captured


def dynamic_shapes(contract: Contract, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `dynamic_shapes` spec for `torch.export.export`, covering every captured kwarg.

    One `Dim` per form of `blocks.TensorSpec`: `image_tokens` (I) and `text_tokens` (L), ranged by
    the contract; a dim `a * I + c` is derived from I (likewise for L). A dim following both, `a * I
    + b * L + c` (Z-Image's joint sequence), gets its own `Dim` over `a * I + b * L`: export takes
    derived dims of one root only.
    """
    roots: dict[tuple[int, int], Dim] = {}

    def root(form: tuple[int, int]) -> Dim:
        if form not in roots:
            name = {(1, 0): "image_tokens", (0, 1): "text_tokens"}.get(form, f"tokens_{form[0]}i_{form[1]}t")
            lo, hi = contract.form_range(form)
            roots[form] = Dim(name, min=lo, max=hi)
        return roots[form]

    specs = iter(contract.tensors)

    def dims(leaf):
        if not isinstance(leaf, torch.Tensor):
            return None
        spec = next(specs)
        dynamic = {}
        for d, (size, off) in enumerate(zip(spec.shape, spec.offsets, strict=True)):
            if size is not None:
                continue
            a, b = spec.form(d)
            if a and b:
                dim = root((a, b))
            else:
                dim = root((1, 0) if a else (0, 1))
                dim = dim * (a or b) if (a or b) != 1 else dim
            dynamic[d] = dim + off if off else dim
        return dynamic or None

    return pytree.tree_map(dims, kwargs)


def export_block(block: torch.nn.Module, kwargs: dict[str, Any], contract: Contract) -> torch.export.ExportedProgram:
    """`torch.export` one block on its captured inputs, with the image-token dim dynamic."""
    with torch.no_grad():
        return torch.export.export(block, args=(), kwargs=kwargs, dynamic_shapes=dynamic_shapes(contract, kwargs))


def compile_package(exported: torch.export.ExportedProgram) -> bytes:
    """AOTInductor-compile `exported` into a weights-less `.pt2` package; returns its bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "package.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=INDUCTOR_CONFIGS)
        with open(path, "rb") as f:
            return f.read()


# --------------------------------------------------------------------------------------------
# The entry points


def compile_blocks(pipe: Any, options: Options | None = None) -> Compiled:
    """Capture, export and compile one package per repeated block class of `pipe.transformer`.

    Leaves `pipe` as it was (FP8 is tried on a copy of one block). Runs on the GPU the pipeline is
    on: on ZeroGPU, inside the worker (`optimize_` calls it through `zerogpu.gpu`).

    Raises:
        ValueError: no repeated blocks, or inputs the shape rule cannot describe.
        RuntimeError: a fast path was explicitly requested but cannot run, or a compiled bf16
            SDPA block does not match its eager block.
    """
    options = options or Options()
    transformer = pipe.transformer
    blocks = repeated_blocks(transformer)
    resolution = options.resolution(pipe.vae_scale_factor)
    plan, planned = resolve_plan(options, transformer.device)
    kernels, skipped = attention_steps(options, plan, transformer, transformer.device)
    granularities, fp8_off = fp8_steps(options, plan, transformer.device)
    log.info("%s", planned)

    if resolution.min_side == resolution.max_side:
        raise ValueError(
            f"sides {resolution.min_side}..{resolution.max_side} px: give two sizes (min_side < max_side); "
            "the captures at both ends find which block inputs follow the image size"
        )
    capture_size = tuple(min(max(s, resolution.min_side), resolution.max_side) for s in CAPTURE_SIZE)
    sizes = [capture_size, (resolution.min_side, resolution.min_side)]
    if resolution.tokens(*sizes[0]) == resolution.tokens(*sizes[1]):
        sizes[1] = (resolution.max_side, resolution.max_side)
    firsts = {name: found[0] for name, found in blocks.items()}
    row = family(type(pipe).__name__)
    modules = {**firsts, TRANSFORMER: transformer}
    captures = capture_blocks(pipe, modules, sizes)
    if row.text_rule == "prompt":
        captures += capture_blocks(pipe, modules, sizes[:1], LONG_PROMPT)
        sizes = [*sizes, sizes[0]]
    references = row.images[0] - 1  # captures have an input image only where one is required
    points = [
        (row.image_tokens(resolution, *size, references), row.text_tokens_of(c[TRANSFORMER][1]))
        for size, c in zip(sizes, captures, strict=True)
    ]
    probe_cpu_isa_in_background().join()  # Inductor needs it; usually done while the weights loaded
    image_range = row.image_range(resolution)
    classes = {}
    for name, block in firsts.items():
        calls = [c[name] for c in captures]
        kwargs = calls[0][1]
        with torch.no_grad():
            reference = block(**kwargs)
        contract = contract_from_captures(name, calls, points, resolution, image_range, row.text_range)
        classes[name] = (block, kwargs, contract, reference)

    walked = list(skipped)
    for kernel in kernels:  # the plan's attention kernels, each a trial; the last one has no fallback
        try:
            packages, granularity, fp8_walk = _compile_classes(classes, kernel, granularities, options)
            break
        except Exception as exc:
            if kernel == kernels[-1]:
                raise
            walked.append(f"{kernel} failed its trial ({brief(exc)})")
            log.warning("attention: %s", walked[-1])
    origin = f"plan {plan.name}" if options.attention == "auto" else "requested"
    attention = Decision("attention", kernel, f"{origin}: " + " -> ".join([*walked, kernel]))
    origin = f"plan {plan.name}" if options.fp8_granularity == "auto" else f"fp8_granularity={options.fp8_granularity}"
    fp8 = Decision("fp8", granularity or "off", f"{origin}: " + " -> ".join(fp8_walk) if granularities else fp8_off)
    log.info("%s", attention)
    log.info("%s", fp8)
    valid_for = fingerprint(transformer, resolution, attention, fp8, options)
    valid_for["cpu_isa"] = str(pick_vec_isa())  # what the packages' C++ is built for (packages.cpu_isa_problem)
    fa3_kernel = options.fa3_kernel if attention.value == "fa3" else None
    return Compiled(packages, [planned, attention, fp8], resolution, fa3_kernel, granularity, valid_for)


def _compile_classes(
    classes: dict[str, tuple[torch.nn.Module, dict[str, Any], Contract, Any]],
    attention: str,
    granularities: list[str],
    options: Options,
) -> tuple[dict[str, BlockPackage], str | None, list[str]]:
    """One package per class with `attention`; FP8 at the first of `granularities` whose trial runs.

    The granularities are walked in order. One whose FP8 block fails to export, compile, load or
    run for a class is dropped for every class (the GPU cannot run it) and the next is tried. A
    class whose FP8 block runs but differs from eager by more than `FP8_MAX_REL_ERROR` stays in bf16
    (`fp8=auto`). Returns the packages, the granularity they use (None: all bf16), and the walk: a
    note per step, ending in "bf16" where no granularity was kept.

    Raises:
        RuntimeError: a bf16 package differs from its eager block by more than `MAX_REL_ERROR`.
        Exception: what the bf16 export or compile raised (the caller falls back to the next
            attention kernel), or, with `fp8=on`, what the last granularity's trial raised.
    """
    plain: dict[str, BlockPackage] = {}

    def bf16(name: str) -> BlockPackage:
        if name not in plain:
            block, kwargs, contract, reference = classes[name]
            package = _compile_class(name, block, kwargs, contract, attention, reference, fp8=None)
            if not package.rel_error <= MAX_REL_ERROR:
                raise RuntimeError(
                    f"{name}: compiled package differs from eager by {package.rel_error:.2e} (relative), "
                    f"above {MAX_REL_ERROR:.0e}"
                )
            plain[name] = package
        return plain[name]

    walk = []
    for granularity in granularities:
        fp8, notes = {}, []
        try:
            for name, (block, kwargs, contract, reference) in classes.items():
                quantized = copy.deepcopy(block)
                counts = quantize_block_(quantized, fp8_config(granularity))
                if counts[0] == 0:
                    notes.append(f"{name}: all {counts[1]} linear layers narrower than {FP8_MIN_FEATURES}, bf16")
                    continue
                package = _compile_class(name, quantized, kwargs, contract, attention, reference, fp8=granularity)
                note = f"{name} {counts[0]} layers FP8, {counts[1]} kept, rel. error {package.rel_error:.1e}"
                if not package.rel_error <= FP8_MAX_REL_ERROR and options.fp8 == "auto":
                    note += f" > {FP8_MAX_REL_ERROR:.0e}: bf16"
                else:
                    fp8[name] = package
                notes.append(note)
        except Exception as exc:
            if options.fp8 != "auto" and granularity == granularities[-1]:
                raise
            walk.append(f"{granularity} failed its trial ({name}: {brief(exc)})")
            log.warning("fp8: %s", walk[-1])
            continue
        finally:
            quantized = None
        walk.append(f"{granularity}: " + "; ".join(notes))
        if fp8:
            return {name: fp8.get(name) or bf16(name) for name in classes}, granularity, walk
    return {name: bf16(name) for name in classes}, None, walk + ["bf16"] * bool(granularities)



def _compile_class(
    name: str,
    block: torch.nn.Module,
    kwargs: dict[str, Any],
    contract: Contract,
    attention: str,
    reference: Any,
    fp8: str | None,
) -> BlockPackage:
    """Export and compile `block` (FP8-quantized at granularity `fp8`, or None) under `attention`
    ("fa3" or "sdpa"), then run the package once against the eager `reference`."""
    from diffusers.models.attention_dispatch import attention_backend

    start = time.perf_counter()
    with attention_backend("_flash_3" if attention == "fa3" else "native"):
        exported = export_block(block, kwargs, contract)
    export_s = time.perf_counter() - start
    if attention == "fa3":
        op = torch.ops._diffusers_flash_attn_3._flash_attn_forward.default
        if not any(node.target is op for node in exported.graph.nodes):
            raise RuntimeError(f"{name}: attention=fa3, but the exported graph calls no FA3 op")
    start = time.perf_counter()
    package = compile_package(exported)
    compile_s = time.perf_counter() - start
    runner, constants = bind(package, block)
    with torch.no_grad():
        error = rel_error(runner(**kwargs), reference)
    log.info(
        "%s: exported in %.1fs, compiled in %.1fs, %d bytes, rel. error %.1e",
        name,
        export_s,
        compile_s,
        len(package),
        error,
    )
    return BlockPackage(
        block=name,
        package=package,
        contract=contract,
        constants={n: (tuple(t.shape), t.dtype) for n, t in constants.items()},
        fp8=fp8,
        export_s=export_s,
        compile_s=compile_s,
        rel_error=error,
    )


def optimize_(pipe: Any, options: Options | None = None, compiled: Compiled | None = None) -> Report:
    """Regionally AoT-compile `pipe.transformer` in place, or bind saved packages that match.

    With `options.cuda_graphs` (`auto`: on CUDA) the step then runs as CUDA graphs (graphs.py).
    With `options.load`, verified packages from that folder or Hub repo are used; when they do not
    match, the reason is logged and the blocks are compiled (or, with `options.strict`, it raises).
    With `options.save` (and `options.push`) the packages in use, compiled or loaded, are saved
    (and published). Loading or compiling is one GPU call (`_load_or_compile`); the rest runs here.
    With `compiled` (another replica's packages, for the same GPU model) those are bound instead.

    Raises:
        RuntimeError: strict loading failed; before any compile: a save or push target that cannot
            be written (a Hub repo without a token), or an explicitly requested fast path that cannot run.
        ValueError: see `compile_blocks` and `apply_`.
    """
    global _pipeline
    options = options or Options()
    if options.save:
        check_save_target(options.save)  # before minutes of compiling, not after
    if options.push:
        check_push_target(options.push)
    graphs = resolve_cuda_graphs(options, pipe.transformer.device)
    if isinstance(pipe.transformer.__dict__.get("forward"), GraphedStep):
        del pipe.transformer.forward  # its graphs replay the blocks being replaced
    if compiled is None:
        wait_for_cpu_isa_probe()  # no thread may be mid-work when the GPU call forks (ZeroGPU)
        _pipeline = pipe
        try:
            compiled = zerogpu.gpu(_load_or_compile, duration=zerogpu.STARTUP_SECONDS, size=options.gpu_size)(options)
        finally:
            _pipeline = None
    report = apply_(pipe, compiled)
    if compiled.text_fp8 is not None:  # the trial ran in the GPU call; here its FP8 layers are quantized too
        text_fp8.apply_(pipe, compiled.text_fp8)
        report.decisions = [*report.decisions, compiled.text_fp8.decision]
    lora.forbid_peft_(pipe)  # an adapter added from now on would be ignored: raise instead
    if graphs.value == "on":
        graph_step_(pipe.transformer, strict=options.cuda_graphs == "on")
    report.decisions = [*report.decisions, graphs]
    if options.save:
        save_packages(compiled, options.save)
        if options.push:
            log.info("pushed packages to %s", push_packages(options.save, options.push))
    return report


# The pipeline `_load_or_compile` works on. On ZeroGPU it reaches the GPU worker through fork, as
# module state: arguments are pickled, and a pipeline's emulated CUDA tensors cannot be.
_pipeline: Any = None


def _load_or_compile(options: Options) -> Compiled:
    """(On the GPU.) Verified packages from `options.load`, else `compile_blocks(_pipeline)`; with
    the text encoders' FP8 trial (`text_fp8.trial_`, first: it holds an encoder's bf16 weights
    beside their FP8 copy) in `Compiled.text_fp8`.

    Raises:
        RuntimeError: `options.strict` and the saved packages cannot be used; see `compile_blocks`
            and `text_fp8.trial_`.
    """
    text = text_fp8.trial_(_pipeline, LONG_PROMPT, options.text_fp8)
    log.info("%s", text)
    compiled = None
    if options.load:
        compiled, reason = load_packages(options.load, _pipeline, options)
        if compiled is None and options.strict:
            raise RuntimeError(f"packages from {options.load} cannot be used: {reason}")
        if compiled is None:
            log.warning("packages from %s not used: %s; compiling", options.load, reason)
    compiled = compiled or compile_blocks(_pipeline, options)
    compiled.text_fp8 = text
    return compiled


def load_pipeline(options: Options) -> Any:
    """Load `options.model` as the pipeline class its `model_index.json` names, on `options.device`
    in `options.dtype`, with the LoRAs of `options.lora` fused into its weights (lora.fuse_); the
    class must have a row in families.py.

    Everything that can be checked without the weights is checked first, in seconds: explicit fast
    paths this machine cannot run, a push target without a token, a pipeline class that is not
    supported, the side range against the model's pixel step (read from its VAE config), a save
    folder that cannot be written, a Hub that cannot be reached, a model too large for a machine
    without CUDA. Beside the weights it starts the CPU ISA probe a compile needs
    (`probe_cpu_isa_in_background`), unless nothing is compiled (`--no-compile`) or packages are to
    be loaded (`AOT_LOAD`, which does not need it; if they are then refused, the compile waits for
    the probe: 35-48 s on the H200 host with torch 2.11).

    Raises:
        RuntimeError: the model cannot be fetched, it is too large to run without CUDA, its
            pipeline needs a module that is not installed, or an explicit option cannot work here.
        ValueError: the pipeline class is not supported; the side range does not fit the model's
            pixel step; a LoRA source that is neither a path nor a Hub repo id, or a LoRA that
            cannot be applied (lora.read).
    """
    import diffusers

    cuda = torch.cuda.is_available()
    if options.device.startswith("cuda") and not cuda:
        raise RuntimeError(
            f"device={options.device} but torch sees no CUDA GPU (torch {torch.__version__}); "
            "use --device auto or cpu, or a CUDA build of torch on a GPU machine"
        )
    device = torch.device(options.device if options.device != "auto" else "cuda" if cuda else "cpu")
    dtype = getattr(torch, options.dtype) if options.dtype != "auto" else torch.bfloat16 if cuda else torch.float32
    if options.compile:
        refuse_impossible_requests(options, device)
    if options.compile and options.save:
        check_save_target(options.save)
    if options.push:
        check_push_target(options.push)
    for spec in lora.parse(options.lora) + lora.parse(options.lora_choices):
        spec.check()
    index = _model_config(diffusers.DiffusionPipeline, options.model, None)
    pipeline_class = index.get("_class_name", "")
    row = family(pipeline_class)  # refuses an unsupported class before any weight loads
    if row.missing():
        raise RuntimeError(
            f"{pipeline_class} needs {', '.join(row.missing())}, which is not installed: "
            f"pip install {' '.join(row.missing())}"
        )
    transformer_class = getattr(diffusers, index["transformer"][1])
    config = _model_config(transformer_class, options.model, "transformer")
    if device.type == "cpu":
        with torch.device("meta"):
            params = sum(p.numel() for p in transformer_class.from_config(config).parameters())
        if params > CPU_MAX_PARAMS:
            raise RuntimeError(
                f"{options.model} has a {params / 1e9:.1f}B-parameter transformer ({params * 2 / 1e9:.0f} GB in "
                "bfloat16): it needs a CUDA GPU with room for it and the text encoders. Without one, run the "
                "bundled tiny pipeline: MODEL_ID=assets/tiny-flux"
            )
    vae = _model_config(getattr(diffusers, index["vae"][1]), options.model, "vae")
    options.resolution(vae_scale_factor=vae_scale_factor(vae))
    if options.compile and not options.load:
        probe_cpu_isa_in_background()  # a compile needs it; it overlaps with loading the weights
    pipe = getattr(diffusers, pipeline_class).from_pretrained(options.model, dtype=dtype).to(device)
    if options.lora:
        lora.fuse_(pipe, lora.parse(options.lora))
    return pipe


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """The VAE's spatial downsampling, as the pipelines compute `vae_scale_factor` from its config:
    2 ** (resolution levels - 1) for `AutoencoderKL`-style VAEs (8 for FLUX's), 2 ** len(temperal_downsample)
    for Qwen-Image's and Wan's."""
    if "temperal_downsample" in vae_config:
        return 2 ** len(vae_config["temperal_downsample"])
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def _model_config(cls: Any, model: str, subfolder: str | None) -> dict[str, Any]:
    """`cls.load_config(model, subfolder=...)` from a folder, the local Hub cache, or the Hub;
    `subfolder=None` reads the model's own `model_index.json`.

    huggingface_hub retries an unreachable Hub for about 30 s before it fails with "does not
    appear to have a file named config.json"; one request with a 5 s timeout tells first.

    Raises:
        RuntimeError: the config cannot be read, saying why (no such folder, Hub unreachable,
            no access to a gated repo).
    """
    import httpx
    from huggingface_hub import constants

    advice = "Offline, or without access to a gated Hub repo, run the bundled tiny pipeline: MODEL_ID=assets/tiny-flux"
    if not os.path.isdir(model):
        try:
            return cls.load_config(model, subfolder=subfolder, local_files_only=True)
        except OSError:
            pass  # not in the cache: ask the Hub
        try:
            httpx.head(constants.ENDPOINT, timeout=5.0)
        except httpx.HTTPError as exc:
            raise RuntimeError(
                f"cannot load {model!r}: it is not a folder, not in the local Hub cache, and the Hub "
                f"({constants.ENDPOINT}) cannot be reached ({type(exc).__name__}: {exc}). {advice}"
            ) from None
    try:
        return cls.load_config(model, subfolder=subfolder)
    except OSError as exc:
        raise RuntimeError(f"cannot load {model!r} ({exc}). {advice}") from exc


def main(argv: list[str] | None = None) -> int:
    """The command line: compile (or load) on one device, check, print the report. A setting that
    cannot work stops it with one line (`options.stops_in_one_line`)."""
    parser = argparse.ArgumentParser(
        prog="compile.py",
        description=__doc__,
        parents=[Options.parser()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    args = parser.parse_args(argv)
    with stops_in_one_line(parser):
        options = Options.from_env(args)
        if not options.compile:
            parser.error("--no-compile: compile.py compiles; `python app.py --no-compile` serves the eager pipeline")
        if options.devices != "auto":
            given = f"--devices {args.devices}" if args.devices is not None else f"AOT_DEVICES={options.devices}"
            parser.error(
                f"{given}: compile.py compiles on one device (--device, e.g. --device cuda:1); "
                "--devices is for app.py (one replica per device)"
            )
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        pipe = load_pipeline(options)
        start = time.perf_counter()
        report = optimize_(pipe, options)
    ready = time.perf_counter() - start
    side = options.min_side
    row = family(type(pipe).__name__)
    pipe(**row.capture_call(pipe, "a test", side, side), output_type="latent")  # loads + binds every block
    print(report)
    first_step = time.perf_counter() - start
    print(f"packages {report.source} in {ready:.1f} s; first step at {side}x{side} done after {first_step:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
