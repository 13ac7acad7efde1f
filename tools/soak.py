"""Soak test: a Space left up under load, watched for what grows.

Starts `python app.py` on a tiny pipeline (compiled, LoRA choices offered, results kept
`--max-age` seconds), then sends `--requests` requests from `--clients` gradio_client clients:
sizes, steps, seeds and LoRAs drawn from a seeded generator, and every `--cancel-every`-th request
cancelled a moment after it is sent. At each checkpoint it reads the server process's resident
memory, open files and threads (/proc), and the results in gradio's cache. It prints a table, then
one JSON line, appended to benchmarks/results.jsonl (`--results`).

    python -m tools.soak                          # 2,000 requests, 4 clients, checkpoints every 500
    python -m tools.soak --requests 200 --every 50  # a short run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(512, 512), (768, 512), (512, 768), (1024, 1024), (1536, 640)]
LORAS = ["none", "a", "b"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_stats(pid: int) -> dict:
    """The server process's resident memory (MB), open files and threads, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "open_files": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


def cache_stats(cache: Path) -> dict:
    """The result files in gradio's cache folder: how many, and their MB."""
    files = [p for p in cache.rglob("*.png") if p.is_file()]
    return {"result_files": len(files), "result_mb": sum(p.stat().st_size for p in files) / 1e6}


def serve(work: Path, max_age: int) -> tuple[subprocess.Popen, str, Path]:
    """app.py on the tiny pipeline in a process group of its own; returns it, its URL, its log."""
    port, cache, log = free_port(), work / "gradio", work / "app.log"
    loras = ROOT / "assets" / "tiny-flux-loras"
    env = {
        **os.environ,
        "MODEL_ID": str(ROOT / "assets" / "tiny-flux"),
        "AOT_LORA_CHOICES": f"a={loras / 'a.safetensors'},b={loras / 'b.safetensors'}",
        "AOT_RESULTS_MAX_AGE": str(max_age),
        "GRADIO_TEMP_DIR": str(cache),
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
    }
    with open(log, "w") as out:
        app = subprocess.Popen(
            [sys.executable, "app.py"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 600
    while "Running on local URL" not in log.read_text(errors="replace"):
        if app.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"app.py did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return app, f"http://127.0.0.1:{port}/", cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--every", type=int, default=500, help="requests between checkpoints")
    parser.add_argument("--cancel-every", type=int, default=10, help="every Nth request is cancelled once sent")
    parser.add_argument("--max-age", type=int, default=60, help="AOT_RESULTS_MAX_AGE of the Space, seconds")
    parser.add_argument(
        "--results",
        default=str(ROOT / "benchmarks" / "results.jsonl"),
        help="file the JSON line is appended to ('' for none)",
    )
    args = parser.parse_args(argv)
    from gradio_client import Client

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    app, url, cache = serve(work, args.max_age)
    rng, lock = random.Random(0), threading.Lock()
    sent, outcomes, rows, failures = 0, {"served": 0, "cancelled": 0, "failed": 0}, [], []
    started = time.monotonic()

    def checkpoint(done: int) -> None:
        row = {"requests": done, "minutes": (time.monotonic() - started) / 60, **process_stats(app.pid)}
        rows.append({**row, **cache_stats(cache), **outcomes})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    def client_loop() -> None:
        nonlocal sent
        client = Client(url, verbose=False)
        while True:
            with lock:
                if sent >= args.requests:
                    return
                sent += 1
                number = sent
                (width, height), steps = rng.choice(SIZES), rng.randint(1, 4)
                lora, seed = rng.choice(LORAS), rng.randrange(2**31)
            values = ("a soak test", seed, False, width, height, steps, 3.5, lora)
            try:
                if number % args.cancel_every == 0:
                    job = client.submit(*values, api_name="/generate")
                    time.sleep(0.05)
                    job.cancel()
                    outcome = "cancelled"
                else:
                    client.predict(*values, api_name="/generate")
                    outcome = "served"
            except Exception as exc:  # a refused or failed request counts; the soak goes on
                outcome = "failed"
                with lock:
                    failures.append(f"request {number} {values[1:]}: {type(exc).__name__}: {exc}"[:300])
            with lock:
                outcomes[outcome] += 1
                if number % args.every == 0:
                    checkpoint(number)

    checkpoint(0)
    threads = [threading.Thread(target=client_loop) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(2 * min(args.max_age, 60) + 5)  # gradio's sweep: results older than max-age go
    checkpoint(sent)
    os.killpg(app.pid, signal.SIGTERM)
    app.wait(timeout=60)

    columns = ["requests", "minutes", "rss_mb", "open_files", "threads", "result_files", "result_mb"]
    columns += ["served", "cancelled", "failed"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines + failures[:20]))
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    line = json.dumps(
        {
            "date": datetime.date.today().isoformat(),
            "tool": "soak",
            "commit": commit.stdout.strip() or "unknown",
            "clients": args.clients,
            "max_age_s": args.max_age,
            "rows": rows,
            "failures": failures[:20],
        }
    )
    print(line)
    if args.results:
        with open(args.results, "a") as results:
            results.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
