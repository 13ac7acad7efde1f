"""tools/bench.py measures a step on inputs a Space serves: each family's first step is finite.

A CUDA graph's check replay compares the replay with the step it was captured from, so a step that
gives NaN fails it (NaN is never equal to itself) and the benchmark reports graphs that cannot run.
"""

import argparse
import json
import time

import pytest
import torch
from test_host_copies import FOLDERS, first_step
from torch.utils import _pytree as pytree

from aot.export import capture
from tools import bench
from tools.bench import pipe_call


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_benchmarks_step_inputs_give_every_family_a_finite_step(folder):
    pipe, inputs = first_step(folder)  # `step_inputs` at 256x256
    with torch.no_grad():
        out = pipe.transformer(**inputs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert leaves and all(torch.isfinite(t).all() for t in leaves)


def test_a_qwen_image_call_of_one_step_gives_a_nan_timestep():
    """Why `step_inputs` calls with the family's `min_steps` (2 for Qwen-Image), not 1."""
    pipe, _ = first_step("tiny-qwen-image")
    with capture({"transformer": pipe.transformer}) as calls:
        pipe(**pipe_call(pipe, 256, 1), output_type="latent")
    assert torch.isnan(calls["transformer"][1]["timestep"]).all()


@pytest.mark.parametrize(
    "name, kind",
    [
        ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(...)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(...)", "attention"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cublas", "gemm"),
        ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>(...)", "gemm"),
        ("triton_poi_fused__scaled_dot_product_flash_attention_0", "other"),
        ("block_3ec880962c8848f58450c42222f53c89_triton_red_fused__flash_attn_forward__to_copy_add_m", "other"),
        ("block_aa9a87f921f34dc6bd0582ea4e30776f_triton_red_fused__scaled_dot_product_cudnn_attentio", "other"),
        ("triton_red_fused_abs_amax_clamp_mul_1", "other"),
        # a launch fixed at compile time (`lowering.STRIDED_ROW_CONFIG`), which Inductor names `unk`
        ("block_b6d692f7afc34f1caab9f362d7e7f3ca_triton_unk_fused__flash_attn_forward__to_copy_add_ar", "other"),
        ("Memcpy HtoD (Pageable -> Device)", "other"),
    ],
)
def test_a_kernel_is_counted_as_what_it_computes(name, kind):
    """The step's GPU time is split by kernel name (`kernel_kind`): FA3 is a CUTLASS kernel but
    attention; an Inductor kernel named after the attention op it feeds is not attention, with or
    without the package's name in front (names from the H200's profiles, 2026-12-04, as the bench
    prints them: cut at 90 characters)."""
    assert bench.kernel_kind(name) == kind


def test_the_time_between_gpu_operations_is_split_out_with_the_memsets():
    """`timeline` over a replay's GPU operations (name, start us, end us): the gaps between them, and
    what each memset costs with the gaps on both sides (cuBLASLt's 4-byte memset before a GEMM: 1.37,
    0.74 and 3.53 us in the H200's replay, BENCHMARKS.md section (e))."""
    events = [
        ("block_x_triton_per_fused_amax_0", 0.0, 10.0),
        ("Memset (Unknown)", 11.0, 12.0),
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_bias_TNT", 15.0, 30.0),
        ("block_x_triton_poi_fused_add_1", 30.5, 40.0),
    ]
    assert bench.timeline(events) == pytest.approx(
        {"span_ms": 0.040, "busy_ms": 0.0355, "between_ms": 0.0045, "memsets": 1, "memset_ms": 0.005}
    )
    assert bench.timeline(events[2:])["memsets"] == 0
    with pytest.raises(ValueError, match="no GPU operations"):
        bench.timeline([])
    rows = [
        {"scenario": "eager", "step_ms": 174.8, "ready_s": None, "cold": None, "s_per_image": 1.5},
        {"scenario": "all", "step_ms": 85.5, "ready_s": 26.2, "cold": True, "s_per_image": 0.8, "replay": {
            "span_ms": 83.2, "busy_ms": 81.0, "between_ms": 2.2, "memsets": 324, "memset_ms": 1.8}},
    ]
    args = argparse.Namespace(family=None, model=bench.RANDOM, size=1024, steps=8, layers=None, heads=None,
                              reference=False)
    assert ("all graphed step under the profiler: GPU busy 81.0 ms, 2.2 ms between its operations "
            "(1.8 ms at 324 memsets)") in bench.table(rows, args)


def test_queued_steps_are_timed_back_to_back_and_shown_against_eager_queued():
    """`queued_ms` times `calls` calls with no sync between them, after one warm-up run of them; on
    this CPU machine with a host clock (a call that sleeps 2 ms takes at least 2 ms a call). The
    table gives each row's queued step and eager's queued step over it."""
    count = []

    def step():
        count.append(1)
        time.sleep(0.002)

    assert 2.0 <= bench.queued_ms(step, calls=4, repeat=3) < 20.0
    assert len(count) == 4 * (3 + 1)
    rows = [
        {"scenario": "eager", "step_ms": 174.8, "step_ms_queued": 172.0, "ready_s": None, "cold": None,
         "s_per_image": 1.5},
        {"scenario": "all", "step_ms": 85.5, "step_ms_queued": 83.2, "ready_s": 26.2, "cold": True,
         "s_per_image": 0.8},
        {"scenario": "no-graphs", "step_ms": 87.6, "ready_s": 26.2, "cold": True, "s_per_image": 0.8},
    ]
    args = argparse.Namespace(family=None, model=bench.RANDOM, size=1024, steps=8, layers=None, heads=None,
                              reference=False)
    text = bench.table(rows, args)
    assert "| all | 85.5 | 2.04x | 83.2 (2.07x) | - |" in text
    assert "| no-graphs | 87.6 | 2.00x | - | - |" in text


