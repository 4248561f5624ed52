"""Shared fixtures: a tiny random-weight Llama (fast), and the default model (end to end)."""
from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from types import SimpleNamespace

# No test touches the user's trace store (~/.cache/kvlens/store or $KVLENS_STORE_DIR): a test's writes would evict
# their traces down to the default size limit. Set before any module opens a store (the app opens one on import).
TEST_STORE = tempfile.mkdtemp(prefix="kvlens-test-store-")
os.environ["KVLENS_STORE_DIR"] = TEST_STORE
atexit.register(shutil.rmtree, TEST_STORE, ignore_errors=True)

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backend.engine import models
from backend.engine.attention import ATTN_IMPLEMENTATION
from backend.engine.models import LoadedModel

# pytest-xdist's workers share the machine's cores: each runs torch on its share, since more threads than cores
# spin against each other in OpenMP's barriers and slow every worker down. The processes a test starts (the app
# under a browser, a command, the notebook's kernel) inherit the share: with a thread per core of their own, the
# 8k browser test's run took 442 s beside one busy core instead of 236 s.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    THREADS = max(1, len(os.sched_getaffinity(0)) // WORKERS)
    torch.set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)

# Triton's interpreter (TRITON_INTERPRET=1: the kernels' tests on a CPU) spent two thirds of the kernels' tests' time
# on two things a compiled kernel never does, and these tests run as triton 3.9 compiles for a GPU without them:
# - it checks every 32-bit integer add, sub and mul for overflow, a debugging aid that triton's CUDA and ROCm backends
#   build in only with debug on (the tests' sizes are far from 2**31);
# - at every call of a jit function inside a kernel (each tl.sum, tl.max, tl.argmin calls one) it lists the members
#   of triton.language to re-point its builtins at the interpreter's; the list is the same every time, so it is
#   read once, and inside a kernel, where they point at the interpreter's already, nothing is re-pointed again.
if os.environ.get("TRITON_INTERPRET") == "1":
    import dataclasses
    import functools
    import inspect

    from triton import language as tl
    from triton.runtime import interpreter

    interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                  sanitize_overflow=False)

    @functools.cache
    def _builtins_of(pkg) -> tuple:
        return tuple((name, member) for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member))

    def _patch_builtin(pkg, builder, scope) -> None:
        # A jit function called inside a kernel finds the builtins re-pointed already: as triton's own loop (which
        # lists only members that are still builtins), it leaves those as they are.
        for name, member in _builtins_of(pkg):
            if getattr(pkg, name, None) is member:
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin

    # Two more of its costs that compiling never pays, per operation of every program:
    # - a binary operation on two blocks of one shape wraps each in a broadcast to that shape (it compares the
    #   shape, a tuple, with a list it builds, which always differ): a new block type and tensor for each operand;
    # - it maps a triton dtype to numpy's by building the table anew at every call.
    from triton.language.semantic import TritonSemantic

    _broadcast = TritonSemantic.broadcast_impl_value

    def _broadcast_impl_value(self, lhs, rhs):
        if lhs.type.is_block() and rhs.type.is_block() and lhs.type.shape == rhs.type.shape:
            return lhs, rhs
        return _broadcast(self, lhs, rhs)

    TritonSemantic.broadcast_impl_value = _broadcast_impl_value

    _np_dtype = interpreter._get_np_dtype
    _np_dtypes: dict = {}

    def _get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # a block's: its element's
        if isinstance(scalar, tl.pointer_type):  # pointers are not hashed; the table gives them uint64
            return _np_dtype(scalar)
        if scalar not in _np_dtypes:
            _np_dtypes[scalar] = _np_dtype(scalar)
        return _np_dtypes[scalar]

    interpreter._get_np_dtype = _get_np_dtype


class TinyTokenizer:
    """Just enough tokenizer for the runner and the app: one character per id, no EOS, no chat template."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text):
        return SimpleNamespace(input_ids=[ord(c) % 101 for c in text])

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def make_tiny(layers: int = 2, heads: int = 6, kv_heads: int = 2, dtype=torch.float64, seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         tie_word_embeddings=False)
    config._attn_implementation = ATTN_IMPLEMENTATION
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Sharper attention than the default init, so policies see clear preferences and no near-ties.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return LoadedModel(name="tiny", model=model, tokenizer=TinyTokenizer(), fingerprint="tiny")


def tiny_model_dir(directory, model_type: str, **config) -> str:
    """A random-weight model of ``model_type`` saved as a local model directory, with a tokenizer of one token per
    lowercase letter, space and stop: what ``--model DIR`` loads, in a second."""
    from tokenizers import Tokenizer, models as vocabularies, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz .,"))}
    words = Tokenizer(vocabularies.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character a token
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<bos>", eos_token="<eos>")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=len(vocab), pad_token_id=0,
                                                                  bos_token_id=1, eos_token_id=2, **config))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def pytest_runtest_setup(item):
    """Under ``--dist loadgroup`` (make test) pytest-xdist appends a test's ``xdist_group`` to its node id and gives
    a group's tests to one worker; a test whose id lacks it was handed to any worker (two browser tests could run
    at once), so it fails before it starts."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail("pytest-xdist did not keep this test in its xdist_group: this pytest and pytest-xdist do not "
                    "work together (requirements-dev.txt says which do)")


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return make_tiny()


@pytest.fixture(scope="session")
def text_ids() -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 101, (40,), generator=g).tolist()


@pytest.fixture(scope="session")
def default_lm():
    from backend.engine.models import load_model
    return load_model()


@pytest.fixture(scope="session")
def inaugural_text() -> str:
    from backend.texts import inaugural
    return inaugural("1789-Washington.txt")


@pytest.fixture
def text_file(tmp_path):
    """A short text on disk, for the CLI commands."""
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.")
    return path


def free_port() -> int:
    """A loopback port nobody listens on (for the app servers the tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A random two-layer Llama on disk with a tokenizer of one token a character (lm-eval sizes RULER's samples
    with it, and the command line loads it by its directory)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", "llama", hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=2048)


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """A private trace store for one test (``KVLENS_STORE_DIR``)."""
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "store"))
    return tmp_path / "store"


@pytest.fixture
def default_loaded(default_lm, monkeypatch):
    """The default model as the one this process has loaded (what ``shared_model`` hands out)."""
    from backend.engine.models import DEFAULT_MODEL

    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, default_lm)
    return default_lm


@pytest.fixture
def tiny_session(tiny, tmp_path, monkeypatch):
    """The app's session with the tiny model standing in for the default one, and a private store."""
    import app
    from backend.engine.models import DEFAULT_MODEL
    from backend.traces.store import TraceStore

    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, tiny)
    store = TraceStore(tmp_path / "store")
    monkeypatch.setattr(app, "STORE", store)
    return store
