"""The target's context features cached on disk, so that epochs after the first skip the target.

A training step spends most of its time in the frozen target's forward (on the default target
on a 2-core CPU, 70% of a DFlash step and 82% of an EAGLE-3 step; README, "Training"), and that
forward gives the same features for a sample every epoch.
With a cache, the first time a sample is trained on its features (the captured
layers, concatenated) are written to disk in float16, or in int8 with a float32 scale per
position and layer (`--feature-dtype int8`: half the disk); later steps read them back instead.
The drafter always trains on the rounded features as stored, computed or read, so a run trains
the same way whether the cache was empty or full.

Layout of a cache folder: `meta.json` (the target's fingerprint, the captured layers, the
feature width, the default dtype), and per writer (training process R: `rankR`; `data
regenerate`: `regen`) `features-NAME.bin` (records appended: float16 rows, or int8 rows then
their scales, the index line saying "int8") with `index-NAME.jsonl` (one line per sample: its
key, byte offset, row count; a line is written only once its rows are on disk; a process that
misses a sample first reads the lines the others wrote since, so under DDP each sample is
computed once). A sample's key is a hash of its token ids, so the cache serves any data folders,
sample limits and orders that contain the same sequences; a cache built for another target or
other layers is refused.

`data regenerate --feature-cache` fills the cache while it answers (`FeatureRecorder`): the
target computes every position's features as it decodes, so storing them spares the first
epoch the target's forward for those samples. They come from the decode loop's forwards
(prefill, then one token at a time) instead of one forward over the whole sequence: the same
model's features, equal up to floating-point rounding (tested), and every position but the last
(whose features no anchor's context reaches).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from ..errors import BlockdraftError
from ..models.layers import permute_rows_
from ..proposers import Proposer

FP16_MAX = 65504.0


def sequence_key(tokens) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


def target_fingerprint(target) -> str:
    """A hash of the target's config and of a slice of its embedding and of its last layer's weights."""
    h = hashlib.blake2b(digest_size=16)
    h.update(
        json.dumps(
            target.config.to_dict() if hasattr(target.config, "to_dict") else vars(target.config),
            sort_keys=True,
            default=str,
        ).encode()
    )
    for p in (target.model.embed_tokens.weight, next(target.model.layers[-1].parameters())):
        h.update(p.detach().float().flatten()[:65536].cpu().numpy().tobytes())
    return h.hexdigest()


FEATURE_DTYPES = ("float16", "int8")
# Bytes the cache leaves free on its disk: a full epoch of the default data in int8 is ~60 GB, and the
# machine it fills also builds llama.cpp, clones the repository (~6 GB with a test run) and commits.
RESERVE = 16 * 2**30


def quantize(features: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 features [..., width] and a float32 scale per position and captured layer [..., width
    / hidden]: each layer's values at a position divided by its largest magnitude / 127, rounded
    (the target's massive activations, up to ~25,000 on the default target, stay in their own
    layer's scale)."""
    x = features.detach().float().unflatten(-1, (-1, hidden))
    scales = x.abs().amax(-1).clamp(min=1e-30) / 127.0
    q = torch.round(x / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 features from `quantize`'s int8 values and scales."""
    return (q.float().unflatten(-1, (scales.shape[-1], -1)) * scales[..., None]).flatten(-2)


TEACHER_TOPK = 32  # the target's likeliest tokens kept per position for soft labels (on the default
# target's answers they hold 94-96% of its probability, 91-94% at 16: benchmarks/label_agreement.py)


def teacher_bytes(rows: int, k: int = TEACHER_TOPK) -> int:
    """The stored size of `rows` positions' top-`k` tokens: an int32 id and a float16 log-probability each."""
    return rows * k * 6


class _Store:
    """One kind of per-sample record in a cache folder: per writer NAME, `DATA-NAME.bin` (records
    appended) and `INDEX-NAME.jsonl`, one line [key, byte offset, rows, *extra] per record, written
    once its bytes are on disk. `nbytes(rows, extra)`: a record's size. Reads the lines other
    processes append (`refresh`), skips a line torn by a crash."""

    def __init__(self, folder: Path, data: str, index: str, writer: str | None, nbytes):
        self.folder, self._data_prefix, self._index_prefix, self.nbytes = folder, data, index, nbytes
        self.index: dict[str, tuple] = {}  # key -> (data file name, byte offset, rows, extra)
        self._read_upto: dict[Path, int] = {}  # index file -> bytes of it read so far
        self.refresh()
        self._readers: dict[str, int] = {}
        self._data = self._index = None
        if writer is None:  # read only
            return
        self._data_name = f"{data}-{writer}.bin"
        self._data = open(folder / self._data_name, "ab")
        path = folder / f"{index}-{writer}.jsonl"
        torn = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self._index = open(path, "a")
        if torn:  # a line cut short by a crash: the next ones start on their own line
            self._index.write("\n")

    def refresh(self):
        """Read the index lines written since the last look (other processes' too)."""
        for index in sorted(self.folder.glob(f"{self._index_prefix}-*.jsonl")):
            data = f"{self._data_prefix}-{index.name[len(self._index_prefix) + 1 : -len('.jsonl')]}.bin"
            size = (self.folder / data).stat().st_size if (self.folder / data).is_file() else 0
            with open(index, "rb") as f:
                f.seek(self._read_upto.get(index, 0))
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
            self._read_upto[index] = self._read_upto.get(index, 0) + len(whole)
            for line in whole.decode().splitlines():
                try:
                    key, offset, rows, *extra = json.loads(line)
                    if offset + self.nbytes(rows, extra) <= size:
                        self.index[key] = (data, offset, rows, tuple(extra))
                except (ValueError, TypeError):
                    continue  # a line torn by a crash

    def has_all(self, keys) -> bool:
        if not all(k in self.index for k in keys):
            self.refresh()  # another process may have stored them since
        return all(k in self.index for k in keys)

    def append(self, key: str, raw: bytes, rows: int, *extra):
        offset = self._data.tell()
        self._data.write(raw)
        self._data.flush()
        self._index.write(json.dumps([key, offset, rows, *extra]) + "\n")
        self._index.flush()
        self.index[key] = (self._data_name, offset, rows, tuple(extra))

    def read(self, key: str) -> tuple[bytes, int, tuple]:
        name, offset, rows, extra = self.index[key]
        fd = self._readers.get(name)
        if fd is None:
            if self._data is not None:
                self._data.flush()
            fd = self._readers[name] = os.open(self.folder / name, os.O_RDONLY)
        return os.pread(fd, self.nbytes(rows, extra), offset), rows, extra

    def close(self):
        for f in (self._data, self._index):
            if f is not None:
                f.close()
        for fd in self._readers.values():
            os.close(fd)
        self._readers = {}


class FeatureCache:
    """Per sample: the target's features at the captured layers (`get` / `put`) and, for soft
    labels, its TEACHER_TOPK likeliest next tokens with their log-probabilities at every answer
    position (`get_teacher` / `put_teacher`: files `teacher-NAME.bin`, `teacher-index-NAME.jsonl`)."""

    def __init__(
        self,
        folder: str | Path,
        target,
        layer_ids,
        rank: int = 0,
        writer: str | None = None,
        dtype: str | None = None,
        readonly: bool = False,
        reserve: int | None = None,
    ):
        """`dtype`: how this process stores features, "float16" or "int8" (FEATURE_DTYPES); default:
        the folder's (`meta.json`, float16 for a new one). A folder holds records of both.
        `readonly`: it reads the folder and never writes to it. `reserve`: bytes it leaves free
        on its disk (default `RESERVE`)."""
        self.folder = Path(folder)
        self.reserve = RESERVE if reserve is None else int(reserve)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layers = tuple(int(i) for i in layer_ids)
        self.hidden = target.config.hidden_size
        self.width = len(layer_ids) * self.hidden
        if dtype is not None and dtype not in FEATURE_DTYPES:
            raise BlockdraftError(f"--feature-dtype must be one of {', '.join(FEATURE_DTYPES)}, not {dtype!r}")
        meta = {
            "format": 1,
            "target": target_fingerprint(target),
            "layers": [int(i) for i in layer_ids],
            "width": self.width,
            "dtype": dtype or "float16",
        }
        path = self.folder / "meta.json"
        if path.is_file():
            have = json.loads(path.read_text())
            what = [k for k in meta if k != "dtype" and have.get(k) != meta[k]]
            if what:
                raise BlockdraftError(
                    f"--feature-cache {self.folder}: made for another {' and '.join(what)}; use an empty folder"
                )
            meta["dtype"] = dtype or have.get("dtype", "float16")
        else:
            path.write_text(json.dumps(meta, indent=2) + "\n")
        self.dtype = meta["dtype"]
        name = None if readonly else writer or f"rank{rank}"
        self._features = _Store(self.folder, "features", "index", name, self._record_bytes)
        # teacher records: int32 ids [rows, k] then float16 log-probabilities [rows, k]; extra (start, k)
        self._teacher = _Store(
            self.folder, "teacher", "teacher-index", name, lambda rows, extra: teacher_bytes(rows, extra[1])
        )
        self.index = self._features.index
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.index)

    def get(self, keys: list[str], width: int, device, dtype=torch.float32) -> tuple[torch.Tensor, list[int]]:
        """Features [len(keys), width, self.width] as `dtype` on `device` (zeros past each
        stored sequence and in the rows not cached), and the indices of the keys not cached."""
        self._features.has_all(keys)
        missing = [i for i, k in enumerate(keys) if k not in self.index]
        if missing:
            self.misses += 1
        else:
            self.hits += 1
        out = torch.zeros(len(keys), width, self.width)
        for row, key in enumerate(keys):
            if key not in self.index:
                continue
            raw, rows, extra = self._features.read(key)
            n = min(rows, width)
            if extra[:1] == ("int8",):
                data = np.frombuffer(raw, dtype=np.uint8)
                q = torch.from_numpy(data[: rows * self.width].view(np.int8).reshape(rows, self.width)[:n].copy())
                scales = torch.from_numpy(data[rows * self.width :].view(np.float32).reshape(rows, -1)[:n].copy())
                out[row, :n] = dequantize(q, scales)
            else:
                out[row, :n] = torch.frombuffer(bytearray(raw), dtype=torch.float16).view(-1, self.width)[:n].float()
        return out.to(device=device, dtype=dtype), missing

    def _record_bytes(self, rows: int, extra) -> int:
        if tuple(extra)[:1] == ("int8",):  # int8 values, then a float32 scale per position and layer
            return rows * (self.width + 4 * len(self.layers))
        return rows * self.width * 2

    @property
    def _extra(self) -> tuple:
        """The index-line fields of the feature records this process writes."""
        return ("int8",) if self.dtype == "int8" else ()

    def sample_bytes(self, rows: int, answer_rows: int = 0) -> int:
        """What one sample adds: `rows` feature rows as this process stores them, and the top tokens
        of `answer_rows` positions."""
        return self._record_bytes(rows, self._extra) + teacher_bytes(answer_rows)

    def round(self, features: torch.Tensor) -> torch.Tensor:
        """`features` as this process stores them and reads them back (float32): what training
        uses for computed features too, so that a run trains the same whether they were cached."""
        if self.dtype == "int8":
            return dequantize(*quantize(features, self.hidden))
        return features.detach().half().float()

    def get_teacher(self, keys: list[str], width: int, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """For soft labels: ids [len(keys), width, TEACHER_TOPK] (long; -1 where nothing is stored)
        and log-probabilities [same] (float32) of the target's likeliest next tokens at each
        position, and the indices of the keys with none stored."""
        self._teacher.has_all(keys)
        ids = torch.full((len(keys), width, TEACHER_TOPK), -1, dtype=torch.long)
        logp = torch.zeros(len(keys), width, TEACHER_TOPK)
        missing = []
        for row, key in enumerate(keys):
            if key not in self._teacher.index:
                missing.append(row)
                continue
            raw, rows, (start, k) = self._teacher.read(key)
            data = np.frombuffer(raw, dtype=np.uint8)
            got_ids = torch.from_numpy(data[: rows * k * 4].view(np.int32).reshape(rows, k).astype(np.int64))
            got_lp = torch.from_numpy(data[rows * k * 4 :].view(np.float16).reshape(rows, k).astype(np.float32))
            n, k = max(0, min(rows, width - start)), min(k, TEACHER_TOPK)
            ids[row, start : start + n, :k] = got_ids[:n, :k]
            logp[row, start : start + n, :k] = got_lp[:n, :k]
        return ids.to(device), logp.to(device), missing

    def put_teacher(self, key: str, ids: torch.Tensor, logp: torch.Tensor, start: int):
        """Store one sample's top tokens ids [rows, k] and log-probabilities [rows, k] for positions
        start..start+rows-1 (unless stored, or the disk would keep less than its reserve free)."""
        rows, k = ids.shape
        if key in self._teacher.index or not self.room(teacher_bytes(rows, k)):
            return
        raw = (
            ids.detach().cpu().to(torch.int32).numpy().tobytes()
            + logp.detach().float().clamp(min=-FP16_MAX).cpu().half().numpy().tobytes()
        )
        self._teacher.append(key, raw, rows, int(start), k)

    def bytes_needed(self, sequences, answer_starts=None) -> int:
        """What storing the features of `sequences` (token id lists) not cached yet adds to the
        cache, and with `answer_starts` (soft labels) the top tokens of their answers not stored yet."""
        keys = [sequence_key(seq) for seq in sequences]
        need = sum(
            self.sample_bytes(len(seq)) for seq, key in zip(sequences, keys, strict=False) if key not in self.index
        )
        if answer_starts is not None:
            need += teacher_bytes(
                sum(
                    len(seq) - start
                    for seq, start, key in zip(sequences, answer_starts, keys, strict=False)
                    if key not in self._teacher.index
                )
            )
        return need

    def check_space(self, sequences, reserve: int | None = None, answer_starts=None) -> str | None:
        """Said before a run, not found out hours into it: None when the features of `sequences`
        not cached yet (and with `answer_starts` their top tokens) fit on the cache's disk with
        `reserve` bytes left free, else what happens instead (`put` stores them until the disk
        would keep only `reserve`; the rest are computed every time)."""
        reserve = self.reserve if reserve is None else reserve
        need, free = self.bytes_needed(sequences, answer_starts), shutil.disk_usage(self.folder).free
        if need <= free - reserve:
            return None
        return (
            f"--feature-cache {self.folder}: the features of this run's samples need {need / 2**30:.1f} GiB "
            f"more and the disk has {free / 2**30:.1f} GiB free: it stores what fits "
            f"({max(0, free - reserve) / 2**30:.1f}"
            f" GiB, {reserve / 2**30:.0f} GiB kept free), and the target runs for the other samples every epoch"
        )

    def room(self, nbytes: int, reserve: int | None = None) -> bool:
        """Whether `nbytes` more fit on the cache's disk with `reserve` bytes (default: the cache's) left free."""
        return shutil.disk_usage(self.folder).free - nbytes > (self.reserve if reserve is None else reserve)

    def put(self, keys: list[str], features: torch.Tensor, lengths: list[int]):
        """Store each row's first `lengths[i]` feature rows (in `self.dtype`) unless its key is
        cached, or the disk would keep less than its reserve free."""
        new = [(i, k) for i, k in enumerate(keys) if k not in self.index]
        extra = self._extra
        if not new or not self.room(sum(self.sample_bytes(int(lengths[i])) for i, _ in new)):
            return  # (a full disk: these stay uncached, computed again when next needed)
        full = features.detach().float().cpu()
        for i, key in new:
            rows = int(lengths[i])
            if extra:
                q, scales = quantize(full[i, :rows], self.hidden)
                self._features.append(key, q.numpy().tobytes() + scales.numpy().tobytes(), rows, *extra)
                continue
            if bool((full[i, :rows].abs() > FP16_MAX).any()):
                raise BlockdraftError(
                    "--feature-cache: the target's features exceed float16's range; "
                    "train without the cache (or with --feature-dtype int8)"
                )
            self._features.append(key, full[i, :rows].half().numpy().tobytes(), rows)

    def close(self):
        self._features.close()
        self._teacher.close()


def top_tokens(logits: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's `k` (default TEACHER_TOPK) likeliest next tokens [..., k] and their
    log-probabilities [..., k] (float32) from its logits [..., V]: what soft labels are made of."""
    from ..models import native

    return native.top_logprobs(logits, k or TEACHER_TOPK)


class FeatureRecorder(Proposer):
    """Plain decoding (it proposes nothing) that keeps the target's features at `layers` for
    every position of every row, and with `teacher` its TEACHER_TOPK likeliest next tokens at
    every position it computed logits for (the prompt's last and every answer position):
    `data regenerate --feature-cache` stores them with each answer (`pop`), so that
    training need not run the target over those samples again, soft labels included.

    The rows' features live in one float16 buffer [rows, max_len, width] (the top tokens in
    [rows, max_len, k] buffers); the decode loop writes each forward's features at their positions
    (padding and frozen rows write junk past a row's end, never read), reorders the rows with the
    loop, and hands over a row when its sequence ends (`release`), before a later prefill can
    reuse the slot."""

    name = "ar"

    def __init__(self, layers, hidden_size: int, teacher: bool = True):
        self.capture_layers = tuple(int(i) for i in layers)
        self.width = len(self.capture_layers) * hidden_size
        self.teacher = teacher
        self.buf: torch.Tensor | None = None
        self.top_ids: torch.Tensor | None = None
        self.top_logp: torch.Tensor | None = None
        self.ended: dict = {}  # request key -> its row's (features, top ids, top log-probabilities)

    def reset(self, batch, max_len):
        if self.buf is None or self.buf.shape[:2] != (batch, max_len):
            self.buf = torch.zeros(batch, max_len, self.width, dtype=torch.float16)
            if self.teacher:
                self.top_ids = torch.zeros(batch, max_len, TEACHER_TOPK, dtype=torch.int32)
                self.top_logp = torch.zeros(batch, max_len, TEACHER_TOPK, dtype=torch.float16)
        self.ended = {}

    @staticmethod
    def _write(buf, values, positions, rows):
        view = buf[rows]  # a view: writes land in the buffer
        at = positions.clamp(max=view.shape[1] - 1).cpu()
        # (indexed assignment: a float16 `scatter_` along the positions took ~1,000x longer on a CPU)
        view[torch.arange(view.shape[0])[:, None], at] = values.detach().to("cpu", buf.dtype)

    def observe(self, tokens, features, positions, rows=slice(None), valid=None):
        self._write(self.buf, features, positions, rows)

    def observe_logits(self, logits, positions, rows=slice(None)):
        if self.teacher:
            ids, logp = top_tokens(logits)
            self._write(self.top_ids, ids, positions, rows)
            self._write(self.top_logp, logp.clamp(min=-FP16_MAX), positions, rows)

    def permute(self, order):
        for buf in (self.buf, self.top_ids, self.top_logp):
            if buf is not None:
                permute_rows_(buf, order, dim=0)

    def release(self, row, key):
        self.ended[key] = (
            self.buf[row].clone(),
            None if self.top_ids is None else (self.top_ids[row].clone(), self.top_logp[row].clone()),
        )

    def pop(self, key, length: int, start: int = 0):
        """The ended request `key`'s features at its first `length` positions [length, width], and
        its top tokens and their log-probabilities [length - start, k] at positions start..length-1
        (None without `teacher`); forgets the request."""
        features, top = self.ended.pop(key)
        return features[:length], None if top is None else (top[0][start:length], top[1][start:length])
