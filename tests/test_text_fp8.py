"""text_fp8 on the tiny pipelines, on the CPU: torchao's FP8 weight-only layers run there (they dequantize
the weight and run a plain matmul), so the trial, the restore and `apply_` all run here, in seconds."""

import pickle

import pytest
import torch
from conftest import ROOT, generate, load_tiny
from diffusers import DiffusionPipeline

from aot import text_fp8
from aot.blocks import rel_error, tensor_bytes
from aot.text_fp8 import TextFP8, apply_, is_fp8, quantize_encoder_, text_encoders, trial_

PROMPT = "a photo of a red fox in fresh snow, morning light, " * 4
# tiny-flux's image (256x256, 2 steps, values in [0, 1]) with both encoders in FP8 vs eager: measured
# 1.6e-3 to 1.7e-3 relative over seeds 0-2 (T5 alone in FP8: 5e-4). Changing one word of the prompt
# ("mat" -> "rug") moves it by 7.4e-3: 5e-3 leaves 3x room and still fails a prompt the encoders misread.
IMAGE_TOLERANCE = 5e-3


@pytest.fixture(autouse=True)
def on_zerogpu(monkeypatch):
    """`auto` tries FP8 on ZeroGPU only (where every new worker moves the weights); these tests
    check the trial itself, so they run it as on ZeroGPU. The ZeroGPU tests run the real thing."""
    monkeypatch.setattr(text_fp8, "ON_ZEROGPU", True)


def test_auto_tries_nothing_off_zerogpu(monkeypatch):
    monkeypatch.setattr(text_fp8, "ON_ZEROGPU", False)
    pipe = load_tiny()
    before = parameters(pipe)
    result = trial_(pipe, PROMPT, "auto")
    assert result.decision.value == "off" and "auto: only on ZeroGPU" in result.decision.reason, result
    assert all(param is before[key] for key, param in parameters(pipe).items())


def load(name: str, **kwargs):
    return DiffusionPipeline.from_pretrained(ROOT / "assets" / name, **kwargs)


def parameters(pipe) -> dict[tuple[str, str], torch.nn.Parameter]:
    """Every text-encoder parameter object by (component, name)."""
    return {(c, n): p for c, e in text_encoders(pipe).items() for n, p in e.named_parameters(remove_duplicate=False)}


def linears(encoder) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)}


def assert_untouched(pipe, before: dict, values: dict) -> None:
    """The same Parameter objects as `before`, holding `values`, and no FP8 layer left."""
    after = parameters(pipe)
    assert after.keys() == before.keys()
    for key, param in after.items():
        assert param is before[key], f"{key} is another Parameter object"
        assert type(param) is torch.nn.Parameter and torch.equal(param, values[key]), key
    for encoder in text_encoders(pipe).values():
        for path, linear in linears(encoder).items():
            assert not is_fp8(linear) and "extra_repr" not in linear.__dict__, path


def snapshot(pipe):
    before = parameters(pipe)
    return before, {k: p.detach().clone() for k, p in before.items()}


def test_text_encoders_by_component_name():
    assert {n: type(e).__name__ for n, e in text_encoders(load_tiny()).items()} == {
        "text_encoder": "CLIPTextModel",
        "text_encoder_2": "T5EncoderModel",
    }
    assert list(text_encoders(load("tiny-qwen-image"))) == ["text_encoder"]


def test_on_puts_every_linear_layer_of_tiny_flux_in_fp8_and_the_image_stays_close():
    pipe, eager = load_tiny(), load_tiny()
    result = trial_(pipe, PROMPT, "on")
    assert result.decision.name == "text_fp8" and result.decision.value == "on"
    for row in result.encoders:
        encoder = text_encoders(pipe)[row.name]
        layers = linears(encoder)
        assert row.fp8 and len(row.layers) == len(layers) > 0 and row.kept == {}, row
        assert all(is_fp8(layers[path]) for path in row.layers)
        # float32 [out, in] weight -> float8 data + one float32 scale per row
        saved = sum(3 * m.in_features * m.out_features - 4 * m.out_features for m in layers.values())
        assert row.bytes_before - row.bytes_after == saved > 0
        assert row.bytes_after == tensor_bytes(encoder)
        assert 0 < row.rel_error < 0.5, row
        assert row.name in str(result) and f"{row.rel_error:.1e}" in str(result)
    assert pickle.loads(pickle.dumps(result)) == result
    for seed in (0, 1):
        error = rel_error(generate(pipe, 256, 256, seed=seed), generate(eager, 256, 256, seed=seed))
        assert 0 < error < IMAGE_TOLERANCE, error


