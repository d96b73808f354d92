"""GGUF files: the same weights for llama.cpp, and the original quantized values for us.

`write_f32_gguf(src, dst)` de-quantizes every tensor of a GGUF file and writes them as F32
with the same metadata (tokenizer, chat template, hyper-parameters). Our own fp32 copy of
the default target (`default.convert_gguf`) is the same de-quantization, so llama.cpp on the
F32 file and blockdraft in fp32 run identical weights: the peer comparison in `blockdraft
bench --methods llamacpp` is like for like. `default_f32_gguf()` makes that file once for the
default target, next to its converted folder.

`quantized_blocks(src)` reads the Q4_1 / Q8_0 tensors as their integer values and group
scales (and minimums), in our parameter names and layout, for the quantized weight path
(`blockdraft.models.quant`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import BlockdraftError
from .default import DEFAULT_TARGET_NAME, cache_home, gguf_path


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a core dependency
        raise BlockdraftError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


@contextlib.contextmanager
def gguf_file(dst: Path, arch: str):
    """A GGUFWriter for `dst`: written under a temporary name next to it and renamed into place
    when the block ends (nothing is left behind on an error)."""
    gguf = _gguf()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def copy_fields(reader, writer, keep=lambda name: True):
    """Copy the metadata fields of GGUF `reader` whose names `keep` accepts into `writer`
    (never the header fields or the architecture, which the writer adds itself)."""
    gguf = _gguf()
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or not keep(name):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write_f32_gguf(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """De-quantize every tensor of GGUF `src` to F32 into `dst` (same metadata, file type F32).
    Written under a temporary name and renamed into place."""
    gguf = _gguf()
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise BlockdraftError(f"GGUF file not found: {src}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    with gguf_file(dst, arch) as writer:
        copy_fields(reader, writer, lambda name: name != "general.file_type")
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        tensors = reader.tensors
        if progress:
            from tqdm import tqdm

            tensors = tqdm(tensors, desc=f"writing {dst.name}", unit="tensor", file=sys.stderr)
        for t in tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            writer.add_tensor(t.name, np.ascontiguousarray(data))
    return dst


def default_f32_gguf() -> Path:
    """The default target as an F32 GGUF (the weights blockdraft runs in fp32), made once."""
    dst = cache_home() / "targets" / f"{DEFAULT_TARGET_NAME}.F32.gguf"
    if not dst.is_file():
        print(f"blockdraft: writing the default target's F32 GGUF to {dst} (once)...", file=sys.stderr, flush=True)
        write_f32_gguf(gguf_path(), dst)
    return dst


def gguf_tensor_type(path: str | Path) -> str:
    """'F32', 'Q4_1', ...: the type of most of a GGUF file's 2-D tensors (for reports)."""
    from collections import Counter

    reader = _gguf().GGUFReader(str(path))
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else "?"
