"""Run the Space in ZeroGPU mode on your own machine, before you push it. From the repo root:

    python tools/zerogpu_harness.py app.py           # a GPU box: real spaces, real forks, real CUDA
    python tools/zerogpu_harness.py --cpu app.py     # no GPU: the worker computes on the CPU
    python tools/zerogpu_harness.py --cold app.py    # every call gets a new worker (ZeroGPU reclaimed it)
    python tools/zerogpu_harness.py --gpus 3 app.py  # three visitors' GPU calls at once, each in its worker

It starts a stand-in for ZeroGPU's device API on 127.0.0.1 and runs the command with the real
`spaces` package in ZeroGPU mode (`SPACES_ZERO_GPU=true`): the main process sees emulated CUDA,
`@spaces.GPU` calls are scheduled here, each runs in a forked worker that gets the GPU, and
arguments and results are pickled across the fork. What breaks on ZeroGPU (CUDA touched in the
main process, a pipeline passed as an argument, a worker that cannot start again after a kill)
breaks here too. Ctrl-C and SIGTERM reach the app; the harness waits for it to end, then kills
the workers it left (as ZeroGPU takes its GPUs back).

The device API (what spaces 0.51.3 calls, `spaces/zero/api.py`; our reading of the client, not
Hugging Face's server): `--gpus N` (default 1) calls hold a GPU at once, each granted its own
`nvidiaIndex` (0 to N-1; spaces keeps one worker per index); further calls queue (server-sent
events) until an index is free, and fail after 60 s. A call's worker is reused (`idle=true`) only
when the same task's worker on that index is alive and not busy; a worker is killed when another
task takes its index, after a failed call, when a call runs past its duration (+
`--duration-grace`), and when the app exits. Startup calls (before the app launches) may ask for
up to 1500 s. On a GPU box every index is the same physical GPU (`nvidiaUUID` is
`ZEROGPU_HARNESS_GPU`, default 0): each of N workers puts its own copy of the weights on that one
card. Test controls, not part of ZeroGPU's API: `POST /reclaim` kills the worker on every GPU now
(`?index=I`: on GPU I), `POST /abort-next?after=S` kills the worker of the next call S seconds into
it, and `GET /status` reports the counts (schedule, grants, allow = workers started, release,
failed, killed, queued = calls that waited), `holding` and `waiting` now, `most_at_once` (the most
calls that held a GPU at the same time) and each GPU's task and worker. Not emulated: the cgroup
that hides the GPU from the main process, quotas, MIG or half-card slices, the real duration caps,
how many calls at once ZeroGPU grants a Space (`--gpus` picks a number).

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


class Slot:
    """One GPU index (`nvidiaIndex`): the token holding it, and the task and worker on it (busy or idle)."""

    def __init__(self, index: int):
        self.index = index
        self.holder: str | None = None
        self.task: int | None = None
        self.worker: int | None = None


class DeviceAPI:
    """The scheduler's state: `gpus` indexes (who holds each, which worker is on it), the tokens handed out."""

    def __init__(self, cold: bool, duration_grace: float, queue_timeout: float, gpus: int = 1):
        if gpus < 1:
            raise ValueError(f"gpus={gpus}: at least 1")
        self.cold, self.duration_grace, self.queue_timeout = cold, duration_grace, queue_timeout
        self.cond = threading.Condition()
        self.started = False  # /startup-report seen: the app launched
        self.slots = [Slot(index) for index in range(gpus)]
        self.tokens: dict[str, dict] = {}  # token -> its task, slot, overtime timer, start time
        self.workers: set[int] = set()  # pids that called /allow: the only ones ever killed
        self.abort_after: float | None = None
        self.waiting = 0  # /schedule calls queued now
        self.most_at_once = 0  # the most tokens that held a GPU at the same time
        self.counts = {
            "schedule": 0,  # /schedule calls
            "grants": 0,  # GPUs handed out (at once or after queueing)
            "allow": 0,  # workers that started (each new worker calls /allow once)
            "release": 0,
            "failed": 0,  # releases with fail=true
            "killed": 0,  # workers killed
            "queued": 0,  # /schedule calls that had to queue
        }

    def kill(self, pid: int | None, why: str) -> None:
        if pid in self.workers and alive(pid):
            log(f"killing worker {pid} ({why})")
            self.counts["killed"] += 1
            os.kill(pid, signal.SIGKILL)

    def free_slot(self, task: int) -> Slot | None:
        """The index to grant `task` (caller holds `cond`): a free one where this task's worker lives
        (reused), else a free one with no live worker, else any free one; None when all are held."""
        free = [slot for slot in self.slots if slot.holder is None]
        reusable = [slot for slot in free if slot.task == task and alive(slot.worker)]
        empty = [slot for slot in free if not alive(slot.worker)]
        return next(iter(reusable + empty + free), None)

    def grant(self, slot: Slot, task: int, duration: int) -> dict:
        """Give `slot` (free: `free_slot`) to a new token (caller holds `cond`)."""
        idle = not self.cold and slot.task == task and alive(slot.worker)
        if not idle:
            self.kill(slot.worker, f"GPU {slot.index} handed to task {task}")
            slot.task, slot.worker = task, None
        token = uuid.uuid4().hex
        slot.holder = token
        limit, why = duration + self.duration_grace, "ran past its duration"
        if self.abort_after is not None:
            limit, why, self.abort_after = self.abort_after, "aborted by /abort-next", None
        timer = threading.Timer(limit, self.overtime, args=(token, why))
        timer.daemon = True
        timer.start()
        self.tokens[token] = {"task": task, "slot": slot, "timer": timer, "t0": time.time()}
        self.counts["grants"] += 1
        self.most_at_once = max(self.most_at_once, sum(s.holder is not None for s in self.slots))
        where = f"GPU {slot.index}, " if len(self.slots) > 1 else ""
        log(f"task {task}: GPU granted for {duration} s, {where}worker {'reused' if idle else 'new'}")
        return {
            "idle": idle,
            "nvidiaIndex": slot.index,
            # Every index is the same physical GPU (the harness has one card to offer, or none).
            "nvidiaUUID": os.environ.get("ZEROGPU_HARNESS_GPU", "0"),
            "allowToken": token,
        }

    def overtime(self, token: str, why: str) -> None:
        with self.cond:
            entry = self.tokens.get(token)
            if entry is not None and entry["slot"].holder == token:
                self.kill(entry["slot"].worker, why)

    def allow(self, token: str, pid: int) -> int:
        with self.cond:
            if token not in self.tokens:
                return 404
            self.tokens[token]["slot"].worker = pid
            self.workers.add(pid)
            self.counts["allow"] += 1
        return 200

    def release(self, token: str, fail: bool) -> int:
        with self.cond:
            entry = self.tokens.pop(token, None)
            if entry is None:
                return 404
            entry["timer"].cancel()
            slot = entry["slot"]
            self.counts["release"] += 1
            self.counts["failed"] += fail
            where = f" GPU {slot.index}" if len(self.slots) > 1 else ""
            took = f"{time.time() - entry['t0']:.1f} s{' (failed)' if fail else ''}"
            log(f"task {entry['task']}:{where} released after {took}")
            if fail or self.cold:
                self.kill(slot.worker, "failed call" if fail else "--cold")
                slot.task, slot.worker = None, None
            if slot.holder == token:
                slot.holder = None
                self.cond.notify_all()
        return 200

    def reclaim(self, index: int | None = None) -> None:
        """Kill the worker on GPU `index` (every GPU's: None), as ZeroGPU does when it wants one back."""
        with self.cond:
            for slot in self.slots if index is None else [self.slots[index]]:
                self.kill(slot.worker, "/reclaim")
                slot.task, slot.worker = None, None

    def kill_workers(self) -> None:
        """Kill every worker still alive (the app has exited: the service takes its GPUs back)."""
        with self.cond:
            for pid in sorted(self.workers):
                self.kill(pid, "the app exited")

    def status(self) -> dict:
        """What `/status` answers: the counts, how many calls hold a GPU now and at most at once so
        far, how many wait, and each GPU's task and worker (`worker`, `worker_alive`: GPU 0's)."""
        with self.cond:
            gpus = [
                {"index": s.index, "busy": s.holder is not None, "task": s.task, "worker": s.worker}
                | {"worker_alive": alive(s.worker)}
                for s in self.slots
            ]
            return {
                **self.counts,
                "holding": sum(gpu["busy"] for gpu in gpus),
                "most_at_once": self.most_at_once,
                "waiting": self.waiting,
                "worker": gpus[0]["worker"],
                "worker_alive": gpus[0]["worker_alive"],
                "gpus": gpus,
            }


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
            return self.send(200, api.status())
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
                api.reclaim(int(params["index"]) if "index" in params else None)
                return self.send(200, {})
            if path == "/abort-next":
                api.abort_after = float(params["after"])
                return self.send(200, {})
        except (KeyError, ValueError, IndexError) as exc:
            return self.send(422, {"detail": f"bad or missing parameter: {exc}"})
        self.send(404)

    def schedule(self, task: int, duration: int) -> None:
        api = self.api
        with api.cond:
            api.counts["schedule"] += 1
        if not api.started and duration > STARTUP_MAX_SECONDS:
            # wait < 0: spaces raises "ZeroGPU illegal duration" (spaces/zero/client.py)
            return self.send(429, {"left": STARTUP_MAX_SECONDS, "wait": -1}, {"X-Approve-Result": "illegal-duration"})
        with api.cond:
            slot = api.free_slot(task)
            granted = api.grant(slot, task, duration) if slot is not None else None
            if granted is None:
                api.counts["queued"] += 1
                api.waiting += 1
        if granted is not None:
            return self.send(200, granted)
        # Every GPU is held: queue as server-sent events, one event per write (spaces reads one event per chunk).
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            deadline = time.time() + api.queue_timeout
            while True:
                with api.cond:
                    api.cond.wait(timeout=5)
                    slot = api.free_slot(task)
                    granted = api.grant(slot, task, duration) if slot is not None else None
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
        except OSError:  # the caller left the queue (spaces closes it when the visitor disconnects)
            log(f"task {task}: left the queue")
            if granted is not None:  # granted but never told: give the GPU back
                api.release(granted["allowToken"], fail=False)
        finally:
            self.close_connection = True
            with api.cond:
                api.waiting -= 1


