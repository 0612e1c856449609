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
    """Where the tokenizer built from a GGUF file is kept: by what it is built from (the file's tokenizer metadata
    and architecture), so files with the same tokenizer (one model's quantizations) build it once."""
    from .models.gguf_header import read_gguf_header

    fields = read_gguf_header(source.path).fields
    described = repr(sorted((k, v) for k, v in fields.items()
                            if k.startswith("tokenizer.") or k == "general.architecture"))
    key = hashlib.sha1(described.encode()).hexdigest()[:16]
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
    try:
        tok = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.path.name)
    except ValueError as exc:  # transformers reads the configs of the GGUF architectures whose models it loads
        tok = _tokenizer_from_metadata(source, exc)
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


def _tokenizer_from_metadata(source: ModelSource, refused: Exception) -> Any:
    """The tokenizer a GGUF file's metadata describes, built as transformers builds it for the architectures it
    knows (the tokenizer depends on ``tokenizer.ggml.model``, not on the model's architecture)."""
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(source.path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ImportError, ValueError, KeyError) as exc:
        raise refused from exc
    log.info("tokenizer of %s built from its GGUF metadata (%s)", source.path.name, refused)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
