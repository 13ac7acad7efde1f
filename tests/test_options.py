"""Options (flags, environment, defaults), the resolution rule, and the switch matrix on CPU."""

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TOLERANCE, decided, generate, load_tiny, optimize, tiny_options

from aot.apply import patch_blocks_
from aot.blocks import rel_error
from aot.export import compile_blocks
from aot.fp8 import fp8_config
from aot.options import Options
from aot.pipeline import load_pipeline
from aot.plans import (
    CUBLASLT_WORKSPACE_SIZE,
    Decision,
    plan_for,
    resolve_attention,
    resolve_cuda_graphs,
    resolve_fp8,
    resolve_plan,
)
from aot.resolution import Resolution


def parse(argv=(), environ=None) -> Options:
    return Options.from_env(Options.parser().parse_args(list(argv)), environ=environ or {})


def test_defaults_take_the_fast_paths_the_hardware_allows():
    options = parse()
    assert (options.compile, options.attention, options.fp8, options.cuda_graphs) == (True, "auto", "auto", "auto")


def test_flag_beats_environment_beats_default():
    environ = {"AOT_ATTENTION": "sdpa", "AOT_FP8": "off", "AOT_MAX_SIDE": "1024", "AOT_COMPILE": "0"}
    assert parse(environ=environ) == Options(attention="sdpa", fp8="off", max_side=1024, compile=False)
    options = parse(["--attention", "fa3", "--compile", "--max-side", "1280"], environ)
    assert (options.attention, options.compile, options.max_side, options.fp8) == ("fa3", True, 1280, "off")


def test_every_field_has_one_flag_and_one_environment_variable():
    fields = dataclasses.fields(Options)
    envs = [f.metadata["env"] for f in fields]
    assert len(set(envs)) == len(envs)
    help_text = Options.parser().format_help()
    for f in fields:
        assert "--" + f.name.replace("_", "-") in help_text
        assert f.metadata["env"] in help_text


def test_readme_documents_every_environment_variable():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [f.metadata["env"] for f in dataclasses.fields(Options) if f"`{f.metadata['env']}`" not in readme]
    assert not missing, f"README.md does not document {missing}"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"AOT_FP8": "maybe"}, "AOT_FP8='maybe': allowed values are auto, on, off"),
        ({"AOT_DEVICE": "gpu"}, "device='gpu': use auto, cpu, cuda or cuda:N"),
        ({"AOT_PUSH": "me/blocks"}, "push='me/blocks' needs save"),
        ({"AOT_COMPILE": "perhaps"}, r"AOT_COMPILE='perhaps': use 1/0, true/false, on/off"),
        ({"AOT_MIN_SIDE": "big"}, "AOT_MIN_SIDE='big': expected an integer"),
        ({"AOT_MIN_SIDE": "500"}, "both ends must be multiples of 16"),
    ],
)
def test_bad_environment_values_say_what_is_allowed(environ, message):
    with pytest.raises(ValueError, match=message):
        Options.from_env(None, environ=environ).resolution(vae_scale_factor=8)


def test_bad_flag_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        Options.parser().parse_args(["--attention", "flash"])
    assert "invalid choice: 'flash'" in capsys.readouterr().err