def serve(port: int, cold: bool = False, duration_grace: float = 10.0, queue_timeout: float = 60.0, gpus: int = 1):
    """Start the device API on 127.0.0.1:`port` in a thread; returns the server (`.api` its state)."""
    handler = type("BoundHandler", (Handler,), {"api": DeviceAPI(cold, duration_grace, queue_timeout, gpus)})
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
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPU calls granted at once, each on its own nvidiaIndex (default 1); all are the same physical GPU",
    )
    parser.add_argument("script", help="the Space's Python file, e.g. app.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus {args.gpus}: at least 1")
    server = serve(args.port, args.cold, args.duration_grace, gpus=args.gpus)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    folder = tempfile.mkdtemp(prefix="zerogpu-harness-")
    env = {**os.environ, **zerogpu_environ(url, folder)}
    if args.cpu:
        command = [sys.executable, "-c", f"import zerogpu_harness as h; h._run_on_cpu({args.script!r}, {args.args!r})"]
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    else:
        command = [sys.executable, args.script, *args.args]
    gpus = f", {args.gpus} GPU calls at once" if args.gpus > 1 else ""
    log(f"device API at {url}{gpus}; running {' '.join([args.script, *args.args])} in ZeroGPU mode")
    app = subprocess.Popen(command, env=env)
    # SIGTERM (a supervisor, `kill`, a test's teardown) ends the app too, not only this process.
    signal.signal(signal.SIGTERM, lambda signum, frame: app.send_signal(signal.SIGTERM))
    try:
        interrupts = 0
        while True:
            try:
                code = app.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C: the app hears it too, and this waits for it; twice: kill it
                interrupts += 1
                app.send_signal(signal.SIGINT if interrupts == 1 else signal.SIGKILL)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says it
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if app.poll() is None:  # this process is failing for another reason: do not leave the app serving
            app.kill()
            app.wait()
        server.api.kill_workers()  # a worker outlives an app killed by a signal; ZeroGPU would reclaim it
        server.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
