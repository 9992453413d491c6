"""Pushing a converted or fine-tuned folder to the HuggingFace hub.

`push_folder` checks the folder against the loading contract first (config with auto_map, the shipped
code, complete safetensors weights with the AttnRes parameters, tokenizer files that belong together, a
model card whose front matter parses), so a push never publishes a repo that does not load. The token
comes from the usual places (an explicit argument, HF_TOKEN, the `hf auth login` cache) and is scrubbed
from every message this module raises.
"""

from __future__ import annotations

import glob
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AttnResError, first_line, scrub
from ..io.hub_access import hub_endpoint, hub_reachable

TOKENIZER_VOCABS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Weight files a new push replaces: stale shards of an earlier push must not survive next to a new index.
REPLACED_ON_PUSH = ["*.safetensors", "*.safetensors.index.json"]
# Text files worth scanning for a leaked token before they go public.
TEXT_SUFFIXES = {".json", ".md", ".txt", ".yaml", ".yml", ".csv", ".jsonl", ".py", ".log", ".toml", ".cfg", ""}


class HubError(AttnResError):
    """The folder cannot be pushed (incomplete folder, no token, refused by the hub)."""


class HubUnreachableError(HubError):
    """The hub cannot be reached from this machine."""


# --------------------------------------------------------------------------------------------------
# Token and repo id
# --------------------------------------------------------------------------------------------------


def resolve_token(token: str | None = None) -> str:
    """The explicit token, else HF_TOKEN, else the `hf auth login` cache; HubError when there is none."""
    if token:
        return token.strip()
    from huggingface_hub import get_token

    found = get_token()
    if not found:
        raise HubError(
            "no HuggingFace token found: set HF_TOKEN, run `hf auth login`, or pass --token "
            "(a token with write access, from https://huggingface.co/settings/tokens)."
        )
    return found


def check_repo_id(repo_id: str) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubError(f"{repo_id!r} is not a valid repo id ({error}). Use NAME or NAMESPACE/NAME.") from None
    return repo_id


# --------------------------------------------------------------------------------------------------
# What a folder must contain
# --------------------------------------------------------------------------------------------------


def _is_hidden_or_cache(relative: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts) or relative.suffix == ".pyc"


def _safetensors_problem(path: Path) -> tuple[str | None, list[str]]:
    """(problem, tensor names): a file whose header does not parse or whose data is cut short would
    publish a repo that fails to load."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            header_len = struct.unpack("<Q", handle.read(8))[0]
            if header_len > size - 8:
                return f"{path.name} is truncated (header runs past the end of the file)", []
            header = json.loads(handle.read(header_len))
    except (OSError, struct.error, ValueError) as error:
        return f"{path.name} is not a readable safetensors file ({error})", []
    names = [name for name in header if name != "__metadata__"]
    end = max((header[name]["data_offsets"][1] for name in names), default=0)
    if 8 + header_len + end > size:
        return f"{path.name} is truncated ({size:,} bytes, its header needs {8 + header_len + end:,})", names
    return None, names


def _weights_problems(folder: Path, attnres: bool) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as error:
            return [f"model.safetensors.index.json is not a valid index ({error})"]
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return ["no weights: model.safetensors (or a sharded index) is missing"]
    problems, names = [], []
    for shard in shards:
        if not (folder / shard).is_file():
            problems.append(f"weight shard {shard} is missing")
            continue
        problem, shard_names = _safetensors_problem(folder / shard)
        names += shard_names
        if problem:
            problems.append(problem)
    if attnres and not problems and not any(name.endswith("output_attn_res_proj.weight") for name in names):
        problems.append("the weights hold no AttnRes parameters (output_attn_res_proj.weight): not a converted model")
    return problems


def _config_problems(folder: Path) -> tuple[list[str], str | None]:
    """(problems, kind): kind is "attnres", "plain" (a model of another type, such as the baseline of an
    A/B fine-tune) or None when config.json is missing or broken."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        return ["config.json is missing"], None
    except (OSError, ValueError) as error:
        return [f"config.json is not valid JSON ({error})"], None
    if not isinstance(config, dict) or not config.get("model_type"):
        return ["config.json has no model_type: not a transformers model folder"], None
    if config["model_type"] != "attnres":
        return [], "plain"
    problems = []
    auto_map = config.get("auto_map") or {}
    for auto in ("AutoConfig", "AutoModelForCausalLM"):
        if auto not in auto_map:
            problems.append(
                f"config.json has no auto_map entry for {auto}: the model would not load with trust_remote_code"
            )
    # Imported here, not at the top: the modeling code imports torch, and a wrong folder or repo id is
    # answered before that (tests/test_cli_screens.py, argument errors).
    from ..io.base_code import BASE_CODE
    from ..modeling import SHIPPED_CODE

    # An auto_map entry is "module.Class", or "repo--module.Class" once it points into a hub repo.
    code = set(SHIPPED_CODE) | {f"{str(ref).split('--')[-1].split('.')[0]}.py" for ref in auto_map.values()}
    if (folder / BASE_CODE).is_file():  # a base model's own code, imported by base_code.py
        from ..transformers_compat import get_relative_imports

        code |= {f"{name}.py" for name in get_relative_imports(folder / BASE_CODE)}
    problems += [f"shipped code {name} is missing" for name in sorted(code) if not (folder / name).is_file()]
    return problems, "attnres"


def _tokenizer_problems(folder: Path) -> list[str]:
    has_config = (folder / "tokenizer_config.json").is_file()
    has_vocab = any((folder / name).is_file() for name in TOKENIZER_VOCABS)
    if has_config and not has_vocab:
        return [f"tokenizer_config.json is there but no vocabulary ({' / '.join(TOKENIZER_VOCABS)})"]
    if has_vocab and not has_config:
        return ["a tokenizer vocabulary is there but tokenizer_config.json is missing"]
    return []


