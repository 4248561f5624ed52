"""What differs between model families, read once from the config and the attention modules.

transformers describes a decoder by features, not by name, and so does KV Lens. Everything the engine and the
policies need to know about a loaded model is here:

* **per layer**: its sliding window (``layer_types`` and ``sliding_window``: such a layer reads only the
  latest ``window`` keys), and how it rotates queries and keys (``rope``): the model's own
  ``apply_rotary_pos_emb`` with the rotary embedding's cos and sin for that layer (Gemma 3's local and
  global theta, GLM's partial and Cohere's interleaved rotary come with the model's function), or none at
  all on a NoPE layer (SmolLM3's ``no_rope_layers``);
* **where queries and keys are read before RoPE**: after QK-norm when the layer has one (Qwen 3, OLMo 2,
  Gemma 3, Cohere), else the projections, split from a fused QKV projection (Phi-3); and the output projection
  (the linear map from the heads' outputs to the hidden size, whatever its name), for scorers that weigh values by it;
* **the logits**: the LM head's output scaled as the model scales it (Cohere's ``logit_scale``, Granite's
  ``logits_scaling``, Gemma's final soft-capping).

The attention scale (Gemma's ``query_pre_attn_scalar``, Granite's multiplier) and logit soft-capping reach
the engine with every attention call, from the module itself (``scaling``, ``softcap``). How a block arranges
attention and MLP (Cohere's parallel blocks, Gemma's extra norms) needs nothing here: the engine replaces only
the attention function, and the model's own code does the rest. A model the engine cannot serve (an
encoder-decoder, state-space or linear-attention layers, an attention module that does not call
transformers' attention functions) gets ``UnsupportedModel`` naming the missing feature.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..traces.rope import KeyRope


class UnsupportedModel(ValueError):
    """The engine cannot run this model; the message names the missing feature in one line."""


Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # rope(x [H, L, d], positions [L]) -> rotated x


@dataclass(frozen=True)
class Capture:
    """Where one layer's queries and keys are read before RoPE: a module's output, the slice of its last
    dimension that holds them (a fused QKV projection holds both, and the values), and the output's layout:
    "flat" [B, n, H*d] or [B, n, H, d], "heads" [B, H, n, d] (a norm applied after the heads are split off)."""

    q_module: torch.nn.Module
    k_module: torch.nn.Module
    q_slice: slice | None = None  # None: the whole output
    k_slice: slice | None = None
    q_layout: str = "flat"
    k_layout: str = "flat"

    def heads(self, which: str, output: torch.Tensor, n_heads: int) -> torch.Tensor:
        """The captured output as [B, H, n, d]."""
        part = self.q_slice if which == "q" else self.k_slice
        x = output if part is None else output[..., part]
        if (self.q_layout if which == "q" else self.k_layout) == "heads":
            return x
        batch, n = x.shape[:2]
        return x.reshape(batch, n, n_heads, -1).transpose(1, 2)


@dataclass(frozen=True)
class LayerFeatures:
    window: int | None  # a sliding-window layer reads the latest ``window`` keys only; None: every key
    rope: Rope  # how the layer rotates queries and keys (the identity on a NoPE layer)
    capture: Capture
    # The attention's output projection (heads x head size -> hidden), which CriticalKV weighs values by; None
    # where the module has no single such linear map.
    output: torch.nn.Module | None = None


def key_rope(rope: Rope, head_dim: int, device: torch.device | str = "cpu") -> KeyRope:
    """A layer's rotation as numbers a trace keeps, read from the rotation itself, so any layout reads the same
    (halves, interleaved pairs, a partial rotary part, none at all): each unit vector turned to position 1.

    Turned there, dimension i of the unit vector of dimension i reads ``scaling * cos(freq[i])``, that of its
    partner ``-scaling * sin(freq[i])``, and every other reads zero. Angles below pi per position (every RoPE's:
    its fastest pair turns one radian) are read without ambiguity."""
    eye = torch.eye(head_dim, dtype=torch.float64, device=device)[:, None]  # [d "heads", 1 position, d]
    turned = rope(eye, torch.ones(1, dtype=torch.long, device=device))[:, 0].cpu().numpy().T  # [i, unit vector]
    own = np.diag(turned).copy()
    others = turned - np.diag(own)
    partner = np.abs(others).argmax(1)
    sin = -others[np.arange(head_dim), partner]  # scaling * sin(freq)
    turns = sin != 0
    scale = np.hypot(own, sin)[turns]
    return KeyRope(freq=np.where(turns, np.arctan2(sin, own), 0.0),
                   partner=np.where(turns, partner, np.arange(head_dim)),
                   scaling=float(scale.mean()) if turns.any() else 1.0)


@dataclass(frozen=True)
class ModelFeatures:
    layers: tuple[LayerFeatures, ...]
    logit_scale: float = 1.0  # the LM head's output is multiplied by this (Cohere)
    logits_scaling: float = 1.0  # ... and divided by this (Granite)
    final_softcap: float | None = None  # ... then soft-capped (Gemma 2, Gemma 3)
    softcap: float | None = None  # attention logits are soft-capped (Gemma 2; each call hands its cap over)

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.layers]

    def logits(self, head_output: torch.Tensor) -> torch.Tensor:
        """The model's logits from its LM head's output, scaled and capped as its own forward does."""
        logits = head_output
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def read_features(model) -> ModelFeatures:
    """A loaded causal LM's features, or UnsupportedModel naming what the engine lacks."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{config.model_type}: encoder-decoder models have no decoder-only KV cache to show")
    decoder = getattr(model, "model", None)
    blocks = getattr(decoder, "layers", None)
    if blocks is None or getattr(decoder, "rotary_emb", None) is None:
        raise UnsupportedModel(f"{config.model_type}: the engine needs decoder layers and a rotary embedding "
                               f"(model.model.layers, model.model.rotary_emb)")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(blocks)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModel(f"{config.model_type}: layers of type {', '.join(unknown)} (linear attention or "
                               f"state-space layers) do not attend through a KV cache")
    layers = []
    for index, block in enumerate(blocks):
        attention = getattr(block, "self_attn", None)
        if attention is None or not hasattr(attention, "layer_idx") or not _calls_attention_interface(attention):
            raise UnsupportedModel(f"{config.model_type}: layer {index} has no self-attention module that calls "
                                   f"transformers' AttentionInterface")
        window = config.sliding_window if layer_types[index] == "sliding_attention" else None
        layers.append(LayerFeatures(window=window, rope=_layer_rope(model, attention, layer_types[index]),
                                    capture=_capture(config, attention), output=_output(config, attention)))
    layouts = _layouts(model, layers[0].capture)
    layers = [dataclasses.replace(layer, capture=dataclasses.replace(layer.capture, q_layout=layouts[0],
                                                                     k_layout=layouts[1])) for layer in layers]
    return ModelFeatures(layers=tuple(layers), logit_scale=float(getattr(model, "logit_scale", 1.0) or 1.0),
                         logits_scaling=float(getattr(config, "logits_scaling", 1.0) or 1.0),
                         final_softcap=getattr(config, "final_logit_softcapping", None),
                         softcap=getattr(config, "attn_logit_softcapping", None))


