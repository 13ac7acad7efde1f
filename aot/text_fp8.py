"""FP8 weights for a pipeline's text encoders: fewer bytes to move onto each new GPU worker.

A text encoder runs once per request, so its speed barely matters; its bytes do: a new ZeroGPU
worker first moves every weight onto the GPU, at the speed of its disk, and a text encoder can be a
large share of them (FLUX.1-dev's T5-XXL; its bytes in bf16 and FP8 are in BENCHMARKS.md).

The contract:

* What is quantized: the `torch.nn.Linear` layers of each text encoder (`text_encoders`), with
  torchao's `Float8WeightOnlyConfig`: the weight is stored as float8_e4m3fn with one float32 scale
  per output row (a `Float8Tensor`); each call dequantizes it to its original dtype and runs a plain
  `torch.matmul`. No FP8 GEMM runs, so there is no alignment or width rule and no compute-capability
  rule: only casts, elementwise ops and a matmul in the weight's dtype, which run wherever torch
  runs (the tests run it on the CPU), compute capability 12.0 GPUs included (where the row-wise
  scaled FP8 GEMMs of the blocks' FP8 are refused). Activations, embeddings, norms and biases stay
  as they are.
* Layers kept as they are, counted by reason: a weight shared with another module (a tied `lm_head`:
  quantizing it would keep both copies), a weight that is not a plain floating Parameter, a weight
  with an all-zero row (torchao's scale is 0 there and the row dequantizes to NaN) and, in a trial,
  a layer the prompt does not run (a vision tower: nothing would have checked it) or one in the
  leading blocks `auto` keeps to bring the encoder within the bound. Layers already
  in FP8 are left alone, so quantizing twice changes nothing. An fp32 weight inside a bf16/fp16 model
  (T5's `wo`, which transformers keeps in fp32 under float16) is quantized like the others and
  dequantizes back to fp32, so its matmul still runs in fp32.
* `trial_` (GPU; on ZeroGPU inside the startup GPU call) quantizes each encoder in place and keeps
  FP8 where the encoder's outputs stay within `TEXT_FP8_MAX_REL_ERROR` of its own outputs before,
  with its first blocks as they were where that is what it takes; elsewhere it puts the original
  Parameter objects back. It returns a `TextFP8`: plain data, picklable.
* `apply_` (no GPU work: in a ZeroGPU main process the weights are emulated CUDA tensors) quantizes
  exactly the layers a `TextFP8` lists: the trial's FP8 weights, bit for bit on the same device
  (abs, amax, one IEEE division and a round-to-nearest cast: the same on CPU and CUDA, unchecked).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from aot.blocks import rel_error, tensor_bytes
from aot.fp8 import FP8_MAX_REL_ERROR
from aot.plans import Decision, brief
from aot.zerogpu_limits import ON_ZEROGPU

# An encoder's outputs in FP8 vs its own outputs before (max over every hidden state, the pooled
# output, logits); above this `auto` keeps leading blocks as they are, then restores it. The blocks'
# bound: the same FP8 format, measured the same way. e4m3 per-row rounding moves each weight by a
# few percent; the tiny pipelines' random encoders stay within this bound with every layer in FP8
# except tiny-flux's CLIP (BENCHMARKS.md). Real models' errors are not measured yet (no weights here).
TEXT_FP8_MAX_REL_ERROR = FP8_MAX_REL_ERROR
GB = 1e9
_HIGH = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes Float8Tensor dequantizes to


def text_encoders(pipe: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's text encoders by component name, in component order: the transformers
    `PreTrainedModel`s among `pipe.components` whose name starts with `text_encoder` (FLUX.1:
    `text_encoder` (CLIP) and `text_encoder_2` (T5); Qwen-Image, Z-Image, FLUX.2: `text_encoder`)."""
    from transformers import PreTrainedModel  # heavy: at first use

    return {
        name: component
        for name, component in pipe.components.items()
        if name.startswith("text_encoder") and isinstance(component, PreTrainedModel)
    }


def is_fp8(linear: torch.nn.Linear) -> bool:
    """Whether the layer's weight is torchao's FP8 weight-only `Float8Tensor`."""
    from torchao.quantization import Float8Tensor  # heavy: at first use

    return isinstance(linear.weight, Float8Tensor) and linear.weight.act_quant_kwargs is None


