"""lm-evaluation-harness against `tinyvllm serve`, as a user evaluates a served model: a small multiple-choice task
of its own (a JSONL and a task YAML written here; nothing is downloaded) scored through the `local-completions`
backend (echo and logprobs over token-id prompts, the server's tokenizer through /tokenizer_info, /tokenize and
/detokenize) on the embedded model, and through lm-eval's `hf` backend (transformers on the same GGUF, float32).
The server runs the model in float32 (--dtype float32), as transformers does: the two accuracies must be equal but for
near ties (a question whose best two choices transformers scores within NEAR_TIE of each other may flip; each flip is
printed). The server's default on the CPU, the GGUF's own 4-bit and 8-bit weights, is scored too: within one question
of transformers' float32 accuracy; and the model with its linear layers quantized to float8 at load
(--quantization fp8, from the float32 weights): within one question of the same model served unquantized."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server import _wait_healthy, serve
from tinyvllm.model.loader import embedded_model_path

pytestmark = pytest.mark.slow

NEAR_TIE = 1e-3  # nats between the two best choices' loglikelihoods, in transformers' scores
QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in our solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["50 degrees Celsius", "100 degrees Celsius", "0 degrees Celsius",
                                           "20 degrees Celsius"], 2),
    ("The opposite of hot is", ["warm", "loud", "tall", "cold"], 3),
    ("A week has", ["seven days", "five days", "ten days", "three days"], 0),
    ("The color of the sky on a clear day is", ["green", "blue", "red", "purple"], 1),
    ("Bees make", ["milk", "silk", "honey", "glass"], 2),
    ("The sun rises in the", ["north", "south", "west", "east"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
    ("The author of Romeo and Juliet is", ["Dickens", "Shakespeare", "Tolstoy", "Homer"], 1),
    ("Ice is the solid form of", ["air", "sand", "water", "salt"], 2),
    ("A baby cat is called a", ["puppy", "calf", "foal", "kitten"], 3),
    ("The chemical symbol for gold is", ["Au", "Ag", "Fe", "Pb"], 0),
    ("People breathe in", ["helium", "oxygen", "neon", "argon"], 1),
    ("The capital of Japan is", ["Seoul", "Beijing", "Tokyo", "Bangkok"], 2),
    ("A triangle has", ["five sides", "six sides", "four sides", "three sides"], 3),
    ("The fastest land animal is the", ["cheetah", "turtle", "snail", "sloth"], 0),
    ("Paper is made from", ["stone", "wood", "iron", "plastic"], 1),
    ("The first month of the year is", ["March", "June", "January", "October"], 2),
    ("Fish live in", ["trees", "deserts", "caves", "water"], 3),
]
TASK = """task: tiny_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def _lm_eval(work: Path, name: str, model: str, model_args: str, *extra: str) -> list[dict]:
    """Runs `python -m lm_eval` on the task (offline); each document's sample: its choices' loglikelihoods and
    whether it was right."""
    out = work / name
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                             "--tasks", "tiny_facts", "--include_path", str(work), "--output_path", str(out),
                             "--log_samples", *extra], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (samples,) = out.rglob("samples_tiny_facts_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return sorted(rows, key=lambda row: row["doc_id"])


def test_local_completions_scores_as_transformers(tmp_path: Path, capsys) -> None:
    pytest.importorskip("lm_eval")
    data = tmp_path / "tiny_facts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "tiny_facts.yaml").write_text(TASK.format(data=data))
    gguf = embedded_model_path()

    def served_by(name: str, *args: str) -> list[dict]:
        with serve(tmp_path, gguf, "--served-model-name", "smol", "--log-level", "warning", *args) as server:
            _wait_healthy(server)
            return _lm_eval(tmp_path, name, "local-completions",
                            f"model=smol,base_url={server.url}/v1/completions,tokenizer_backend=remote,"
                            "tokenized_requests=True,num_concurrent=4,max_retries=1")

    served = served_by("served", "--dtype", "float32")
    quantized = served_by("served-gguf-types")
    fp8 = served_by("served-fp8", "--dtype", "float32", "--quantization", "fp8")
    reference = _lm_eval(tmp_path, "hf", "hf", f"pretrained={os.path.dirname(gguf)},"
                         f"gguf_file={os.path.basename(gguf)},dtype=float32", "--device", "cpu")

    flips, gaps = [], []
    for ours, theirs in zip(served, reference):
        assert ours["doc_id"] == theirs["doc_id"]
        gaps += [abs(float(a[0]) - float(b[0])) for a, b in zip(ours["filtered_resps"], theirs["filtered_resps"])]
        if ours["acc"] != theirs["acc"]:
            scores = sorted((float(r[0]) for r in theirs["filtered_resps"]), reverse=True)
            flips.append((theirs["doc"]["question"], scores[0] - scores[1]))
    accuracy = [sum(row["acc"] for row in rows) / len(rows) for rows in (served, reference, quantized, fp8)]
    fp8_gaps = [abs(float(a[0]) - float(b[0])) for ours, theirs in zip(fp8, served)
                for a, b in zip(ours["filtered_resps"], theirs["filtered_resps"])]
    with capsys.disabled():
        print(f"\nlm-eval tiny_facts ({len(QUESTIONS)} questions): local-completions on tinyvllm serve "
              f"acc {accuracy[0]:.3f} (float32), {accuracy[2]:.3f} (the GGUF's own types), {accuracy[3]:.3f} (fp8 "
              f"weights; choices' loglikelihoods within {max(fp8_gaps):.2e} nats of float32's, mean "
              f"{sum(fp8_gaps) / len(fp8_gaps):.2e}); hf (transformers) acc {accuracy[1]:.3f}; flips {flips}; "
              f"choices' loglikelihoods differ by up to {max(gaps):.2e} nats")
    assert abs(accuracy[2] - accuracy[1]) <= 1 / len(QUESTIONS) + 1e-9
    assert abs(accuracy[3] - accuracy[0]) <= 1 / len(QUESTIONS) + 1e-9
    assert all(gap < NEAR_TIE for _, gap in flips), flips
    assert accuracy[0] == pytest.approx(accuracy[1], abs=len(flips) / len(QUESTIONS) + 1e-9)
    assert accuracy[1] > 0.25  # (better than chance: the task and the model are real)
    assert max(gaps) < 1e-2  # (the same float32 model: only the order of the sums differs)
