"""Run the Space in ZeroGPU mode on your own machine, before you push it.

    python zerogpu_harness.py app.py                 # a GPU box: real spaces, real forks, real CUDA
    python zerogpu_harness.py --cpu app.py           # no GPU: the worker computes on the CPU
    python zerogpu_harness.py --cold app.py          # every call gets a new worker (ZeroGPU reclaimed it)

It starts a stand-in for ZeroGPU's device API on 127.0.0.1 and runs the command with the real
`spaces` package in ZeroGPU mode (`SPACES_ZERO_GPU=true`): the main process sees emulated CUDA,
`@spaces.GPU` calls are scheduled here, each runs in a forked worker that gets the GPU, and
arguments and results are pickled across the fork. What breaks on ZeroGPU (CUDA touched in the
main process, a pipeline passed as an argument, a worker that cannot start again after a kill)
breaks here too.

The device API (what spaces 0.51.3 calls, `spaces/zero/api.py`; our reading of the client, not
Hugging Face's server): one GPU, one task at a time, others queue; a worker is reused (`idle=true`)
while it lives and the same task asks; it is killed when another task takes the GPU, after a failed
call, and when a call runs past its duration (+ `--duration-grace`). Startup calls (before the app
launches) may ask for up to 1500 s. Two test controls, not part of ZeroGPU's API:
`POST /reclaim` kills the worker on the GPU now, and `POST /abort-next?after=S` kills the worker
of the next call S seconds into it. Not emulated: the cgroup that hides the GPU from the main
process, quotas, MIG or half-card slices, the real duration caps.

`--cpu` replaces the two steps of spaces' worker start that need an NVIDIA driver (see
`use_cpu_worker`); everything else is the real spaces code. The harness itself is standard library
only and never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

STARTUP_MAX_SECONDS = 1500


def log(message: str) -> None:
    print(f"[zerogpu-harness {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def alive(pid: int | None) -> bool:
    """True for a running process (not a zombie)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class DeviceAPI:
    """The scheduler's state: who holds the GPU, which worker is on it, the tokens handed out."""

    def __init__(self, cold: bool, duration_grace: float, queue_timeout: float):
        self.cold, self.duration_grace, self.queue_timeout = cold, duration_grace, queue_timeout
        self.cond = threading.Condition()
        self.started = False  # /startup-report seen: the app launched
        self.holder: str | None = None  # token holding the GPU
        self.tokens: dict[str, dict] = {}
        self.task: int | None = None  # the task and worker on the GPU (busy or idle)
        self.worker: int | None = None
        self.workers: set[int] = set()  # pids that called /allow: the only ones ever killed
        self.abort_after: float | None = None
        self.counts = {"schedule": 0, "allow": 0, "release": 0, "failed": 0, "killed": 0, "queued": 0}

    def kill(self, pid: int | None, why: str) -> None:
        if pid in self.workers and alive(pid):
            log(f"killing worker {pid} ({why})")
            self.counts["killed"] += 1
            os.kill(pid, signal.SIGKILL)

    def grant(self, task: int, duration: int) -> dict:
        """Give the GPU to a new token (caller holds `cond` and saw `holder is None`)."""
        idle = not self.cold and self.task == task and alive(self.worker)
        if not idle:
            self.kill(self.worker, f"GPU handed to task {task}")
            self.task, self.worker = task, None
        token = uuid.uuid4().hex
        self.holder = token
        limit, why = duration + self.duration_grace, "ran past its duration"
        if self.abort_after is not None:
            limit, why, self.abort_after = self.abort_after, "aborted by /abort-next", None
        timer = threading.Timer(limit, self.overtime, args=(token, why))
        timer.daemon = True
        timer.start()
        self.tokens[token] = {"task": task, "timer": timer, "t0": time.time()}
        log(f"task {task}: GPU granted for {duration} s, worker {'reused' if idle else 'new'}")
        return {
            "idle": idle,
            "nvidiaIndex": 0,
            "nvidiaUUID": os.environ.get("ZEROGPU_HARNESS_GPU", "0"),
            "allowToken": token,
        }

    def overtime(self, token: str, why: str) -> None:
        with self.cond:
            if self.holder == token:
                self.kill(self.worker, why)

    def allow(self, token: str, pid: int) -> int:
        with self.cond:
            if token not in self.tokens:
                return 404
            self.worker = pid
            self.workers.add(pid)
            self.counts["allow"] += 1
        return 200

    def release(self, token: str, fail: bool) -> int:
        with self.cond:
            entry = self.tokens.pop(token, None)
            if entry is None:
                return 404
            entry["timer"].cancel()
            self.counts["release"] += 1
            self.counts["failed"] += fail
            log(f"task {entry['task']}: released after {time.time() - entry['t0']:.1f} s{' (failed)' if fail else ''}")
            if fail or self.cold:
                self.kill(self.worker, "failed call" if fail else "--cold")
                self.task, self.worker = None, None
            if self.holder == token:
                self.holder = None
                self.cond.notify_all()
        return 200

    def reclaim(self) -> None:
        with self.cond:
            self.kill(self.worker, "/reclaim")
            self.task, self.worker = None, None


