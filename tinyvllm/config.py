"""Configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from tinyvllm.ops.rotary import check_rope_scaling


class ConfigError(ValueError):
    """A model or engine setting that we cannot run, with a message that says why."""


# Architecture names (config.json's `architectures`, GGUF's `general.architecture`) -> the canonical name of the
# family that implements them. llama.cpp writes Mistral as `llama` (its converter's LlamaModel), which loads as Llama.
# The table lives here, not in model/registry (canonical name -> class), so that reading a config never imports a
# model: the models import this module.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "llama": "LlamaForCausalLM",
    "MistralForCausalLM": "MistralForCausalLM",
    "Qwen2ForCausalLM": "Qwen2ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "Qwen3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "Gemma2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}

# The ModelConfig fields whose default, where config.json leaves them out, is not Llama's: transformers' config class
# of the family has its own (Gemma 2's checkpoints carry no tie_word_embeddings, and tie them).
ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=256,
                              max_position_embeddings=8192),
}


class UnsupportedArchitectureError(ConfigError):
    """A model of an architecture tinyvllm has no implementation for."""


# `quantization`'s choices (vLLM's names): how the linear layers' weights are stored (model/quantization.py).
QUANTIZATION_METHODS = ("fp8",)


@dataclass(frozen=True)
class QuantizationConfig:
    """Which linear layers hold quantized weights, and how. method "fp8": float8 e4m3 weights with a float32 scale per
    output channel, activations quantized per token as each product runs. from_checkpoint: the checkpoint stores the
    float8 weights with their `weight_scale` tensors, one per output channel ("channel") or per tensor ("tensor");
    else the weights are quantized as they load. ignore: modules kept unquantized, by name or "re:" pattern. lm_head:
    the LM head too, quantized as it loads (a tied head gets a float8 copy of the embedding table, whose lookups keep
    the model's dtype); else it stays in the model's dtype."""

    method: str = "fp8"  # or "gguf": a GGUF's weights in their own types, on the CPU (model/loader.py)
    from_checkpoint: bool = False
    weight_strategy: str = "channel"
    ignore: tuple[str, ...] = ()
    lm_head: bool = False

    def ignores(self, module_name: str) -> bool:
        return any(re.fullmatch(rule[3:], module_name) if rule.startswith("re:") else
                   module_name == rule or module_name.endswith("." + rule) for rule in self.ignore)

    @classmethod
    def from_hf_dict(cls, quant: Any) -> QuantizationConfig:
        """A config.json's `quantization_config`: compressed-tensors' float8 scheme (llm-compressor's FP8 and
        FP8_DYNAMIC) or quant_method "fp8" (per-tensor scales). Anything else is a ConfigError naming what it is."""
        if not isinstance(quant, dict):
            raise ConfigError(f"'quantization_config' must be an object, not {quant!r}")
        method = quant.get("quant_method")
        if method == "fp8":
            if quant.get("weight_block_size"):
                raise ConfigError("'quantization_config': FP8 with block-wise scales (weight_block_size "
                                  f"{quant['weight_block_size']}) is not supported; tinyvllm loads per-tensor and "
                                  "per-channel float8 scales")
            ignore = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or []
            return cls("fp8", True, "tensor", tuple(ignore))
        if method != "compressed-tensors":
            raise ConfigError(f"'quantization_config': quant_method {method!r} is not supported; tinyvllm loads "
                              "float8 checkpoints (quant_method 'fp8', or 'compressed-tensors' with float8 weights) "
                              f"and quantizes at load with quantization={'|'.join(QUANTIZATION_METHODS)}")
        groups = quant.get("config_groups") or {}
        strategies = {_float8_weight_strategy(name, group) for name, group in groups.items()}
        if len(strategies) != 1:
            raise ConfigError("'quantization_config': compressed-tensors needs one float8 weight scheme for every "
                              f"group; this one has {len(strategies)} ({sorted(strategies)})")
        return cls("fp8", True, strategies.pop(), tuple(quant.get("ignore") or ()))


def _float8_weight_strategy(name: str, group: Any) -> str:
    """The scale strategy ("channel" or "tensor") of a compressed-tensors group of float8 weights, or a ConfigError
    that says what the group is instead."""
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict) or weights.get("num_bits") != 8 or weights.get("type") != "float" \
            or weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
        raise ConfigError(f"'quantization_config': compressed-tensors group {name!r} quantizes weights as {weights!r}; "
                          "tinyvllm loads 8-bit float weights with a static scale per channel or per tensor")
    activations = group.get("input_activations")
    if activations is not None and (activations.get("num_bits") != 8 or activations.get("type") != "float"):
        raise ConfigError(f"'quantization_config': compressed-tensors group {name!r} quantizes activations as "
                          f"{activations!r}; tinyvllm quantizes them to float8 per token")
    return weights["strategy"]


def check_architecture(name: str) -> str:
    """The canonical architecture name, or an error that lists the ones we support."""
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported; tinyvllm runs: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return SUPPORTED_ARCHITECTURES[name]


@dataclass
class ModelConfig:
    """A model's architecture, read from config.json or from GGUF metadata: what every family has (a family reads
    the rest from hf_config)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype = torch.float32
    quantization: QuantizationConfig | None = None  # the checkpoint's (config.json's quantization_config)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The whole config.json (of a GGUF, the fields its metadata gives: gguf_loader._HF_CONFIG_KEYS): a family reads
    # its own fields from it.
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        """The config of a Hugging Face model directory: config.json, and generation_config.json's EOS tokens
        (which chat models often list only there)."""
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"{path} has no config.json: a model directory needs config.json and *.safetensors")
        config = cls.from_hf_dict(_read_json_object(config_path), source=config_path)
        generation_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_path):
            eos = _read_json_object(generation_path).get("eos_token_id")
            if eos is not None:
                config.eos_token_ids = _token_ids(eos, generation_path)
        return config

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """The config from a parsed config.json. Every error is a ConfigError whose message starts with
        `source` (the file's path) and names the field, so that a broken file reads as one line to fix."""
        try:
            return cls._from_hf_dict(hf, source)
        except ConfigError as e:
            raise type(e)(f"{source}: {e}") from None

    @classmethod
    def _from_hf_dict(cls, hf: dict[str, Any], source: str) -> ModelConfig:
        architectures = hf.get("architectures") or ["LlamaForCausalLM"]
        if isinstance(architectures, str):
            architectures = [architectures]
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise ConfigError(f"'architectures' must be a list of class names, not {architectures!r}")
        architecture = check_architecture(architectures[0])
        config_json, hf = hf, {**ARCHITECTURE_DEFAULTS.get(architecture, {}), **hf}
        num_heads = _positive_int(hf, "num_attention_heads")
        hidden = _positive_int(hf, "hidden_size")
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = hf.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"'rope_parameters' must be an object, not {rope!r}")
        rope_theta = _number(hf, "rope_theta", _number(rope, "rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise ConfigError(f"'rope_scaling' must be an object, not {scaling!r}")
            try:
                scaling = check_rope_scaling(scaling)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        dtype_name = hf.get("torch_dtype", hf.get("dtype", "float32")) or "float32"
        bos = hf.get("bos_token_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
            raise ConfigError(f"'bos_token_id' must be a token id, not {bos!r}")
        return cls(
            architecture=architecture,
            vocab_size=_positive_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(hf, "intermediate_size"),
            num_layers=_positive_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_positive_int(hf, "num_key_value_heads", num_heads),
            head_dim=_positive_int(hf, "head_dim", hidden // num_heads),
            rms_norm_eps=_number(hf, "rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=_positive_int(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            dtype=getattr(torch, str(dtype_name).replace("torch.", ""), torch.float32),
            quantization=(QuantizationConfig.from_hf_dict(hf["quantization_config"])
                          if hf.get("quantization_config") is not None else None),
            bos_token_id=bos,
            eos_token_ids=_token_ids(hf.get("eos_token_id")),
            hf_config=dict(config_json),
        )


_REQUIRED: Any = object()


def _read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in `path`, or a one-line ConfigError naming the file and, for bad JSON, where it
    breaks (a JSONDecodeError traceback does not say which of a model's files is broken)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}; "
                          "fix the file or copy it again from the model's source") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): it should be a JSON file") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object of settings")
    return data


def _positive_int(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """hf[key] as a positive integer. Without a default the field is required; with one, an absent, null or
    0 field takes the default (as `hf.get(key) or default` did)."""
    value = hf.get(key)
    if value is None or (value == 0 and default is not _REQUIRED):
        if default is _REQUIRED:
            raise ConfigError(f"field {key!r} is missing, and the model needs it: add it "
                              "(the model's original config.json has it)")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"field {key!r} must be a positive integer, not {value!r}")
    return value


def _number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"field {key!r} must be a number, not {value!r}")
    return float(value)


def _token_ids(value: Any, source: str | None = None) -> list[int]:
    """eos_token_id (one id or a list of ids) as a list."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}'eos_token_id' must be a token id or a list of them, not {value!r}")
    return list(ids)


def check_tensor_parallel_size(config: ModelConfig, tensor_parallel_size: int, device_type: str = "cpu",
                               num_gpus: int | None = None) -> None:
    """Raise ConfigError unless `tensor_parallel_size` ranks can each hold a whole share of the heads, KV
    heads and MLP columns (the vocabulary is padded, so it need not divide) and, on CUDA, a GPU each.
    num_gpus defaults to torch.cuda.device_count()."""
    size = tensor_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, not {size!r}")
    for what, n in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
                    ("intermediate_size", config.intermediate_size)):
        if n % size:
            raise ConfigError(f"tensor_parallel_size={size} does not divide the model's {what}={n}: "
                              "pick a size that divides it")
    if device_type == "cuda" and size > 1:
        available = torch.cuda.device_count() if num_gpus is None else num_gpus
        if size > available:
            raise ConfigError(f"tensor_parallel_size={size} needs {size} GPUs, but {available} are visible")


# speculative_config's methods (vLLM's names): "ngram" proposes by prompt lookup, "draft_model" by a smaller model.
SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): at each step a proposer guesses up to num_speculative_tokens
    next tokens of each decoding sequence, and the target model verifies them in the same forward pass, so a step
    may give a sequence several tokens, with the output distribution unchanged. method "ngram" (prompt lookup): the
    tokens that followed the latest prompt_lookup_max .. prompt_lookup_min tokens where they occurred before in the
    sequence's prompt or output (spec_decode/ngram_proposer.py). vLLM's defaults: both lookup bounds 5, or the one
    given. method "draft_model": the greedy tokens of a smaller model at `model` (a directory or .gguf) with the
    target's tokenizer, run by the same engine with a KV cache of its own (spec_decode/draft_model.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """The config from speculative_config: a dict, or its JSON text (--speculative-config); None for none.
        Anything we cannot run is a ConfigError that says what can."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON ({e.msg} at column {e.colno}): give an "
                                  """object such as '{"method": "ngram", "num_speculative_tokens": 4}'""") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be an object (a dict, or JSON text), not {value!r}")
        unknown = [key for key in value if key not in _SPECULATIVE_KEYS]
        if unknown:
            raise ConfigError("speculative_config: " + "; ".join(
                _unknown_argument(key, list(_SPECULATIVE_KEYS)).replace("engine argument", "key") for key in unknown))
        model = value.get("model")
        method = value.get("method", "draft_model" if model is not None else None)  # (vLLM's rule)
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, not "
                              f"{method!r}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be a positive integer (the tokens "
                              f"proposed per step, say 2 to 8), not {k!r}")
        lookup = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if value.get(key) is not None]
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ConfigError("speculative_config: method 'draft_model' needs 'model', the draft model's "
                                  f"directory or .gguf (a smaller model with the target's tokenizer), not {model!r}")
            if lookup:
                raise ConfigError(f"speculative_config: {lookup[0]} is the 'ngram' method's; method 'draft_model' "
                                  "takes 'model' and 'num_speculative_tokens'")
            return cls(method, k, model=model)
        if model is not None:
            raise ConfigError("speculative_config: method 'ngram' takes no 'model' (it proposes from the sequence's "
                              "own tokens)")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (high if low is None else low,
                                                                 low if high is None else high)
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"speculative_config: {name} must be a positive integer, not {n!r}")
        if low > high:
            raise ConfigError(f"speculative_config: prompt_lookup_min={low} is more than prompt_lookup_max={high}")
        return cls(method, k, low, high)