def test_command_lines_refuse_what_they_cannot_do(capsys):
    # app.py itself, in a process of its own; compile.py's main as `python compile.py` runs it
    # (test_compile_py_keeps_the_traceback_of_an_error_raised_inside_a_library runs compile.py itself).
    command = [sys.executable, "app.py", "--max-szie", "1024"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --max-szie 1024" in done.stderr, done.stderr[-2000:]
    import compile

    with pytest.raises(SystemExit) as exited:
        compile.main(["--no-compile"])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr[-2000:]
    assert "compile.py compiles; `python app.py --no-compile` serves the eager pipeline" in stderr, stderr[-2000:]


def test_resolution_rule():
    rule = Resolution(512, 1536)
    assert rule.tokens(1024, 1024) == 4096 and rule.tokens(768, 1344) == 48 * 84
    assert rule.token_range == (1024, 9216)
    assert rule.sides == "a multiple of 16 from 512 to 1536 px"
    with pytest.raises(ValueError, match="0 < min <= max"):
        Resolution(1024, 512)


@pytest.mark.parametrize("attention", ["auto", "sdpa", "fa3", "fa3-fp8", "sage"])
@pytest.mark.parametrize("fp8", ["auto", "on", "off"])
def test_switch_matrix_on_cpu(attention, fp8):
    """Every combination: auto falls back with the reason, explicit requests that cannot run raise."""
    transformer = load_tiny().transformer
    options = tiny_options(attention=attention, fp8=fp8)
    device = torch.device("cpu")
    if attention not in ("auto", "sdpa"):
        needs = "sage attention" if attention == "sage" else "FA3"
        with pytest.raises(
            RuntimeError, match=f"attention={attention} cannot run: {needs} needs a CUDA GPU; the pipeline is on cpu"
        ):
            resolve_attention(options, transformer, device)
    else:
        decision = resolve_attention(options, transformer, device)
        expected = "requested" if attention == "sdpa" else "auto: FA3 needs a CUDA GPU; the pipeline is on cpu"
        assert (decision.value, decision.reason) == ("sdpa", expected)
    check_on_off_auto("fp8", fp8, "FP8 needs", lambda: resolve_fp8(options, device))


@pytest.mark.parametrize("cuda_graphs", ["auto", "on", "off"])
def test_cuda_graphs_switch_on_cpu(cuda_graphs):
    options, device = tiny_options(cuda_graphs=cuda_graphs), torch.device("cpu")
    check_on_off_auto("cuda_graphs", cuda_graphs, "CUDA graphs need", lambda: resolve_cuda_graphs(options, device))


def check_on_off_auto(name, value, problem, resolve):
    """On CPU: `on` raises naming the problem, `auto` is off with it as the reason, `off` is off."""
    problem += " a CUDA GPU; the pipeline is on cpu"
    if value == "on":
        with pytest.raises(RuntimeError, match=f"{name}=on cannot run: {problem}"):
            resolve()
    else:
        decision = resolve()
        assert (decision.value, decision.reason) == ("off", "requested" if value == "off" else f"auto: {problem}")


def test_explicit_request_that_cannot_run_fails_before_any_work():
    pipe = load_tiny()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(RuntimeError, match="attention=fa3 cannot run"):
        compile_blocks(*decided(pipe, tiny_options(attention="fa3")))
    assert not calls, "the pipeline ran before the request was refused"
    with pytest.raises(RuntimeError, match="cuda_graphs=on cannot run"):
        optimize(pipe, tiny_options(cuda_graphs="on"))
    assert not calls, "the pipeline ran before the request was refused"


def capability_checks_pass(monkeypatch, fa3: bool = True):
    """Stand-in for a GPU whose capability checks pass (FA3 loads, FP8 may run): the CPU then really
    runs each trial, and the FA3 and FP8 kernels really fail them. The tiny model's
    layers are narrower than FP8_MIN_FEATURES: lowered so that FP8 is attempted."""
    from aot import fp8, plans

    monkeypatch.setattr(fp8, "FP8_MIN_FEATURES", 16)
    passed = Decision("attention", "fa3" if fa3 else "sdpa", "auto: checks passed")
    monkeypatch.setattr(plans, "resolve_attention", lambda *args: passed)
    monkeypatch.setattr(plans, "resolve_fp8", lambda *args: Decision("fp8", "on", "auto"))


@pytest.mark.parametrize(
    ("capability", "plan", "attention", "fp8"),
    [
        (None, "cpu", ["sdpa"], []),
        ((9, 0), "sm_90", ["fa3-fp8", "fa3", "sdpa"], ["row", "tensor"]),
        ((12, 0), "sm_120", ["sage", "sdpa"], ["row-after", "tensor"]),
        ((8, 9), "sm_89", ["sage", "sdpa"], ["row-after", "tensor"]),
        ((8, 0), "sm_80", ["sdpa"], []),
        ((10, 0), "sm_100", ["sage", "sdpa"], ["row", "row-after", "tensor"]),
    ],
)
def test_the_plan_per_gpu_is_data_keyed_by_compute_capability(capability, plan, attention, fp8):
    chosen = plan_for(capability)
    assert (chosen.name, list(chosen.attention), list(chosen.fp8)) == (plan, attention, fp8)
    with pytest.raises(ValueError, match="no plan for compute capability 13.0"):
        plan_for((13, 0))
    with pytest.raises(ValueError, match="plan='12': use auto or a compute capability"):
        Options(plan="12")


def test_the_hopper_plan_gives_the_process_no_cublaslt_workspace_unless_the_environment_has_one(monkeypatch):
    """torch reads `CUBLASLT_WORKSPACE_SIZE` at each cuBLASLt call; what it does on the GPU is measured by
    tools/bench.py (BENCHMARKS.md, "Hopper's plan without cuBLASLt's workspace"), not here."""
    cpu = torch.device("cpu")
    _, planned = resolve_plan(tiny_options(plan="12.0"), cpu)
    assert CUBLASLT_WORKSPACE_SIZE not in os.environ and "cuBLASLt" not in planned.reason
    _, planned = resolve_plan(tiny_options(plan="9.0"), cpu)
    assert os.environ[CUBLASLT_WORKSPACE_SIZE] == "0"
    assert planned.reason.endswith("; cuBLASLt workspace 0 KiB (CUBLASLT_WORKSPACE_SIZE)"), planned
    for plan in ("9.0", "12.0"):  # what the environment holds wins, and the decision says so
        monkeypatch.setenv(CUBLASLT_WORKSPACE_SIZE, "32768")
        _, planned = resolve_plan(tiny_options(plan=plan), cpu)
        assert os.environ[CUBLASLT_WORKSPACE_SIZE] == "32768"
        assert planned.reason.endswith("; CUBLASLT_WORKSPACE_SIZE=32768 as set"), planned


def test_the_gpu_call_resolves_its_plan_before_the_text_encoders_run_a_gemm(monkeypatch):
    """compile.py's GPU call: the plan's cuBLASLt workspace is set before the text encoders' FP8 trial,
    the first code that could run a GEMM. The compile after it is cut short: its result is not checked here."""
    import compile as compile_py

    seen, trial = [], compile_py.text_fp8.trial_

    def recorded(*args, **kwargs):
        seen.append(os.environ.get(CUBLASLT_WORKSPACE_SIZE))
        return trial(*args, **kwargs)

    def cut_short(*args, **kwargs):
        raise RuntimeError("cut short")

    monkeypatch.setattr(compile_py.text_fp8, "trial_", recorded)
    monkeypatch.setattr(compile_py, "compile_blocks", cut_short)
    with pytest.raises(RuntimeError, match="cut short"):
        compile_py.compile_transformer(load_tiny(), tiny_options(plan="9.0"))
    assert seen == ["0"]


def test_each_plan_walks_its_chain_to_bf16_sdpa_when_every_trial_fails(monkeypatch, eager_pipe):
    capability_checks_pass(monkeypatch)
    compiled = compile_blocks(*decided(load_tiny(), tiny_options(plan="9.0")))
    plan, attention, fp8, norm_rope, row_fp8 = compiled.decisions
    values = (plan.value, attention.value, fp8.value, norm_rope.value, row_fp8.value)
    assert values == ("sm_90", "sdpa", "off", "on", "off")
    assert plan.reason.startswith("forced by plan=9.0 on cpu; Hopper"), plan
    trials = r"plan sm_90: fa3-fp8 failed its trial \(.+\) -> fa3 failed its trial \(.+\) -> sdpa"
    assert re.fullmatch(trials, attention.reason), attention
    walk = r"plan sm_90: row failed its trial \(.+\) -> tensor failed its trial \(.+\) -> bf16"
    assert re.fullmatch(walk, fp8.reason), fp8
    assert not any(p.fp8 for p in compiled.packages.values()) and compiled.fp8_granularity is None
    pipe = load_tiny()
    patch_blocks_(pipe, compiled)
    assert rel_error(generate(pipe, 512, 512), generate(eager_pipe, 512, 512)) < TOLERANCE
    # ZeroGPU's card: no FA3 in its plan (none tried), sage left out off CUDA, row-wise FP8 with its scales after
    # the GEMM, then per tensor. The decisions are what is checked here, and the walk is the same for every block
    # class: one class is compiled.
    pipe = load_tiny()
    pipe.transformer._repeated_blocks = ["FluxSingleTransformerBlock"]
    plan, attention, fp8, *_ = compile_blocks(*decided(pipe, tiny_options(plan="12.0"))).decisions
    sage_skipped = "sage skipped (sage attention needs a CUDA GPU; the pipeline is on cpu)"
    assert (plan.value, attention.reason) == ("sm_120", f"plan sm_120: {sage_skipped} -> sdpa")
    walk = r"plan sm_120: row-after failed its trial \(.+\) -> tensor failed its trial \(.+\) -> bf16"
    assert re.fullmatch(walk, fp8.reason), fp8


def test_a_failed_granularity_falls_back_to_the_next_one_that_runs(monkeypatch, eager_pipe):
    # Stand-in for per-tensor FP8, which a CPU cannot run: int8 weight-only (torchao), which it can;
    # row-wise FP8 really fails its trial here, as it does on sm_120.
    from torchao.quantization import Int8WeightOnlyConfig

    from aot import compiled, fp8

    capability_checks_pass(monkeypatch, fa3=False)
    for module in (fp8, compiled):
        monkeypatch.setattr(module, "fp8_config", lambda g: Int8WeightOnlyConfig() if g == "tensor" else fp8_config(g))
    compiled = compile_blocks(*decided(load_tiny(), tiny_options(plan="9.0")))
    fp8 = compiled.decisions[2]
    assert fp8.value == "tensor" and compiled.fp8_granularity == "tensor", fp8
    assert re.fullmatch(r"plan sm_90: row failed its trial \(.+\) -> tensor: FluxTransformerBlock .+", fp8.reason)
    assert all(p.fp8 == "tensor" for p in compiled.packages.values())
    pipe = load_tiny()
    patch_blocks_(pipe, compiled)  # quantizes each class at its package's granularity before binding
    assert rel_error(generate(pipe, 512, 512), generate(eager_pipe, 512, 512)) < 5e-2


def test_fp8_on_that_fails_every_trial_raises(monkeypatch):
    capability_checks_pass(monkeypatch, fa3=False)
    with pytest.raises(AssertionError, match="Float8 dynamic quantization requires CUDA"):  # torchao's own check
        compile_blocks(*decided(load_tiny(), tiny_options(fp8="on", plan="9.0")))
    with pytest.raises(RuntimeError, match="fp8=on cannot run: plan sm_80 has no FP8"):
        compile_blocks(*decided(load_tiny(), tiny_options(fp8="on", plan="8.0")))


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"min_side": 500}, ValueError, "both ends must be multiples of 16"),
        ({"min_side": 1024, "max_side": 512}, ValueError, "0 < min <= max"),
        ({"max_side": 20000}, ValueError, "max_side=20000: at most 2048 px"),
        ({"attention": "fa3"}, RuntimeError, "attention=fa3 cannot run: FA3 needs a CUDA GPU"),
        ({"attention": "fa3-fp8"}, RuntimeError, "attention=fa3-fp8 cannot run: FA3 needs a CUDA GPU"),
        ({"attention": "sage"}, RuntimeError, "attention=sage cannot run: sage attention needs a CUDA GPU"),
        ({"fp8": "on"}, RuntimeError, "fp8=on cannot run: FP8 needs a CUDA GPU"),
        ({"cuda_graphs": "on"}, RuntimeError, "cuda_graphs=on cannot run"),
        ({"save": "p", "push": "someone/blocks"}, RuntimeError, "pushing to the Hub needs a token"),
        ({"save": str(ROOT / "README.md" / "packages")}, RuntimeError, "README.md is a file, not a folder"),
    ],
)
def test_options_that_cannot_work_are_refused_before_any_weight_loads(changes, error, message, monkeypatch, tmp_path):
    from diffusers import FluxPipeline

    def tripwire(*args, **kwargs):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(FluxPipeline, "from_pretrained", tripwire)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token either
    with pytest.raises(error, match=message):
        load_pipeline(tiny_options(**changes))