class Handler(BaseHTTPRequestHandler):
    api: DeviceAPI  # set by serve()

    def log_message(self, *args) -> None:  # our own log() says what matters
        pass

    def send(self, code: int, body=None, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path, api = urlparse(self.path).path, self.api
        if path == "/status":
            with api.cond:
                return self.send(200, {**api.counts, "worker": api.worker, "worker_alive": alive(api.worker)})
        self.send(404)

    def do_POST(self) -> None:
        path, api = urlparse(self.path).path, self.api
        params = {key: values[-1] for key, values in parse_qs(urlparse(self.path).query).items()}
        try:
            if path == "/startup-report":
                api.started = True
                log("the app launched (/startup-report)")
                return self.send(200, {})
            if path == "/allow":
                return self.send(api.allow(params["allowToken"], int(params["pid"])))
            if path == "/release":
                return self.send(api.release(params["allowToken"], params.get("fail", "false").lower() == "true"))
            if path == "/schedule":
                return self.schedule(int(params["taskId"]), int(params.get("durationSeconds", 60)))
            if path == "/reclaim":
                api.reclaim()
                return self.send(200, {})
            if path == "/abort-next":
                api.abort_after = float(params["after"])
                return self.send(200, {})
        except (KeyError, ValueError) as exc:
            return self.send(422, {"detail": f"bad or missing parameter: {exc}"})
        self.send(404)

    def schedule(self, task: int, duration: int) -> None:
        api = self.api
        api.counts["schedule"] += 1
        if not api.started and duration > STARTUP_MAX_SECONDS:
            # wait < 0: spaces raises "ZeroGPU illegal duration" (spaces/zero/client.py)
            return self.send(429, {"left": STARTUP_MAX_SECONDS, "wait": -1}, {"X-Approve-Result": "illegal-duration"})
        with api.cond:
            if api.holder is None:
                return self.send(200, api.grant(task, duration))
        # Busy: queue as server-sent events, one event per write (spaces reads one event per chunk).
        api.counts["queued"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        deadline = time.time() + api.queue_timeout
        while True:
            with api.cond:
                api.cond.wait(timeout=5)
                granted = api.grant(task, duration) if api.holder is None else None
            if granted is not None:
                time.sleep(0.5)  # never in the same chunk as a ping
                self.wfile.write(f"event: succeeded\ndata: {json.dumps(granted)}\n\n".encode())
                break
            if time.time() > deadline:
                self.wfile.write(b"event: failed\n\n")
                break
            self.wfile.write(b"event: ping\n\n")
            self.wfile.flush()
        self.wfile.flush()
        self.close_connection = True


def serve(port: int, cold: bool = False, duration_grace: float = 10.0, queue_timeout: float = 60.0):
    """Start the device API on 127.0.0.1:`port` in a thread; returns the server (`.api` its state)."""
    handler = type("BoundHandler", (Handler,), {"api": DeviceAPI(cold, duration_grace, queue_timeout)})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    server.api = handler.api
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def zerogpu_environ(url: str, folder: str) -> dict[str, str]:
    """The environment a ZeroGPU Space sees, pointed at the stand-in at `url`; scratch files in `folder`."""
    cgroup = os.path.join(folder, "cgroup")
    with open(cgroup, "w") as f:
        f.write("0::/zerogpu-harness\n")  # what spaces sends as its cgroup; /proc/self/cgroup varies (gVisor)
    return {
        "SPACES_ZERO_GPU": "true",
        "SPACES_ZERO_DEVICE_API_URL": url,
        "ZEROGPU_OFFLOAD_DIR": os.path.join(folder, "offload"),  # where spaces packs the weights at launch
        # Packing deletes the Hub cache files it packed unless this matches none of them.
        "ZEROGPU_MMAP_AUTOPRUNE_PATTERN": os.path.join(folder, "no-such-file", "*"),
        "ZEROGPU_PROC_SELF_CGROUP_PATH": cgroup,
    }


# --------------------------------------------------------------------------------------------
# --cpu: stand-ins for the two worker steps that need an NVIDIA driver (in the app's process)


def use_cpu_worker() -> None:
    """Let spaces' GPU worker run on the CPU. Import spaces (in ZeroGPU mode) first.

    Stood in, and why: `spaces.zero.torch.init` ends with `torch.Tensor([0]).cuda()` and `move`
    copies every weight to CUDA; both need a GPU driver (with a CUDA build of torch everything
    else of ZeroGPU mode runs on a CPU: the emulated CUDA, packing, forking, scheduling). Here init
    only sets CUDA_VISIBLE_DEVICES, and move gives each emulated tensor its CPU data back (from
    memory, or from the pack on disk) so the worker computes on the CPU.
    """
    import spaces.zero.torch as zero_torch
    import torch
    from spaces.zero.torch import patching

    def init(nvidia_uuid: str) -> None:
        os.environ["CUDA_VISIBLE_DEVICES"] = nvidia_uuid

    def move(callback=None) -> None:
        callback = callback or (lambda n: None)
        for fake, original in list(patching.cuda_aliases.items()):
            if original is not None:
                fake.data = original
                callback(fake.numel() * fake.element_size())
        for pack in patching.tensor_packs:  # the layout `spaces.zero.torch.packing.pack_tensors` writes
            with open(pack.path(), "rb") as f:
                data = f.read()
            offset = 0
            for meta, size, padded in [item for batch in pack.batches for item in batch] + list(pack.big_tensors):
                buffer = torch.frombuffer(bytearray(data[offset : offset + size]), dtype=torch.uint8)
                tensor = torch.empty(0, dtype=meta.dtype).set_(buffer.untyped_storage(), 0, meta.shape, meta.stride())
                for fake in pack.fakes[meta]:
                    fake.data = tensor
                offset += padded
                callback(size)

    zero_torch.init, zero_torch.move = init, move


def _run_on_cpu(script: str, args: list[str]) -> None:
    """The app process under --cpu: spaces in ZeroGPU mode, the CPU worker, then `script` as __main__."""
    import spaces  # noqa: F401  (patches torch: emulated CUDA in this process)

    use_cpu_worker()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=7870, help="device API port on 127.0.0.1 (default 7870)")
    parser.add_argument("--cold", action="store_true", help="never reuse a worker: every call forks a new one")
    parser.add_argument("--cpu", action="store_true", help="no GPU here: the worker computes on the CPU")
    parser.add_argument("--duration-grace", type=float, default=10.0, help="seconds past its duration a call may run")
    parser.add_argument("script", help="the Space's Python file, e.g. app.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    server = serve(args.port, args.cold, args.duration_grace)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    folder = tempfile.mkdtemp(prefix="zerogpu-harness-")
    env = {**os.environ, **zerogpu_environ(url, folder)}
    if args.cpu:
        command = [sys.executable, "-c", f"import zerogpu_harness as h; h._run_on_cpu({args.script!r}, {args.args!r})"]
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    else:
        command = [sys.executable, args.script, *args.args]
    log(f"device API at {url}; running {' '.join([args.script, *args.args])} in ZeroGPU mode")
    app = subprocess.Popen(command, env=env)
    try:
        return app.wait()
    except KeyboardInterrupt:
        app.send_signal(signal.SIGINT)
        return app.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
