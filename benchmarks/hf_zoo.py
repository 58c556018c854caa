"""transformers' architectures beyond :mod:`benchmarks.torch_models`' through the toolchain: each
built from its configuration class at a tiny size (random weights, nothing downloaded), exported
as a model engineer would, made a training plan, and one SGD step of the plan held to torch
autograd's by :func:`benchmarks.real_zoo.step_check` (its verdicts, its JSON line per model and exporter).

    PYTHONPATH=. python -m benchmarks.hf_zoo [--only NAME ...] [--exporters from_torch classic ...]

Needs the ``bench`` extra (torch, transformers; not torchvision). Dropout is off
(:func:`benchmarks.export_fixtures.without_dropout`, and SpecAugment's masking in the audio
encoders), eager attention. Classifiers take ``input_ids`` and ``attention_mask`` (or an image, or
a waveform) and predict one of :data:`CLASSES`; language models predict the next token at every
position.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from benchmarks.export_fixtures import batch, perturb, without_dropout
from benchmarks.real_zoo import EXPORTERS, no_stochastic_depth, step_check
from benchmarks.torch_models import Input, ModelSpec, _Logits
from emulator.toolchain.torch_export import TorchInput

CLASSES = 4
VOCAB = 200
SEQ = 16
HIDDEN = 32


def _hf(model: str, config: str, keywords: tuple[str, ...] = (), **fields: Any) -> nn.Module:
    """transformers' ``model`` class built from its ``config`` class with ``fields`` (eager attention)."""
    import transformers

    made = getattr(transformers, config)(attn_implementation="eager", **fields)
    return _Logits(getattr(transformers, model)(made), keywords)


_BERT_FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=2 * HIDDEN,
    max_position_embeddings=64,
    num_labels=CLASSES,
)
_LM_FIELDS = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_AUDIO_FIELDS = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=2 * HIDDEN,
    conv_dim=(8, 8),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2,
    mask_time_prob=0.0,
    mask_feature_prob=0.0,
    layerdrop=0.0,
    classifier_proj_size=16,
    num_labels=CLASSES,
)


def _classifier(model: str, config: str, **fields: Any) -> Callable[[], nn.Module]:
    return partial(_hf, model, config, **{**_BERT_FIELDS, **fields})


def _lm(model: str, config: str, **fields: Any) -> Callable[[], nn.Module]:
    return partial(_hf, model, config, **fields)


_TEXT = (Input("input_ids", (SEQ,), "int64", VOCAB), Input("attention_mask", (SEQ,), "int64", 2))
_TOKENS = (Input("input_ids", (SEQ,), "int64", VOCAB),)
_IMAGE = (Input("pixel_values", (3, 32, 32)),)
_AUDIO = (Input("input_values", (400,)),)


def _text(factory: Callable[[], nn.Module]) -> ModelSpec:
    return ModelSpec("transformers", factory, factory, _TEXT, CLASSES)


def _causal(factory: Callable[[], nn.Module]) -> ModelSpec:
    return ModelSpec("transformers", factory, factory, _TOKENS, VOCAB, label_shape=(SEQ,))


def _image(factory: Callable[[], nn.Module]) -> ModelSpec:
    return ModelSpec("transformers", factory, factory, _IMAGE, CLASSES)


