"""What `python app.py` checks before it loads anything: where it will serve, and where it will write.

Each check refuses in one line naming the port or the path (app.py's `usage_errors` turns the
exception into `app.py: error: ...`), so a Space that cannot serve says so in seconds, not after
minutes of loading and compiling. (The save target is checked by `load_pipeline`, also before any
weight loads.)
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile

from gradio.utils import get_upload_folder

# gradio's own defaults for where `launch()` listens (gradio/networking.py, gradio/http_server.py).
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 7860


def serving_port() -> int:
    """The port `launch()` will listen on (`GRADIO_SERVER_PORT`, default 7860), checked free on
    `GRADIO_SERVER_NAME`. Pass it to `launch(server_port=...)`: given no port, gradio takes the next
    free one without a word, and a Space's health check then fails with no hint why.

    Raises:
        ValueError: `GRADIO_SERVER_PORT` is not a port number.
        RuntimeError: the port is taken (or cannot be bound), naming it and what to do.
    """
    raw = os.environ.get("GRADIO_SERVER_PORT", str(DEFAULT_PORT))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(f"GRADIO_SERVER_PORT={raw!r}: use a port number from 1 to 65535")
    host, port = os.environ.get("GRADIO_SERVER_NAME") or DEFAULT_HOST, int(raw)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            problem = "is taken by another process" if taken else f"cannot be bound ({exc.strerror})"
            advice = "stop it, or set GRADIO_SERVER_PORT to a free port"
            raise RuntimeError(f"port {port} on {host} {problem}: {advice}") from None
    return port


def check_cache_writable() -> str:
    """gradio's cache folder (`GRADIO_TEMP_DIR`, default /tmp/gradio), where uploads and results go,
    made if missing and checked writable by writing a file there; returns its path.

    Raises:
        RuntimeError: it cannot be made or written, naming it and what to do.
    """
    folder = get_upload_folder()
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise RuntimeError(
            f"gradio's cache folder {folder} is not writable ({exc.strerror}): results and uploads go there; "
            "set GRADIO_TEMP_DIR to a writable folder"
        ) from None
    return folder
