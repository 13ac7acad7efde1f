"""LoRAs on the compiled tiny pipeline (CPU): fused at startup, switched per request, never ignored.

References are the eager pipeline with the same LoRAs loaded by diffusers + peft
(`load_lora_weights`, `set_adapters`): peft's own unfused forward, not our arithmetic.
"""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TOLERANCE, generate, load_tiny, optimize, tiny_options
from diffusers import FluxPipeline
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict

from aot import lora, lora_specs
from aot.blocks import rel_error
from aot.pipeline import load_pipeline

LORAS = ROOT / "assets" / "tiny-flux-loras"
A, B = str(LORAS / "a.safetensors"), str(LORAS / "b.safetensors")
SIZES = [(512, 512), (768, 1344)]


def eager_with(**scales: float):
    """The eager tiny pipeline running LoRAs a and/or b through peft, at these scales."""
    pipe = load_tiny()
    for name in scales:
        pipe.load_lora_weights({"a": A, "b": B}[name], adapter_name=name)
    if scales:
        pipe.set_adapters(list(scales), adapter_weights=list(scales.values()))
    return pipe


@pytest.fixture(scope="module")
def references():
    """Eager images per LoRA choice and size."""
    pipes = {None: eager_with(), "a": eager_with(a=1.0), "b": eager_with(b=1.0)}
    return {(name, size): generate(pipe, *size) for name, pipe in pipes.items() for size in SIZES}


@pytest.fixture(scope="module")
def switching(compiled):
    """The compiled tiny pipeline with LoRAs a and b offered per request."""
    pipe = load_tiny()
    adapters = lora.Adapters(pipe, lora_specs.parse(f"{A},{B}"))
    optimize(pipe, tiny_options(), compiled=compiled)
    return pipe, adapters


def test_switching_a_b_none_a_matches_eager_each_time(switching, references):
    pipe, adapters = switching
    for name in ["a", "b", None, "a"]:
        adapters.use(name)
        for size in SIZES:
            expected, actual = references[(name, size)], generate(pipe, *size)
            error = rel_error(actual, expected)
            assert error < TOLERANCE, f"LoRA {name} at {size}: rel. error {error:.2e}"
            if name is not None:  # the LoRA does change the image: the comparison above means something
                assert rel_error(references[(None, size)], expected) > 1e-2


def test_switching_back_restores_the_base_weights_bit_for_bit(switching):
    pipe, adapters = switching
    adapters.use(None)
    base = {name: t.clone() for name, t in pipe.transformer.state_dict().items()}
    adapters.use("b")
    changed = [n for n, t in pipe.transformer.state_dict().items() if not torch.equal(t, base[n])]
    assert "x_embedder.weight" in changed and "proj_out.weight" in changed, "outside the blocks too"
    assert "transformer_blocks.0.attn.to_q.weight" in changed
    adapters.use("a")
    adapters.use(None)
    for name, tensor in pipe.transformer.state_dict().items():
        assert torch.equal(tensor, base[name]), name


def test_an_unknown_lora_is_refused_naming_the_offered_ones(switching):
    _, adapters = switching
    with pytest.raises(ValueError, match="LoRA 'c' is not offered; offered: a, b"):
        adapters.use("c")


@pytest.mark.parametrize("size", SIZES, ids=["min", "non-square"])
def test_a_startup_lora_fused_before_compiling_matches_eager(compiled, size):
    pipe = load_pipeline(tiny_options(lora=f"{A}:0.5"))  # fused into the weights the packages bind
    optimize(pipe, tiny_options(), compiled=compiled)
    expected = generate(eager_with(a=0.5), *size)
    error = rel_error(generate(pipe, *size), expected)
    assert error < TOLERANCE, f"rel. error {error:.2e}"
    assert rel_error(generate(eager_with(a=1.0), *size), expected) > 1e-2, "the scale is applied"


