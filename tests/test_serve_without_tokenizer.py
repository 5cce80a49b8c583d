"""`tinyvllm serve --skip-tokenizer-init` under `tinyvllm bench serve --vocab-size`, end to end through
benchmarks/serve.py --small: a random-weight model with no tokenizer is served, streams a chunk per step,
is measured at two concurrency levels and stops with exit code 0 on SIGINT."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.utils import save_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serve_benchmark_small(tmp_path):
    model = save_tiny_llama(str(tmp_path / "tiny"), seed=1)
    out = tmp_path / "serve.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/serve.py", "--small", "--model", model, "--max-model-len", "64", "--json",
         str(out), "--server-log", str(tmp_path / "server.log"), "--no-offline"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "server stopped with SIGINT: exit code 0" in proc.stdout
    result = json.loads(out.read_text())
    assert result["server_exit_code"] == 0
    assert [level["config"]["concurrency"] for level in result["levels"]] == [1, 4]
    for level in result["levels"]:
        n, output_len = level["config"]["num_prompts"], result["output_len"]
        assert level["completed"] == n and level["failed"] == 0
        assert level["total_output_tokens"] == n * output_len and level["total_input_tokens"] == n * 16
        assert level["streamed_chunks"] > n  # empty-text chunks count: more than one per request
        assert level["ttft_ms"]["median"] > 0 and level["tpot_ms"]["median"] > 0
