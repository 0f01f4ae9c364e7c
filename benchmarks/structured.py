"""Structured-output benchmark: what a JSON Schema constraint costs against free decoding, one process.

    python -m benchmarks.structured                 # engine workload, then the grammar libraries
    python -m benchmarks.structured --rounds 3 --write-docs

Engine: 16 of the bundled sample's 32 CPython doc topics (--num-prompts), each asked to be
described as JSON, greedy, on one engine (SmolLM2-135M, bf16 on CPU), all in one batch: output
tokens per wall second with and without `json_schema` (a nested schema: enum, bounded strings, an
array, a nested object), on the
same prompts and with the same number of output tokens per prompt (free decoding runs to the
constrained output's length with ignore_eos), so the two differ by the grammar work alone. Each
round runs both once, alternating which goes first; the ratio is taken within a round, then the
median over rounds. Also the share of outputs that parse and validate, constrained and free, the
share of constrained outputs that finished (stop) and validate (all must), and how many
max_tokens cut (a job types those rows truncated_structured_output).

Grammar libraries: for xgrammar (the engine's) and, when installed, llguidance: the one-off
vocabulary preparation, the compile time of the nested schema, and the per-step cost of filling
the token bitmasks of a batch of 32 matchers walking a valid document, on SmolLM2's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Optional, Union

import torch

from batchrun.benchmark.doc import WRITE_DOCS_HELP, markdown_table, script_command, stamp, write_section
from batchrun.benchmark.timing import median_ratio, round_order
from batchrun.engine import Engine, SamplingParams
from benchmarks.quality import make_engine
from benchmarks.workloads import bundled_texts, chat_ids

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "category": {"enum": ["syntax", "data model", "statements", "expressions", "library", "other"]},
        "keywords": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 1,
            "maxItems": 4,
        },
        "details": {
            "type": "object",
            "properties": {
                "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
                "has_examples": {"type": "boolean"},
            },
            "required": ["difficulty", "has_examples"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "category", "keywords", "details"],
    "additionalProperties": False,
}
PROMPT = (
    "Describe this documentation excerpt as a JSON object with the keys title, category (one of syntax, "
    "data model, statements, expressions, library, other), keywords (a list) and details (difficulty "
    "from 1 to 5, has_examples true or false). Answer with the JSON only.\n\n{text}"
)
BATCH = 32


def describe_prompts(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, [{"role": "user", "content": PROMPT.format(text=t[:1500])}]) for t in bundled_texts()]


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _measure(engine: Engine, prompts: list[list[int]], params: Union[SamplingParams, list[SamplingParams]]) -> dict:
    engine.reset_prefix_cache()  # every run prefills afresh
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    finished = [o for o in outs if o.finish_reason == "stop"]
    return {
        "tok_s": sum(len(o.token_ids) for o in outs) / wall,
        "valid": sum(is_valid(o.text, SCHEMA) for o in outs) / len(outs),
        # a constrained output that ended by itself must be valid; one max_tokens cut may not be
        "finished_valid": sum(is_valid(o.text, SCHEMA) for o in finished) / max(len(finished), 1),
        "cut": sum(o.finish_reason == "length" for o in outs),
    }


def run_engine(
    rounds: int, max_tokens: int, num_prompts: int, cache_dir: Optional[str], threads: Optional[int]
) -> dict:
    engine = make_engine("none", "bfloat16", cache_dir=cache_dir, threads=threads)
    prompts = describe_prompts(engine.tokenizer)[:num_prompts]
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=SCHEMA)
    # The constrained pass first, untimed: it warms up (kernels, the vocabulary scan) and gives each
    # prompt's output length. Free decoding then produces exactly as many tokens per prompt
    # (ignore_eos), so both systems do the same prefill and decode work and differ by the grammar only.
    lengths = [len(o.token_ids) for o in engine.generate(prompts, constrained)]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    free_texts = [o.text for o in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))]
    free_valid = sum(is_valid(t, SCHEMA) for t in free_texts) / len(prompts)
    systems: dict[str, Union[SamplingParams, list[SamplingParams]]] = {"free": free, "json_schema": constrained}
    print(
        f"engine: {len(prompts)} prompts, greedy, {statistics.mean(lengths):.0f} tokens per output on average, "
        f"threads={torch.get_num_threads()}"
    )
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(rounds):
        for name in round_order(list(systems), r):
            results[name].append(_measure(engine, prompts, systems[name]))
        print(
            f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {v[-1]['tok_s']:.1f} tok/s" for n, v in results.items()),
            flush=True,
        )
    ratio = median_ratio([v["tok_s"] for v in results["json_schema"]], [v["tok_s"] for v in results["free"]])
    table = {name: {"tok_s": statistics.median(v["tok_s"] for v in vals)} for name, vals in results.items()}
    table["json_schema"]["valid"] = min(v["valid"] for v in results["json_schema"])
    finished_valid = min(v["finished_valid"] for v in results["json_schema"])
    cut = max(v["cut"] for v in results["json_schema"])
    table["free"]["valid"] = free_valid  # free decoding to max_tokens, stopping at EOS
    for name, row in table.items():
        print(f"  {name:<12} {row['tok_s']:>7.1f} tok/s, {row['valid']:.0%} of outputs valid")
    print(
        f"  json_schema: {finished_valid:.0%} of the outputs that finished (stop) valid, "
        f"{cut} of {len(prompts)} cut by max_tokens (typed truncated_structured_output in a job's rows)"
    )
    print(f"  constrained / free throughput: {ratio:.2f}x (median of {rounds} per-round ratios)")
    return {"systems": table, "ratio": ratio, "mean_tokens": statistics.mean(lengths), "cut": cut}


def _walk(fill, accept, doc_ids: list[int]) -> float:
    """Median seconds of one `fill` over the steps of walking `doc_ids`."""
    times = []
    for token in doc_ids:
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        accept(token)
    return statistics.median(times)


def run_libraries(cache_dir: Optional[str]) -> dict:
    """Compile and mask costs of the grammar libraries on SmolLM2's tokenizer."""
    from batchrun.model.loader import load_model

    tokenizer = load_model("smollm2-135m", cache_dir=cache_dir).tokenizer
    vocab = len(tokenizer)
    text = json.dumps(SCHEMA)
    doc = json.dumps(
        {
            "title": "The for statement",
            "category": "statements",
            "keywords": ["loop", "iteration"],
            "details": {"difficulty": 2, "has_examples": True},
        }
    )
    doc_ids = tokenizer.encode(doc, add_special_tokens=False)
    print(f"grammar libraries: vocabulary {vocab}, batch {BATCH}, a {len(doc_ids)}-token document")
    table = {}
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    prepare = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    fill = _walk(
        lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask),
        lambda tok: [m.accept_token(tok) for m in matchers],
        doc_ids,
    )
    table["xgrammar"] = {"prepare_s": prepare, "compile_s": compile_s, "fill_s": fill}
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        print("  llguidance is not installed: only xgrammar measured")
    else:
        t = time.perf_counter()
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        prepare = time.perf_counter() - t
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
        first = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t
        assert not first.get_error(), first.get_error()
        lmatchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
        lbitmask = llguidance.torch.allocate_token_bitmask(BATCH, vocab)
        executor = llguidance.LLExecutor(num_threads=1)
        fill = _walk(
            lambda: llguidance.torch.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(lmatchers)], lbitmask
            ),
            lambda tok: [m.consume_token(tok) for m in lmatchers],
            doc_ids,
        )
        table["llguidance"] = {"prepare_s": prepare, "compile_s": compile_s, "fill_s": fill}
    for name, row in table.items():
        print(
            f"  {name:<11} vocabulary {row['prepare_s'] * 1e3:>6.0f} ms once, "
            f"nested schema {row['compile_s'] * 1e3:>6.1f} ms, "
            f"masks of {BATCH} rows {row['fill_s'] * 1e3:>6.3f} ms per step"
        )
    return table


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("engine", "libraries"), default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=16, help="of the 32 bundled texts; all run in one batch")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--write-docs", action="store_true", help=WRITE_DOCS_HELP)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[list[str]] = []
    if args.only != "libraries":
        result = run_engine(args.rounds, args.max_tokens, args.num_prompts, args.cache_dir, args.threads)
        for name, row in result["systems"].items():
            rows.append([f"engine, {name}", f"{row['tok_s']:.1f} output tok/s, {row['valid']:.0%} parse and validate"])
        rows.append(["engine, json_schema / free throughput", f"{result['ratio']:.2f}x"])
    if args.only != "engine":
        for name, row in run_libraries(args.cache_dir).items():
            rows.append(
                [
                    f"{name}: vocabulary once / nested schema compile / masks of {BATCH} rows per step",
                    f"{row['prepare_s'] * 1e3:.0f} ms / {row['compile_s'] * 1e3:.1f} ms / {row['fill_s'] * 1e3:.3f} ms",
                ]
            )
    if args.write_docs:
        notes = (
            f"Bundled sample ({args.num_prompts} prompts) asked for JSON, greedy, max {args.max_tokens} tokens, "
            "bf16, one batch; free decoding produces as many tokens per prompt as the constrained run (ignore_eos), "
            "its validity is that of free decoding stopping at EOS; "
            f"{args.rounds} alternating rounds, median of per-round ratios in the same process. Library "
            "figures: SmolLM2's vocabulary, one thread, median step of a walk through a valid document."
        )
        command = script_command("benchmarks.structured", argv)
        write_section(
            "structured", command, stamp(), markdown_table(["measurement", "result"], rows), notes, "Structured output"
        )


if __name__ == "__main__":
    main()
