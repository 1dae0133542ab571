"""What meta.json may keep of the engine's command line, environment and server answers.

Two levels (docs/privacy.md has the table):
- always: credentials never stored in clear: values of secret-looking flags, variables and keys
  (api keys, tokens, passwords, cookies, private key files) and passwords inside URLs;
- `--redact-text`: also nothing that may hold prompt or output text: values of prompt flags
  (-p, --system-prompt, --file, --chat-template, grammars, ...) and any other argument with
  whitespace, environment values except for an allow-list of engine settings (others keep their
  name only), and the prompt-like keys of the server's /props answer (system prompt, chat
  template, stop strings, grammar).
Matching is by the words of a name, so variants (`--api-key-file`, `LLAMA_ARG_HF_TOKEN`,
`MY_PASSPHRASE`) are covered without listing them.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"


def _wordset(words: str) -> frozenset[str]:
    return frozenset(words.split())


# a word of a flag, variable or key name that marks its value as a credential
_SECRET_WORDS = _wordset(
    "key keys apikey token secret secrets password passwd pass passphrase pwd credential "
    "credentials auth authorization cookie cookies bearer session private signature"
)
# "token" is also the model's unit: bos_token, next_token, --max-tokens, timings_per_token
_TOKEN_ROLES = _wordset("bos eos eot eom pad sep unk mask cls next per max min n num first last")
_SECRET_SHORT_FLAGS = frozenset({"-hft"})  # llama.cpp's --hf-token
# a word of a flag, variable or key name that marks its value as prompt or output text
_TEXT_WORDS = _wordset(
    "prompt prompts system template grammar schema antiprompt stop stopping word words prefix "
    "suffix text message messages content"
)
# prompt flags of llama.cpp whose names say nothing (a file of prompt text, a reverse prompt)
_TEXT_FLAGS = frozenset({"-p", "-f", "--file", "-bf", "--binary-file", "-sys", "-sysf", "-j", "-jf", "-r"})
# flags that always take a value, even one that starts with "-"
_VALUE_FLAGS = _TEXT_FLAGS | {"--prompt", "--system-prompt", "--api-key", "--hf-token", "-hft"}
_FLAG = re.compile(r"--\S|-[A-Za-z]")
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")

# Environment variables kept with their value under --redact-text: engine settings (threads,
# devices, ggml/BLAS tuning, llama.cpp's own LLAMA_ARG_* flags), minus any secret or text ones.
_ENV_ALLOW = re.compile(
    r"(GGML_|OMP_|KMP_|GOMP_|OPENBLAS_|MKL_|LLAMA_ARG_|SPARSEETY_|CUDA_|HIP_VISIBLE_DEVICES$|"
    r"ROCR_VISIBLE_DEVICES$|NVIDIA_VISIBLE_DEVICES$|LLAMA_CACHE$|LLAMA_LOG_)"
)


def _words(name: str) -> set[str]:
    return {w for w in re.split(r"[^a-z0-9]+", name.lower()) if w}


def is_secret_name(name: str) -> bool:
    """A flag, variable or key whose value is a credential (by the words of its name)."""
    if name in _SECRET_SHORT_FLAGS:
        return True
    words = _words(name)
    if "token" in words and words & _TOKEN_ROLES:
        words.discard("token")
    return bool(words & _SECRET_WORDS)


def is_text_name(name: str) -> bool:
    """A flag, variable or key whose value may be prompt or output text."""
    return name in _TEXT_FLAGS or bool(_words(name) & _TEXT_WORDS)


def without_url_credentials(value: str) -> str:
    """`scheme://user:password@host` -> `scheme://<redacted>@host`."""
    return _URL_CREDENTIALS.sub(rf"\1{REDACTED}@", value)


def command_line(argv: list[str], *, redact_text: bool) -> list[str]:
    """The engine's argv with the values of secret flags (and, with `redact_text`, of prompt flags
    and every argument holding whitespace) replaced by REDACTED. `--flag value` and `--flag=value`."""
    out: list[str] = []
    hide_next = False
    for i, arg in enumerate(argv):
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        is_flag = i > 0 and arg.startswith("-") and len(arg) > 1
        hide = is_flag and (is_secret_name(flag) or (redact_text and is_text_name(flag)))
        if hide and eq:
            out.append(f"{flag}={REDACTED}")
        elif hide:
            out.append(arg)
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            # a switch (--no-..., --in-prefix-bos) is followed by the next flag, not a value
            hide_next = arg in _VALUE_FLAGS or not (arg.startswith("--no-") or _FLAG.match(nxt))
        elif redact_text and i > 0 and not is_flag and any(c.isspace() for c in arg):
            out.append(REDACTED)  # a positional prompt
        else:
            out.append(without_url_credentials(arg))
    return out


def environment(env: dict[str, str], *, redact_text: bool) -> dict[str, str]:
    """Secret-looking names keep their name only; with `redact_text`, so does every name not
    on the allow-list of engine settings, and allowed names that may hold text."""
    out: dict[str, str] = {}
    for name, value in env.items():
        hidden = is_secret_name(name) or (redact_text and (not _ENV_ALLOW.match(name) or is_text_name(name)))
        out[name] = REDACTED if hidden else without_url_credentials(value)
    return out


def server_answer(obj: Any, *, redact_text: bool) -> Any:
    """A server's JSON answer (/props) with secret keys' values (and, with `redact_text`, prompt
    keys' values) replaced by REDACTED, at any depth."""
    if isinstance(obj, dict):
        return {
            k: REDACTED
            if is_secret_name(str(k)) or (redact_text and is_text_name(str(k)))
            else server_answer(v, redact_text=redact_text)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [server_answer(v, redact_text=redact_text) for v in obj]
    if isinstance(obj, str):
        return without_url_credentials(obj)
    return obj