def test_adapter_calls_after_compiling_raise_instead_of_being_ignored(compiled):
    pipe = load_tiny()
    optimize(pipe, tiny_options(), compiled=compiled)
    with pytest.raises(RuntimeError, match=r"load_lora_adapter: .* would be ignored. .*--lora"):
        pipe.load_lora_weights(A)
    with pytest.raises(RuntimeError, match="add_adapter: "):
        pipe.transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
    with pytest.raises(RuntimeError, match="fuse_lora: "):
        pipe.fuse_lora()
    assert generate(pipe, 512, 512, steps=1).isfinite().all(), "the pipeline still works"


def test_a_weight_replaced_after_binding_raises_and_in_place_changes_are_seen(compiled_pipe):
    generate(compiled_pipe, 512, 512, steps=1)  # binds every block
    layer = compiled_pipe.transformer.single_transformer_blocks[1].proj_out
    before = generate(compiled_pipe, 512, 512, steps=1)
    with torch.no_grad():
        layer.weight.mul_(0.5)  # in place: the package reads this memory
    assert rel_error(generate(compiled_pipe, 512, 512, steps=1), before) > 1e-3
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())  # a new tensor the package never saw
    with pytest.raises(RuntimeError, match=r"\(FluxSingleTransformerBlock\): proj_out.weight was replaced"):
        generate(compiled_pipe, 512, 512, steps=1)


def _save(tmp_path, config: LoraConfig, text_encoder: bool = False) -> str:
    """A LoRA for the tiny pipeline saved as diffusers saves one; B random so it is not zero."""
    pipe = load_tiny()
    torch.manual_seed(0)
    pipe.transformer.add_adapter(config)
    layers = {"transformer_lora_layers": get_peft_model_state_dict(pipe.transformer)}
    if text_encoder:
        # peft itself: transformers' add_adapter wants a newer peft than PyPI has (0.21.2)
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), pipe.text_encoder)
        layers["text_encoder_lora_layers"] = get_peft_model_state_dict(pipe.text_encoder)
    FluxPipeline.save_lora_weights(tmp_path, **layers, weight_name="lora.safetensors")
    return str(tmp_path / "lora.safetensors")


