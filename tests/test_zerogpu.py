"""The Space in ZeroGPU mode on CPU: the real `spaces` package, our device-API stand-in, real forks.

`zerogpu_harness.py --cpu` runs app.py with `SPACES_ZERO_GPU=true`: the main process sees emulated
CUDA, every `@spaces.GPU` call is scheduled by the stand-in and runs in a forked worker, arguments
and results are pickled, the weights are packed to disk at launch. The one stand-in (a CPU has no
driver for spaces' worker start) is `zerogpu_harness.use_cpu_worker`: the worker computes on the CPU.
"""

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, ZeroGPUSpace, free_port, load_tiny
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image

from aot.runner import OWNER_MARK, load_runner, remove_stale_extractions
from aot.server import weight_bytes
from aot.zerogpu_limits import LARGE_MAX_BYTES, size_advice

# float32 in the main process too (on ZeroGPU `auto` means bfloat16: CUDA looks available there),
# so the worker's images can be compared with an eager float32 pipeline here.
LORAS = ROOT / "assets" / "tiny-flux-loras"
# Text encoders stay as they are, so images equal the eager pipeline's: their FP8 (on by default on
# ZeroGPU) has its own test below.
ZEROGPU_ENV = {
    "MODEL_ID": TINY,
    "AOT_DTYPE": "float32",
    "AOT_LORA_CHOICES": str(LORAS / "a.safetensors"),
    "AOT_TEXT_FP8": "off",
}
CALL = dict(height=768, width=512, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=512)


def cpu_space(env: dict[str, str], log, *harness_flags: str) -> ZeroGPUSpace:
    return ZeroGPUSpace({**ZEROGPU_ENV, **env}, log, "--cpu", *harness_flags)


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    app = cpu_space({}, tmp_path_factory.mktemp("zerogpu") / "app.log")
    yield app.wait_until_serving()
    app.stop()


def request(url: str, seed=7, width=512, height=768, steps=2, lora="none") -> np.ndarray:
    client = Client(url, verbose=False)
    path, _, _ = client.predict("a red cat", seed, False, width, height, steps, 3.5, lora, api_name="/generate")
    return np.asarray(Image.open(path))


def visitors(url: str, count: int = 3) -> list[np.ndarray]:
    """`count` visitors' `request()`s sent at the same moment (a thread and a client each); their images."""
    ready = threading.Barrier(count)

    def visit(_) -> np.ndarray:
        client = Client(url, verbose=False)
        ready.wait(timeout=60)  # every client connected: the requests leave together
        path, _, _ = client.predict("a red cat", 7, False, 512, 768, 2, 3.5, "none", api_name="/generate")
        return np.asarray(Image.open(path))

    pool = ThreadPoolExecutor(count)
    try:
        return [future.result(timeout=180) for future in [pool.submit(visit, n) for n in range(count)]]
    finally:  # a visitor left without an answer fails the test (TimeoutError), not the whole run by waiting
        pool.shutdown(wait=False, cancel_futures=True)


# Three threads make TLS contexts while the main thread forks children that each make one and exit
# (as spaces forks a worker beside other requests' device-API clients); prints how many children hung.
TLS_FORKS = """
import json, os, signal, ssl, sys, threading, time
from aot.zerogpu import fork_safe_tls_contexts
fork_safe_tls_contexts()
done = threading.Event()
def make_contexts():
    while not done.is_set():
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
for _ in range(3):
    threading.Thread(target=make_contexts, daemon=True).start()
hung = 0
for _ in range(300):
    pid = os.fork()
    if pid == 0:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        os._exit(0)
    deadline = time.monotonic() + 5
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.001)
done.set()
print(json.dumps({"forks": 300, "hung": hung}))
"""


