"""Helpers shared by the tests: small random-weight Llama checkpoints and direct model access."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tinyvllm.entrypoints.bench_offline import draw_norm_weights, random_llama_1b  # noqa: F401  (random_llama_1b: tests/gpu)
from tinyvllm.ops import AttentionMetadata

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
            eos_token_id=1, initializer_range=0.1)
# What the family tests (Qwen2, Qwen3, Mistral, Gemma 2) share of TINY: each config sets its own heads and width.
FAMILY_BASE = {k: v for k, v in TINY.items() if k not in ("hidden_size", "num_attention_heads", "num_key_value_heads")}
# transformers' eager attention: the one of its implementations that applies Gemma 2's soft cap in every version
HF_ARGS = dict(dtype=torch.float32, attn_implementation="eager")
# general.architecture of the classes llama.cpp's converter writes (convert_hf_to_gguf.py: Mistral as llama)
GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2"}


def save_tiny_llama(path: str, seed: int = 0, max_shard_size: str | None = None, tokenizer_dir: str | None = None,
                    dtype: torch.dtype = torch.float32, **overrides: Any) -> str:
    """A random-weight LlamaForCausalLM saved as a safetensors directory (sharded if asked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config)
    draw_norm_weights(model)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            with open(os.path.join(tokenizer_dir, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return path


def random_model(family: str, seed: int, **config: Any) -> Any:
    """A random-weight transformers `{family}ForCausalLM` (float32) of `config`, with every RMSNorm weight drawn
    (draw_norm_weights: q_norm and k_norm too; Gemma 2's four norms a layer, which scale by 1 + w) and every bias
    from N(0, 0.1) (transformers starts them at 0, which would hide a bias left out)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config))
    draw_norm_weights(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    return model


def convert_to_gguf(model_dir: str, path: str, qtype: str = "F32") -> str:
    """The GGUF that llama.cpp's convert_hf_to_gguf.py writes of a safetensors directory whose class is one of
    GGUF_ARCHITECTURES', from its config.json and tensors as the converter reads them: TextModel's metadata (key_length
    where config.json has a head_dim), LlamaModel's vocab_size and rope dimension, Gemma2Model's soft caps and window;
    the tensors renamed by gguf's own TensorNameMap, Q and K rows permuted for llama (LlamaModel.permute), 1 added to
    Gemma 2's norms, no lm_head where it is tied (Gemma 2's never); a placeholder vocabulary. 2-D weights in `qtype`
    (F32, or a type gguf.quants writes, as Q8_0), the others F32."""
    import json

    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hp = json.load(f)
    arch = GGUF_ARCHITECTURES[hp["architectures"][0]]
    heads, hidden = hp["num_attention_heads"], hp["hidden_size"]
    kv_heads = hp.get("num_key_value_heads", heads)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(hp.get("rope_theta") or hp["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hidden // heads)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
        writer.add_sliding_window(hp["sliding_window"])
    writer.add_token_list([f"<t{i}>" for i in range(hp["vocab_size"])])

    def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
            weights.shape)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hp["num_hidden_layers"])
    quant = gguf.GGMLQuantizationType[qtype]
    for name, tensor in load_file(os.path.join(model_dir, "model.safetensors")).items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        data = tensor.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, kv_heads)
        elif arch == "gemma2" and name.endswith("norm.weight"):
            data = data + 1
        array = data.numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A JSON schema the structured-output tests hold answers to: a nested object, an enum, an array, a pattern, required
# fields.
USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


# The marks of every test in tests/gpu: run by `pytest -m cuda` on a GPU machine, skipped elsewhere, and
# meaningless under the Triton interpreter.
CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is set: the kernels would run under the interpreter, not on the GPU "
                              "(run `pytest -m cuda`, which leaves it unset)"),
]


def tiny_llama_fixture(seed: int) -> Any:
    """A module-scoped `checkpoint` fixture: one tiny random Llama, saved once for the module's tests
    (assign it to the name `checkpoint`)."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
        return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=seed)

    return checkpoint


def tiny_llm(path: str, **kwargs: Any) -> Any:
    """An LLM over a tiny checkpoint on the CPU, token ids in and out."""
    from tinyvllm import LLM

    return LLM(path, skip_tokenizer_init=True, device="cpu", **kwargs)


def hf_model(path: str) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def our_logits(llm: Any, token_ids: list[int], attention: Any = None) -> torch.Tensor:
    """Logits at every position of one sequence, through our model and a scratch block table (attention: what
    computes attention instead of ops.paged_attention, as AttentionMetadata.attention)."""
    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    assert engine.engine_core.block_manager.num_free_blocks == engine.engine_core.block_manager.num_blocks
    return model_logits(runner.model, token_ids, runner.block_size, attention)


@torch.inference_mode()
def model_logits(model: Any, token_ids: list[int], block_size: int = 16, attention: Any = None) -> torch.Tensor:
    """our_logits for a model (a CausalLM) whose attention layers hold KV pools of enough blocks (block 0 on)."""
    device = model.lm_head_weight.device
    n = len(token_ids)
    blocks = list(range((n + block_size - 1) // block_size))
    meta = AttentionMetadata(
        cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=device),
        slot_mapping=torch.arange(n, device=device),
        max_query_len=n, max_context_len=n, attention=attention)
    hidden = model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), meta)
    return model.compute_logits(hidden).float()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache, no EOS handling): the plainest reference."""
    ids, device = list(prompt), next(model.parameters()).device
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def run_python(code: str, args: Any, env: dict[str, str], timeout: float) -> dict[str, Any] | str:
    """Run `code` in a fresh Python process (argv[1]: args as JSON) from the repository root; the JSON it
    prints after "RESULT", or, if it failed, a message with the end of its stderr. (A fresh process per run:
    each picks its ops and its GPU memory from nothing.)"""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return f"timed out after {e.timeout} s\n{stderr[-3000:]}"
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    if proc.returncode != 0 or line is None:
        return f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


def compile_for_hopper(script: str, cases: list, timeout: float) -> None:
    """Run `script` (which compiles the kernels of `cases`, its JSON argument, for sm_90 and prints "compiled N")
    in a process without the Triton interpreter, from the repository root; fail unless all N compiled."""
    import json
    import subprocess
    import sys

    if not hasattr(__import__("triton"), "compile"):
        pytest.skip("this Triton has no triton.compile")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and f"compiled {len(cases)}" in proc.stdout, proc.stderr[-3000:]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_bf16_attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A bfloat16 attention output as the GPU tests judge one: finite, ||out - ref|| / ||ref|| within bfloat16's 1e-2
    (value by value, an output near zero from cancelling terms is off by more than a relative tolerance allows)."""
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all()), f"{out.dtype} output, or not finite"
    assert relative_error(out, ref) <= 1e-2


def head_major(pools: torch.Tensor) -> torch.Tensor:
    """The same values and shape as pools [..., blocks, block_size, heads, head_dim], stored [..., blocks, heads,
    block_size, head_dim] in memory (ops.kv_pool's default layout)."""
    return pools.transpose(-3, -2).contiguous().transpose(-3, -2)


def attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata.for_cached(query_lens, context_lens, block_tables)


def count_gemv_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each launch of gemv.py's kernel through fused_linear.py (which imports
    launch_gemv by name: the patch goes there)."""
    import importlib

    fused_linear_module = importlib.import_module("tinyvllm.ops.fused_linear")  # (ops.fused_linear is the op)
    launches: list[int] = []
    real_launch = fused_linear_module.launch_gemv

    def counted(*args: Any, **kwargs: Any) -> Any:
        launches.append(1)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(fused_linear_module, "launch_gemv", counted)
    return launches
