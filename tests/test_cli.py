"""The `tinyvllm` command on the embedded model, as a new user runs it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tinyvllm(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "tinyvllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_generate_with_the_embedded_model():
    proc = tinyvllm("generate", "What is the capital of France?", "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_with_a_json_schema(tmp_path):
    """--json-schema FILE: the answer validates against the schema; a schema that is not JSON is a clear error."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer"}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    proc = tinyvllm("generate", "Is the sky blue? Answer in JSON.", "--max-tokens", "40", "--json-schema", str(path))
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["answer"] in ("yes", "no") and isinstance(answer["confidence"], int)
    assert set(answer) == set(schema["properties"])
    path.write_text("{not json")
    proc = tinyvllm("generate", "Hi", "--json-schema", str(path))
    assert proc.returncode == 2 and "--json-schema" in proc.stderr


def test_chat_keeps_the_history(tiny_text_checkpoint, tiny_text_llm):
    proc = tinyvllm("chat", "--model", tiny_text_checkpoint, "--max-tokens", "8",
                    stdin="My name is Alice.\nWhat is my name?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    # The second answer is what the model says given the whole conversation so far.
    from tinyvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    conversation = [{"role": "user", "content": "My name is Alice."}]
    first = tiny_text_llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is my name?"}]
    second = tiny_text_llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == f"{first}\n{second}\n"


def test_generate_raw_prompt_on_a_small_model(tiny_text_checkpoint):
    proc = tinyvllm("generate", "Hello", "--no-chat", "--model", tiny_text_checkpoint, "--max-tokens", "5",
                    "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_bad_arguments_give_a_clear_error(tiny_text_checkpoint):
    proc = tinyvllm("generate", "Hello", "--model", tiny_text_checkpoint, "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr
    proc = tinyvllm("generate", "Hello", "--model", "/no/such/dir")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_bench_latency_and_throughput_on_a_small_model(tiny_text_checkpoint):
    proc = tinyvllm("bench", "latency", "--model", tiny_text_checkpoint, "--input-len", "16", "--output-len", "8")
    assert proc.returncode == 0, proc.stderr
    assert "TPOT median" in proc.stdout
    proc = tinyvllm("bench", "throughput", "--model", tiny_text_checkpoint, "--num-prompts", "8",
                    "--max-input-len", "40", "--max-output-len", "10")
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stdout


def test_bench_takes_vllms_options(tiny_text_checkpoint):
    proc = tinyvllm("bench", "latency", "--model", tiny_text_checkpoint, "--input-len", "8", "--output-len", "4",
                    "--batch-size", "3")
    assert proc.returncode == 0, proc.stderr
    assert "latency, batch 3" in proc.stdout
    proc = tinyvllm("bench", "throughput", "--model", tiny_text_checkpoint, "--dataset-name", "random",
                    "--num-prompts", "4", "--input-len", "12", "--output-len", "5")
    assert proc.returncode == 0, proc.stderr
    assert "4 prompts (48 tokens): 20 output tokens" in proc.stdout
    assert "Processed prompts" in proc.stderr  # progress while it runs


def test_generate_n_stop_and_logprobs(tiny_text_checkpoint):
    proc = tinyvllm("generate", "Hello", "--no-chat", "--model", tiny_text_checkpoint, "--max-tokens", "4",
                    "-n", "2", "--temperature", "0.9", "--seed", "1", "--logprobs", "1", "--stop", "zzz")
    assert proc.returncode == 0, proc.stderr
    assert "--- completion 0" in proc.stdout and "--- completion 1" in proc.stdout


def test_help_shows_each_default_and_serve_takes_the_model_as_an_argument(tiny_text_checkpoint):
    proc = tinyvllm("serve", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "(default: 256)" in proc.stdout and "--max-num-seqs" in proc.stdout and "MODEL" in proc.stdout
    from tinyvllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", tiny_text_checkpoint, "--port", "1"])
    assert args.model_tag == tiny_text_checkpoint


def test_throughput_warm_up_leaves_no_prefix_cache_hits(tiny_text_checkpoint):
    """The warm-up before the clock starts must not leave the measured prompts' blocks in the prefix cache (it
    ran on the workload's own first prompts, whose prefill the measured run then skipped)."""
    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import random_workload, run_throughput

    llm = LLM(tiny_text_checkpoint, device="cpu", num_kv_blocks=256, skip_tokenizer_init=True)
    prompts, params = random_workload(8, 40, 4)
    result = run_throughput(llm, prompts, params)
    assert result["output_tokens"] == 8 * 4
    assert result["prefix_cache_hits"] == 0, result


def test_chat_offers_no_flag_that_does_nothing():
    """chat shows one streamed answer: -n and --logprobs, which it ignored, are refused as unknown."""
    for flag in (["-n", "2"], ["--logprobs", "1"]):
        proc = tinyvllm("chat", *flag, stdin="/exit\n")
        assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr, proc.stderr


def test_a_misspelled_flag_gets_the_closest_name():
    proc = tinyvllm("generate", "Hello", "--max-tokns", "3")
    assert proc.returncode == 2 and "--max-tokns (did you mean --max-tokens?)" in proc.stderr, proc.stderr
    proc = tinyvllm("bench", "latency", "--input-lenn", "3")
    assert proc.returncode == 2 and "did you mean --input-len?" in proc.stderr, proc.stderr


def test_generate_logprobs_shows_that_many_tokens(tiny_text_checkpoint):
    """--logprobs N: each token's line lists the N most likely tokens at its place (it printed N - 1 when the chosen
    token was among them)."""
    proc = tinyvllm("generate", "Hello", "--no-chat", "--model", tiny_text_checkpoint, "--max-tokens", "3",
                    "--logprobs", "2")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "(top 2:" in line]
    assert len(lines) == 3, proc.stdout
    for line in lines:
        top = line.split("(top 2: ", 1)[1].rstrip(")")
        assert top.count(", ") == 1, line  # two entries