# kv_cache_dtype's choices, as vLLM's --kv-cache-dtype names them -> the cache's torch dtype (None: the model's).
# fp8 stores e4m3 with no scale factors (vLLM's default k_scale = v_scale = 1.0): a value is rounded to e4m3,
# saturating at +-448 (ops/rotary.py's to_cache_dtype_ref), and the kernels read it back as the query's dtype.
_KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn,
                                                    "fp8_e4m3": torch.float8_e4m3fn}
KV_CACHE_DTYPES = tuple(_KV_CACHE_DTYPES)
# Triton's float8e4nv (the kernels' e4m3) needs Ada or Hopper: compute capability 8.9 or more.
FP8_MIN_CAPABILITY = (8, 9)


def _arg(default: Any, help: str, **cli: Any) -> Any:
    """A field of EngineConfig with what the command line needs to offer it (help, type, choices, aliases):
    the CLI's engine flags are generated from these, so each default is written once."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """How the engine runs: memory, batch limits, scheduling policy. Names and defaults follow vLLM."""

    model: str | None = _arg(None, "model directory (config.json + *.safetensors) or .gguf file; none: the embedded "
                                   "SmolLM2-135M-Instruct", type=str)
    dtype: str = _arg("auto", "weights and activations: auto is float32 on the CPU and the checkpoint's half type on a "
                              "GPU; on the CPU a GGUF's quantized weights then stay quantized (bfloat16 activations "
                              "in their products), an explicit dtype dequantizes them to it",
                      choices=("auto", "float32", "float16", "bfloat16"))
    device: str = _arg("auto", "auto, cpu or cuda")
    max_model_len: int | None = _arg(None, "context length in tokens (none: the model's)", type=int)
    max_num_seqs: int = _arg(256, "at most this many sequences in one step")
    max_num_batched_tokens: int = _arg(8192, "at most this many tokens in one step (longer prompts are chunked)")
    block_size: int = _arg(16, "tokens per KV-cache block (a power of two)")
    gpu_memory_utilization: float = _arg(0.9, "fraction of the GPU's memory the engine may use (the KV cache gets "
                                              "what the weights and activations leave)")
    num_kv_blocks: int | None = _arg(None, "KV-cache blocks (none: as many as memory allows)", type=int)
    kv_cache_memory: str | None = _arg(None, "memory for the KV cache, in bytes or with a unit (4GiB, 512MiB); "
                                             "none: on a GPU what gpu_memory_utilization leaves, on the CPU one "
                                             "whole-context sequence plus a block per other sequence (within a "
                                             "tenth of the available memory)", type=str)
    kv_cache_dtype: str = _arg("auto", "KV cache storage: auto is the model's dtype; fp8 (or fp8_e4m3) is float8 e4m3 "
                                       "without scale factors, half the bytes of bf16 (on a GPU: sm_89 or newer)",
                               choices=KV_CACHE_DTYPES)
    quantization: str | None = _arg(None, "quantize the linear layers' weights as they load: fp8 is float8 e4m3 with "
                                          "a scale per output channel (on a GPU: sm_89 or newer); none: as the "
                                          "checkpoint stores them (float8 checkpoints load as such)",
                                    choices=QUANTIZATION_METHODS, aliases=("-q",))
    quantize_lm_head: bool = _arg(False, "with quantization fp8 (or a float8 checkpoint): the LM head in float8 "
                                         "too, a scale per vocabulary row (a tied embedding keeps its table for the "
                                         "lookups and gets a float8 copy for the head)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV cache of prompt prefixes computed before")
    enforce_eager: bool = _arg(False, "no CUDA graphs")
    cascade_attention: bool = _arg(True, "decode steps whose sequences share a cached prefix read its KV once for "
                                         "all of them (cascade attention), when the prefix and the batch are large "
                                         "enough to pay")
    scheduling: str = _arg("continuous", "continuous batching, or static (a batch runs to its end before the next)",
                           choices=("continuous", "static"))
    # None: on for CUDA, where the host is the bottleneck; off on the CPU, where nothing runs concurrently and
    # a stopped sequence's extra token would cost.
    async_scheduling: bool | None = _arg(None, "schedule step N+1 while the device runs step N (none: on for CUDA, "
                                               "off on the CPU)", type=bool)
    tensor_parallel_size: int = _arg(1, "split the model over this many processes (GPUs on CUDA, gloo ranks on the "
                                        "CPU)", aliases=("-tp",))
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer (a random-weight model has none): prompts and outputs "
                                            "are token ids")
    speculative_config: dict[str, Any] | str | None = _arg(
        None, "speculative decoding, as JSON (vLLM's keys): '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' proposes tokens by prompt lookup, "
              "'{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}' by a smaller model; "
              "the target verifies them in one step (output unchanged; async scheduling off); none: off", type=str)
    seed: int = _arg(0, "seed of the draws of requests that give none")
    max_n: int = _arg(128, "most completions one request may ask for (n, best_of): one request's sequences share "
                           "the engine with everyone else's (OpenAI's limit is 128)")

    def __post_init__(self) -> None:
        if self.scheduling not in ("continuous", "static"):
            raise ConfigError(f"scheduling must be 'continuous' or 'static', not {self.scheduling!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, not {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, not {self.max_num_seqs}")
        if not isinstance(self.max_n, int) or self.max_n < 1:
            raise ConfigError(f"max_n must be a positive integer, not {self.max_n!r}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, not {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory_bytes()  # (refuses a value it cannot read)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be at least 1, not {self.num_kv_blocks}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, not {self.tensor_parallel_size!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                              f"not {self.kv_cache_dtype!r}")
        speculative = self.resolve_speculative()
        if speculative is not None and speculative.method == "draft_model" and self.async_scheduling:
            raise ConfigError("speculative decoding with a draft model runs without async scheduling (its proposals "
                              "need the tokens of the step before): leave async_scheduling unset or false")
        if speculative is not None and speculative.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ConfigError("speculative decoding with a draft model runs with tensor_parallel_size 1 for now; "
                              "use the 'ngram' method with tensor parallelism")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                              f"not {self.quantization!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config from engine arguments (LLM(...)'s keywords). A misspelled name is a ConfigError that
        suggests the closest real one, where the dataclass would raise a TypeError that lists nothing."""
        names = [f.name for f in fields(cls)]
        unknown = [key for key in kwargs if key not in names]
        if unknown:
            raise ConfigError("; ".join(_unknown_argument(key, names) for key in unknown))
        return cls(**kwargs)

    def kv_cache_memory_bytes(self) -> int | None:
        """kv_cache_memory in bytes ("4GiB", "512MiB", "2GB", "1e9" or a number), or None."""
        if self.kv_cache_memory is None:
            return None
        text = str(self.kv_cache_memory).strip()
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
                 "tb": 10**12, "b": 1, "": 1}
        match = re.fullmatch(r"([0-9.eE+]+)\s*([a-zA-Z]*)", text)
        unit = match.group(2).lower() if match else None
        try:
            value = float(match.group(1)) * units[unit] if match else -1.0
        except (KeyError, ValueError):
            value = -1.0
        if value < 1:
            raise ConfigError(f"kv_cache_memory must be a positive size such as 4GiB, 512MiB or 2000000000 bytes, "
                              f"not {self.kv_cache_memory!r}")
        return int(value)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        elif self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA GPU")
        else:
            device = torch.device(self.device)
        if device.type == "cuda" and _KV_CACHE_DTYPES[self.kv_cache_dtype] is not None:
            check_fp8_capability(torch.cuda.get_device_capability(device), self.kv_cache_dtype)
        return device

    def resolve_quantization(self, model: ModelConfig, device: torch.device) -> QuantizationConfig | None:
        """The weights' format: the checkpoint's if it is quantized (quantization, if given, must name its method),
        else what `quantization` asks for at load."""
        if model.quantization is not None:
            if self.quantization not in (None, model.quantization.method):
                raise ConfigError(f"quantization={self.quantization!r} was asked for, but the checkpoint is already "
                                  f"quantized as {model.quantization.method}")
            quantization = model.quantization
        else:
            quantization = QuantizationConfig(self.quantization) if self.quantization else None
        if self.quantize_lm_head:
            if quantization is None or quantization.method != "fp8":
                raise ConfigError("quantize_lm_head needs float8 weights: quantization='fp8', or a float8 checkpoint")
            quantization = dataclasses.replace(quantization, lm_head=True)
        if quantization is not None and device.type == "cuda":
            check_fp8_capability(torch.cuda.get_device_capability(device), what="float8 weights")
        return quantization

    def resolve_speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def keeps_gguf_types(self, model_path: str, device: torch.device) -> bool:
        """Whether a GGUF loads in its own types (4-bit and Q8_0 weights kept so, through torch's int4 kernel, other
        quantized types widened to bfloat16): on the CPU, one rank, dtype "auto" and no quantization asked for. An
        explicit dtype loads every weight dequantized to it (float32: the exact reference, ~4x the memory)."""
        return (model_path.endswith(".gguf") and device.type == "cpu" and self.dtype == "auto"
                and self.tensor_parallel_size == 1 and self.quantization is None)

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        """On for CUDA unless asked otherwise; off with a draft model, which proposes at every step from the tokens the
        step before accepted (n-gram speculation keeps it, reading a step back first where lookups find proposals:
        Scheduler.speculation_ready)."""
        speculative = self.resolve_speculative()
        if speculative is not None and speculative.method == "draft_model":
            return False
        return device.type == "cuda" if self.async_scheduling is None else self.async_scheduling

    def resolve_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model run in `dtype`: that dtype for "auto", float8 e4m3 for "fp8"."""
        cache_dtype = _KV_CACHE_DTYPES[self.kv_cache_dtype]
        return dtype if cache_dtype is None else cache_dtype

    def resolve_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """'auto' is float32 on the CPU and the checkpoint's half type (bf16 if it has none) on a GPU."""
        if self.dtype == "auto":
            if device.type == "cpu":
                return torch.float32
            return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        names = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                 "half": torch.float16, "bfloat16": torch.bfloat16}
        if self.dtype not in names:
            raise ConfigError(f"dtype must be one of auto, {', '.join(names)}; not {self.dtype!r}")
        return names[self.dtype]


