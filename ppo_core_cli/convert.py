"""GGUF in: a GGUF file (llama.cpp's format) converted once into a Hugging Face checkpoint folder, then reused.

``transformers`` reads a GGUF file (weights dequantized, the tokenizer rebuilt from the file's vocabulary and
merges) but will not ``save_pretrained`` the result ("quantized with GGUF ... not serializable"), and every worker
would read and dequantize the file again. :func:`convert_gguf` writes what the rest of ppo-core reads:

- ``config.json`` and ``model.safetensors`` in the requested dtype (a plain model: no quantization config);
- the tokenizer files with the chat template, the tokenizer's EOS and padding set to the resolved ones
  (:func:`ppo_core_cli.tokens.resolve_special_tokens`: SmolLM2's file names ``<|im_start|>`` as its EOS, the
  converted tokenizer ``<|im_end|>``), and ``generation_config.json`` with those ids;
- ``ppo_core_conversion.json``: the source file, its size and modification time, the dtype (the cache key).

The folder is written into a temporary sibling and renamed into place only when complete: an interrupted
conversion (Ctrl-C, a crash) leaves no folder that a later run would reuse.

:func:`converted_checkpoint` is the cache ``ppo-core train`` uses: ``{convert_dir}/{file stem}-{dtype}`` is reused
when its key matches the file (same path, size, modification time and dtype) and converted again otherwise.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any

__all__ = [
    "CONVERSION_FILE",
    "convert_gguf",
    "converted_checkpoint",
    "default_convert_dir",
    "find_gguf_file",
]

logger = logging.getLogger(__name__)

CONVERSION_FILE = "ppo_core_conversion.json"
"""Written last into a converted folder: where it came from (the cache key)."""

_FORMAT = 1  # bump when the converted folder's content changes: older folders are then converted again
_MAGIC = b"GGUF"


def find_gguf_file(path: str | os.PathLike[str]) -> str | None:
    """The GGUF file ``path`` names: ``path`` itself (a ``*.gguf`` file), the one ``*.gguf`` in a directory without
    ``config.json``, or None (a Hugging Face checkpoint directory, or a path that names neither).

    Raises:
        FileNotFoundError: ``path`` ends in ``.gguf`` and does not exist.
        ValueError: a directory holds several GGUF files (naming them).
    """
    path = os.fspath(path)
    if path.lower().endswith(".gguf") and not os.path.isdir(path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"the GGUF file {path!r} does not exist")
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found)
        raise ValueError(f"{path!r} holds several GGUF files ({names}): name one")
    return found[0] if found else None


def default_convert_dir() -> str:
    """``$XDG_CACHE_HOME/ppo-core/converted`` (``~/.cache/ppo-core/converted`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ppo-core", "converted")


def _source_key(gguf_file: str, dtype: str) -> dict[str, Any]:
    st = os.stat(gguf_file)
    return {
        "source": os.path.realpath(gguf_file),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "dtype": dtype,
        "format": _FORMAT,
    }


def _read_key(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, CONVERSION_FILE), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info.get("key") if isinstance(info, dict) else None


def _check_magic(gguf_file: str) -> None:
    with open(gguf_file, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(f"{gguf_file!r} is not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})")


def _load_gguf(gguf_file: str, dtype: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` as ``transformers`` reads the file (weights dequantized into ``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_file))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=getattr(torch, dtype), local_files_only=True
        )
    except ImportError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read the GGUF file {gguf_file!r}: {type(exc).__name__}: {exc}") from exc
    return model, tokenizer


