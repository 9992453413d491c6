"""Careful saving: a converted folder appears complete or not at all.

Everything is written to a hidden temporary folder beside the output and moved into place at the end
(a rename on the same filesystem), so a crash or SIGKILL never leaves a half-written model at the
output path, and an existing output is untouched until its replacement is complete.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from ..errors import OutputError, SourceError
from ..modeling import SHIPPED_CODE
from ..modeling.configuration_attnres import AttnResConfig
from ..modeling.modeling_attnres import AttnResForCausalLM
from .base_code import BASE_CODE, ship_model_code
from .hub_access import DEFAULT_MAX_SHARD_SIZE
from .paths import check_output, is_attnres_output, is_converted_folder, write_problem  # noqa: F401 - re-exported


def register_auto_classes() -> None:
    """Make the AttnRes classes known to transformers' Auto classes, in this process. Idempotent.

    Two effects, both needed wherever a model is saved or loaded: save_pretrained then copies the modeling
    code (and its relative imports) next to the weights and writes `auto_map`, so the folder loads with
    trust_remote_code=True where this package is not installed; and AutoConfig / AutoModelForCausalLM
    resolve model_type "attnres" to these classes here. Called by convert_model, save_converted and
    load_converted rather than at import, so importing a module changes nothing global.
    """
    AttnResConfig.register_for_auto_class()
    AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)


# Temporary folders are named .NAME.partial-<host>-<pid>-<random>: a later run on the same host can tell
# that the process which made one is gone and remove it, and never mistakes one for the output.
def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _stale(entry: Path, prefix: str) -> bool:
    """A leftover of a process of this host that no longer runs."""
    parts = entry.name[len(prefix) :].split("-")
    if len(parts) < 3 or parts[0] != _host_tag() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but not ours: alive
        return False
    return False


def clean_stale_partials(out: str | os.PathLike) -> list[Path]:
    """Remove temporary folders left beside OUT by killed runs on this host; returns what was removed.
    Folders of running processes, of other hosts and anything not named like ours are left alone."""
    out = Path(os.path.abspath(Path(out).expanduser()))
    prefix = partial_prefix(out)
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return removed
    for entry in sorted(entries):
        if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink() and _stale(entry, prefix):
            if entry.name[len(prefix) :].split("-")[2] == "old" and not out.exists():
                # Killed between the two renames of the fallback swap: the previous output comes back.
                os.replace(entry, out)
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _new_sibling(out: Path, kind: str = "") -> Path:
    """A fresh name for a temporary folder beside OUT, tagged with this host and process."""
    return out.parent / f"{partial_prefix(out)}{_host_tag()}-{os.getpid()}-{kind}{secrets.token_hex(4)}"


def _make_dir(path: Path, path_for: Callable[[], Path], mode: int = 0o700) -> Path:
    """Create PATH (or, if it exists, a fresh name from PATH_FOR)."""
    for _ in range(100):
        try:
            os.mkdir(path, mode)
            return path
        except FileExistsError:
            path = path_for()
    raise FileExistsError(f"could not create a temporary folder like {path}")


def atomic_folder(out: Path, write: Callable[[Path], None], overwrite: bool = False, owned: bool = False) -> Path:
    """Run `write(tmp)` into a temporary folder beside `out`, then move it into place.

    A kill at any moment leaves either nothing or the previous output at `out`, never a partial folder:
    an existing output is swapped for the new one in a single atomic rename once the new one is complete.
    Ctrl-C (or any exception) removes the temporary folder at once, whenever it arrives.
    """
    out = check_output(out, overwrite, owned)
    clean_stale_partials(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(
            f"cannot write {out} ({error.strerror or error}). Choose an output path you can write to."
        ) from error
    # The name is chosen before the folder exists, so an interrupt arriving just after the mkdir still
    # knows what to remove.
    tmp = _new_sibling(out)
    try:
        tmp = _make_dir(tmp, lambda: _new_sibling(out))  # its first try is the name chosen above
        write(tmp)
        _apply_umask(tmp)
        fsync_tree(tmp)
        publish_folder(tmp, out)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, OSError):
            raise OutputError(
                f"writing {out} failed ({error.strerror or error}: {error.filename or ''}); nothing was written "
                "there. Check free disk space and permissions, then rerun."
            ) from error
        raise
    return out


def new_partial_folder(out: Path, mode: int = 0o700) -> Path:
    """Create and return a fresh temporary folder beside OUT, named like atomic_folder's (hidden, never taken
    for the output, removed by a later clean_stale_partials once its process is gone)."""
    return _make_dir(_new_sibling(out), lambda: _new_sibling(out), mode)


def publish_folder(tmp: Path, out: Path) -> None:
    """Move the complete folder TMP (beside OUT) to OUT. An existing OUT is swapped for it in one atomic
    rename where the filesystem can, then removed; elsewhere it is moved aside first and put back if an
    interrupt arrives between the two renames (after a kill, clean_stale_partials puts it back)."""
    old = None
    try:
        if out.exists():
            if _exchange(tmp, out):
                shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous output
            else:
                old = _new_sibling(out, "old-")
                os.replace(out, old)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        if old is not None and old.exists() and not out.exists():
            os.replace(old, out)  # interrupted between the two renames: the previous output goes back
        raise


def current_umask() -> int:
    """The process umask, read without changing it. `os.umask` can only be read by setting it, and setting
    it (even for an instant) races with files other threads create meanwhile: they would get mode 0666."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # No /proc (macOS): the mode a fresh folder gets is 0777 minus the umask.
    probe = Path(tempfile.mkdtemp(prefix=".attnres-umask-"))
    try:
        inner = probe / "d"
        os.mkdir(inner, 0o777)
        return 0o777 & ~inner.stat().st_mode
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _apply_umask(folder: Path) -> None:
    """The temporary folder is private (0700) while it is written; the published one gets the modes a
    plain save_pretrained would have, so other users can read the model."""
    mask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def fsync_tree(folder: Path) -> None:
    """Flush every file under FOLDER to disk, so a rename that publishes it never publishes empty files."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _fsync_dir(folder: Path) -> None:
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def write_converted(
    model: AttnResForCausalLM,
    folder: Path,
    tokenizer=None,
    extra: dict[str, str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Weights (safetensors, in shards of at most MAX_SHARD_SIZE), config, generation config,
    self-contained code, tokenizer, extras."""
    register_auto_classes()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    ship_model_code(model, folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    missing = [name for name in SHIPPED_CODE if not (folder / name).is_file()]
    if missing:
        raise OutputError(f"internal error: save_pretrained did not copy {missing}; the folder would not load")


def save_converted(
    model: AttnResForCausalLM,
    out: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    extra: dict[str, str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    return atomic_folder(
        Path(out), lambda tmp: write_converted(model, tmp, tokenizer, extra, max_shard_size), overwrite
    )


def load_converted(path: str | os.PathLike, trust_remote_code: bool = False, **kwargs) -> AttnResForCausalLM:
    """Load a converted folder with this package's classes (no remote code needed, unless the base model has its
    own code: that ships in the folder and runs only with TRUST_REMOTE_CODE)."""
    if not is_converted_folder(path):
        raise SourceError(f"{path} is not an AttnRes model folder (no config.json with model_type 'attnres').")
    register_auto_classes()
    _register_base_code(Path(path), trust_remote_code)
    if "config" not in kwargs:
        config = AttnResConfig.from_pretrained(path)
        if not config.structure:  # converted before plans were recorded in configs: the table's plan
            from ..architectures import table_structure

            config.structure = table_structure(config)
            kwargs["config"] = config
    return AttnResForCausalLM.from_pretrained(path, **kwargs)


def _register_base_code(folder: Path, trust_remote_code: bool) -> None:
    """Import the base model's own code shipped in FOLDER (its base_code.py registers it), as
    from_pretrained(trust_remote_code=True) would."""
    from ..transformers_compat import get_class_from_dynamic_module, get_relative_imports

    generated = folder / BASE_CODE
    if not generated.is_file() or not get_relative_imports(generated):
        return  # a base model transformers ships
    if not trust_remote_code:
        raise SourceError(
            f"{folder} holds a model whose base has its own code (shipped in the folder, see {BASE_CODE}). attnres "
            "runs such code only when asked: rerun with --trust-remote-code if you trust that code."
        )
    get_class_from_dynamic_module(f"{generated.stem}.BASE_CLASSES", str(folder))