ZOO: dict[str, ModelSpec] = {
    "electra": _text(_classifier("ElectraForSequenceClassification", "ElectraConfig", embedding_size=16)),
    "deberta_v2": _text(
        _classifier(
            "DebertaV2ForSequenceClassification",
            "DebertaV2Config",
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=8,
            max_relative_positions=16,
        )
    ),
    "mobilebert": _text(
        _classifier(
            "MobileBertForSequenceClassification",
            "MobileBertConfig",
            embedding_size=16,
            intra_bottleneck_size=16,
            true_hidden_size=16,
            num_feedforward_networks=2,
        )
    ),
    "xlm_roberta": _text(_classifier("XLMRobertaForSequenceClassification", "XLMRobertaConfig")),
    "convbert": _text(
        _classifier("ConvBertForSequenceClassification", "ConvBertConfig", embedding_size=HIDDEN, conv_kernel_size=3)
    ),
    "mpnet": _text(_classifier("MPNetForSequenceClassification", "MPNetConfig")),
    "funnel": _text(
        _lm(
            "FunnelForSequenceClassification",
            "FunnelConfig",
            vocab_size=VOCAB,
            block_sizes=[1, 1],
            num_decoder_layers=1,
            d_model=HIDDEN,
            n_head=2,
            d_head=16,
            d_inner=2 * HIDDEN,
            num_labels=CLASSES,
        )
    ),
    "longformer": _text(
        _classifier("LongformerForSequenceClassification", "LongformerConfig", attention_window=4, pad_token_id=1)
    ),
    "big_bird": _text(_classifier("BigBirdForSequenceClassification", "BigBirdConfig", attention_type="original_full")),
    "gpt_neo": _causal(
        _lm(
            "GPTNeoForCausalLM",
            "GPTNeoConfig",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
        )
    ),
    "gptj": _causal(
        _lm(
            "GPTJForCausalLM",
            "GPTJConfig",
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=2,
            rotary_dim=8,
            n_positions=64,
        )
    ),
    "codegen": _causal(
        _lm(
            "CodeGenForCausalLM",
            "CodeGenConfig",
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=2,
            rotary_dim=8,
            n_positions=64,
            n_ctx=64,
        )
    ),
    "opt": _causal(
        _lm(
            "OPTForCausalLM",
            "OPTConfig",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            ffn_dim=2 * HIDDEN,
            num_attention_heads=2,
            word_embed_proj_dim=HIDDEN,
            max_position_embeddings=64,
        )
    ),
    "mistral": _causal(_lm("MistralForCausalLM", "MistralConfig", **_LM_FIELDS, sliding_window=8)),
    "phi": _causal(
        _lm("PhiForCausalLM", "PhiConfig", **{**_LM_FIELDS, "num_key_value_heads": 4}, partial_rotary_factor=0.5)
    ),
    "phi3": _causal(_lm("Phi3ForCausalLM", "Phi3Config", **_LM_FIELDS, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma": _causal(_lm("GemmaForCausalLM", "GemmaConfig", **_LM_FIELDS, head_dim=8)),
    "stablelm": _causal(_lm("StableLmForCausalLM", "StableLmConfig", **_LM_FIELDS)),
    "falcon": _causal(
        _lm(
            "FalconForCausalLM",
            "FalconConfig",
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    ),
    "bloom": _causal(_lm("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4)),
    "mpt": _causal(
        _lm(
            "MptForCausalLM",
            "MptConfig",
            vocab_size=VOCAB,
            d_model=HIDDEN,
            n_heads=2,
            n_layers=2,
            expansion_ratio=2,
            max_seq_len=64,
        )
    ),
    "mamba": _causal(
        _lm("MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=HIDDEN, state_size=8, num_hidden_layers=2)
    ),
    "whisper": ModelSpec(
        "transformers",
        partial(
            _hf,
            "WhisperForConditionalGeneration",
            "WhisperConfig",
            ("input_features", "decoder_input_ids"),
            vocab_size=VOCAB,
            num_mel_bins=8,
            d_model=HIDDEN,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=2 * HIDDEN,
            decoder_ffn_dim=2 * HIDDEN,
            max_source_positions=16,
            max_target_positions=32,
            pad_token_id=0,
            decoder_start_token_id=1,
        ),
        lambda: None,  # type: ignore[arg-type, return-value]
        (Input("input_features", (8, 32)), Input("decoder_input_ids", (SEQ,), "int64", VOCAB)),
        VOCAB,
        label_shape=(SEQ,),
    ),
    "wav2vec2": ModelSpec(
        "transformers",
        _lm("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", **_AUDIO_FIELDS),
        lambda: None,  # type: ignore[arg-type, return-value]
        _AUDIO,
        CLASSES,
    ),
    "hubert": ModelSpec(
        "transformers",
        _lm("HubertForSequenceClassification", "HubertConfig", **_AUDIO_FIELDS),
        lambda: None,  # type: ignore[arg-type, return-value]
        _AUDIO,
        CLASSES,
    ),
    "swin": _image(
        _lm(
            "SwinForImageClassification",
            "SwinConfig",
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            num_labels=CLASSES,
        )
    ),
    "convnext": _image(
        _lm(
            "ConvNextForImageClassification",
            "ConvNextConfig",
            hidden_sizes=[8, 16],
            depths=[1, 1],
            num_stages=2,
            num_labels=CLASSES,
        )
    ),
    "segformer": _image(
        _lm(
            "SegformerForImageClassification",
            "SegformerConfig",
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[8, 16],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            num_labels=CLASSES,
        )
    ),
    "mobilevit": _image(
        _lm(
            "MobileViTForImageClassification",
            "MobileViTConfig",
            image_size=32,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48],
            num_labels=CLASSES,
        )
    ),
}


def run(name: str, exporter: str) -> dict[str, Any]:
    spec = ZOO[name]
    torch.manual_seed(0)
    row: dict[str, Any] = {"model": name, "exporter": exporter}
    try:
        module = no_stochastic_depth(without_dropout(spec.small())).train()
    except Exception as exc:  # noqa: BLE001 - the library's own configuration
        return {**row, "result": "torch_failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
    generator = torch.Generator().manual_seed(1)
    perturb(module, generator)
    inputs, labels = batch(spec, generator)
    specs = [TorchInput(i.name, i.shape, i.dtype) for i in spec.inputs]
    return step_check(module, specs, inputs, labels, exporter, row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(ZOO))
    parser.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=["from_torch"])
    args = parser.parse_args(argv)
    for name in args.only or list(ZOO):
        for exporter in args.exporters:
            print(json.dumps(run(name, exporter)), flush=True)


if __name__ == "__main__":
    main()