def config() -> Any:
    """torchao's FP8 weight-only config: float8_e4m3fn weights, one float32 scale per output row.

    `set_inductor_config=False`: quantizing must not change Inductor's global settings.
    """
    from torchao.quantization import Float8WeightOnlyConfig, PerRow  # heavy: at first use

    return Float8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)


def _plan(encoder: torch.nn.Module) -> tuple[dict[str, torch.nn.Linear], dict[str, str], int]:
    """(eligible layers by path, kept layers' path -> reason, layers already in FP8)."""
    owners: dict[int, int] = {}
    for module in encoder.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
    eligible, kept, already = {}, {}, 0
    for path, module in encoder.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if is_fp8(module):
            already += 1
        elif type(weight) is not torch.nn.Parameter:
            kept[path] = f"a {type(weight).__name__} weight"
        elif weight.dtype not in _HIGH:
            kept[path] = f"a {weight.dtype} weight"
        elif weight.device.type == "meta":
            kept[path] = "a meta-device weight"
        elif owners[id(weight)] > 1:
            kept[path] = "a weight shared with another module"
        else:
            eligible[path] = module
    return eligible, kept, already


def _quantize_(
    layers: Mapping[str, torch.nn.Linear], originals: dict[str, torch.nn.Parameter], kept: dict[str, str]
) -> None:
    """FP8-quantize `layers` in place, recording each original Parameter in `originals` before its
    layer changes (so a failure midway can be undone). A layer with an all-zero row gets its
    Parameter back at once and goes into `kept`."""
    from torchao.quantization import quantize_  # heavy: at first use

    fp8 = config()
    with torch.no_grad():
        for path, linear in layers.items():
            originals[path] = linear.weight
            quantize_(linear, fp8, filter_fn=None)
            if not bool((linear.weight.scale != 0).all()):
                _restore_(layers, {path: originals.pop(path)})
                kept[path] = "an all-zero row (FP8 scale 0: NaN)"


def _restore_(layers: Mapping[str, torch.nn.Linear], originals: Mapping[str, torch.nn.Parameter]) -> None:
    """Put the original Parameter objects back (and drop the `extra_repr` torchao patched in)."""
    for path, original in originals.items():
        layers[path].weight = original
        layers[path].__dict__.pop("extra_repr", None)


def quantize_encoder_(encoder: torch.nn.Module, layers: Sequence[str] | None = None) -> tuple[int, int]:
    """FP8-quantize `encoder`'s linear layers in place: every eligible one, or exactly the paths in
    `layers` (module paths inside `encoder`, e.g. `encoder.block.0.layer.0.SelfAttention.q`).

    Idempotent: layers already in FP8 are skipped. Returns (FP8, kept): the linear layers whose
    weight is FP8 after the call (any that were before included) and those left as they are.

    Raises:
        ValueError: a path in `layers` is not a linear layer of `encoder` or cannot take FP8 (its
            weight is shared, not a floating Parameter, or has an all-zero row); then nothing changed.
    """
    eligible, kept, _ = _plan(encoder)
    name = type(encoder).__name__
    if layers is not None:
        modules = dict(encoder.named_modules())
        for path in layers:
            if not isinstance(modules.get(path), torch.nn.Linear):
                raise ValueError(f"{name}: no linear layer {path!r}")
            if path in kept:
                raise ValueError(f"{name}.{path} cannot take FP8 weights: {kept[path]}")
        eligible = {path: eligible[path] for path in layers if path in eligible}
    originals: dict[str, torch.nn.Parameter] = {}
    try:
        _quantize_(eligible, originals, kept)
    except BaseException:
        _restore_(eligible, originals)
        raise
    refused = sorted(kept.keys() & set(layers or ()))
    if refused:
        _restore_(eligible, originals)
        raise ValueError(f"{name}.{refused[0]} cannot take FP8 weights: {kept[refused[0]]}")
    linears = [m for m in encoder.modules() if isinstance(m, torch.nn.Linear)]
    fp8 = sum(is_fp8(m) for m in linears)
    return fp8, len(linears) - fp8


