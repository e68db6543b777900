"""Tiny real Hugging Face models built from configs (random weights), saved like hub
checkpoints, plus a real BPE tokenizer trained offline on the embedded corpus.

Nothing is downloaded: every test model is a genuine transformers architecture, only small.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 300


def make_tokenizer(bos: bool):
    """A byte-level BPE tokenizer (vocab 300); ``bos`` makes it prepend <s> like Llama's."""
    from pydoc_data import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, show_progress=False, special_tokens=["<unk>", "<s>", "</s>", "<pad>"]
    )
    tok.train_from_iterator(list(topics.topics.values()), trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A </s> <s> $B", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def save_text_model(kind: str, directory: Path) -> Path:
    """Save a tiny model of architecture ``kind`` (gpt2, llama, qwen2, qwen3, mistral, gemma,
    gemma2: causal LMs; bert: a post-norm encoder) with tokenizer."""
    import transformers as tf

    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(
            tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=256, **common)
        )
    elif kind == "llama":
        model = tf.LlamaForCausalLM(
            tf.LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                **common,
            )
        )
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                **common,
            )
        )
    elif kind in ("qwen3", "mistral", "gemma"):
        config_class, model_class = {
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
        }[kind]
        model = model_class(
            config_class(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=256,
                **common,
            )
        )
    elif kind == "gemma2":
        model = tf.Gemma2ForCausalLM(
            tf.Gemma2Config(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=256,
                **common,
            )
        )
    elif kind == "bert":
        model = tf.BertModel(
            tf.BertConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=256,
                vocab_size=VOCAB,
                pad_token_id=3,
            ),
            add_pooling_layer=False,
        )
    else:
        raise ValueError(kind)
    model.save_pretrained(directory)
    make_tokenizer(bos=kind == "llama").save_pretrained(directory)
    return directory


def save_vision_model(kind: str, directory: Path) -> Path:
    """Save a tiny full CLIP / SigLIP model or a DINOv2 model, with its image processor."""
    import transformers as tf

    torch.manual_seed(0)
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
    }
    text = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 64,
    }
    if kind == "clip":
        model = tf.CLIPModel(
            tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
        )
        processor = tf.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    elif kind == "siglip":
        model = tf.SiglipModel(tf.SiglipConfig(text_config=text, vision_config=vision))
        processor = tf.SiglipImageProcessor(size={"height": 32, "width": 32})
    elif kind == "dinov2":
        model = tf.Dinov2Model(tf.Dinov2Config(**vision))
        processor = tf.BitImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    else:
        raise ValueError(kind)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def make_image_folder(directory: Path, n_per_class: int = 5, classes=("cat", "dog", "owl")):
    """Class subfolders of small random RGB images of varied sizes (PNG and JPEG)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (directory / c).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            h, w = rng.integers(24, 64, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            suffix = ".png" if i % 2 else ".jpg"
            Image.fromarray(pixels).save(directory / c / f"{c}_{i:03d}{suffix}")
    return directory
