"""GGUF inputs converted tensor by tensor: each tensor dequantised when its turn comes to be written, then dropped.

transformers loads a GGUF of the older architectures (Llama, Mistral, Qwen2, Gemma...) with
`load_gguf_checkpoint`: every tensor dequantised by `gguf.quants.dequantize`, passed through the
architecture's tensor processor (Llama's q/k reverse permutation, Gemma's norm offset...) and renamed with
`get_gguf_hf_weights_map`. This module runs those same functions of transformers, one tensor at a time (the
names as get_gguf_hf_weights_map computes them, with gguf's name map built once), so the streamed folder
holds bit for bit what a load + save would. A GGUF that transformers converts some other
way (its newer weight-conversion pipeline, experts merged across tensors) raises NotStreamable, and `convert`
goes through memory instead.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig

from .shards import DTYPE_NAMES, NotStreamable, OutputTensor
from .sources import DTYPES as DTYPE_CHOICES

ROWS_BYTES = 4 * 2**20  # dequantise this many output bytes at a time: the dequantiser's temporaries stay small


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf's dequantize, a band of rows at a time into one output array: rows are quantised independently,
    so the values are those of a single call, without its several tensor-sized temporaries."""
    from gguf import dequantize

    if data.ndim < 2 or data.shape[0] < 2:
        return dequantize(data, qtype)
    first = dequantize(data[:1], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    per_band = max(1, ROWS_BYTES // max(1, first.nbytes))
    for start in range(0, data.shape[0], per_band):
        out[start : start + per_band] = dequantize(data[start : start + per_band], qtype)
    return out


def _release(data: np.ndarray, start: int) -> None:
    """Unmap the file pages a tensor was read from (at byte START of the file): they stay in the page cache, but
    no longer count in this process's resident memory, which so holds one tensor at a time however large the
    GGUF."""
    mapping = getattr(data, "_mmap", None)
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    aligned = start - start % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(mmap.MADV_DONTNEED, aligned, start + data.nbytes - aligned)


def _file_tensors(path: Path) -> tuple[str, list[tuple[str, np.ndarray, object, int]]]:
    """The GGUF's architecture and, in file order, each tensor's name, bytes (shaped as gguf's reader shapes
    them: rows of blocks), type and offset in the file. Read with transformers' GGUF header reader, which skips the vocabulary
    (gguf's GGUFReader parses every token string: seconds per read), or with GGUFReader where transformers has none."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ..transformers_compat import has, internal

    if not has("GgufHeader"):
        return _file_tensors_read_whole(path)
    try:
        header = internal("GgufHeader").from_file(str(path))
    except ValueError as error:  # a tensor type this reader does not know
        raise NotStreamable(str(error)) from error
    tensors = []
    for info, lazy in zip(header.tensors, internal("load_gguf_state_dict")(header).values()):
        qtype = GGMLQuantizationType(info.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        data = lazy.data.reshape(*info.shape[:-1], info.shape[-1] // block * block_bytes)
        tensors.append((info.name, data, qtype, header.data_start + info.offset))
    return header.architecture, tensors


def _file_tensors_read_whole(path: Path) -> tuple[str, list[tuple[str, np.ndarray, object, int]]]:
    """`_file_tensors` with gguf's GGUFReader (the whole header, vocabulary included), as transformers before
    its own header reader (5.17) reads a GGUF: the same tensors, bytes and offsets."""
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(path))
    except ValueError as error:  # a tensor type this gguf does not know
        raise NotStreamable(str(error)) from error
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    tensors = [(t.name, t.data, GGMLQuantizationType(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    return architecture, tensors


def _gguf_to_hf_names(model: torch.nn.Module, processor, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> transformers name, computed as transformers' get_gguf_hf_weights_map computes it
    (each module's state-dict names through gguf's name map, the processor's fallback for those it does
    not know, then the module's children, whose names never replace their parent's), with gguf's name map
    for the file's ARCHITECTURE built once: transformers builds it again for every module it recurses into
    (seconds for a model of a few hundred modules)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise NotStreamable(
            f"the installed gguf package does not name the tensors of GGUF architecture {architecture!r}"
        )
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)

    def names(module: torch.nn.Module, qual_name: str) -> dict[str, str]:
        mapping: dict[str, str] = {}
        for hf_name in module.state_dict():
            hf_name = processor.preprocess_name(hf_name)
            name, suffix = hf_name, ""
            if hf_name.endswith((".weight", ".bias")):
                name, suffix = hf_name.rsplit(".", 1)
                suffix = "." + suffix
            gguf_name = name_map.get_name(name)
            if gguf_name is None:
                processor.perform_fallback_tensor_mapping(mapping, suffix, qual_name, hf_name)
            else:
                mapping[gguf_name + suffix] = qual_name + hf_name
        for child_name, child in module.named_children():
            for gguf_name, hf_name in names(child, f"{qual_name}{child_name}.").items():
                mapping.setdefault(gguf_name, hf_name)
        return mapping

    return names(model, "")


def gguf_base_tensors(
    path: Path, config: PreTrainedConfig, dtype: str = "auto", trust_remote_code: bool = False
) -> list[OutputTensor]:
    """The GGUF's tensors under their transformers names, in file order, each computed when written: float32
    (the in-memory path's dtype for a GGUF) or DTYPE. NotStreamable when transformers would not load the file
    tensor by tensor."""
    from ..transformers_compat import TENSOR_PROCESSORS, TensorProcessor, has, internal

    architecture, file_tensors = _file_tensors(path)
    # Before transformers had the weight-conversion pipeline for GGUF (5.17), every architecture it loads goes tensor by tensor.
    if has("is_gguf_arch_supported") and internal("is_gguf_arch_supported")(architecture):
        raise NotStreamable(
            f"transformers converts GGUF architecture {architecture!r} with its weight-conversion pipeline"
        )
    # transformers hands the processor the config it parsed from the file; the config built from that parse
    # holds the same values (the head counts Llama's q/k permutation needs...).
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = _gguf_to_hf_names(model, processor, architecture)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    out_dtype = torch.float32 if dtype == "auto" else DTYPE_CHOICES[dtype]

    def loader(gguf_name: str, data: np.ndarray, qtype, start: int):
        def load() -> torch.Tensor:
            weights = _dequantize(data, qtype)
            _release(data, start)
            diverted: dict = {"tensors": {}}
            result = processor.process(
                weights=weights, name=gguf_name, tensor_key_mapping=names, parsed_parameters=diverted
            )
            if result.name != gguf_name or diverted["tensors"]:
                raise NotStreamable(f"transformers' GGUF loader rearranges tensor {gguf_name} across tensors")
            # A plain float tensor comes back as a view of the read-only file mapping: copied, as transformers does.
            return torch.from_numpy(np.require(result.weights, requirements=("C_CONTIGUOUS", "WRITEABLE"))).to(
                out_dtype
            )

        return load

    base = []
    for gguf_name, data, qtype, start in file_tensors:
        if gguf_name not in names:
            continue  # transformers drops it too (rope_freqs...); a tensor it merges into others leaves its
            # target missing, which the plan's check of the names turns into the in-memory path
        name = names[gguf_name]
        base.append(
            OutputTensor(name, DTYPE_NAMES[out_dtype], shapes[name], load=loader(gguf_name, data, qtype, start))
        )
    return base