@dataclass(frozen=True)
class EncoderTrial:
    """One text encoder's trial, as plain data.

    name: the pipeline component (`text_encoder_2`); model: its class (`T5EncoderModel`).
    fp8: whether it ends in FP8. layers: the paths of its linear layers in FP8 (what `apply_`
        quantizes); empty where it was restored.
    kept: linear layers left as they are, counted by reason; a restored encoder's tried layers
        count under "restored".
    bytes_before, bytes_after: `tensor_bytes` of the encoder before and after the trial, in bytes.
    rel_error: its outputs in FP8 vs before (`blocks.rel_error`; inf for NaN); None where no FP8
        output was compared.
    note: why it was restored or nothing was tried; "" where it is in FP8.
    """

    name: str
    model: str
    fp8: bool
    layers: tuple[str, ...]
    kept: dict[str, int]
    bytes_before: int
    bytes_after: int
    rel_error: float | None = None
    note: str = ""

    def __str__(self) -> str:
        state = f"FP8 in {len(self.layers)} linear layers" if self.fp8 else "kept as it is"
        if self.kept:
            state += " (kept: " + ", ".join(f"{n} {why}" for why, n in self.kept.items()) + ")"
        text = f"{self.name} ({self.model}): {state}, {self.bytes_before / GB:.3g} -> {self.bytes_after / GB:.3g} GB"
        if self.rel_error is not None:
            text += f", rel. error {self.rel_error:.1e}"
        return text + (f": {self.note}" if self.note else "")


@dataclass(frozen=True)
class TextFP8:
    """What `trial_` decided, as plain data (picklable: it crosses back from a ZeroGPU worker).

    option: the request (auto, on, off). encoders: one row per text encoder tried. reason: why
    none was tried (off: "requested"; no text encoder).
    """

    option: str
    encoders: tuple[EncoderTrial, ...] = ()
    reason: str = ""

    @property
    def layers(self) -> dict[str, tuple[str, ...]]:
        """The linear layers in FP8 by component: what `apply_` quantizes."""
        return {e.name: e.layers for e in self.encoders if e.fp8}

    @property
    def decision(self) -> Decision:
        """`text_fp8: on|off (reason)`: on where any encoder is in FP8; the reason names every encoder."""
        reason = self.reason or "; ".join(str(e) for e in self.encoders)
        return Decision(
            "text_fp8", "on" if self.layers else "off", reason if self.option == "off" else f"{self.option}: {reason}"
        )

    def __str__(self) -> str:
        return str(self.decision)


def trial_(pipe: Any, prompt: str, option: str = "auto", max_rel_error: float = TEXT_FP8_MAX_REL_ERROR) -> TextFP8:
    """Try FP8 weights in each text encoder of `pipe`, in place; keep them where they hold up.

    Per encoder: run it on `prompt` as it is (its tokenizer's `input_ids`, [1, tokens] int64, on the
    encoder's device, with `output_hidden_states=True`), FP8-quantize the linear layers that run
    used (the rules of `quantize_encoder_`), run it again and compare every floating output tensor
    (each hidden state, the pooled output, logits) with `blocks.rel_error`. `auto` keeps FP8 within
    `max_rel_error`; above it, it puts the encoder's blocks back in their own dtype one at a time,
    first block first, and runs it again after each, until within (`_keep_leading_blocks_`: an early
    block's rounding passes through every later one); where even all but the last block back is
    above, or anything raises, it puts every original Parameter object back and says why. Outside
    ZeroGPU, where the weights move to the GPU once, `auto` tries nothing. `on` keeps every layer in
    FP8 at any finite error and raises where it cannot run (the originals back first). `off` touches
    nothing.

    Each encoder runs twice, plus once per block put back, with its original weights beside the FP8
    ones at the peak (+1/2 of a bf16 encoder's bytes, one encoder at a time); the originals of the
    layers kept in FP8 are freed when it is done. On ZeroGPU call it inside the startup GPU call,
    then `apply_` the result in the main process.

    Raises:
        RuntimeError: `on` and the pipeline has no text encoder, an encoder has no tokenizer or its
            run raised, or its FP8 output is not finite.
        ValueError: `option` is not auto, on or off.
    """
    if option not in ("auto", "on", "off"):
        raise ValueError(f"text_fp8={option!r}: allowed values are auto, on, off")
    if option == "off":
        return TextFP8(option, reason="requested")
    if option == "auto" and not ON_ZEROGPU:
        return TextFP8(
            option,
            reason="only on ZeroGPU, where each new worker moves the weights to the GPU "
            "(--text-fp8 on halves the text encoders' memory here too)",
        )
    encoders = text_encoders(pipe)
    if not encoders:
        if option == "on":
            raise RuntimeError("text_fp8=on cannot run: the pipeline has no text encoder. Use --text-fp8 auto or off.")
        return TextFP8(option, reason="the pipeline has no text encoder")
    return TextFP8(
        option,
        tuple(_trial_one_(pipe, name, encoder, prompt, option, max_rel_error) for name, encoder in encoders.items()),
    )