def _plain_model(model: Any, dtype: str) -> Any:
    """The same weights in a model built from its config without the GGUF quantization config (which is what
    ``save_pretrained`` refuses): built on the meta device, the tensors assigned, no copy."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    return plain.eval()


def convert_gguf(
    gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "float32"
) -> str:
    """Convert ``gguf_file`` into a Hugging Face checkpoint folder ``out_dir`` (see the module docstring).

    An existing ``out_dir`` is replaced only once the new folder is complete, and only if it is empty or an earlier
    conversion; a folder holding anything else, or the GGUF file itself, is refused before any work.

    Args:
        gguf_file: the ``.gguf`` file.
        out_dir: the folder to write.
        dtype: ``float32``, ``bfloat16`` or ``float16``: the dtype of the written weights.

    Returns:
        ``out_dir`` as a string.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, one without weight tensors or one ``transformers`` cannot read (naming the
            file); an output folder that may not be replaced; a bad dtype.
    """
    from ppo_core_cli.tokens import resolve_special_tokens

    gguf_file, out = os.fspath(gguf_file), os.path.abspath(os.fspath(out_dir))
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"the GGUF file {gguf_file!r} does not exist")
    _check_magic(gguf_file)
    _check_out_dir(gguf_file, out)
    _check_has_weights(gguf_file)
    key = _source_key(gguf_file, dtype)
    start = time.perf_counter()
    # transformers' own progress bars are off in the command (one line a run, not one bar a file): say what the
    # wait is for, the dequantization takes tens of seconds on a CPU for a 100 MB file
    logger.info(
        "reading %s (%.0f MB) and dequantizing its weights into %s: this takes a while on a CPU",
        gguf_file,
        os.path.getsize(gguf_file) / 1e6,
        dtype,
    )
    model, tokenizer = _load_gguf(gguf_file, dtype)
    tokens = resolve_special_tokens(tokenizer, where=gguf_file)
    tokenizer.eos_token, tokenizer.pad_token = tokens.eos_token, tokens.pad_token
    plain = _plain_model(model, dtype)
    del model
    ids = {"eos_token_id": tokens.eos_token_id, "pad_token_id": tokens.pad_token_id}
    for name, value in ids.items():
        setattr(plain.config, name, value)
        setattr(plain.generation_config, name, value)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would stay on the renamed folder
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, CONVERSION_FILE), "w", encoding="utf-8") as f:
            json.dump({"key": key, "eos_token": tokens.eos_token, "pad_token": tokens.pad_token}, f, indent=2)
            f.write("\n")
        # the weights file is written 0600 (a temporary file renamed): give it the mode the others got (the umask's)
        mode = os.stat(os.path.join(tmp, CONVERSION_FILE)).st_mode & 0o777
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), mode)
        _replace_dir(tmp, out)
    except BaseException:  # Ctrl-C included: no half folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "converted the GGUF file %s into the Hugging Face checkpoint %s (%s, %.0f s)",
        gguf_file,
        out,
        dtype,
        time.perf_counter() - start,
    )
    return out


def _check_out_dir(gguf_file: str, out: str) -> None:
    """``out`` may be replaced: a new or empty folder, or an earlier conversion (it holds :data:`CONVERSION_FILE`),
    and not a folder that holds ``gguf_file`` itself. Anything else is refused before any work: the complete
    conversion replaces the whole folder."""
    source = os.path.realpath(gguf_file)
    target = os.path.realpath(out)
    if source.startswith(target.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"the output folder {out!r} holds the GGUF file being converted ({gguf_file!r}); the conversion replaces "
            "its output folder: choose another one"
        )
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise ValueError(f"the output folder {out!r} is a file; choose a new or empty folder")
    if os.listdir(out) and not os.path.isfile(os.path.join(out, CONVERSION_FILE)):
        raise ValueError(
            f"the output folder {out!r} is not empty and holds no earlier conversion ({CONVERSION_FILE}); the "
            "conversion replaces its output folder, so it refuses to delete what is there: choose a new or empty folder"
        )


def _check_has_weights(gguf_file: str) -> None:
    """A GGUF file without weight tensors (a vocabulary-only file, such as llama.cpp's ``ggml-vocab-*.gguf``) is
    refused before anything is allocated: ``transformers`` would build the model its metadata describes with random
    weights (or run out of memory building a large one). Read with the ``gguf`` package, which maps the file and
    reads its header only."""
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers needs it to read the file at all: it says so there
        return
    try:
        tensors = len(GGUFReader(gguf_file, "r").tensors)
    except Exception as exc:
        raise ValueError(f"cannot read the GGUF file {gguf_file!r}: {type(exc).__name__}: {exc}") from exc
    if tensors == 0:
        raise ValueError(
            f"the GGUF file {gguf_file!r} holds no weight tensors (a vocabulary-only file?): there is no model to "
            "convert"
        )


def _replace_dir(new: str, target: str) -> None:
    """Rename the complete folder ``new`` to ``target``, moving an existing ``target`` out of the way first."""
    old = None
    if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
        os.rmdir(old)
        os.rename(target, old)
    os.rename(new, target)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)


def converted_checkpoint(
    gguf_file: str | os.PathLike[str],
    convert_dir: str | os.PathLike[str] | None = None,
    *,
    dtype: str = "float32",
) -> str:
    """The Hugging Face checkpoint of ``gguf_file`` in ``dtype``: ``{convert_dir}/{stem}-{dtype}``, reused when it
    was converted from this very file (path, size, modification time, dtype), converted (again) otherwise.

    ``convert_dir`` None: :func:`default_convert_dir`.
    """
    gguf_file = os.fspath(gguf_file)
    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"the GGUF file {gguf_file!r} does not exist")
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    out = os.path.join(os.fspath(convert_dir) if convert_dir else default_convert_dir(), f"{stem}-{dtype}")
    found = _read_key(out)
    if found == _source_key(gguf_file, dtype):
        logger.info("reusing the Hugging Face checkpoint %s converted from %s", out, gguf_file)
        return out
    if found is not None:
        logger.info("%s was converted from another file or version than %s: converting again", out, gguf_file)
    else:
        logger.info("converting the GGUF file %s into a Hugging Face checkpoint at %s (once)", gguf_file, out)
    return convert_gguf(gguf_file, out, dtype=dtype)