def test_a_hub_model_offline_fails_fast_saying_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    # CI has no route to the Hub, as this machine: huggingface_hub alone retried for 34 s here
    # before saying "does not appear to have a file named config.json".
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    start = time.monotonic()
    message = r"not in the local Hub cache, and the Hub \(https://huggingface.co\) cannot be reached"
    with pytest.raises(RuntimeError, match=message):
        load_pipeline(Options(model="black-forest-labs/FLUX.1-dev", device="cpu"))
    assert time.monotonic() - start < 15


@pytest.mark.parametrize("where", ["flag", "environment"])
def test_compile_py_refuses_devices_it_would_ignore(where, monkeypatch, capsys):
    # Before: `python compile.py --devices cuda:0,cuda:1` compiled on the CPU without a word.
    import compile

    def tripwire(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before --devices was refused")

    monkeypatch.setattr(compile, "load_pipeline", tripwire)
    argv = ["--model", str(ROOT / "assets" / "tiny-flux")]
    if where == "flag":
        argv += ["--devices", "cuda:0,cuda:1"]
    else:
        monkeypatch.setenv("AOT_DEVICES", "cuda:0,cuda:1")
    with pytest.raises(SystemExit) as exited:
        compile.main(argv)
    given = "--devices cuda:0,cuda:1" if where == "flag" else "AOT_DEVICES=cuda:0,cuda:1"
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"compile.py: error: {given}: compile.py compiles on one device (--device, e.g. --device cuda:1); "
        "--devices is for app.py (one replica per device)"
    )