def _trial_one_(
    pipe: Any, name: str, encoder: torch.nn.Module, prompt: str, option: str, max_rel_error: float
) -> EncoderTrial:
    before = tensor_bytes(encoder)
    eligible, kept, already = _plan(encoder)
    originals: dict[str, torch.nn.Parameter] = {}

    def row(fp8: bool, error: float | None = None, note: str = "") -> EncoderTrial:
        counts: dict[str, int] = {}
        for why in kept.values():
            counts[why] = counts.get(why, 0) + 1
        if not fp8 and originals:
            counts["restored"] = len(originals)
        layers = tuple(p for p, m in encoder.named_modules() if isinstance(m, torch.nn.Linear) and is_fp8(m))
        return EncoderTrial(
            name, type(encoder).__name__, fp8, layers if fp8 else (), counts, before, tensor_bytes(encoder), error, note
        )

    def restore_or_raise(note: str, error: float | None = None, cause: Exception | None = None) -> EncoderTrial:
        _restore_(eligible, originals)
        if option == "on":
            raise RuntimeError(f"text_fp8=on cannot run: {name}: {note}. Use --text-fp8 auto or off.") from cause
        return row(False, error, note)

    training = encoder.training
    encoder.eval()  # dropout off for both runs (from_pretrained leaves encoders in eval mode anyway)
    try:
        ids = _input_ids(pipe, name, prompt).to(encoder.device)
        ran: dict[str, None] = {}  # in the order the prompt runs them
        hooks = [m.register_forward_pre_hook(lambda *_, p=p: ran.setdefault(p)) for p, m in eligible.items()]
        try:
            reference = _outputs(encoder, ids)
        finally:
            for hook in hooks:
                hook.remove()
        kept.update(dict.fromkeys(sorted(eligible.keys() - ran), "not run by a text prompt"))
        tried = {path: eligible[path] for path in ran}
        if not tried:
            return row(already > 0, note="already in FP8" if already else "no linear layer to quantize")
        _quantize_(tried, originals, kept)
        error = rel_error(_outputs(encoder, ids), reference)
        searched = 0
        if option == "auto" and not error <= max_rel_error:
            error, searched = _keep_leading_blocks_(
                encoder, ids, reference, originals, tried, kept, error, max_rel_error
            )
    except Exception as exc:
        return restore_or_raise(brief(exc), cause=exc)
    finally:
        encoder.train(training)
    if error == float("inf"):
        return restore_or_raise("its FP8 output has NaN or inf", error)
    if option == "auto" and not error <= max_rel_error:
        also = ", also with every block but its last as it was" if searched else ""
        return restore_or_raise(f"above {max_rel_error:.0e}{also}", error)
    return row(True, error)


def blocks(encoder: torch.nn.Module, paths: Sequence[str]) -> dict[str, list[str]]:
    """`paths` (linear layers of `encoder`) by the repeated block holding each, blocks and layers in
    the order of `paths`. The block classes are those transformers keeps whole on one device: the
    `_no_split_modules` of `encoder` and of every model nested in it (T5: `T5Block`; CLIP:
    `CLIPEncoderLayer`; Mistral3 names none, its language model `MistralDecoderLayer`). A block is
    the outermost module of such a class; a layer in none (a projection head) is left out."""
    from transformers import PreTrainedModel  # heavy: at first use

    classes = {n for m in encoder.modules() if isinstance(m, PreTrainedModel) for n in m._no_split_modules or ()}
    starts = {path for path, module in encoder.named_modules() if type(module).__name__ in classes}
    grouped: dict[str, list[str]] = {}
    for path in paths:
        parts = path.split(".")
        block = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in starts), None)
        if block is not None:
            grouped.setdefault(block, []).append(path)
    return grouped


