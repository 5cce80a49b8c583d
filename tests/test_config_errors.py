"""A broken config.json or a misspelled engine argument is one line that says which file or argument and
what is wrong (issue 14), not a JSONDecodeError/KeyError/TypeError traceback."""

import json
import os

import pytest

from tinyvllm import LLM
from tinyvllm.config import ConfigError, EngineConfig, ModelConfig

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
               "num_hidden_layers": 1, "num_attention_heads": 2}


def _model_dir(tmp_path, config_text: str) -> str:
    (tmp_path / "config.json").write_text(config_text)
    return str(tmp_path)


def _error(path: str) -> str:
    """The message LLM(path) fails with; it must be a ConfigError of one line."""
    with pytest.raises(ConfigError) as info:
        LLM(path, skip_tokenizer_init=True, device="cpu")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_config_that_is_not_json(tmp_path):
    path = _model_dir(tmp_path, '{"vocab_size": 8,\n  "hidden_size": 8,,\n}')
    message = _error(path)
    assert os.path.join(path, "config.json") in message
    assert "not valid JSON" in message and "line 2, column 20" in message


def test_config_that_is_not_an_object(tmp_path):
    message = _error(_model_dir(tmp_path, "[1, 2]"))
    assert "config.json holds a JSON list" in message


@pytest.mark.parametrize("field", ["num_attention_heads", "hidden_size", "vocab_size", "num_hidden_layers"])
def test_config_missing_a_field(tmp_path, field):
    config = {k: v for k, v in TINY_CONFIG.items() if k != field}
    path = _model_dir(tmp_path, json.dumps(config))
    message = _error(path)
    assert message.startswith(os.path.join(path, "config.json") + ":")
    assert f"field {field!r} is missing" in message


def test_config_field_of_the_wrong_type(tmp_path):
    path = _model_dir(tmp_path, json.dumps({**TINY_CONFIG, "hidden_size": "8"}))
    assert "field 'hidden_size' must be a positive integer, not '8'" in _error(path)


def test_config_error_from_the_model_names_the_file(tmp_path):
    path = _model_dir(tmp_path, json.dumps({**TINY_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 3}))
    message = _error(path)
    assert message.startswith(os.path.join(path, "config.json") + ":") and "not a multiple" in message


def test_broken_generation_config_names_that_file(tmp_path):
    path = _model_dir(tmp_path, json.dumps(TINY_CONFIG))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, }')
    with pytest.raises(ConfigError, match="generation_config.json is not valid JSON: .* line 1, column 22"):
        ModelConfig.from_hf_dir(path)


def test_good_config_still_loads(tmp_path):
    path = _model_dir(tmp_path, json.dumps({**TINY_CONFIG, "eos_token_id": 2, "rope_theta": 500000}))
    config = ModelConfig.from_hf_dir(path)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (2, 2, 4)
    assert config.eos_token_ids == [2] and config.rope_theta == 500000.0


def test_misspelled_engine_argument_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"^unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'\?$"):
        LLM(max_num_seq=8)


def test_unknown_engine_argument_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown engine argument 'colour'; the engine arguments are: .*max_num_seqs"):
        EngineConfig.from_kwargs(colour="blue")


def test_from_kwargs_builds_the_same_config():
    assert EngineConfig.from_kwargs(max_num_seqs=8, device="cpu") == EngineConfig(max_num_seqs=8, device="cpu")


def test_gguf_without_a_needed_field_names_it(tmp_path, monkeypatch):
    import gguf

    from tinyvllm.model.checkpoint import ModelLoadError
    from tinyvllm.model.loader import load_model_config

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_embedding_length(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"m\.gguf: the GGUF metadata lacks llama\.attention\.head_count,"):
        load_model_config(path)