# Printed on stderr by a library whatever the options: diffusers' torchao quantizer, at import, with
# this torchao (its Tensor classes moved). Nothing of ours.
HARMLESS = ("Unable to import `torchao` Tensor objects.",)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-side", "500"], "side range 500..1536 px: both ends must be multiples of 16 with 0 < min <= max"),
        (["--attention", "fa3"], "attention=fa3 cannot run: FA3 needs a CUDA GPU; the pipeline is on cpu."),
        (["--attention", "fa3-fp8"], "attention=fa3-fp8 cannot run: FA3 needs a CUDA GPU; the pipeline is on cpu."),
    ],
    ids=["min-side", "fa3", "fa3-fp8"],
)
def test_compile_py_configuration_errors_are_one_line_without_a_traceback(flags, message, capsys):
    import compile

    with pytest.raises(SystemExit) as exited:
        compile.main(["--model", str(ROOT / "assets" / "tiny-flux"), *flags])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(HARMLESS)]
    assert exited.value.code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"compile.py: error: {message}"), stderr[-3000:]


def test_compile_py_keeps_the_traceback_of_an_error_raised_inside_a_library(tmp_path):
    # A RuntimeError that torch raises (not a configuration error of ours) is a fault to find: traceback kept.
    import json
    import shutil

    model = Path(shutil.copytree(ROOT / "assets" / "tiny-flux", tmp_path / "model"))
    config = model / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "joint_attention_dim": -5}))
    command = [sys.executable, "compile.py", "--model", str(model)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith("RuntimeError: Trying to create tensor with negative dimension")
