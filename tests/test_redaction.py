"""Redaction (issue 18, item 3): credentials on the engine's command line, in its environment and
in its server's answers are never stored in clear; with --redact-text neither is anything that
may hold prompt text. Performed on a real llama-server started with secrets, and a real HTTP
server whose /props answer holds them."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import ENGINES, Engine, Recorder, free_port

import sparseety_prof
from sparseety_prof.session import redaction
from sparseety_prof.session.snapshot import server_props

R = redaction.REDACTED


# ------------------------------------------------------------------ the rules
def test_command_line_credentials_always_prompts_with_redact_text() -> None:
    argv = [
        "llama-server",
        "-m",
        "/m/x.gguf",
        "--api-key",
        "k1",
        "--api-key-file=/run/keyfile",
        "--ssl-key-file",
        "/etc/key.pem",
        "-hft",
        "hf1",
        "--hf-token=hf2",
        "--model-url",
        "https://user:pw@host/m.gguf",
        "--system-prompt",
        "be nice",
        "-p",
        "-dash prompt",
        "--chat-template",
        "chatml",
        "--in-prefix-bos",
        "-c",
        "2048",
        "--max-tokens",
        "64",
        "a positional prompt",
    ]
    kept = redaction.command_line(argv, redact_text=False)
    assert kept == [
        "llama-server", "-m", "/m/x.gguf", "--api-key", R, f"--api-key-file={R}", "--ssl-key-file", R,
        "-hft", R, f"--hf-token={R}", "--model-url", f"https://{R}@host/m.gguf",
        "--system-prompt", "be nice", "-p", "-dash prompt", "--chat-template", "chatml",
        "--in-prefix-bos", "-c", "2048", "--max-tokens", "64", "a positional prompt",
    ]  # fmt: skip
    redacted = redaction.command_line(argv, redact_text=True)
    assert redacted == [
        "llama-server", "-m", "/m/x.gguf", "--api-key", R, f"--api-key-file={R}", "--ssl-key-file", R,
        "-hft", R, f"--hf-token={R}", "--model-url", f"https://{R}@host/m.gguf",
        "--system-prompt", R, "-p", R, "--chat-template", R,
        "--in-prefix-bos", "-c", "2048", "--max-tokens", "64", R,
    ]  # fmt: skip


def test_environment_allow_list_with_redact_text() -> None:
    env = {
        "OMP_NUM_THREADS": "3",
        "CUDA_VISIBLE_DEVICES": "0",
        "LLAMA_ARG_N_GPU_LAYERS": "99",
        "LLAMA_ARG_API_KEY": "s1",
        "LLAMA_ARG_SSL_KEY_FILE": "/k",
        "GGML_PASSPHRASE": "s2",
        "LLAMA_SESSION_COOKIE": "s3",
        "LLAMA_ARG_CHAT_TEMPLATE": "t",
        "XLLAMACPP_NOTE": "n",
        "LLAMA_ARG_MODEL_URL": "https://u:p@h/m",
    }
    assert redaction.environment(env, redact_text=False) == {
        **env,
        "LLAMA_ARG_API_KEY": R,
        "LLAMA_ARG_SSL_KEY_FILE": R,
        "GGML_PASSPHRASE": R,
        "LLAMA_SESSION_COOKIE": R,
        "LLAMA_ARG_MODEL_URL": f"https://{R}@h/m",
    }
    assert redaction.environment(env, redact_text=True) == {
        "OMP_NUM_THREADS": "3",
        "CUDA_VISIBLE_DEVICES": "0",
        "LLAMA_ARG_N_GPU_LAYERS": "99",
        "LLAMA_ARG_API_KEY": R,
        "LLAMA_ARG_SSL_KEY_FILE": R,
        "GGML_PASSPHRASE": R,
        "LLAMA_SESSION_COOKIE": R,
        "LLAMA_ARG_CHAT_TEMPLATE": R,
        "XLLAMACPP_NOTE": R,
        "LLAMA_ARG_MODEL_URL": f"https://{R}@h/m",
    }


PROPS: dict[str, Any] = {
    "default_generation_settings": {
        "params": {"temperature": 0.8, "max_tokens": -1, "stop": ["SECRET-stop"], "n_keep": 0},
        "prompt": "SECRET-prompt",
        "n_ctx": 512,
    },
    "system_prompt": "SECRET-system",
    "api_key": "SECRET-key",
    "hf_token": "SECRET-hf",
    "chat_template": "SECRET-template",
    "model_path": "/m/x.gguf",
    "bos_token": "<s>",
    "total_slots": 1,
}


@pytest.fixture
def props_server() -> Iterator[str]:
    """A real HTTP server answering GET /props with secrets in it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(PROPS).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_server_answer_keeps_settings_hides_keys_and_with_redact_text_prompts(props_server: str) -> None:
    plain = server_props(props_server)
    assert plain["api_key"] == R and plain["hf_token"] == R and "chat_template" not in plain
    assert plain["system_prompt"] == "SECRET-system"  # a prompt, not a credential: kept by default
    assert plain["bos_token"] == "<s>" and plain["total_slots"] == 1
    assert plain["default_generation_settings"]["params"]["max_tokens"] == -1
    redacted = server_props(props_server, redact_text=True)
    assert "SECRET" not in json.dumps(redacted)
    assert redacted["default_generation_settings"]["prompt"] == R
    assert redacted["default_generation_settings"]["params"]["stop"] == R
    assert redacted["default_generation_settings"]["params"]["temperature"] == 0.8
    assert redacted["model_path"] == "/m/x.gguf" and redacted["bos_token"] == "<s>"