@pytest.mark.parametrize(
    ("config", "text_encoder", "message"),
    [
        (LoraConfig(r=2, target_modules=["to_q"]), True, "has layers of text_encoder; only transformer LoRAs"),
        (LoraConfig(r=2, target_modules=["to_q"], use_dora=True), False, "is DoRA; only plain LoRA"),
        (LoraConfig(r=2, target_modules=["to_q"], lora_bias=True), False, "has LoRA biases"),
    ],
    ids=["text-encoder", "dora", "bias"],
)
def test_loras_this_template_cannot_apply_are_refused_with_the_reason(tmp_path, config, text_encoder, message):
    source = _save(tmp_path, config, text_encoder)
    pipe = load_tiny()
    before = {n: t.clone() for n, t in pipe.transformer.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        lora.fuse_(pipe, lora_specs.parse(source))
    assert all(torch.equal(t, before[n]) for n, t in pipe.transformer.state_dict().items()), "nothing changed"


def test_lora_options_parse_and_bad_ones_say_the_syntax(tmp_path):
    specs = lora_specs.parse(f"ghibli=owner/flux-ghibli:0.8, {A}, owner/repo/style.safetensors")
    assert [(s.name, s.source, s.scale) for s in specs] == [
        ("ghibli", "owner/flux-ghibli", 0.8),
        ("a", A, 1.0),
        ("style", "owner/repo/style.safetensors", 1.0),
    ]
    assert specs[2].load_kwargs()["weight_name"] == "style.safetensors"
    assert lora_specs.parse(None) == lora_specs.parse("") == []
    with pytest.raises(ValueError, match=r"use \[name=\]source\[:scale\]"):
        lora_specs.parse("a.safetensors:strong")
    with pytest.raises(ValueError, match="that name means no LoRA"):
        lora_specs.parse(f"none={A}")
    with pytest.raises(ValueError, match="a used twice"):
        lora_specs.parse(f"{A},a={B}")
    with pytest.raises(ValueError, match="neither a file or folder here nor a Hub repo"):
        lora_specs.parse(str(tmp_path / "missing" / "x.safetensors"))[0].check_source()


def test_a_missing_lora_file_stops_startup_before_the_weights_load(tmp_path):
    options = tiny_options(lora_choices=str(tmp_path / "nope.safetensors"))
    with pytest.raises(ValueError, match="nope.safetensors' is neither a file"):
        load_pipeline(options)


def _corrupt(tmp_path, kind: str) -> tuple[str, str, str]:
    """A LoRA source of `kind`, its default name, and the file in it that is broken."""
    if kind == "text":
        path = tmp_path / "notes.safetensors"
        path.write_text("a text file saved under a LoRA's name\n")
        return str(path), "notes", str(path)
    truncated = Path(A).read_bytes()[: Path(A).stat().st_size // 2]
    if kind == "truncated":
        path = tmp_path / "half.safetensors"
        path.write_bytes(truncated)
        return str(path), "half", str(path)
    # A folder: diffusers prefers pytorch_lora_weights.safetensors over the valid file beside it.
    folder = tmp_path / "style"
    folder.mkdir()
    shutil.copyfile(B, folder / "other.safetensors")
    (folder / "pytorch_lora_weights.safetensors").write_bytes(truncated)
    return str(folder), "style", str(folder / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("option", ["lora", "lora_choices"])
@pytest.mark.parametrize("kind", ["text", "truncated", "folder"])
def test_a_corrupt_lora_is_refused_naming_it_before_any_weight_loads(tmp_path, monkeypatch, kind, option):
    # Before: a corrupt AOT_LORA_CHOICES file failed after the compile with a raw SafetensorError.
    source, name, broken = _corrupt(tmp_path, kind)

    def tripwire(*args, **kwargs):
        raise AssertionError("weights were loaded before the LoRAs were checked")

    monkeypatch.setattr(FluxPipeline, "from_pretrained", tripwire)
    message = rf"LoRA {name}: {re.escape(broken)} is not a readable safetensors file \(Error while deserializing header"
    with pytest.raises(ValueError, match=message):
        load_pipeline(tiny_options(**{option: f"{A},{source}"}))


def test_the_file_checked_in_a_folder_is_the_one_diffusers_reads(tmp_path):
    from diffusers.loaders.lora_base import _best_guess_weight_name

    folder = tmp_path / "loras"
    folder.mkdir()
    (folder / "checkpoint-500.safetensors").write_text("skipped by diffusers, so not checked")
    for name in ("x.safetensors", "y.safetensors", "z.safetensors"):
        shutil.copyfile(A, folder / name)
    spec = lora_specs.LoraSpec("loras", str(folder))
    spec.check_source()
    assert os.path.basename(spec.local_file()) == _best_guess_weight_name(str(folder))
    shutil.copyfile(B, folder / "pytorch_lora_weights.safetensors")
    assert os.path.basename(spec.local_file()) == _best_guess_weight_name(str(folder)) == lora_specs.DIFFUSERS_LORA_FILE
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"LoRA empty: the folder {re.escape(str(empty))} holds no .safetensors"):
        lora_specs.LoraSpec("empty", str(empty)).check_source()


def test_read_errors_name_the_lora(tmp_path):
    # lora.read without the startup check (bench.py, code using lora.Adapters directly).
    source, _, _ = _corrupt(tmp_path, "text")
    pipe = load_tiny()
    with pytest.raises(ValueError, match=rf"LoRA broken: {re.escape(source)} is not a readable safetensors file \("):
        lora.read(pipe, lora_specs.LoraSpec("broken", source))
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="LoRA gone: cannot read .*empty: Error no file named pytorch_lora_weights"):
        lora.read(pipe, lora_specs.LoraSpec("gone", str(tmp_path / "empty")))
