"""RequestOutput.prompt is the prompt's text however the prompt came: as text, as token ids (decoded), or as a
chat conversation (the templated text), as vLLM gives it; without a tokenizer there is no text."""

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
checkpoint = tiny_llama_fixture(seed=5)


def test_prompt_text_for_text_ids_and_chat(tiny_text_llm):
    llm = tiny_text_llm
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The sky is")
    text_out, ids_out = llm.generate(["The sky is", ids], PARAMS, use_tqdm=False)
    assert text_out.prompt == "The sky is"
    assert ids_out.prompt == tokenizer.decode(ids) and ids_out.prompt_token_ids == ids
    chat = llm.chat([{"role": "user", "content": "Hi there"}], PARAMS, use_tqdm=False)[0]
    assert "Hi there" in chat.prompt and chat.prompt == tokenizer.decode(chat.prompt_token_ids)
    assert chat.prompt != "Hi there"  # the template's text, not the message alone


def test_no_text_without_a_tokenizer(checkpoint):
    out = tiny_llm(checkpoint, num_kv_blocks=16).generate([[3, 4, 5]], PARAMS, use_tqdm=False)[0]
    assert out.prompt is None and out.prompt_token_ids == [3, 4, 5]
