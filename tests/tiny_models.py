"""Tiny random-weight checkpoints shared by tests and benchmarks."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers


def build_key_outlier_model(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (head_dim 16, GQA 4/2, k_proj bias) whose keys carry strong outlier channels, saved as a
    float32 checkpoint at ``path``.

    In every KV head, the slowest rotary pair (channels 7 and 15) gets a large constant offset (k_proj bias +-30)
    and channel 6 a 20x larger weight row, the two kinds KIVI and KVQuant describe: per-token int4 then spends
    its range on those channels.
    """
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hd = 16
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif n.endswith("lm_head.weight") or n.endswith("embed_tokens.weight"):
                p.mul_(8.0)  # sharper next-token distributions, so that errors show in them
        for layer in hf.model.layers:
            # sharper attention whose output carries weight in the residual, so that key errors reach the logits
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.v_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
            kp = layer.self_attn.k_proj
            for h in range(cfg.num_key_value_heads):
                kp.bias[h * hd + 7] = 30.0
                kp.bias[h * hd + 15] = -30.0
                kp.weight[h * hd + 6] *= 20.0
    hf.save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)
    return Path(path)


def build_tiny_llama(path: Path, seed: int = 0, **config) -> Path:
    """A random 2-layer float32 Llama (vocab 128, hidden 64, GQA 4/2, head_dim 16 unless ``config`` says otherwise:
    any ``transformers.LlamaConfig`` field) with the word-level test tokenizer, saved at ``path``."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    cfg = transformers.LlamaConfig(**{**fields, **config})
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)
    return Path(path)


def save_word_tokenizer(path: Path, vocab_size: int, bos: bool = False) -> None:
    """A word-level tokenizer over the most frequent words of the bundled C4 sample (``[UNK]``, ``</s>`` first),
    so that a tiny model reads real calibration text and runs in the engine.

    ``bos``: token 2 is ``<s>``, which the tokenizer adds before every text (as Llama's does), and the chat
    template writes it once itself (``{{ bos_token }}`` at its start)."""
    import collections

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    import calib_data

    counts = collections.Counter(w for doc in calib_data.load_rows("c4")[:200] for w in doc.split())
    specials = ["[UNK]", "</s>"] + (["<s>"] if bos else [])
    words = specials + [w for w, _ in counts.most_common(vocab_size - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {}
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 2)])
        extra = dict(bos_token="<s>", chat_template="{{ bos_token }}{% for m in messages %}{{ m['role'] }} "
                                                    "{{ m['content'] }} {% endfor %}assistant")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", **extra).save_pretrained(path)
