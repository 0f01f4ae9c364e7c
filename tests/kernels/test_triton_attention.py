"""The Triton paged attention equals the torch reference: in Triton's interpreter on CPU (small
sizes), and on a real GPU when one is present (`-m gpu`).

Every case is a mixed flattened batch like the runner builds: decodes with context, a one-token
fresh prompt, a fresh prompt, a prompt chunk over a cached prefix, a short verify-like chunk; block
sizes 4 and 16 make partial last blocks and unaligned prefixes. Over that: GQA ratios 1, 2, 4 and
MQA (3 query heads on 1 KV head: a group that is not a power of two) x block sizes, each with
sliding window off/5 and float32/bfloat16 in pairwise coverage; then split-K (1, 3 and 7 splits,
empty splits included), softcap, float16, a head_dim that is not a power of two, and prefill-only
and decode-only batches; then int8 and fp8 caches over mixed batches, split-K decodes (GQA 4, and
more splits than tiles) and a prefill-only batch. fp8 runs in the interpreter: it loads
float8_e4m3fn as raw bytes and widens them to float32 exactly.

The interpreted cases all run in one child process (TRITON_INTERPRET must be set before triton is
first imported, and in a pytest session some other module may already have imported it); each
case still reports as its own test. bfloat16 in the interpreter: its tl.dot is wrong for bf16 (numpy
has no bf16), so the kernels upcast the operands there (`_dot_f32`); compiled kernels do not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.interpreted import interpreted_and_on_gpu, report_cases

pytest.importorskip("triton")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 3e-2)}  # (rtol, atol)

# (cached tokens, new tokens) per sequence; one new token is a decode.
MIXED = [(6, 1), (0, 7), (13, 1), (9, 12), (0, 1), (33, 1), (20, 3)]
DECODES = [(40, 1), (3, 1), (77, 1), (0, 1)]
RATIOS = {"ratio1": (2, 2), "ratio2": (4, 2), "ratio4": (8, 2), "mqa3": (3, 1)}


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    # Ratio x block size, each with two (window, dtype) pairs chosen so that every ratio and every
    # block size meets all four (window, dtype) combinations: pairwise coverage at half the product
    # (the interpreter is slow).
    for i, (ratio, (heads, kv_heads)) in enumerate(RATIOS.items()):
        for j, block_size in enumerate((4, 16)):
            pairs = [(None, "float32"), (5, "bfloat16")] if (i + j) % 2 == 0 else [(None, "bfloat16"), (5, "float32")]
            for window, dtype in pairs:
                cases[f"{ratio}-bs{block_size}-win{window}-{dtype}"] = dict(
                    seqs=MIXED,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=16,
                    block_size=block_size,
                    window=window,
                    dtype=dtype,
                )
    base = dict(heads=4, kv_heads=2, head_dim=16, block_size=4, window=None, dtype="float32")
    cases["decode-splits1"] = {**base, "seqs": DECODES, "num_splits": 1}
    cases["decode-splits3-win9-bf16"] = {**base, "seqs": DECODES, "num_splits": 3, "window": 9, "dtype": "bfloat16"}
    cases["decode-splits7"] = {**base, "seqs": DECODES, "num_splits": 7}  # more splits than some contexts have tiles
    cases["decode-default-splits-mqa"] = {**base, "seqs": DECODES, "heads": 4, "kv_heads": 1}
    cases["softcap-fp32"] = {**base, "seqs": MIXED, "softcap": 2.0}
    cases["softcap-win5-bf16"] = {**base, "seqs": MIXED, "softcap": 2.0, "window": 5, "dtype": "bfloat16"}
    cases["float16-bs16"] = {**base, "seqs": MIXED, "dtype": "float16", "block_size": 16}
    cases["head-dim24"] = {**base, "seqs": MIXED, "head_dim": 24}
    cases["prefill-only-win4"] = {**base, "seqs": [(0, 9), (5, 6), (16, 2)], "window": 4}
    # int8/fp8 caches (engine.kv_cache_dtype): tiles dequantized in the kernel, against the
    # reference over the same QuantizedKVCache (which dequantizes what it gathers).
    cases["int8-mixed-fp32"] = {**base, "seqs": MIXED, "kv": "int8"}
    cases["fp8-mixed-mqa3-bs16-win5-bf16"] = {
        **base,
        "seqs": MIXED,
        "heads": 3,
        "kv_heads": 1,
        "block_size": 16,
        "window": 5,
        "dtype": "bfloat16",
        "kv": "fp8",
    }
    cases["int8-decode-splits3-ratio4-bf16"] = {
        **base,
        "seqs": DECODES,
        "heads": 8,
        "num_splits": 3,
        "dtype": "bfloat16",
        "kv": "int8",
    }
    cases["fp8-decode-splits7-fp32"] = {**base, "seqs": DECODES, "num_splits": 7, "kv": "fp8"}
    cases["fp8-prefill-only-softcap-fp16"] = {
        **base,
        "seqs": [(0, 9), (5, 6), (16, 2)],
        "softcap": 2.0,
        "dtype": "float16",
        "kv": "fp8",
    }
    return cases


CASES = _cases()


def run_case(spec: dict[str, Any], device: str = "cpu") -> None:
    """Raise AssertionError when the Triton result differs from the reference beyond tolerance."""
    from batchrun.kernels.attention_torch import paged_attention_reference
    from batchrun.kernels.quant.kv import KV_CACHE_DTYPES
    from batchrun.kernels.triton_attention import decode_attention, paged_attention
    from benchmarks.cases import attention_case

    c = attention_case(
        spec["seqs"],
        spec["heads"],
        spec["kv_heads"],
        spec["head_dim"],
        spec["block_size"],
        _DTYPES[spec["dtype"]],
        device,
        seed=len(spec["seqs"]) + spec["heads"],
        kv_cache_dtype=KV_CACHE_DTYPES[spec["kv"]] if "kv" in spec else None,
    )
    scale = spec["head_dim"] ** -0.5
    window, softcap = spec["window"], spec.get("softcap")
    # Over a quantized cache the kernels read every key from the cache, so the reference must too
    # (given this step's keys, it would attend fresh prompts to them unquantized).
    k_new, v_new = (None, None) if "kv" in spec else (c.k_new, c.v_new)
    want = paged_attention_reference(c.q, c.k_cache, c.v_cache, c.meta, scale, window, softcap, k_new, v_new)
    if "num_splits" in spec:
        m = c.meta
        got = decode_attention(
            c.q,
            c.k_cache,
            c.v_cache,
            m.block_tables,
            m.decode_seq_ids,
            m.decode_seq_lens,
            scale,
            window,
            softcap,
            num_splits=spec["num_splits"],
        )
    else:
        got = paged_attention(c.q, c.k_cache, c.v_cache, c.meta, scale, window, softcap)
    rtol, atol = _TOLERANCES[spec["dtype"]]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


test_triton_attention_matches_reference_interpreted, test_triton_attention_matches_reference_on_gpu = (
    interpreted_and_on_gpu(CASES, lambda spec: run_case(spec, "cuda"))
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (9, 3, 64), (32, 4, 128)])
def test_triton_attention_large_on_gpu(dtype, heads, kv_heads, head_dim):
    seqs = [(c, 1) for c in (1, 17, 500, 4000, 9000)] + [(0, 300), (700, 130), (64, 1000)]
    for window in (None, 256):
        run_case(
            dict(
                seqs=seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, window=window, dtype=dtype
            ),
            "cuda",
        )


if __name__ == "__main__":
    report_cases(CASES, run_case)
