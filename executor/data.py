"""Training data and the loss normalization that makes every layout compute the same gradients.

Data. Step `t` has one *global batch* of `global_batch` sequences of `seq_len` tokens, identical for every
layout: synthetic tokens drawn from `torch.Generator().manual_seed(seed + 1_000_003 * t)`, or windows
of a token file (`--data`: a `.npy` of integer ids, or a `.bin` of uint16 ids as nanoGPT writes them;
sample i of step t starts at token `(t * global_batch + i) * (seq_len + 1)` modulo the file length).
causal-lm and seq2seq-lm: labels are the next tokens (a seq2seq model's decoder reads them shifted
right, `executor.model.forward_inputs`). masked-lm: 15% of positions (from the same generator) are
replaced by the mask id and are the only labelled ones.

Slicing. Data-parallel rank d takes sequences [d*B, (d+1)*B) with B = micro_batch * num_microbatches,
then micro-batch k takes [k*m, (k+1)*m). Context-parallel rank c of cp takes two of the sequence's 2*cp chunks of
S/(2*cp) tokens, chunk c and chunk 2*cp-1-c (`cp_chunks`, the load-balanced layout of Megatron's and torch's ring
attention: under a causal mask every rank then attends to the same number of query-key pairs), with their position
ids.

Loss. With N labelled tokens in the global batch and R = dp*cp ranks averaging gradients, each
micro-batch's loss is `sum_CE(local tokens) * R / N`. Gradients are summed over micro-batches (and
pipeline micro-batches, `scale_grads=False`) and averaged over the R ranks, which gives exactly the
gradient of the global mean `sum_CE(all) / N`, whatever the layout. The reported loss is the sum of
the unscaled local sums, all-reduced over the R ranks, divided by N.

The cross-entropy is the plan's: by default `executor.cross_entropy` (the gradient made in the forward, a
slice of tokens at a time, its memory a third of the upcast one's); plans written before it existed run
`F.cross_entropy(logits.float())`. Under tensor parallelism with the whole model on the rank, the logits are
a DTensor sharded on the vocabulary and either loss is vocab-parallel (the upcast one is torch's, in
`loss_parallel()`, entered by the training step around the loss and its backward); its sum is the same on
every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from executor.cross_entropy import IGNORE, check_cross_entropy, chunked_cross_entropy
from tracer.errors import SoapError

MASK_FRACTION = 0.15


@dataclass(frozen=True)
class GlobalBatch:
    input_ids: torch.Tensor
    """(global_batch, seq_len) token ids."""
    labels: torch.Tensor
    """(global_batch, seq_len) target ids, IGNORE where unlabelled."""

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE).sum())


class TokenSource:
    """Global batches for each step, from the seed or a token file."""

    def __init__(self, *, vocab_size: int, global_batch: int, seq_len: int, task: str, seed: int,
                 data_file: str | None = None, mask_token_id: int | None = None) -> None:
        self.vocab, self.batch, self.seq, self.task, self.seed = vocab_size, global_batch, seq_len, task, seed
        self.mask_id = mask_token_id if mask_token_id is not None else min(103, vocab_size - 1)
        self.tokens = _load_tokens(data_file, vocab_size, seq_len) if data_file else None

    def batch_for_step(self, step: int) -> GlobalBatch:
        gen = torch.Generator().manual_seed(self.seed + 1_000_003 * step)
        if self.tokens is None:
            window = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=gen)
        else:
            span = self.seq + 1
            usable = len(self.tokens) - span
            starts = [((step * self.batch + i) * span) % (usable + 1) for i in range(self.batch)]
            window = torch.from_numpy(np.stack([self.tokens[s:s + span] for s in starts]).astype(np.int64))
        if self.task in ("causal-lm", "seq2seq-lm"):
            return GlobalBatch(window[:, :-1].contiguous(), window[:, 1:].contiguous())
        ids = window[:, :-1].clone()
        masked = torch.rand(ids.shape, generator=gen) < MASK_FRACTION
        masked[:, 0] |= ~masked.any(dim=1)  # at least one label per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, IGNORE))
        ids[masked] = self.mask_id
        return GlobalBatch(ids, labels)


def _load_tokens(path: str, vocab: int, seq_len: int) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise SoapError(f"--data {path}: no such file; pass a .npy or .bin (uint16) file of token ids")
    if p.suffix == ".npy":
        tokens = np.load(p, mmap_mode="r")
    elif p.suffix == ".bin":
        tokens = np.memmap(p, dtype=np.uint16, mode="r")
    else:
        raise SoapError(f"--data {path}: unknown format; use .npy (integer ids) or .bin (uint16 ids)")
    if tokens.ndim != 1:
        tokens = tokens.reshape(-1)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise SoapError(f"--data {path}: holds {tokens.dtype}, not integer token ids")
    if len(tokens) < seq_len + 1:
        raise SoapError(f"--data {path}: {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}")
    if int(tokens.max()) >= vocab:
        raise SoapError(f"--data {path}: token id {int(tokens.max())} >= the model's vocab size {vocab}")
    return tokens


@dataclass(frozen=True)
class Slicer:
    """This rank's share of a global batch (see the module docstring)."""

    dp_rank: int
    per_rank: int
    cp_rank: int
    cp: int

    def local(self, t: torch.Tensor) -> torch.Tensor:
        rows = t[self.dp_rank * self.per_rank:(self.dp_rank + 1) * self.per_rank]
        if self.cp == 1:
            return rows
        return torch.cat([rows[:, start:start + size] for start, size in cp_chunks(t.shape[1], self.cp, self.cp_rank)],
                         dim=1)

    def position_ids(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return cp_position_ids(seq_len, self.cp, self.cp_rank, device)


def cp_chunks(seq_len: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """(start, length) of the sequence's pieces context-parallel rank `rank` of `cp` holds, in order: chunks rank
    and 2*cp-1-rank of 2*cp (the whole sequence when cp is 1)."""
    if cp == 1:
        return [(0, seq_len)]
    chunk = seq_len // (2 * cp)
    return [(rank * chunk, chunk), ((2 * cp - 1 - rank) * chunk, chunk)]


def cp_position_ids(seq_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The position ids of the tokens context-parallel rank `rank` holds (`cp_chunks`), [1, S/cp]."""
    return torch.cat([torch.arange(start, start + size, device=device)
                      for start, size in cp_chunks(seq_len, cp, rank)]).unsqueeze(0)


class ScaledTokenLoss:
    """`sum_CE * factor`, with `factor = R / N` set for each step (see the module docstring). `cross_entropy`
    is the plan's (`TrainingConfig.cross_entropy`): "chunked", `executor.cross_entropy`; "upcast",
    `F.cross_entropy` on an fp32 copy of the logits."""

    def __init__(self, cross_entropy: str = "chunked") -> None:
        check_cross_entropy(cross_entropy)
        self.cross_entropy = cross_entropy
        self.factor = 1.0
        self.unscaled_sum = torch.zeros(())

    def set_step(self, *, num_labels: int, ranks_averaging: int) -> None:
        self.factor = ranks_averaging / num_labels
        self.unscaled_sum = torch.zeros(())

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The scaled loss of one micro-batch, a plain tensor, the same on every TP rank. Vocab-sharded DTensor
        logits (tp > 1, `costmodel.strategy.shards_vocabulary`) under the upcast loss need the call and its
        backward inside `loss_parallel()`."""
        if self.cross_entropy == "chunked":
            total = chunked_cross_entropy(logits, labels)
        else:
            total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                    reduction="sum")
        if isinstance(total, DTensor):  # replicated over tp: every rank's local value is the whole sum
            total = total.full_tensor()
        # stays on the device: a copy to the host here would wait for the GPU once per micro-batch
        self.unscaled_sum = self.unscaled_sum + total.detach()
        return total * self.factor


# --- the user's data (`soap execute --dataset PATH --tokenizer DIR`) --------------------------------

DATASET_FILES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
"""Local file formats `--dataset` reads, by suffix, with the `datasets` builder that reads each."""
PACKING_VERSION = 1
"""Part of the cache key: bump when the packing below changes."""


def prepare_dataset(dataset: str | Path, tokenizer: str | Path, seq_len: int, *,
                    cache_dir: str | Path | None = None, vocab_size: int | None = None) -> Path:
    """The `.npy` token file of `dataset` (a `datasets` dataset saved to disk, or json/jsonl/parquet/text
    files: one file or a directory of them) tokenized with the local `tokenizer` and packed for `seq_len`.

    Packing: every document's ids (no special tokens) followed by the tokenizer's EOS id (its SEP id
    when it has no EOS; nothing when it has neither), concatenated in dataset order and cut to whole
    windows of `seq_len + 1` tokens, which are the windows `TokenSource` reads (sample i of step t is
    window `t * global_batch + i`, until the file wraps around). The file is cached in `cache_dir` (default
    `$XDG_CACHE_HOME/soap/datasets`) as `tokens-KEY.npy`, KEY hashing the dataset's and the tokenizer's
    files (names, sizes, modification times), `seq_len` and `PACKING_VERSION`, with `tokens-KEY.json`
    beside it saying what it holds; a second run with the same inputs reads the cache. A tokenizer with more
    tokens than the model's `vocab_size` is refused before any text is read."""
    import hashlib
    import json
    import os

    from tracer.files import write_atomic

    source, tok_dir = Path(dataset), Path(tokenizer)
    for path, flag in ((source, "--dataset"), (tok_dir, "--tokenizer")):
        if not path.exists():
            raise SoapError(f"{flag} {path}: no such file or directory")
    if not tok_dir.is_dir():
        raise SoapError(f"--tokenizer {tok_dir}: not a directory; pass a local tokenizer saved with "
                        "`tokenizer.save_pretrained(DIR)`")
    if vocab_size is not None:
        size = len(_load_tokenizer(tok_dir))
        if size > vocab_size:
            raise SoapError(f"--tokenizer {tok_dir}: {size} tokens, more than the model's vocabulary of {vocab_size}; "
                            "use the model's own tokenizer, or plan a config whose vocab_size is at least "
                            f"{size}")
    key = hashlib.sha256(json.dumps([_fingerprint(source), _fingerprint(tok_dir), seq_len, PACKING_VERSION])
                         .encode()).hexdigest()[:20]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(cache_dir) if cache_dir else cache_home / "soap" / "datasets"
    target = root / f"tokens-{key}.npy"
    if target.is_file():
        return target
    tokens, documents, column = _tokenize(source, tok_dir, seq_len, root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{key}-{os.getpid()}.npy"
    np.save(tmp, tokens)
    tmp.replace(target)  # atomic: ranks under an external torchrun may all prepare the same file
    write_atomic(root / f"tokens-{key}.json", json.dumps(
        {"dataset": str(source.resolve()), "tokenizer": str(tok_dir.resolve()), "column": column,
         "documents": documents, "tokens": int(len(tokens)), "seq_len": seq_len,
         "sequences": int(len(tokens) // (seq_len + 1))}, indent=2) + "\n", what="dataset cache")
    return target


def _fingerprint(path: Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.relative_to(path) if path.is_dir() else p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
            for p in files]


def _tokenize(source: Path, tok_dir: Path, seq_len: int, cache_root: Path) -> tuple[np.ndarray, int, str]:
    """(packed ids, number of documents, text column) of `source` (see `prepare_dataset`)."""
    table = _load_table(source, cache_root)
    column = _text_column(table, source)
    tok = _load_tokenizer(tok_dir)
    end = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    pieces: list[np.ndarray] = []
    chunk = 1000
    for start in range(0, len(table), chunk):
        texts = [t for t in table[start:start + chunk][column] if t]
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray(ids + ([end] if end is not None else []), dtype=np.int64))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    span = seq_len + 1
    if len(stream) < span:
        raise SoapError(f"--dataset {source}: {len(stream)} tokens, fewer than one sequence of {span} "
                        f"(the plan's seq_len {seq_len} + 1)")
    stream = stream[:len(stream) // span * span]
    dtype = np.uint16 if int(stream.max()) < 2**16 else np.int32
    return stream.astype(dtype), len(table), column


def _load_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise SoapError(f"--tokenizer {tok_dir}: cannot load a tokenizer there ({reason})") from None


def _load_table(source: Path, cache_root: Path):
    try:
        import datasets
    except ImportError:
        raise SoapError("--dataset needs the `datasets` package: pip install -e '.[data]' in the soap checkout "
                        "(`soap` on PyPI is another project), or pip install 'datasets>=3'; or pre-tokenize to "
                        "a .npy and pass --data") from None
    datasets.disable_progress_bars()
    if source.is_dir() and ((source / "dataset_info.json").is_file() or (source / "dataset_dict.json").is_file()):
        loaded = datasets.load_from_disk(str(source))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded and len(loaded) != 1:
                raise SoapError(f"--dataset {source}: splits {sorted(loaded)}, none named train; "
                                "save the split to train on alone")
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        return loaded
    files = sorted(p for p in source.rglob("*") if p.suffix in DATASET_FILES) if source.is_dir() else [source]
    builders = {DATASET_FILES.get(p.suffix) for p in files}
    if not files or None in builders:
        raise SoapError(f"--dataset {source}: need a dataset saved with `save_to_disk`, or "
                        f"{'/'.join(sorted(DATASET_FILES))} files")
    if len(builders) > 1:
        raise SoapError(f"--dataset {source}: mixes {' and '.join(sorted(builders))} files; keep one format")
    return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train",
                                 cache_dir=str(cache_root / "hf"))


def _text_column(table, source: Path) -> str:
    columns = [name for name, feature in table.features.items()
               if getattr(feature, "dtype", None) in ("string", "large_string")]
    if "text" in columns:
        return "text"
    if len(columns) == 1:
        return columns[0]
    raise SoapError(f"--dataset {source}: no `text` column and {len(columns)} string columns "
                    f"({', '.join(columns) or 'none'}); rename the one to train on to `text`")
