"""The target's context features cached on disk, so that epochs after the first skip the target.

A training step spends most of its time in the frozen target's forward (on the default target
on a 2-core CPU, 70% of a DFlash step and 82% of an EAGLE-3 step; README, "Training"), and that
forward gives the same features for a sample every epoch. With a cache, the first time a sample is trained on its features (the captured
layers, concatenated) are written to disk in float16; later steps read them back instead. The
drafter always trains on the float16-rounded features, computed or read, so a run trains the
same way whether the cache was empty or full.

Layout of a cache folder: `meta.json` (the target's fingerprint, the captured layers, the
feature width), and per writer (training process R: `rankR`; `data regenerate`: `regen`)
`features-NAME.bin` (float16 rows appended) with `index-NAME.jsonl` (one line per sample: its
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
    h.update(json.dumps(target.config.to_dict() if hasattr(target.config, "to_dict") else vars(target.config),
                        sort_keys=True, default=str).encode())
    for p in (target.model.embed_tokens.weight, next(target.model.layers[-1].parameters())):
        h.update(p.detach().float().flatten()[:65536].cpu().numpy().tobytes())
    return h.hexdigest()


class FeatureCache:
    def __init__(self, folder: str | Path, target, layer_ids, rank: int = 0, writer: str | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layers = tuple(int(i) for i in layer_ids)
        self.width = len(layer_ids) * target.config.hidden_size
        meta = {"format": 1, "target": target_fingerprint(target), "layers": [int(i) for i in layer_ids],
                "width": self.width, "dtype": "float16"}
        path = self.folder / "meta.json"
        if path.is_file():
            have = json.loads(path.read_text())
            if have != meta:
                what = [k for k in meta if have.get(k) != meta[k]]
                raise BlockdraftError(f"--feature-cache {self.folder}: made for another {' and '.join(what)}; "
                                      "use an empty folder")
        else:
            path.write_text(json.dumps(meta, indent=2) + "\n")
        self.index: dict[str, tuple[str, int, int]] = {}  # key -> (file name, byte offset, rows)
        self._read_upto: dict[Path, int] = {}  # index file -> bytes of it read so far
        self._refresh()
        name = writer or f"rank{rank}"
        self._data_name = f"features-{name}.bin"
        self._data = open(self.folder / self._data_name, "ab")
        index = self.folder / f"index-{name}.jsonl"
        torn = index.is_file() and index.stat().st_size and not index.read_bytes().endswith(b"\n")
        self._index = open(index, "a")
        if torn:  # a line cut short by a crash: the next ones start on their own line
            self._index.write("\n")
        self._readers: dict[str, int] = {}
        self.hits = self.misses = 0

    def _refresh(self):
        """Read the index lines written since the last look (other training processes' too)."""
        for index in sorted(self.folder.glob("index-*.jsonl")):
            data = index.name.replace("index-", "features-").replace(".jsonl", ".bin")
            size = (self.folder / data).stat().st_size if (self.folder / data).is_file() else 0
            with open(index, "rb") as f:
                f.seek(self._read_upto.get(index, 0))
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next look
            self._read_upto[index] = self._read_upto.get(index, 0) + len(whole)
            for line in whole.decode().splitlines():
                try:
                    key, offset, rows = json.loads(line)
                except (ValueError, TypeError):
                    continue  # a line torn by a crash
                if offset + rows * self.width * 2 <= size:
                    self.index[key] = (data, offset, rows)

    def __len__(self) -> int:
        return len(self.index)

    def get(self, keys: list[str], width: int, device, dtype=torch.float32) -> tuple[torch.Tensor, list[int]]:
        """Features [len(keys), width, self.width] as `dtype` on `device` (zeros past each
        stored sequence and in the rows not cached), and the indices of the keys not cached."""
        if not all(k in self.index for k in keys):
            self._refresh()  # another process may have stored them since
        missing = [i for i, k in enumerate(keys) if k not in self.index]
        if missing:
            self.misses += 1
        else:
            self.hits += 1
        out = torch.zeros(len(keys), width, self.width, dtype=torch.float16)
        for row, key in enumerate(keys):
            if key not in self.index:
                continue
            name, offset, rows = self.index[key]
            fd = self._readers.get(name)
            if fd is None:
                self._data.flush()
                fd = self._readers[name] = os.open(self.folder / name, os.O_RDONLY)
            raw = os.pread(fd, rows * self.width * 2, offset)
            rows = min(rows, width)
            out[row, :rows] = torch.frombuffer(bytearray(raw), dtype=torch.float16).view(-1, self.width)[:rows]
        return out.to(device=device, dtype=dtype), missing

    def bytes_needed(self, sequences) -> int:
        """What storing the features of `sequences` (token id lists) not cached yet adds to the cache."""
        return sum(len(seq) for seq in sequences if sequence_key(seq) not in self.index) * self.width * 2

    def check_space(self, sequences, reserve: int = 2**30) -> str | None:
        """Said before a run, not found out hours into it: None when the features of `sequences`
        not cached yet fit on the cache's disk with `reserve` bytes left free, else what happens
        instead (`put` stores them until the disk would keep only `reserve`; the rest are
        computed every time)."""
        need, free = self.bytes_needed(sequences), shutil.disk_usage(self.folder).free
        if need <= free - reserve:
            return None
        return (f"--feature-cache {self.folder}: the features of this run's samples need {need / 2**30:.1f} GiB "
                f"more and the disk has {free / 2**30:.1f} GiB free: it stores what fits ({max(0, free - reserve) / 2**30:.1f}"
                f" GiB, 1 GiB kept free), and the target runs for the other samples every epoch")

    def room(self, nbytes: int, reserve: int = 2**30) -> bool:
        """Whether `nbytes` more fit on the cache's disk with `reserve` bytes left free."""
        return shutil.disk_usage(self.folder).free - nbytes > reserve

    def put(self, keys: list[str], features: torch.Tensor, lengths: list[int]):
        """Store each row's first `lengths[i]` feature rows (float16) unless its key is cached, or
        the disk would keep less than 1 GiB free."""
        new = [(i, k) for i, k in enumerate(keys) if k not in self.index]
        if not new or not self.room(sum(int(lengths[i]) for i, _ in new) * self.width * 2):
            return  # (a full disk: these stay uncached, computed again when next needed)
        full = features.detach().float().cpu()
        for i, key in new:
            rows = int(lengths[i])
            if bool((full[i, :rows].abs() > FP16_MAX).any()):
                raise BlockdraftError("--feature-cache: the target's features exceed float16's range; "
                                      "train without the cache")
            offset = self._data.tell()
            self._data.write(full[i, :rows].half().numpy().tobytes())
            self._data.flush()
            self._index.write(json.dumps([key, offset, rows]) + "\n")
            self.index[key] = (self._data_name, offset, rows)
        self._index.flush()

    def close(self):
        self._data.close()
        self._index.close()
        for fd in self._readers.values():
            os.close(fd)
        self._readers = {}


class FeatureRecorder(Proposer):
    """Plain decoding (it proposes nothing) that keeps the target's features at `layers` for
    every position of every row: `data regenerate --feature-cache` stores them with each answer
    (`pop`), so that training need not run the target over those samples again.

    The rows' features live in one float16 buffer [rows, max_len, width]; the decode loop writes
    each forward's features at their positions (padding and frozen rows write junk past a row's
    end, never read), reorders the rows with the loop, and hands over a row when its sequence
    ends (`release`), before a later prefill can reuse the slot."""

    name = "ar"

    def __init__(self, layers, hidden_size: int):
        self.capture_layers = tuple(int(i) for i in layers)
        self.width = len(self.capture_layers) * hidden_size
        self.buf: torch.Tensor | None = None
        self.ended: dict = {}  # request key -> its row's features [max_len, width]

    def reset(self, batch, max_len):
        if self.buf is None or self.buf.shape[:2] != (batch, max_len):
            self.buf = torch.zeros(batch, max_len, self.width, dtype=torch.float16)
        self.ended = {}

    def observe(self, tokens, features, positions, rows=slice(None), valid=None):
        view = self.buf[rows]  # a view: writes land in the buffer
        at = positions.clamp(max=view.shape[1] - 1).cpu()
        # (indexed assignment: a float16 `scatter_` along the positions took ~1,000x longer on a CPU)
        view[torch.arange(view.shape[0])[:, None], at] = features.detach().to("cpu", torch.float16)

    def permute(self, order):
        permute_rows_(self.buf, order, dim=0)

    def release(self, row, key):
        self.ended[key] = self.buf[row].clone()

    def pop(self, key, length: int) -> torch.Tensor:
        """The first `length` positions' features [length, width] of the ended request `key`."""
        return self.ended.pop(key)[:length]