def _keep_leading_blocks_(
    encoder: torch.nn.Module,
    ids: torch.Tensor,
    reference: list[torch.Tensor],
    originals: Mapping[str, torch.nn.Parameter],
    layers: Mapping[str, torch.nn.Linear],
    kept: dict[str, str],
    error: float,
    max_rel_error: float,
) -> tuple[float, int]:
    """Put the encoder's blocks (`blocks`) back as they were one at a time, in the order the prompt
    runs them (`originals`' order: the layers in FP8), until its outputs are within `max_rel_error`
    (`error`: theirs with every layer in FP8); the last block stays in FP8. Returns (the last run's
    error, the blocks put back); where within, the layers put back are in `kept`, else the caller
    restores the rest.

    Why the leading ones: an early block's rounding passes through every block after it. The bench's
    random T5-XXL (24 blocks) is 2.5e-1 from its own outputs with every layer in FP8, 1.2e-1 with
    its first block back in bf16 and 8.7e-2 with two (BENCHMARKS.md, "Text encoders in FP8").
    """
    grouped = list(blocks(encoder, list(originals)).values())
    back: list[str] = []
    for count, paths in enumerate(grouped[:-1], 1):
        _restore_(layers, {path: originals[path] for path in paths})
        back += paths
        error = rel_error(_outputs(encoder, ids), reference)
        if error <= max_rel_error:
            kept.update(dict.fromkeys(back, f"in its first {count} of {len(grouped)} blocks, kept for the bound"))
            return error, count
    return error, len(grouped[:-1])


def _input_ids(pipe: Any, name: str, prompt: str) -> torch.Tensor:
    """The prompt's token ids, [1, tokens] int64, from the tokenizer paired with encoder `name`:
    diffusers pairs them by name in every pipeline here (`text_encoder_2` -> `tokenizer_2`), and where
    that component is a processor, its own tokenizer reads the text.

    Raises:
        RuntimeError: no such tokenizer.
    """
    tokenizer = pipe.components.get(name.replace("text_encoder", "tokenizer"))
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's (e.g. FLUX.2's PixtralProcessor)
    if not callable(tokenizer):
        raise RuntimeError(f"no tokenizer for {name} (component {name.replace('text_encoder', 'tokenizer')!r})")
    return tokenizer(prompt, truncation=True, return_tensors="pt").input_ids


def _outputs(encoder: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every floating tensor the encoder returns for `ids` (a KV cache, if one comes back, is dropped)."""
    kwargs: dict[str, Any] = {"input_ids": ids, "output_hidden_states": True}
    if "use_cache" in inspect.signature(encoder.forward).parameters:
        kwargs["use_cache"] = False
    with torch.no_grad():
        out = encoder(**kwargs)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def apply_(pipe: Any, trial: TextFP8 | Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Quantize exactly the layers `trial` (a `TextFP8`, or its `layers`: component -> layer paths)
    keeps in FP8, in place, without running anything: for a ZeroGPU main process after the trial
    ran in the GPU worker (its copy of the weights is discarded). Idempotent: where the trial ran in
    this process, nothing changes. From equal weights the FP8 weights equal the trial's bit for bit.

    Returns the linear layers in FP8 per component.

    Raises:
        ValueError: a component is not a text encoder of `pipe`, or a layer path does not fit
            (`quantize_encoder_`).
    """
    layers = trial.layers if isinstance(trial, TextFP8) else trial
    encoders = text_encoders(pipe)
    counts = {}
    for name, paths in layers.items():
        if name not in encoders:
            raise ValueError(f"{name} is not a text encoder of {type(pipe).__name__} (it has {', '.join(encoders)})")
        counts[name] = quantize_encoder_(encoders[name], paths)[0]
    return counts