def _calls_attention_interface(attention) -> bool:
    """Whether the module's forward dispatches through transformers' attention functions, the engine's way in
    (a forward written without them computes its attention where no policy can reach it)."""
    forward = inspect.unwrap(type(attention).forward)
    return "ALL_ATTENTION_FUNCTIONS" in getattr(forward, "__globals__", {})


def _layer_rope(model, attention, layer_type: str) -> Rope:
    """The layer's rotation, through the model's own rotary embedding and ``apply_rotary_pos_emb``."""
    if not getattr(attention, "use_rope", True):  # a NoPE layer (SmolLM3's no_rope_layers)
        return lambda x, positions: x
    apply = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise UnsupportedModel(f"{model.config.model_type}: its modeling code has no apply_rotary_pos_emb")
    rotary = model.model.rotary_emb
    per_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        extra = (layer_type,) if per_layer_type else ()
        cos, sin = rotary(x, positions[None], *extra)
        rotated, _ = apply(x[None], x[None, :1], cos, sin)
        return rotated[0]

    return rope


def _capture(config, attention) -> Capture:
    """Queries and keys before RoPE: after QK-norm where the layer has it, else the projections."""
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    if q_norm is not None and k_norm is not None:
        return Capture(q_norm, k_norm)
    if hasattr(attention, "q_proj") and hasattr(attention, "k_proj"):
        return Capture(attention.q_proj, attention.k_proj)
    fused = getattr(attention, "qkv_proj", None)
    if fused is not None:  # [queries | keys | values] along the last dimension
        head_dim = getattr(attention, "head_dim", None) or config.hidden_size // config.num_attention_heads
        queries = config.num_attention_heads * head_dim
        keys = config.num_key_value_heads * head_dim
        return Capture(fused, fused, slice(0, queries), slice(queries, queries + keys))
    raise UnsupportedModel(f"{config.model_type}: its attention has neither q_proj/k_proj nor a fused qkv_proj")


def _output(config, attention) -> torch.nn.Module | None:
    """The attention's output projection, whatever the modeling code calls it: a linear map from every head's output
    (heads x head size) to the hidden size. Where the input projections have that shape too (as many heads as the
    hidden size holds), it is the last one: modeling code defines the output after the inputs it mirrors."""
    head_dim = getattr(attention, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fitting = [module for module in attention.children() if isinstance(module, torch.nn.Linear)
               and module.in_features == config.num_attention_heads * head_dim
               and module.out_features == config.hidden_size]
    return fitting[-1] if fitting else None


def _layouts(model, capture: Capture) -> tuple[str, str]:
    """The layout of the captured queries' and keys' outputs, from one short plain forward: whether a norm runs
    before or after the heads are moved in front of the positions is the modeling code's choice (Qwen 3: before,
    Gemma 3: after), visible only in the shapes."""
    config = model.config
    n = config.num_attention_heads + config.num_key_value_heads + 1  # a length no head count equals
    shapes = {}

    def hook(which: str):
        def remember(_module, _inputs, output) -> None:  # returns None: the output goes on unchanged
            shapes.setdefault(which, output.shape)
        return remember

    hooks = [module.register_forward_hook(hook(which))
             for which, module in (("q", capture.q_module), ("k", capture.k_module))]
    try:
        with torch.inference_mode():
            model.model(input_ids=torch.zeros((1, n), dtype=torch.long, device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return tuple("heads" if len(shapes[w]) == 4 and shapes[w][2] == n else "flat" for w in ("q", "k"))
