"""Tiny random-weight models for tests and examples: no network, built from transformers configs.

Lives in the package (not tests/) so notebooks, benchmarks and worker subprocesses can build the
same models. The tokenizer is a small byte-level BPE trained on CPython's own documentation text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Per family: the config overrides that make a tiny model exercise that family's features.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=24),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=24),
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Mixture of experts: 4 experts, top-2. Qwen3-MoE also keeps layer 1 dense (mlp_only_layers).
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def sample_texts() -> list[str]:
    """Real English text shipped with CPython: the pydoc topic documents, in a stable order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on pydoc text, with ChatML-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_texts()[:40], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(out_dir: str | os.PathLike, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight HF model directory (config.json, model.safetensors, tokenizer files)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    # vocab_size may be overridden: a model vocabulary larger than the tokenizer's (the extra ids
    # decode to nothing) gives a test a size of its choosing, e.g. one no tensor-parallel group divides.
    kw = {"vocab_size": len(tokenizer), **_BASE, **FAMILIES[family], **overrides}
    model_type = kw.pop("model_type")
    assert kw["vocab_size"] >= len(tokenizer), "a vocabulary smaller than the tokenizer's cannot embed its ids"
    kw.update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves small logits; widen them so greedy argmax is not decided by float noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # MoE router: wide logits so no token sits on a top-k boundary where float noise
                # between implementations could pick a different expert.
                p.normal_(0.0, 0.5)
            elif p.dim() >= 2:  # 3D: fused expert weights (num_experts, out, in)
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif "norm" in name and family == "gemma3_text":
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "batchrun_family.json").write_text(json.dumps({"family": family}))
    return out


# A reasoning model's template, Qwen3's convention with the R1 distills' opening: with thinking on
# (enable_thinking unset or true) the generation prompt opens the trace (`<think>\n`); with
# enable_thinking=False it carries a closed, empty one, and the answer follows the separator.
REASONING_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def make_tiny_reasoning_model(out_dir: str | os.PathLike, family: str = "qwen3", seed: int = 0) -> Path:
    """A tiny random model whose tokenizer has `<think>` and `</think>` as single (non-special, as
    in Qwen3) tokens and whose chat template opens a trace (REASONING_CHAT_TEMPLATE)."""
    from tokenizers import AddedToken

    out = make_tiny_model(out_dir, family, seed=seed, vocab_size=len(build_tokenizer()) + 2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer.chat_template = REASONING_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def build_wordpiece_tokenizer(vocab_size: int = 512, do_lower_case: bool = True):
    """A BERT WordPiece tokenizer ([CLS] text [SEP]) trained on pydoc text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=do_lower_case)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    tok.train_from_iterator(sample_texts()[:40], trainer=trainer)
    return BertTokenizer(vocab=tok.get_vocab(), do_lower_case=do_lower_case)


def make_tiny_bert(
    out_dir: str | os.PathLike,
    seed: int = 0,
    num_labels: Optional[int] = None,
    pooling: Optional[str] = None,
    normalize: bool = True,
    max_seq_length: Optional[int] = None,
    do_lower_case: bool = False,
    tokenizer_lower_case: bool = True,
    **overrides: Any,
) -> Path:
    """Write a random-weight BERT directory: a BertModel, or with `num_labels` a
    BertForSequenceClassification (id2label LABEL_i). With `pooling` ("mean", "cls"), also the
    sentence-transformers files of the 2.x-5.x layout (modules.json: Transformer, Pooling, then
    Normalize when `normalize`; sentence_bert_config.json with `max_seq_length` and `do_lower_case`),
    which sentence-transformers 6 still reads."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_wordpiece_tokenizer(do_lower_case=tokenizer_lower_case)
    kw: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    if num_labels is not None:
        kw.update(num_labels=num_labels, id2label={i: f"LABEL_{i}" for i in range(num_labels)})
    config = BertConfig(**{**kw, **overrides})
    torch.manual_seed(seed)
    model = (BertForSequenceClassification if num_labels is not None else BertModel)(config).float()
    with torch.no_grad():  # BERT's init leaves near-identical rows; spread them so rows differ
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embeddings" in name else 0.15)
            elif "LayerNorm.weight" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_Pooling").mkdir(exist_ok=True)
        modes = {
            "cls": "pooling_mode_cls_token",
            "mean": "pooling_mode_mean_tokens",
            "lasttoken": "pooling_mode_lasttoken",
        }
        pooling_config = {
            "word_embedding_dimension": config.hidden_size,
            **{m: m == modes[pooling] for m in modes.values()},
        }
        (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
        bert_config: dict[str, Any] = {"do_lower_case": do_lower_case}
        if max_seq_length is not None:
            bert_config["max_seq_length"] = max_seq_length
        (out / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return out


@dataclasses.dataclass(frozen=True)
class LocalRayCluster:
    address: str  # host:port of its GCS: what launcher.ray_address and RAY_ADDRESS take
    client_address: Optional[str]  # ray://host:port of its Ray Client server (needs ray[client]), or None
    temp_dir: str


@contextlib.contextmanager
def local_ray_cluster(
    num_cpus: int = 2,
    num_gpus: int = 0,
    pythonpath: Sequence[str] = (),
    client: bool = False,
    worker_niceness: Optional[int] = 0,
    start_timeout_s: float = 120.0,
) -> Iterator[LocalRayCluster]:
    """A real Ray cluster on this machine (`ray start --head --block` as a subprocess) until the
    block ends; its processes run with `pythonpath` ahead of the current one. `num_gpus` declares
    GPUs Ray hands out (setting each actor's CUDA_VISIBLE_DEVICES) whether or not any exist: a GPU
    host simulated on a CPU machine. Authentication is off for it (a throwaway cluster of this
    machine), in this process's environment too, so the drivers it starts can connect. `client`:
    also a Ray Client server (ray://), which needs `ray[client]`. `worker_niceness`: the nice value
    of its worker processes (Ray's default, None, is 15: on a machine busy with other work its
    actors would get a small share of the cores, and tests and benchmarks would time that)."""
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    import ray

    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_cli is None:
        raise RuntimeError("the ray command is not on PATH")

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    port, client_port = free_port(), (free_port() if client else None)
    previous_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])}
    env.pop("BATCHRUN_TEST_HOOKS", None)
    if worker_niceness is not None:
        env["RAY_worker_niceness"] = str(worker_niceness)
    # Short: Ray's unix sockets live under it, and their paths must stay under 108 bytes.
    temp = tempfile.mkdtemp(prefix="br-ray-", dir="/tmp")
    log_path = os.path.join(temp, "ray-start.log")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", "--port", str(port), "--num-cpus", str(num_cpus)]
            + ["--num-gpus", str(num_gpus)]
            + (["--ray-client-server-port", str(client_port)] if client_port else [])
            + ["--disable-usage-stats", "--include-dashboard=false", "--temp-dir", temp],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one at the end
        )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s  # a hang guard
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited ({proc.returncode}): {Path(log_path).read_text()[-2000:]}")
            try:
                ray.init(address=address, log_to_driver=False)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        ray.shutdown()
        yield LocalRayCluster(address, f"ray://127.0.0.1:{client_port}" if client_port else None, temp)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
            proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        if previous_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous_auth