# ------------------------------------------------------------------ a real engine
API_KEY = "SECRET-api-key-7f3a"
HF_TOKEN = "SECRET-hf-token-91c2"
SYSTEM_PROMPT = "SECRET system prompt words"
CREDENTIAL_ENV = {
    "MY_PASSPHRASE": "SECRET-passphrase-1",
    "SESSION_COOKIE": "SECRET-cookie-1",
    "GGML_PASSPHRASE": "SECRET-passphrase-2",  # prefixes the snapshot keeps: the old filter missed these
    "LLAMA_SESSION_COOKIE": "SECRET-cookie-2",
    "LLAMA_ARG_API_KEY": "SECRET-api-key-env",
}
TEXT_ENV = {"LLAMA_ARG_CHAT_TEMPLATE": "SECRET-template-env", "XLLAMACPP_NOTE": "SECRET-note-env"}
CREDENTIALS = [API_KEY, HF_TOKEN, *CREDENTIAL_ENV.values()]


def _everything_stored(rec: Path) -> str:
    """Every byte of every file of the recording, and every value of its tables decoded (a
    compressed segment could hide a string from a byte search)."""
    raw = b"".join(f.read_bytes() for f in sorted(rec.rglob("*")) if f.is_file())
    r = sparseety_prof.open(rec)
    decoded = [str(r.table(name).to_dicts()) for name in r.meta["tables"]]
    return raw.decode("utf-8", "replace") + "".join(decoded)


def _record(server: Engine, out: Path, *flags: str) -> None:
    rec = Recorder(server.pid, out, *flags)
    req = urllib.request.Request(
        server.ready["url"] + "/completion",
        data=json.dumps({"prompt": "SECRET prompt", "n_predict": 4, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    assert sparseety_prof.open(out).tokens().height == 4


@pytest.mark.root
@pytest.mark.engine
def test_secrets_of_a_real_engine_never_reach_the_recording(models: dict[str, Path], tmp_path: Path) -> None:
    server = Engine(
        [
            str(ENGINES / "server_engine.py"),
            str(models["moe"]),
            "--port",
            str(free_port()),
            "--api-key",
            API_KEY,
            "--hf-token",
            HF_TOKEN,
            "--system-prompt",
            SYSTEM_PROMPT,
        ],
        env={**CREDENTIAL_ENV, **TEXT_ENV, "OMP_NUM_THREADS": "1"},
    )
    try:
        _record(server, tmp_path / "default")
        _record(server, tmp_path / "redacted", "--redact-text")
    finally:
        server.close()

    stored = _everything_stored(tmp_path / "default")
    for secret in CREDENTIALS:
        assert secret not in stored, secret
    meta = sparseety_prof.open(tmp_path / "default").meta
    cmdline = meta["target"]["cmdline"]
    assert cmdline[cmdline.index("--api-key") + 1] == R and cmdline[cmdline.index("--hf-token") + 1] == R
    assert cmdline[cmdline.index("--system-prompt") + 1] == SYSTEM_PROMPT  # default: prompts are kept
    env = meta["config"]["environment"]
    assert env["GGML_PASSPHRASE"] == R and env["LLAMA_ARG_API_KEY"] == R and env["OMP_NUM_THREADS"] == "1"
    assert env["LLAMA_ARG_CHAT_TEMPLATE"] == "SECRET-template-env"

    stored = _everything_stored(tmp_path / "redacted")
    assert "SECRET" not in stored, [m for m in ("SECRET",) if m in stored]
    meta = sparseety_prof.open(tmp_path / "redacted").meta
    assert meta["redact_text"] is True
    cmdline = meta["target"]["cmdline"]
    assert cmdline[cmdline.index("--system-prompt") + 1] == R and str(models["moe"]) in cmdline
    env = meta["config"]["environment"]
    assert (
        env["OMP_NUM_THREADS"] == "1" and env["XLLAMACPP_NOTE"] == R and env["LLAMA_ARG_CHAT_TEMPLATE"] == R
    )
