"""Find a checkpoint (built-in name, local folder or hub id) and read only the tensors a span needs."""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from beeswarm.shard.errors import ShardError

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUILTIN = {"tinycode": ASSETS / "tinycode" / "target", "tinycode-draft": ASSETS / "tinycode" / "draft"}
PAIRED_DRAFT = {"tinycode": "tinycode-draft"}
DEFAULT_MODEL = "tinycode"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
OnBytes = Callable[[str, int, "int | None"], None]  # (file, bytes done, bytes in all or None)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class Parts:
    """Which tensors of a checkpoint a process needs: layers [start, end), embedding, final norm + head."""

    start: int = 0
    end: int = 0
    embed: bool = False
    head: bool = False

    def wants(self, name: str, tied: bool) -> bool:
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return self.start <= layer < self.end
        if name == "model.embed_tokens.weight":
            return self.embed or (self.head and tied)
        if name == "model.norm.weight" or name == "lm_head.weight":
            return self.head
        return False


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or the single file's header."""
    index = folder / INDEX
    if index.exists():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ShardError(f"{index}: not a valid safetensors index ({e})") from None
    single = folder / SINGLE
    if not single.exists():
        raise ShardError(f"{folder}: no {SINGLE} or {INDEX} found")
    with safe_open(str(single), framework="pt") as f:
        return {name: SINGLE for name in f.keys()}


def read_tensors(folder: Path, files: dict[str, str], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read exactly `names` (and nothing else) from the safetensors files that hold them."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in files:
            raise ShardError(f"{folder}: checkpoint lacks tensor {name!r}")
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, wanted in sorted(by_file.items()):
        path = folder / file
        if not path.exists():
            raise ShardError(f"{path}: shard file named by the index is missing")
        with safe_open(str(path), framework="pt") as f:
            for name in wanted:
                out[name] = f.get_tensor(name)
    return out


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def resolve(ref: str, parts: Parts | None = None, revision: str | None = None,
            on_bytes: OnBytes | None = None) -> Path:
    """A local folder holding `ref`'s config, tokenizer and the safetensors files `parts` needs.

    `ref` is a built-in name (tinycode), a local folder, or a hub id (org/name), in which case only
    the config, tokenizer files, the index and the shard files holding the wanted tensors are fetched.
    """
    if ref in BUILTIN:
        folder = BUILTIN[ref]
        if not (folder / "config.json").exists():
            raise ShardError(f"built-in model {ref!r} is missing from {folder}: reinstall beeswarm")
        return folder
    local = Path(ref).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ShardError(f"{local}: no config.json; expected a Hugging Face checkpoint folder")
        return local
    if not _looks_like_hub_id(ref):
        raise ShardError(f"model {ref!r}: not a built-in name ({', '.join(BUILTIN)}), a folder, or a hub id org/name")
    return _download(ref, parts or Parts(0, 10**9, True, True), revision, on_bytes)


# config fields that say how a copy was saved, not which model it is
_NOT_THE_MODEL = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"}


def fingerprint(folder: Path) -> str:
    """Which model a checkpoint folder holds, from its config (16 hex digits): equal for every copy of a model
    however it is named or saved, different for another architecture, size or vocabulary."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ShardError(f"cannot read {folder}/config.json: {e}") from None
    if not isinstance(config, dict):
        raise ShardError(f"{folder}/config.json is not a JSON object")
    kept = {k: v for k, v in config.items() if k not in _NOT_THE_MODEL}
    return hashlib.blake2b(json.dumps(kept, sort_keys=True).encode(), digest_size=8).hexdigest()


def resolve_config(ref: str, revision: str | None = None) -> Path:
    """A folder holding at least `ref`'s config.json (a hub id fetches nothing else)."""
    if ref in BUILTIN or Path(ref).expanduser().is_dir() or not _looks_like_hub_id(ref):
        return resolve(ref)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ref, "config.json", revision=revision)).parent
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo
        raise ShardError(f"could not download config.json of {ref!r}: {e}") from None


def progress_bar_class(name: str, on_bytes: OnBytes) -> type:
    """A tqdm class for `hf_hub_download(tqdm_class=...)` that reports bytes instead of drawing a bar."""
    from tqdm import tqdm

    class Report(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": _Discard()})
            on_bytes(name, 0, self.total)

        def update(self, n=1):
            shown = super().update(n)
            on_bytes(name, int(self.n), self.total)
            return shown

    return Report


class _Discard:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _download(repo: str, parts: Parts, revision: str | None, on_bytes: OnBytes | None = None) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    def fetch(name: str, required: bool = True) -> Path | None:
        bar = progress_bar_class(name, on_bytes) if on_bytes else None
        try:
            return Path(hf_hub_download(repo, name, revision=revision, tqdm_class=bar))
        except EntryNotFoundError:
            if required:
                raise ShardError(f"hub model {repo!r} has no {name}") from None
            return None
        except (HfHubHTTPError, OSError) as e:
            raise ShardError(f"could not download {name} of {repo!r}: {e}") from None

    config = fetch("config.json")
    assert config is not None, "a required file is downloaded or fetch raises"
    folder = config.parent
    for name in TOKENIZER_FILES:
        fetch(name, required=False)
    index = fetch(INDEX, required=False)
    if index is None:
        fetch(SINGLE)
        return folder
    config = json.loads((folder / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    files = weight_map(folder)
    needed = sorted({file for name, file in files.items() if parts.wants(name, tied)})
    log.info("fetching %d of %d shard files of %s", len(needed), len(set(files.values())), repo)
    for file in needed:
        fetch(file)
    return folder
