"""The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF): our greedy output, with the file dequantized to float32
(dtype="float32"), equals transformers' greedy output on the same file, token for token. (The default CPU load
keeps the weights quantized: tests/test_gguf_int4.py holds it to this float32 path.)"""

import os

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.model.loader import embedded_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in two sentences.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def test_greedy_chat_matches_transformers_on_the_same_gguf(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=48)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    ours = llm.chat(conversations, params, use_tqdm=False)
    for conversation, out in zip(conversations, ours):
        prompt = llm.apply_chat_template(conversation)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=2,
                              pad_token_id=2)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, (conversation, out.outputs[0].text)
    assert "Paris" in ours[0].outputs[0].text


def test_text_prompt_without_chat_template(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].prompt == "The capital of France is"