def test_a_variant_runs_its_scenario_in_a_process_with_its_settings(tmp_path, monkeypatch):
    """`all@VAR=VALUE@...` is `all` with those environment variables in its group's process, over the
    bench's own (its compile caches apart from the plain `all`'s); malformed settings and variants of
    the scenarios that cannot have one are refused before anything runs."""
    assert bench.variant("all") == ("all", {})
    assert bench.variant("all@CUBLASLT_WORKSPACE_SIZE=0@AOT_FP8=off") == (
        "all", {"CUBLASLT_WORKSPACE_SIZE": "0", "AOT_FP8": "off"})
    assert bench.variant("peer@X=") == ("peer", {"X": ""})
    monkeypatch.setenv("AOT_FP8", "on")
    env = bench.group_env(["all@AOT_FP8=off"], str(tmp_path))
    assert env["AOT_FP8"] == "off"
    assert env["TORCHINDUCTOR_CACHE_DIR"] != bench.group_env(["all"], str(tmp_path))["TORCHINDUCTOR_CACHE_DIR"]
    assert bench.group_env(["all"], str(tmp_path))["AOT_FP8"] == "on"
    for spec, reason in [
        ("all@CUBLASLT_WORKSPACE_SIZE", "is not NAME=VALUE"),
        ("all@1X=0", "is not NAME=VALUE"),
        ("warm@X=1", "a variant .* is of one of eager, aot"),
    ]:
        with pytest.raises(ValueError, match=reason):
            bench.variant(spec)
    for scenarios in ["eager,warm@X=1", "eager,nothing@X=1", "all@X=1"]:
        with pytest.raises(SystemExit) as exit_:
            bench.main(["--scenarios", scenarios, "--results", ""])
        assert exit_.value.code == 2
    # The settings reach the group's process: there PYTHONPATH names an empty folder, not the
    # repository a plain group's names first, so its worker cannot import the engine, and the row says so.
    assert bench.group_env(["eager"], str(tmp_path))["PYTHONPATH"].startswith(str(bench.ROOT))
    args = argparse.Namespace(model=bench.RANDOM, size=256, steps=1, work=str(tmp_path), family=None, layers=None,
                              heads=None, reference=False, top=3)
    (row,) = bench.run_group([f"eager@PYTHONPATH={tmp_path}"], args, tmp_path)
    assert row["scenario"] == f"eager@PYTHONPATH={tmp_path}"
    assert "No module named 'aot'" in row["error"]


def test_a_new_worker_is_measured_once_the_gpu_is_idle(tmp_path, monkeypatch):
    """`wait_for_idle_gpu` polls nvidia-smi until the GPU's memory in use falls below `IDLE_MIB`.

    This machine has no GPU, so a stand-in `nvidia-smi` (a shell script, test-only) reports a killed
    worker's 40 GB for its first three calls, then what a driver alone holds; it also records the
    GPU it was asked about."""
    calls = tmp_path / "calls"
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\necho "$1" >> {calls}\n'
        f"if [ $(wc -l < {calls}) -le 3 ]; then echo 40960; else echo {bench.IDLE_MIB // 2}; fi\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("ZEROGPU_HARNESS_GPU", "1")
    assert bench.wait_for_idle_gpu() >= 0.3  # three polls 0.1 s apart
    assert calls.read_text().split() == ["--id=1"] * 4
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: a CPU run waits for nothing
    assert bench.wait_for_idle_gpu() == 0.0


def test_a_kept_work_folder_holds_the_run_and_must_be_new_or_empty(tmp_path):
    """`--keep DIR` leaves the run's work in DIR (eager's latents, the group's caches, its row), and refuses
    a file or a folder with something in it before anything runs: a second run there would take the first
    run's eager latents as its own reference and compile from warm caches."""
    kept = tmp_path / "kept"
    run = ["--scenarios", "eager", "--model", "assets/tiny-flux", "--size", "256", "--steps", "1", "--results", ""]
    assert bench.main([*run, "--keep", str(kept)]) == 0
    assert (kept / "eager.pt").is_file()
    assert (kept / "caches" / "eager" / "inductor").is_dir()
    assert json.loads((kept / "rows.jsonl").read_text())["scenario"] == "eager"
    (tmp_path / "file").write_text("")
    for taken in [kept, tmp_path / "file"]:
        before = sorted(p.name for p in tmp_path.rglob("*"))
        with pytest.raises(SystemExit) as exit_:
            bench.main([*run, "--keep", str(taken)])
        assert exit_.value.code == 2
        assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_kernel_list_of_no_kernels_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--scenarios", "eager", "--top", "0", "--results", ""])
    assert exit_.value.code == 2 and "--top: 0 kernels; give at least 1" in capsys.readouterr().err
