"""Safetensors checkpoints read and written in pieces, never whole.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape and
byte range of its data) and the raw data. So a tensor kept as it is can be copied file to file by byte range
(the kernel's copy_file_range: no tensor in this process's memory at all), and a tensor that changes dtype is
converted a chunk of elements at a time (the conversion is elementwise). Memory stays a few chunks whatever
the model size. The files written follow transformers' sharded layout (`model-00001-of-00004.safetensors`
and `model.safetensors.index.json`), so `from_pretrained` and the hub read them as any sharded model.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from ..errors import SourceError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
CHUNK_BYTES = 16 * 2**20  # bytes per read when a tensor changes dtype (and per copy where the kernel cannot)
COPY_BYTES = 256 * 2**20  # bytes per kernel copy: the progress bar and the background flush advance this often


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str  # safetensors' name: BF16, F32...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of its data in the file
    nbytes: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def _corrupt(path: Path, why: str) -> SourceError:
    return SourceError(
        f"could not load the weights of {path.parent}: {path.name} ({why}). The file may be truncated or corrupt: "
        "re-download or re-export it."
    )


def read_header(path: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file, in the order of their data in the file."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(handle.read(length))
        file_size = path.stat().st_size
    except (OSError, ValueError, struct.error) as error:
        raise _corrupt(path, f"not a readable safetensors file: {error}") from error
    header.pop("__metadata__", None)
    data_start = 8 + length
    tensors = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise _corrupt(path, f"tensor {name} has the unknown dtype {info['dtype']}")
        if data_start + end > file_size:
            raise _corrupt(path, f"tensor {name} lies past the end of the file")
        tensors.append(StoredTensor(name, info["dtype"], tuple(info["shape"]), path, data_start + begin, end - begin))
    return sorted(tensors, key=lambda t: t.start)


def checkpoint_files(folder: Path) -> list[Path] | None:
    """The safetensors files of a model folder (from its index when sharded), or None when it has none."""
    index = folder / SAFETENSORS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise SourceError(f"{index} is not a valid safetensors index ({error}); re-download the model.") from error
        files = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in files if not (folder / name).is_file()]
        if missing:
            raise SourceError(
                f"{folder} is incomplete: its index names {', '.join(missing)}, which is missing. Re-download the model."
            )
        return [folder / name for name in files]
    single = folder / SAFETENSORS_SINGLE_FILE
    return [single] if single.is_file() else None


def checkpoint_tensors(files: Iterable[Path]) -> list[StoredTensor]:
    """Every tensor of a checkpoint, file by file, each file in data order (the order a copy reads fastest)."""
    tensors, seen = [], set()
    for path in files:
        for tensor in read_header(path):
            if tensor.name in seen:
                raise SourceError(
                    f"tensor {tensor.name} appears twice in the checkpoint ({path}); re-export the model."
                )
            seen.add(tensor.name)
            tensors.append(tensor)
    return tensors


@dataclass(frozen=True)
class OutputTensor:
    """A tensor to write: copied (or re-dtyped) from a stored tensor, given in memory (a small new one), or
    computed when its turn comes to be written (LOAD: a GGUF tensor dequantised), then dropped."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: StoredTensor | None = None
    value: torch.Tensor | None = None
    load: Callable[[], torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPES[self.dtype].itemsize

    @staticmethod
    def stored(tensor: StoredTensor, dtype: torch.dtype | None = None) -> OutputTensor:
        """TENSOR as it is, or re-dtyped to DTYPE when it is a floating-point tensor of another dtype."""
        name = tensor.dtype
        if dtype is not None and DTYPES[tensor.dtype].is_floating_point:
            name = DTYPE_NAMES[dtype]
        return OutputTensor(tensor.name, name, tensor.shape, source=tensor)

    @staticmethod
    def new(name: str, value: torch.Tensor) -> OutputTensor:
        return OutputTensor(name, DTYPE_NAMES[value.dtype], tuple(value.shape), value=value.detach().contiguous())


def plan_shards(tensors: list[OutputTensor], max_shard_size: int) -> list[list[OutputTensor]]:
    """Consecutive groups of at most MAX_SHARD_SIZE bytes, in the given order (so a copy reads each input
    file front to back); a tensor larger than the limit gets a shard of its own, as in transformers."""
    shards: list[list[OutputTensor]] = []
    size = 0
    for tensor in tensors:
        if not shards or (shards[-1] and size + tensor.nbytes > max_shard_size):
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def _header_bytes(tensors: list[OutputTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _write_all(target: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(target, view) :]


def _copy_range(source: int, target: int, start: int, count: int, advance: Callable[[int], None]) -> None:
    """COUNT bytes of SOURCE from START appended to TARGET: in the kernel where it can (no user-space copy)."""
    copy_range = getattr(os, "copy_file_range", None)
    while count > 0 and copy_range is not None:
        try:
            done = copy_range(source, target, min(count, COPY_BYTES), start)
        except OSError:  # another filesystem, or not supported here: plain reads below
            break
        if done == 0:
            raise SourceError("unexpected end of file while copying a tensor (file truncated while being read?)")
        start, count = start + done, count - done
        advance(done)
    if count > 0:
        buffer = bytearray(min(count, CHUNK_BYTES))
        while count > 0:
            view = memoryview(buffer)[: min(count, len(buffer))]
            read = os.preadv(source, [view], start)
            if read == 0:
                raise SourceError("unexpected end of file while copying a tensor (file truncated while being read?)")
            _write_all(target, view[:read])
            start, count = start + read, count - read
            advance(read)


def _convert_range(
    source: int, target: int, tensor: StoredTensor, dtype: torch.dtype, advance: Callable[[int], None]
) -> None:
    """A stored tensor re-dtyped a chunk of elements at a time (dtype conversion is elementwise)."""
    stored = DTYPES[tensor.dtype]
    per_chunk = max(1, min(CHUNK_BYTES // stored.itemsize, tensor.numel))
    buffer = bytearray(per_chunk * stored.itemsize)  # both buffers reused chunk after chunk
    converted = torch.empty(per_chunk, dtype=dtype)
    done = 0
    while done < tensor.numel:
        count = min(per_chunk, tensor.numel - done)
        view = memoryview(buffer)[: count * stored.itemsize]
        if os.preadv(source, [view], tensor.start + done * stored.itemsize) != len(view):
            raise SourceError(f"{tensor.file} ended inside tensor {tensor.name} (truncated?); re-download the model.")
        chunk = converted[:count]
        chunk.copy_(torch.frombuffer(view, dtype=stored, count=count))  # the rounding of .to(dtype)
        _write_all(target, chunk.view(torch.uint8).numpy())
        advance(chunk.nbytes)
        done += count


class _Writeback:
    """Flushes a file being written to disk on a thread, while the copy goes on. The folder is fsynced before
    it is published; flushing as the bytes arrive overlaps that disk write with the copy instead of waiting
    for all of it at the end."""

    def __init__(self, path: Path):
        self.path, self.pending = path, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="attnres-writeback", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.pending.get():
            try:
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
                finally:
                    os.close(fd)
            except OSError:
                pass  # an error here shows again in the fsync before publishing, which reports it

    def kick(self) -> None:
        if self.pending.empty():
            self.pending.put(True)

    def close(self) -> None:
        self.pending.put(False)
        self.thread.join()


class _ShardWriter:
    """Appends tensors to one open file descriptor. Plain writes and kernel copies go through the same fd,
    so there is no user-space buffer to fall out of order; runs of tensors that lie back to back in one
    input file, with their dtype kept, become a single copy."""

    def __init__(self, target: int, path: Path, advance: Callable[[int], None]):
        self.target, self.report = target, advance
        self.inputs: dict[Path, int] = {}
        self.run: list[int] = []  # fd, start, count of the pending contiguous copy
        self.writeback = _Writeback(path)
        self.unflushed = 0

    def advance(self, nbytes: int) -> None:
        self.unflushed += nbytes
        if self.unflushed >= COPY_BYTES:
            self.writeback.kick()
            self.unflushed = 0
        self.report(nbytes)

    def input(self, path: Path) -> int:
        if path not in self.inputs:
            self.inputs[path] = os.open(path, os.O_RDONLY)
        return self.inputs[path]

    def flush(self) -> None:
        if self.run:
            fd, start, count = self.run
            _copy_range(fd, self.target, start, count, self.advance)
            self.run = []

    def add(self, tensor: OutputTensor) -> None:
        stored = tensor.source
        if stored is None:
            self.flush()
            value = tensor.value if tensor.value is not None else tensor.load()
            if tuple(value.shape) != tensor.shape or value.dtype != DTYPES[tensor.dtype]:
                raise SourceError(
                    f"tensor {tensor.name} came out as {value.dtype} {list(value.shape)}, not the {tensor.dtype} "
                    f"{list(tensor.shape)} the shard's header announced: convert with --no-stream and report it."
                )
            _write_all(self.target, value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            self.advance(tensor.nbytes)
            return
        fd = self.input(stored.file)
        if stored.dtype != tensor.dtype:
            self.flush()
            _convert_range(fd, self.target, stored, DTYPES[tensor.dtype], self.advance)
        elif self.run and self.run[0] == fd and self.run[1] + self.run[2] == stored.start:
            self.run[2] += stored.nbytes
        else:
            self.flush()
            self.run = [fd, stored.start, stored.nbytes]

    def close(self) -> None:
        self.writeback.close()
        for fd in self.inputs.values():
            os.close(fd)


def write_shard(path: Path, tensors: list[OutputTensor], advance: Callable[[int], None] = lambda nbytes: None) -> None:
    """One safetensors file: the header, then each tensor's bytes, streamed."""
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    writer = _ShardWriter(target, path, advance)
    try:
        _write_all(target, _header_bytes(tensors))
        for tensor in tensors:
            writer.add(tensor)
        writer.flush()
    finally:
        try:
            writer.close()
        finally:
            os.close(target)


def write_index(folder: Path, weight_map: dict[str, str], total_size: int, total_parameters: int) -> Path:
    """model.safetensors.index.json, written last and renamed into place: a folder whose index exists has
    every shard the index names."""
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path = folder / SAFETENSORS_INDEX_FILE
    partial = folder / f".{SAFETENSORS_INDEX_FILE}.partial"
    partial.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)
    return path


def write_sharded(
    folder: Path,
    shards: list[list[OutputTensor]],
    advance: Callable[[int], None] = lambda nbytes: None,
    last: Callable[[], list[OutputTensor]] | None = None,
) -> dict[str, str]:
    """Write SHARDS as model-0000i-of-0000N.safetensors and the index; returns the weight map. LAST, when
    given, is called once SHARDS are written and returns one more shard, the last: tensors known only after
    work that ran while the others were copied."""
    names = shard_names(len(shards) + (last is not None))
    weight_map: dict[str, str] = {}
    written: list[OutputTensor] = []

    def write(name: str, tensors: list[OutputTensor]) -> None:
        write_shard(folder / name, tensors, advance)
        weight_map.update({tensor.name: name for tensor in tensors})
        written.extend(tensors)

    for name, tensors in zip(names, shards):
        write(name, tensors)
    if last is not None:
        write(names[-1], last())
    total_size = sum(tensor.nbytes for tensor in written)
    total_parameters = sum(tensor.nbytes // DTYPES[tensor.dtype].itemsize for tensor in written)
    write_index(folder, weight_map, total_size, total_parameters)
    return weight_map


class NotStreamable(Exception):
    """The checkpoint cannot be streamed (the message says why): convert it in memory instead."""