def test_auto_keeps_clips_first_block_in_bf16_where_all_of_it_in_fp8_is_above_the_bound():
    """tiny-flux's random 32-wide CLIP turns FP8's ~2.5% weight error into 1.4e-1 (> 1e-1), its T5 into
    3.2e-2; with CLIP's first block back in bf16 it is 7.5e-2, so `auto` keeps only that block."""
    everything = {row.name: row for row in trial_(load_tiny(), PROMPT, "on").encoders}["text_encoder"]
    assert everything.rel_error > text_fp8.TEXT_FP8_MAX_REL_ERROR, everything
    pipe = load_tiny()
    before, values = snapshot(pipe)
    result = trial_(pipe, PROMPT, "auto")
    rows = {row.name: row for row in result.encoders}
    clip, layers = rows["text_encoder"], linears(pipe.text_encoder)
    assert clip.fp8 and clip.rel_error <= text_fp8.TEXT_FP8_MAX_REL_ERROR < everything.rel_error, clip
    assert clip.kept == {"in its first 1 of 2 blocks, kept for the bound": 6}, clip
    first = set(text_fp8.blocks(pipe.text_encoder, list(layers))["encoder.layers.0"])
    assert len(first) == 6 and set(clip.layers) == set(layers) - first
    for path in first:
        key = ("text_encoder", f"{path}.weight")
        assert not is_fp8(layers[path]) and layers[path].weight is before[key], path
        assert torch.equal(layers[path].weight, values[key]) and "extra_repr" not in layers[path].__dict__, path
    assert all(is_fp8(layers[path]) for path in clip.layers)
    assert clip.bytes_before > clip.bytes_after > everything.bytes_after
    said = str(clip)
    assert "kept: 6 in its first 1 of 2 blocks, kept for the bound" in said and said.count("rel. error") == 1, said
    assert rows["text_encoder_2"].fp8 and rows["text_encoder_2"].kept == {}
    assert result.layers.keys() == {"text_encoder", "text_encoder_2"} and result.decision.value == "on"

    fresh = load_tiny()
    assert apply_(fresh, result) == {name: len(paths) for name, paths in result.layers.items()}
    for name, encoder in text_encoders(fresh).items():
        assert {p for p, m in linears(encoder).items() if is_fp8(m)} == set(result.layers[name]), name
    fc1 = "encoder.layers.1.mlp.fc1"
    assert torch.equal(linears(fresh.text_encoder)[fc1].weight.qdata, layers[fc1].weight.qdata)


