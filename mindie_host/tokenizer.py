"""Loading the tokenizer (and its chat template) from an HF directory or a GGUF file."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from .models.weights import ModelSource

log = logging.getLogger("mindie_host.tokenizer")


def _cache_dir(source: ModelSource) -> Path:
    stat = source.path.stat()
    key = hashlib.sha1(f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("MINDIE_HOST_CACHE", Path.home() / ".cache" / "mindie-host"))
    return root / "tokenizers" / key


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> Any:
    """A Hugging Face fast tokenizer for the model.

    Building one from GGUF metadata takes seconds, so the result is saved once
    under ``~/.cache/mindie-host`` (``MINDIE_HOST_CACHE``) and reloaded from there.
    """
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(str(source.path), trust_remote_code=trust_remote_code)
    cache = _cache_dir(source)
    if (cache / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:  # a stale or partial cache: rebuild it
            log.warning("tokenizer cache %s unreadable; rebuilding", cache)
    tok = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError:
        log.warning("could not cache the tokenizer under %s", cache)
    return tok


#: the built-in byte-level tokenizer's chat template: one ``<|role|>`` line per message
BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] if m['content'] is string else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_level_tokenizer() -> Any:
    """A tokenizer that needs no files: one token per byte (GPT-2's byte alphabet, no merges) after ``<s>``,
    ``</s>`` (end of sequence) and ``<pad>``, 259 tokens, with a plain chat template. StandardMock serves it
    when ``modelWeightPath`` has no tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate([*specials, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=BYTE_LEVEL_CHAT_TEMPLATE)
