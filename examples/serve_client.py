"""Start `kvforge serve` on a model, then talk to it with the stock openai client: one chat answer, one streamed.

    python examples/serve_client.py [MODEL] [PORT]   # needs: pip install 'kvforge[serve]' openai

The server listens on 127.0.0.1 only (PORT: the argument, else $KVFORGE_PORT, else a free port) and is stopped at
the end. Any OpenAI-compatible client works the same way: base_url http://127.0.0.1:PORT/v1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(server: subprocess.Popen, url: str, timeout_s: float = 180.0) -> None:
    """Poll ``url/health`` until the model has loaded (the first load of a GGUF model dequantizes it: ~20 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited: {server.stderr.read() if server.stderr else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    sys.exit(f"the server did not answer on {url} within {timeout_s:.0f} s")


def main(model_name: str = "smollm2-135m", port: str | None = None) -> None:
    port = port or os.environ.get("KVFORGE_PORT") or str(free_port())
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvforge", "serve", "--model", model_name, "--host", "127.0.0.1", "--port", port,
           "--served-model-name", "kvforge-demo"]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_up(server, url)
        client = OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name a colour of the sky."}]
        reply = client.chat.completions.create(model="kvforge-demo", messages=messages, max_tokens=12, temperature=0)
        print(f"chat: {reply.choices[0].message.content!r} ({reply.usage.prompt_tokens} prompt tokens)")
        stream = client.chat.completions.create(
            model="kvforge-demo", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        print(f"stream: {text!r}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main(*sys.argv[1:3])
