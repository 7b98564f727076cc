"""Offline `pdserve generate`: --max-tokens past the context is refused naming the flag (as the
server refuses it), a long generation shows progress on stderr, and Ctrl-C prints what was
generated until then, without a traceback."""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pdserve.offline_generate import Progress, check_max_tokens

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "512"]


def test_max_tokens_within_the_context_passes_and_past_it_names_the_flag():
    check_max_tokens(prompt_tokens=12, max_tokens=500, max_model_len=512, index=0, count=1)
    with pytest.raises(ValueError, match=r"^--max-tokens: 501 tokens after a prompt of 12 exceed the context of 512; at most 500$"):
        check_max_tokens(prompt_tokens=12, max_tokens=501, max_model_len=512, index=0, count=1)
    with pytest.raises(ValueError, match=r"at most 2 \(prompt 2 of 3\)$"):
        check_max_tokens(prompt_tokens=510, max_tokens=3, max_model_len=512, index=1, count=3)
    with pytest.raises(ValueError, match=r"^prompt: 512 tokens leave no room"):
        check_max_tokens(prompt_tokens=512, max_tokens=1, max_model_len=512, index=0, count=1)


def test_progress_is_silent_at_first_then_one_line_per_interval():
    now = [0.0]
    out = io.StringIO()
    progress = Progress(out, total=2, after_s=2.0, every_s=2.0, clock=lambda: now[0])
    for t, tokens in [(0.5, 10), (1.9, 40)]:
        now[0] = t
        progress.update(tokens, 0)
    assert out.getvalue() == ""  # a short generation prints nothing
    now[0] = 2.0
    progress.update(50, 1)
    now[0] = 3.0
    progress.update(70, 1)  # within the interval: nothing
    now[0] = 4.0
    progress.update(100, 1)
    assert out.getvalue().splitlines() == [
        "pdserve: generating: 50 tokens, 1 of 2 prompts done, 25.0 tokens/s",
        "pdserve: generating: 100 tokens, 1 of 2 prompts done, 25.0 tokens/s",
    ]


def _generate(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "generate", *SMALL, *args], cwd=ROOT,
        env=os.environ | {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_max_tokens_past_the_context_is_refused_in_one_line():
    proc = _generate("--max-tokens", "100000", "--raw", "The sky is")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("pdserve: error: --max-tokens: 100000 tokens after a prompt of ")
    assert "exceed the context of 512; at most " in lines[0] and out == ""


def test_ctrl_c_prints_what_was_generated_until_then():
    proc = _generate("--max-tokens", "480", "--ignore-eos", "--raw", "--json", "The sky is")
    errs: queue.Queue = queue.Queue()

    def read() -> None:
        for line in iter(proc.stderr.readline, ""):
            errs.put(line.rstrip("\n"))
        errs.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen = []
    try:
        while not any(line.startswith("pdserve: generating: ") for line in seen):
            line = errs.get(timeout=300)
            assert line is not None, f"exited ({proc.wait(30)}) before any progress: {seen}"
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read()
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    while (line := errs.get(timeout=10)) is not None:
        seen.append(line)
    answer = json.loads(out)
    assert 0 < len(answer["token_ids"]) < 480 and answer["text"] and answer["finish_reason"] is None
    assert seen[-1] == "pdserve: interrupted; above is what was generated until then", seen
    assert not [line for line in seen if "Traceback" in line], seen