def test_blocks_are_the_classes_transformers_keeps_whole_and_heads_are_left_out():
    def classes(encoder, paths):
        grouped = text_fp8.blocks(encoder, paths)
        modules = dict(encoder.named_modules())
        return {type(modules[block]).__name__ for block in grouped}, grouped

    flux = load_tiny()
    for encoder, block_class in [(flux.text_encoder_2, "T5Block"), (flux.text_encoder, "CLIPEncoderLayer")]:
        paths = list(linears(encoder))
        names, grouped = classes(encoder, paths)
        assert names == {block_class} and len(grouped) == 2, grouped
        assert [p for ps in grouped.values() for p in ps] == paths  # every layer is in a block, in order
    qwen = load("tiny-qwen-image").text_encoder  # Qwen2.5-VL: its vision tower's blocks too, and lm_head in none
    names, grouped = classes(qwen, list(linears(qwen)))
    assert names == {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"}
    assert "lm_head" in linears(qwen) and all("lm_head" not in ps for ps in grouped.values())
    mistral = load("tiny-flux2").text_encoder  # Mistral3 names no block class; its language model does
    assert type(mistral)._no_split_modules is None
    names, grouped = classes(mistral, list(linears(mistral)))
    assert "MistralDecoderLayer" in names and len(grouped) > 1


def test_a_zero_row_in_a_leading_block_stays_as_it_is_and_the_rest_of_the_block_is_put_back():
    pipe = load_tiny()
    fc1 = linears(pipe.text_encoder)["encoder.layers.0.mlp.fc1"]
    with torch.no_grad():
        fc1.weight[3] = 0
    clip = {row.name: row for row in trial_(pipe, PROMPT, "auto").encoders}["text_encoder"]
    assert clip.fp8 and clip.rel_error <= text_fp8.TEXT_FP8_MAX_REL_ERROR, clip
    assert clip.kept == {"an all-zero row (FP8 scale 0: NaN)": 1, "in its first 1 of 2 blocks, kept for the bound": 5}
    assert not is_fp8(fc1) and len(clip.layers) == 6


def test_a_failed_trial_gives_back_the_exact_parameters():
    pipe = load_tiny()
    before, values = snapshot(pipe)
    result = trial_(pipe, PROMPT, "auto", max_rel_error=0.0)
    assert result.decision.value == "off" and result.layers == {}
    note = "above 0e+00, also with every block but its last as it was"
    assert all(row.note == note and row.kept == {"restored": 12} for row in result.encoders)
    assert_untouched(pipe, before, values)


def test_an_encoder_that_raises_in_fp8_is_restored(monkeypatch):
    """A stand-in for model code that cannot take a tensor-subclass weight: T5's forward raises once its
    weights are FP8 (the reference run passes)."""
    pipe = load_tiny()
    t5 = pipe.text_encoder_2
    forward = t5.forward

    def refuses_fp8(*args, **kwargs):
        if any(is_fp8(m) for m in linears(t5).values()):
            raise NotImplementedError("this model code needs plain weights")
        return forward(*args, **kwargs)

    monkeypatch.setattr(t5, "forward", refuses_fp8)
    before, values = snapshot(pipe)
    before = {k: p for k, p in before.items() if k[0] == "text_encoder_2"}
    result = trial_(pipe, PROMPT, "auto", max_rel_error=1.0)
    row = {r.name: r for r in result.encoders}["text_encoder_2"]
    assert not row.fp8 and row.note == "NotImplementedError: this model code needs plain weights"
    assert row.kept == {"restored": 12} and "needs plain weights" in result.decision.reason
    assert {r.name: r.fp8 for r in result.encoders} == {"text_encoder": True, "text_encoder_2": False}
    for key, param in before.items():
        assert parameters(pipe)[key] is param and torch.equal(param, values[key])
    assert not any(is_fp8(m) for m in linears(t5).values())

    with pytest.raises(RuntimeError, match="text_fp8=on cannot run: text_encoder_2: NotImplementedError"):
        trial_(pipe, PROMPT, "on")
    for key, param in before.items():
        assert parameters(pipe)[key] is param
    assert not any(is_fp8(m) for m in linears(t5).values())


def test_off_touches_nothing():
    pipe = load_tiny()
    before, values = snapshot(pipe)
    result = trial_(pipe, PROMPT, "off")
    assert str(result.decision) == "text_fp8: off (requested)" and apply_(pipe, result) == {}
    assert_untouched(pipe, before, values)
    with pytest.raises(ValueError, match="allowed values are auto, on, off"):
        trial_(pipe, PROMPT, "yes")


def test_apply_on_a_fresh_pipeline_gives_the_trial_weights_bit_for_bit():
    tried, fresh = load_tiny(), load_tiny()
    result = trial_(tried, PROMPT, "on")
    assert apply_(fresh, pickle.loads(pickle.dumps(result))) == {"text_encoder": 12, "text_encoder_2": 12}
    for name, encoder in text_encoders(fresh).items():
        assert tensor_bytes(encoder) == tensor_bytes(text_encoders(tried)[name])
        want = dict(text_encoders(tried)[name].named_parameters())
        for path, param in encoder.named_parameters():
            if is_fp8(linears(encoder).get(path.removesuffix(".weight"), torch.nn.Linear(1, 1))):
                assert is_fp8(linears(text_encoders(tried)[name])[path.removesuffix(".weight")])
                assert torch.equal(param.qdata.view(torch.uint8), want[path].qdata.view(torch.uint8)), path
                assert torch.equal(param.scale, want[path].scale), path
            else:
                assert type(param) is torch.nn.Parameter and torch.equal(param, want[path]), path
    assert torch.equal(generate(fresh, 256, 256), generate(tried, 256, 256))
    # idempotent: a second apply_ (or the trial's own process applying it) changes nothing
    same = parameters(fresh)
    assert apply_(fresh, result) == {"text_encoder": 12, "text_encoder_2": 12}
    assert all(parameters(fresh)[k] is p for k, p in same.items())
    assert trial_(fresh, PROMPT, "on").layers == result.layers


def test_apply_refuses_what_does_not_fit():
    pipe = load_tiny()
    before, values = snapshot(pipe)
    with pytest.raises(ValueError, match="text_encoder_3 is not a text encoder of FluxPipeline"):
        apply_(pipe, {"text_encoder_3": ()})
    with pytest.raises(ValueError, match="no linear layer 'encoder.nope'"):
        apply_(pipe, {"text_encoder": ("encoder.nope",)})
    assert_untouched(pipe, before, values)


def test_a_zero_row_stays_out_of_fp8():
    """torchao's per-row scale of an all-zero row is 0, and 0 / 0 dequantizes that row to NaN."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight[1] = 0
    kept = model[0].weight
    with pytest.raises(ValueError, match=r"0 cannot take FP8 weights: an all-zero row"):
        quantize_encoder_(model, ["0", "1"])
    assert model[0].weight is kept and not is_fp8(model[1])
    assert quantize_encoder_(model) == (1, 1) and model[0].weight is kept and is_fp8(model[1])
    assert quantize_encoder_(model) == (1, 1)  # idempotent
    assert torch.isfinite(model(torch.ones(2, 8))).all()


@pytest.mark.parametrize(
    "name, kept",
    [
        # Qwen3ForCausalLM: lm_head shares the embedding's weight (FP8 there would keep both copies)
        ("tiny-flux2-klein", {"a weight shared with another module": 1}),
        # Qwen2.5-VL: a text prompt does not run the vision tower, so nothing would check it in FP8
        ("tiny-qwen-image", {"not run by a text prompt": 12}),
        # Mistral3 (FLUX.2 dev): both, the Pixtral vision tower and the multimodal projector
        ("tiny-flux2", {"a weight shared with another module": 1, "not run by a text prompt": 10}),
        ("tiny-z-image", {}),
        ("tiny-chroma", {}),
    ],
)
def test_other_families(name, kept):
    if name == "tiny-flux2":
        pytest.importorskip("torchvision", reason="FLUX.2's PixtralProcessor needs torchvision")
    pipe = load(name)
    result = trial_(pipe, PROMPT, "on")
    (row,) = result.encoders
    encoder = text_encoders(pipe)["text_encoder"]
    assert row.fp8 and row.kept == kept and len(row.layers) + sum(kept.values()) == len(linears(encoder))
    assert row.bytes_after < row.bytes_before and row.rel_error < text_fp8.TEXT_FP8_MAX_REL_ERROR
    if name == "tiny-flux2-klein":
        assert encoder.lm_head.weight is encoder.model.embed_tokens.weight


def test_t5_wo_kept_in_fp32_under_float16_dequantizes_to_fp32():
    """transformers keeps T5's `wo` in fp32 for float16 models; in FP8 it still dequantizes to fp32,
    so T5's cast of its input to `wo.weight.dtype` keeps that matmul in fp32."""
    pipe = load("tiny-flux", dtype=torch.float16)
    wo = pipe.text_encoder_2.encoder.block[0].layer[1].DenseReluDense.wo
    assert wo.weight.dtype == torch.float32
    result = trial_(pipe, PROMPT, "auto")
    row = {r.name: r for r in result.encoders}["text_encoder_2"]
    assert row.fp8 and is_fp8(wo) and wo.weight.dtype == torch.float32 and wo.weight.qdata.dtype == torch.float8_e4m3fn
    assert row.rel_error < text_fp8.TEXT_FP8_MAX_REL_ERROR


def test_nothing_to_try():
    pipe = load_tiny()
    pipe.text_encoder, pipe.text_encoder_2 = None, None
    assert trial_(pipe, PROMPT, "auto") == TextFP8("auto", reason="the pipeline has no text encoder")
    with pytest.raises(RuntimeError, match="text_fp8=on cannot run: the pipeline has no text encoder"):
        trial_(pipe, PROMPT, "on")


def test_the_trial_runs_encoders_without_dropout():
    """An encoder left in training mode (T5's dropout is 0.1) is compared in eval mode, then left as it was."""
    eval_pipe, train_pipe = load_tiny(), load_tiny()
    train_pipe.text_encoder_2.train()
    want = {r.name: r.rel_error for r in trial_(eval_pipe, PROMPT, "on").encoders}
    assert {r.name: r.rel_error for r in trial_(train_pipe, PROMPT, "on").encoders} == want
    assert train_pipe.text_encoder_2.training and not train_pipe.text_encoder.training