def test_forks_beside_threads_making_tls_contexts_leave_no_child_hung():
    """`zerogpu.fork_safe_tls_contexts`: no child forked while other threads make TLS contexts waits
    forever on the lock OpenSSL's `SSL_CTX_new` held at the fork. The same script without it left 6-7 of
    300 children hung (2-core CPU, OpenSSL 3.0, 2026-12-06), as a ZeroGPU worker hung in
    `SSLContext.__new__` when three visitors came at once."""
    run = subprocess.run([sys.executable, "-c", TLS_FORKS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"forks": 300, "hung": 0}


def eager_image(pipe, lora: str | None = None) -> np.ndarray:
    """What `request()` should return, from an eager pipeline here (with a LoRA through peft)."""
    if lora:
        pipe.load_lora_weights(str(LORAS / f"{lora}.safetensors"))
    return np.asarray(pipe("a red cat", generator=torch.Generator().manual_seed(7), **CALL).images[0]).astype(float)


def test_startup_compiles_in_the_worker_and_the_main_process_never_touches_cuda(space):
    log = space.text()
    # The compile was the startup call (1500 s), in a worker; the main process applied its packages.
    assert "GPU granted for 1500 s, worker new" in log
    assert "AoT compiled: 2 block classes, 4 blocks" in log
    # spaces makes torch's CUDA init raise in the main process: had anything touched CUDA there,
    # startup would have stopped with "Low-level CUDA init (`torch._C._cuda_init`) reached".
    assert "_cuda_init" not in log and "Traceback" not in log


def test_requests_reuse_one_worker_and_a_reclaimed_worker_is_replaced(space, eager_pipe):
    started = space.device("/status")["allow"]  # each new worker calls /allow once
    images = [request(space.url) for _ in range(3)]
    # app.gpu_seconds: a new worker's setup (3 x 16 s) + a LoRA switch, since LoRAs are offered (3 x 0.6 s)
    # + 2 steps x 3 x 0.175 s x 1536/4096 tokens, rounded up
    assert "GPU granted for 51 s" in space.text()
    assert space.device("/status")["allow"] == started + 1, "three requests, one worker"
    # The worker computed what the eager pipeline computes (its weights crossed the fork intact).
    expected = eager_image(eager_pipe)
    for image in images:
        assert image.shape == (768, 512, 3)
        assert np.abs(image.astype(float) - expected).max() <= 1, "worker output differs from eager"
    space.device("/reclaim", "POST")  # ZeroGPU takes the GPU back: the worker is killed
    after = request(space.url)
    assert space.device("/status")["allow"] == started + 2, "a new worker, with blocks bound again"
    assert np.array_equal(after, images[0])


def test_a_lora_is_written_into_each_workers_weights_and_the_main_process_keeps_the_base(space, eager_pipe):
    base = request(space.url)
    styled = request(space.url, lora="a")
    assert np.abs(styled.astype(float) - eager_image(load_tiny(), "a")).max() <= 1, "worker differs from eager + peft"
    space.device("/reclaim", "POST")  # the next worker forks from the main process: base weights, no LoRA
    assert np.array_equal(request(space.url), base)
    assert np.array_equal(request(space.url, lora="a"), styled)


def test_a_request_aborted_past_its_duration_fails_and_the_next_one_works(space):
    space.device("/abort-next?after=1", "POST")  # as if the next call ran past its duration
    with pytest.raises(AppError, match="GPU task aborted"):
        request(space.url, width=1536, height=1536, steps=30)
    assert request(space.url).shape == (768, 512, 3)
    assert space.device("/status")["failed"] >= 1


def test_three_visitors_at_once_on_one_gpu_wait_in_zerogpus_queue_and_all_get_images(space):
    alone = request(space.url)
    before = space.device("/status")
    images = visitors(space.url)
    after = space.device("/status")
    for image in images:  # none refused ("Queue is full" when gradio ran one and held one)
        assert np.array_equal(image, alone)
    # Gradio ran the three at once and the device API queued two of them behind the one GPU.
    assert after["schedule"] - before["schedule"] == 3
    assert after["queued"] - before["queued"] == 2, "the requests reached the GPU one at a time"
    assert after["most_at_once"] == 1 and after["failed"] == before["failed"]
    assert after["allow"] - before["allow"] == 0, "one GPU: the three took turns on its worker"


@pytest.fixture(scope="module")
def three_gpus(saved, tmp_path_factory):
    """The Space under `--gpus 3`: the device API grants three GPU calls at once (saved packages:
    no compile at startup). `test_sigterm_to_the_harness_ends_the_app_and_its_workers` ends it."""
    log = tmp_path_factory.mktemp("zerogpu-3-gpus") / "app.log"
    app = cpu_space({"AOT_LOAD": str(saved), "AOT_STRICT": "1"}, log, "--gpus", "3")
    yield app.wait_until_serving()
    app.stop()


def test_three_gpus_serve_three_visitors_at_once_each_in_its_own_worker(three_gpus, eager_pipe):
    started = three_gpus.device("/status")
    images = visitors(three_gpus.url)
    status = three_gpus.device("/status")
    assert status["most_at_once"] > 1, "the three requests never held GPUs at the same time"
    assert status["queued"] == started["queued"] == 0, "three GPUs for three calls: none waited"
    assert status["allow"] - started["allow"] == 3, "a new worker on each GPU"
    workers = {gpu["worker"] for gpu in status["gpus"] if gpu["worker_alive"]}
    assert len(workers) == 3 and {gpu["index"] for gpu in status["gpus"]} == {0, 1, 2}
    expected = eager_image(eager_pipe)
    for image in images:  # each worker bound the saved packages to its own copy of the weights
        assert np.abs(image.astype(float) - expected).max() <= 1, "worker output differs from eager"
    again = visitors(three_gpus.url)  # each GPU's worker is free and alive: all three are reused
    status = three_gpus.device("/status")
    assert status["allow"] - started["allow"] == 3, "a worker was not reused"
    assert all(np.array_equal(image, images[0]) for image in again)


def test_sigterm_to_the_harness_ends_the_app_and_its_workers(three_gpus):
    """SIGTERM to the harness alone (as a supervisor sends it) ends the app it started and the app's
    GPU workers: nothing of the Space keeps running, nothing answers on its port."""
    workers = [gpu["worker"] for gpu in three_gpus.device("/status")["gpus"] if gpu["worker_alive"]]
    assert workers, "no worker alive to check"
    group = three_gpus.process.pid  # the harness leads the process group (conftest.Server)
    assert len(running(group)) > 1 + len(workers), "the harness, the app and its workers"
    os.kill(group, signal.SIGTERM)
    assert three_gpus.process.wait(timeout=60) == 128 + signal.SIGTERM  # the app's end, as a shell says it
    assert running(group) == [], "a process of the Space outlived the harness"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", three_gpus.port), timeout=5).close()


def running(group: int) -> list[int]:
    """The live (not zombie) processes of process group `group`."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # ended meanwhile
            continue
        if int(pgrp) == group and state != "Z":
            found.append(int(stat.split("/")[2]))
    return found


def test_saved_packages_load_in_new_workers_which_move_fp8_text_encoders(saved, tmp_path, eager_pipe):
    # --cold: every GPU call gets a new worker, which loads the saved packages, one per block class.
    # The default on ZeroGPU: the text encoders' FP8 trial runs in the startup call, the main process
    # quantizes the layers it kept before spaces packs the weights; a new worker moves fewer bytes.
    env = {"AOT_LOAD": str(saved), "AOT_STRICT": "1", "AOT_TEXT_FP8": "auto", "AOT_LORA_CHOICES": ""}
    app = cpu_space(env, tmp_path / "app.log", "--cold")
    try:
        app.wait_until_serving()
        log = app.text()
        assert f"AoT loaded from {saved}" in log
        decision = re.search(r"text_fp8: on \(auto: (.+)\)", log)
        assert decision and "text_encoder_2 (T5EncoderModel): FP8 in" in decision.group(1), log[-3000:]
        moved = float(re.search(r"a new ZeroGPU worker moves ([\d.]+) MB of weights to the GPU: fits large", log)[1])
        everything = weight_bytes(eager_pipe) / 1e6  # float32, on the CPU here
        fewer = sum(float(a) - float(b) for a, b in re.findall(r"([\d.e-]+) -> ([\d.e-]+) GB", decision[1])) * 1e3
        assert fewer > 0.01 and moved == pytest.approx(everything - fewer, abs=2e-3), (moved, everything, fewer)
        first, second = request(app.url), request(app.url)
        assert np.array_equal(first, second)
        assert app.device("/status")["allow"] == 3, "startup + two requests, each in a new worker (--cold)"
        assert np.abs(first.astype(float) - eager_image(eager_pipe)).mean() < 2, "FP8 text encoders changed the image"
        lines = [line.split("zerogpu-call ", 1)[1] for line in app.text().splitlines() if "zerogpu-call" in line]
        infers = [c for c in map(json.loads, lines) if c["fn"] == "infer"]
        assert len(infers) == 2, lines
        for call in infers:
            assert call["new_worker"] and call["wait_s"] > 0, call
            assert (call["loads"], call["binds"]) == (2, 2 * 4), "one load per block class; 2 steps x 4 blocks bound"
            assert call["imported"] == 0, "each new worker would import these again: import them before the fork"
    finally:
        app.stop()


def test_eager_switch_serves_in_zerogpu_mode_with_a_lora_fused_in_the_main_process(tmp_path, eager_pipe):
    # AOT_LORA is fused at startup into the main process's emulated CUDA tensors.
    app = cpu_space({"AOT_COMPILE": "0", "AOT_LORA": str(LORAS / "b.safetensors")}, tmp_path / "app.log")
    try:
        app.wait_until_serving()
        assert np.abs(request(app.url).astype(float) - eager_image(eager_pipe, "b")).max() <= 1
        assert app.device("/status")["schedule"] == 1, "no startup call: only the request used the GPU"
    finally:
        app.stop()


def test_an_error_in_the_worker_reaches_the_main_process_whole(tmp_path):
    # spaces forwards only an exception's class name ("ZeroGPU worker error: RuntimeError");
    # zerogpu.worker carries the exception itself.
    (tmp_path / "empty").mkdir()
    app = cpu_space({"AOT_LOAD": str(tmp_path / "empty"), "AOT_STRICT": "1"}, tmp_path / "app.log")
    assert app.wait_until_exit() != 0
    assert "RuntimeError: packages from" in app.text()
    assert "cannot be used: no config.sdpa-float32-512-1536.json" in app.text()


def test_package_folders_left_by_a_killed_process_are_removed(compiled, tmp_path):
    # The loader extracts every package into /tmp and removes it only when the runner is freed;
    # ZeroGPU kills its workers, so the next process removes what dead ones left. The owner is told
    # by a lock the kernel drops at its death, not by its PID (a container's app is PID 1 at every start).
    package = tmp_path / "package.pt2"
    package.write_bytes(compiled.packages["FluxSingleTransformerBlock"].package)
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from aot.runner import _mapped_extractions, load_runner
runner = load_runner(open({str(package)!r}, "rb").read())
print(*_mapped_extractions(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    left = done.stdout.split()
    assert left and all(os.path.exists(os.path.join(p, OWNER_MARK)) for p in left), "nothing was left to remove"
    before = set(glob.glob(f"/tmp/*/{OWNER_MARK}"))
    mine = load_runner(package.read_bytes())  # this process is alive: its folder must stay
    own = set(glob.glob(f"/tmp/*/{OWNER_MARK}")) - before
    assert len(own) == 1
    remove_stale_extractions()
    assert not any(os.path.exists(p) for p in left)
    assert all(os.path.exists(p) for p in own), "a living process's package was removed"
    del mine


def test_the_sweep_skips_a_folder_another_process_removes_meanwhile(tmp_path, monkeypatch):
    # Three workers loading at once: one swept /tmp while another's folder vanished, and glob raised
    # FileNotFoundError into the request. Stand-in for the other process: after the sweep lists the
    # folders, the first one is removed (os.scandir wrapped, here only); a dead owner's folder goes.
    from aot import runner

    gone, stale = tmp_path / "gone", tmp_path / "stale"
    for folder in (gone, stale):
        folder.mkdir()
    (stale / OWNER_MARK).touch()  # nobody holds its lock: its process is gone
    monkeypatch.setattr(runner, "EXTRACT_ROOT", tmp_path)
    listing = os.scandir

    def listed_then_removed(path):
        if path != tmp_path:
            return listing(path)
        with listing(path) as found:
            entries = list(found)
        shutil.rmtree(gone)
        return contextlib.nullcontext(entries)

    monkeypatch.setattr(os, "scandir", listed_then_removed)
    assert remove_stale_extractions() == [stale] and not stale.exists()


@pytest.mark.parametrize(
    ("moved", "size", "warns", "says"),
    [
        (17_471_120_942, None, False, "moves 17.5 GB of weights to the GPU: fits large"),
        (17_471_120_942, "xlarge", True, "large would hold them; GPU_SIZE='xlarge' takes the whole card"),
        (LARGE_MAX_BYTES + 1, None, True, "over 42 GiB: spaces runs every GPU call on xlarge"),
        (LARGE_MAX_BYTES + 1, "large", True, "GPU_SIZE='large' (48 GB) may not hold them"),
        (LARGE_MAX_BYTES + 1, "xlarge", False, "over 42 GiB: xlarge"),
        (708_764, None, False, "moves 0.709 MB of weights"),
    ],
)
def test_startup_says_which_zerogpu_size_the_weights_fit(moved, size, warns, says):
    # spaces 0.51.3 makes xlarge its default size past LARGE_MAX_BYTES packed (zero/configs.json).
    line, warning = size_advice(moved, size)
    assert says in line and warning == warns, line


def test_shapes_a_worker_checked_reach_the_workers_forked_after_it(tmp_path):
    # graphs.VERIFIED crosses back with a call's result (zerogpu.worker), so a new worker captures a
    # shape an earlier worker checked without replaying it. A CPU has no CUDA graphs: the key here is
    # a stand-in for a graph's; the fork, the pickling and the new workers (--cold) are real.
    script = tmp_path / "verified.py"
    script.write_text(
        f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import spaces
from aot import graphs, zerogpu

def check(key):
    graphs.VERIFIED.add(key)

def seen():
    return sorted(graphs.VERIFIED)

spaces.GPU(duration=60)(zerogpu.worker(check))(("shape", 1024))
print("main process:", sorted(graphs.VERIFIED), flush=True)
print("next new worker:", spaces.GPU(duration=60)(zerogpu.worker(seen))(), flush=True)
"""
    )
    done = subprocess.run(
        [sys.executable, "tools/zerogpu_harness.py", "--cpu", "--cold", "--port", str(free_port()), str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "main process: [('shape', 1024)]" in done.stdout, done.stdout
    assert "next new worker: [('shape', 1024)]" in done.stdout, done.stdout
    assert done.stderr.count("worker new") == 2, done.stderr[-3000:]


def test_any_import_of_the_engine_imports_spaces_before_torch():
    # On ZeroGPU torch must not be imported before spaces (it patches torch as it loads). aot/__init__.py,
    # which every import of the engine runs first, imports spaces, then each verb's module on first use:
    # a process that needs one module (here loading.py, which imports most of the engine) imports no gradio.
    code = "import sys, aot.loading; names = list(sys.modules); print(names.index('spaces') < names.index('torch'))"
    code += "; print('gradio' in names, 'aot.server' in names)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "False"], done.stdout