def _card_problems(folder: Path) -> list[str]:
    from ..io.card import read_front_matter  # lazy: the card module imports torch

    card = folder / "README.md"
    if not card.is_file():
        return ["README.md (the model card) is missing"]
    try:
        meta = read_front_matter(card.read_text())
    except ValueError as error:
        return [f"README.md front matter does not parse ({error})"]
    if not meta:
        return ["README.md has no YAML front matter (base_model, library_name, tags...)"]
    return []


def check_push_ready(folder: str | Path) -> list[str]:
    """The files to upload (relative paths), after checking the folder against the loading contract.

    Raises HubError listing every problem at once, so one fix-and-retry round is enough.
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise HubError(f"{folder} is not a folder. Pass the output folder of `attnres convert` or `attnres finetune`.")
    problems, kind = _config_problems(root)
    if kind is not None:  # without a readable config, one clear message rather than its consequences
        problems += _weights_problems(root, kind == "attnres") + _tokenizer_problems(root) + _card_problems(root)
    if problems:
        raise HubError(
            f"{folder} is not ready to push, nothing was uploaded:\n  - "
            + "\n  - ".join(problems)
            + "\nRe-create the folder with `attnres convert` (or `attnres finetune`)."
        )
    files = [
        path.relative_to(root)
        for path in root.rglob("*")
        if path.is_file() and not _is_hidden_or_cache(path.relative_to(root))
    ]
    return sorted(p.as_posix() for p in files)


def check_no_secret(folder: Path, files: list[str], token: str) -> None:
    """Refuse to publish a folder in which a text file contains the token (a config, a log, a card)."""
    needle = token.encode()
    for name in files:
        path = folder / name
        if Path(name).suffix.lower() not in TEXT_SUFFIXES or path.stat().st_size > 50_000_000:
            continue
        if needle in path.read_bytes():
            raise HubError(
                f"{name} contains your HuggingFace token: refusing to upload it. Remove the token from that file "
                "and push again (and consider revoking the token)."
            )


# --------------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------------


@dataclass
class PushResult:
    repo_id: str
    url: str  # the repo (or branch) page
    revision: str
    commit_url: str | None
    files: list[str] = field(default_factory=list)


def _unreachable(folder: Path, repo_id: str, detail: str = "") -> HubUnreachableError:
    return HubUnreachableError(
        f"the HuggingFace hub ({hub_endpoint()}) is unreachable from this machine{detail}: nothing was uploaded. "
        f"The model is saved locally in {folder}; push it later with: attnres push {folder} {repo_id}"
    )


# Transport failures by class name: huggingface_hub's HTTP client (httpx, or its httpx2 fork) is its own
# business, and an HTTP status error (HfHubHTTPError) is not a connection failure.
_CONNECTION_FAILURES = {"TransportError", "NetworkError", "ConnectError", "ConnectTimeout", "TimeoutException"}


def _is_connection_failure(error: Exception) -> bool:
    return isinstance(error, ConnectionError) or any(
        cls.__name__ in _CONNECTION_FAILURES for cls in type(error).__mro__
    )


def _explain(error: Exception, repo_id: str, token: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, HfHubHTTPError) and status == 401:
        reason = "the hub rejected the token (401): it is invalid or expired. Log in again with `hf auth login`"
    elif isinstance(error, HfHubHTTPError) and status == 403:
        reason = (
            f"the token may not write to {repo_id!r} (403): use a token with write access to that namespace, "
            "or push under your own user name"
        )
    else:
        reason = first_line(error)
    return scrub(f"pushing to {repo_id!r} failed: {reason}.", token)


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Create REPO_ID if needed (private when asked) and upload FOLDER to it, on REVISION (a branch, created
    from main when it does not exist). Weight files of an earlier push that this folder does not have are
    deleted in the same commit.

    Raises HubError (incomplete folder, no token, refused) or HubUnreachableError; messages never hold
    the token.
    """
    from huggingface_hub import HfApi

    folder = Path(folder).expanduser()
    check_repo_id(repo_id)
    files = check_push_ready(folder)
    token = resolve_token(token)
    check_no_secret(folder, files, token)
    if not hub_reachable():
        raise _unreachable(folder, repo_id)
    api = HfApi(endpoint=hub_endpoint(), token=token)
    branch = revision or "main"
    try:
        repo_url = api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")
        repo_id = repo_url.repo_id or repo_id  # the hub fills in the namespace of a bare NAME
        if private and not api.repo_info(repo_id).private:
            raise HubError(
                f"{repo_id} already exists and is public: --private cannot hide an existing repo, nothing was "
                "uploaded. Make it private on the hub first, or choose another repo id."
            )
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            revision=branch,
            commit_message=commit_message or "Upload Block AttnRes model (attnres)",
            allow_patterns=[glob.escape(name) for name in files],
            delete_patterns=REPLACED_ON_PUSH,
        )
    except HubError:
        raise
    except Exception as error:  # noqa: BLE001 - every hub failure becomes a message without the token
        if _is_connection_failure(error):
            raise _unreachable(folder, repo_id, f" (connection lost: {type(error).__name__})") from None
        raise HubError(_explain(error, repo_id, token)) from None
    url = f"{hub_endpoint()}/{repo_id}" + (f"/tree/{branch}" if branch != "main" else "")
    return PushResult(repo_id, url, branch, getattr(commit, "commit_url", None), files)