@dataclass(frozen=True)
class Config:
    """Everything the engine core, its tensor-parallel workers and the model runner are built from, resolved once
    (nano-vllm's Config, vLLM's VllmConfig): the engine's arguments, the model's architecture and where its files
    are, the device, the dtype and the context length. LLMEngine resolves it (llm_engine.resolve_config); the others
    take it as it is."""

    engine: EngineConfig
    model: ModelConfig
    model_path: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    quantization: QuantizationConfig | None = None
    speculative: SpeculativeConfig | None = None
    draft: Config | None = None  # speculative decoding's draft model, resolved as the target is (method draft_model)


def check_fp8_capability(capability: tuple[int, int], kv_cache_dtype: str = "fp8", what: str | None = None) -> None:
    """Raise ConfigError unless a GPU of this compute capability runs the float8 kernels (of the KV cache, or of
    `what`)."""
    if tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        asked, instead = ((f"kv_cache_dtype={kv_cache_dtype!r}", "use kv_cache_dtype='auto'") if what is None
                          else (what, "load the model unquantized"))
        raise ConfigError(f"{asked} needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for float8 e4m3; "
                          f"this one is {major}.{minor}: {instead}")


def _unknown_argument(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"unknown engine argument {name!r}; did you mean {close[0]!r}?"
    return f"unknown engine argument {name!r}; the engine arguments are: {', '.join(known)}"
