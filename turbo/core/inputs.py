"""Input processing: raw text and chat conversations to token ids, and the checks a prompt must pass.

Raw text is tokenized as the model's tokenizer does by default (its special tokens, e.g. a BOS, where it adds
them), as transformers and vLLM tokenize a raw prompt; a chat conversation is rendered by the tokenizer's chat
template, which alone places special tokens (never a second BOS).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import InvalidRequest


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of raw ``text``; ``add_special_tokens=False`` for a fragment. Raises ``InvalidRequest`` for text that
    is not valid Unicode (e.g. undecodable bytes read with ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"the text holds bytes that are not valid UTF-8 (at character {e.start}); "
                             f"decode your input as UTF-8 (errors='replace' keeps the rest)") from None
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def chat_template_ids(tokenizer, messages: list[dict], path: Path | str = "the model") -> list[int]:
    """Token ids of ``messages`` rendered by the chat template with the generation prompt. Raises
    ``InvalidRequest`` when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(f"the tokenizer of {path} has no chat template; use Engine.generate with a plain prompt "
                             f"instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode(tokenizer, text, add_special_tokens=False)


def check_prompt(ids: list[int], session_len: int, vocab_size: int, session: bool = False) -> None:
    """Raise ``InvalidRequest`` for an empty prompt, one that leaves no room to generate within ``session_len``
    (naming both numbers), or a token id outside the vocabulary."""
    if not ids:
        raise InvalidRequest("the prompt is empty: give at least one token of text")
    if len(ids) >= session_len:
        if session:
            raise InvalidRequest(f"the session would reach {len(ids)} tokens but session_len is {session_len}; "
                                 f"reset the session, shorten the message (or the system prompt), let the server drop "
                                 f"the oldest turns (session_overflow='drop-oldest', --session-overflow drop-oldest), "
                                 f"or raise session_len and the KV pool (max_kv_tokens or kv_cache_gib; in the CLI "
                                 f"--session-len, --kv-cache-gib)")
        raise InvalidRequest(f"the prompt has {len(ids)} tokens but the context holds {session_len}; shorten the "
                             f"prompt, or raise session_len and the KV pool (max_kv_tokens or kv_cache_gib; in the "
                             f"CLI --session-len, --kv-cache-gib)")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
